"""README.md and docs/*.md stay true to the tree and to the CLI: relative links and #anchors
resolve, flags shown on `argosy ...` command lines exist, the flag lists and default columns
of docs/server.md and docs/gateway.md match argparse, and `--help` names each default once.

No server, no model: the parsers are built as `argosy --help` builds them (no torch)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from argosy_runtime.cli.main import build_parser

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def subparsers(parser: argparse.ArgumentParser, name: str = "argosy"):
    """(name, parser) for `argosy` and every subcommand below it."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from subparsers(sub, f"{name} {sub_name}")


PARSERS = dict(subparsers(build_parser()))


def options(command: str) -> set[str]:
    return {o for a in PARSERS[command]._actions for o in a.option_strings}


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.+?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for m in re.finditer(r"\]\(([^)\s]+)\)", FENCE.sub("", doc.read_text())):
        link = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", link):  # https:, mailto:
            continue
        path, _, fragment = link.partition("#")
        target = (doc.parent / path).resolve() if path else doc
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif fragment and target.suffix == ".md" and fragment not in anchors(target):
            broken.append(f"{link}: no heading #{fragment} in {target.name}")
    assert broken == []


def command_lines(text: str):
    """`argosy SUBCOMMAND ...` lines in fenced blocks, backslash continuations joined."""
    for block in FENCE.findall(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            m = re.search(r"(?:^|\$ |\s)argosy ([a-z-]+(?: (?:offline|serve))?)\b(.*)", line)
            if m and m.group(1).split()[0] in {c.split()[1] for c in PARSERS if " " in c}:
                command = "argosy " + m.group(1)
                if command not in PARSERS:  # "argosy bench" followed by something else
                    command = "argosy " + m.group(1).split()[0]
                yield command, m.group(2).split(" -- ")[0].split("#")[0]


def test_flags_on_documented_command_lines_exist() -> None:
    unknown = []
    for doc in DOCS:
        for command, rest in command_lines(doc.read_text()):
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest):
                if flag not in options(command):
                    unknown.append(f"{doc.name}: {command} {flag}")
    assert unknown == []


def test_help_names_each_default_once() -> None:
    """An option's help says "(default ...)" at most once (the engine flags used to append
    "(default: None)" after help that already said what the default is)."""
    doubled = [f"{name} {a.option_strings[0]}: {a.help}"
               for name, parser in PARSERS.items() for a in parser._actions
               if a.help and a.help.replace("%(default)", "").count("(default") > 1]
    assert doubled == []


def test_server_flag_table_matches_argparse() -> None:
    """docs/server.md's server-flags table lists every flag of the "server" group, with
    argparse's default where that is a number or a word."""
    table = {}
    for m in re.finditer(r"^\| `(--[a-z-]+)` \| ([^|]*) \|", (REPO / "docs" / "server.md")
                         .read_text(), re.M):
        table[m.group(1)] = m.group(2).strip().strip("`")
    (group,) = [g for g in PARSERS["argosy serve"]._action_groups if g.title == "server"]
    wrong = []
    for action in group._group_actions:
        flag = action.option_strings[0]
        if flag not in table:
            wrong.append(f"{flag}: not in the table")
            continue
        default = action.default
        if isinstance(default, bool) or default is None:
            continue
        documented = table[flag]
        same = (float(documented) == default if isinstance(default, int | float)
                and re.fullmatch(r"[0-9.]+", documented) else documented == str(default))
        if not same:
            wrong.append(f"{flag}: documented {documented!r}, argparse {default!r}")
    assert wrong == []


def test_gateway_and_fleet_flags_are_documented() -> None:
    text = (REPO / "docs" / "gateway.md").read_text()
    flags_paragraph = re.search(r"^Flags: (.*?)\n\n", text, re.S | re.M).group(1)
    (synopsis,) = [b for b in FENCE.findall(text) if b.count("argosy fleet --model M")]
    missing = [f"gateway {o}" for o in sorted(options("argosy gateway") - {"-h", "--help"})
               if o not in flags_paragraph]
    missing += [f"fleet {o}" for o in sorted(options("argosy fleet") - {"-h", "--help"})
                if o not in synopsis]
    assert missing == []
