"""A small Dockerfile parser for the image rules tests: stages, instructions, ARG defaults.

Handles what docker/*.Dockerfile use: comments, parser directives, backslash continuations,
exec-form (JSON) and shell-form arguments, global ARGs before the first FROM with `${NAME}`
substitution in FROM lines, and `FROM image AS name` stages.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

_VAR = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")


@dataclass(frozen=True)
class Instruction:
    """One instruction: upper-case keyword, raw argument text, 1-based starting line."""

    keyword: str
    text: str
    line: int

    def exec_form(self) -> list[str]:
        """The argument as a list: JSON exec form, or shell form split like a shell would."""
        stripped = self.text.strip()
        if stripped.startswith("["):
            return list(json.loads(stripped))
        return shlex.split(stripped)

    def flags(self) -> dict[str, str]:
        """Leading `--name=value` flags (COPY --from=builder)."""
        found: dict[str, str] = {}
        for word in self.text.split():
            if not word.startswith("--"):
                break
            name, _, value = word[2:].partition("=")
            found[name] = value
        return found

    def key_values(self) -> dict[str, str]:
        """LABEL/ENV/ARG `key=value` pairs (quotes removed)."""
        pairs: dict[str, str] = {}
        for word in shlex.split(self.text):
            key, sep, value = word.partition("=")
            pairs[key] = value if sep else ""
        return pairs


@dataclass
class Stage:
    """A build stage: its FROM (resolved), optional name, and instructions after FROM."""

    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None

    def labels(self) -> dict[str, str]:
        merged: dict[str, str] = {}
        for instruction in self.all("LABEL"):
            merged.update(instruction.key_values())
        return merged

    def arg_defaults(self) -> dict[str, str]:
        merged: dict[str, str] = {}
        for instruction in self.all("ARG"):
            merged.update(instruction.key_values())
        return merged


@dataclass
class Dockerfile:
    path: Path
    global_args: dict[str, str]
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def stage_names(self) -> set[str]:
        return {s.name for s in self.stages if s.name}

    def run_text(self) -> str:
        """Every RUN argument of every stage, joined (for content rules)."""
        return "\n".join(i.text for s in self.stages for i in s.all("RUN"))


def logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, joined text) per instruction; comments and blank lines dropped.

    A comment line inside a continued instruction is skipped, as Docker does.
    """
    result: list[tuple[int, str]] = []
    buffer: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.rstrip()
        if line.lstrip().startswith("#") or (not line.strip() and not buffer):
            continue
        if not buffer:
            start = number
        if line.endswith("\\"):
            buffer.append(line[:-1])
            continue
        buffer.append(line)
        result.append((start, " ".join(part.strip() for part in buffer).strip()))
        buffer = []
    if buffer:
        result.append((start, " ".join(part.strip() for part in buffer).strip()))
    return result


def substitute(value: str, variables: dict[str, str]) -> str:
    """`${NAME}` / `$NAME` replaced by its value (unknown names left as they are)."""
    return _VAR.sub(lambda m: variables.get(m.group(1), m.group(0)), value)


def parse(path: Path) -> Dockerfile:
    """Parse a Dockerfile; raises ValueError on an instruction before the first FROM."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line_number, line in logical_lines(path.read_text()):
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        instruction = Instruction(keyword, rest.strip(), line_number)
        if keyword == "FROM":
            words = rest.split()
            image = substitute(words[0], global_args)
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(image, name))
        elif not stages:
            if keyword != "ARG":
                raise ValueError(f"{path}:{line_number}: {keyword} before the first FROM")
            global_args.update(instruction.key_values())
        else:
            stages[-1].instructions.append(instruction)
    if not stages:
        raise ValueError(f"{path}: no FROM")
    return Dockerfile(path, global_args, stages)
