"""The build context .dockerignore leaves: everything the Dockerfiles COPY, and little else.

The matcher follows Docker's rules (moby/patternmatcher): patterns are matched against the
slash-separated path relative to the context root, against the path and each parent directory;
`*` and `?` stay within one path segment, `**` spans any number; the last matching pattern wins
and `!` re-includes.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path

import pytest
from dockerfile_parser import parse

REPO = Path(__file__).resolve().parents[2]
# Nothing that size belongs in an image build: a model, a venv or .git would be far larger.
MAX_CONTEXT_BYTES = 8 * 1024 * 1024


def _translate(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out + r"\Z")


@lru_cache(maxsize=1)
def patterns() -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        rules.append((negate, _translate(os.path.normpath(line.lstrip("!")).lstrip("/"))))
    return rules


@lru_cache(maxsize=1)
def negations() -> tuple[str, ...]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return tuple(line.strip()[1:] for line in lines if line.strip().startswith("!"))


def excluded(rel_path: str) -> bool:
    """Whether Docker leaves `rel_path` (relative to the repo root) out of the context."""
    parts = rel_path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    result = False
    for negate, regex in patterns():
        if any(regex.match(prefix) for prefix in prefixes):
            result = not negate
    return result


def context_files() -> list[str]:
    files = []
    for root, dirs, names in os.walk(REPO):
        rel_root = os.path.relpath(root, REPO)
        rel_root = "" if rel_root == "." else rel_root + "/"
        # Skip excluded folders that no `!` pattern reaches into (Docker skips them too).
        dirs[:] = [d for d in dirs if d != ".git" and not (
            excluded(rel_root + d) and not any(n.startswith(rel_root + d) for n in negations()))]
        files.extend(rel_root + name for name in names if not excluded(rel_root + name))
    return files


def test_matcher_follows_docker_semantics() -> None:
    assert excluded(".venv/bin/python")
    assert excluded("tests/images/test_image_build_context.py")
    assert not excluded("runtime/argosy_runtime/cli/main.py")
    assert excluded("runtime/argosy_runtime/__pycache__/x.cpython-311.pyc")  # **/ re-excludes
    assert not excluded("docker/image_requirements.py")
    assert excluded("docker/operator.Dockerfile")  # only the helper script is needed inside


@pytest.mark.parametrize("dockerfile", sorted((REPO / "docker").glob("*.Dockerfile")),
                         ids=lambda p: p.stem)
def test_every_copy_source_is_in_the_context(dockerfile: Path) -> None:
    for stage in parse(dockerfile).stages:
        for copy in stage.all("COPY"):
            if "from" in copy.flags():
                continue
            sources = [w for w in copy.exec_form() if not w.startswith("--")][:-1]
            for source in sources:
                path = REPO / source
                assert path.exists(), f"{dockerfile.name}:{copy.line}: {source} does not exist"
                files = [path] if path.is_file() else [p for p in path.rglob("*.py")]
                assert files, f"{source}: nothing to copy"
                for file in files:
                    rel = file.relative_to(REPO).as_posix()
                    if "__pycache__" not in rel:
                        assert not excluded(rel), f"{dockerfile.name}: COPY {rel} is ignored"


def test_context_leaves_out_local_state_and_stays_small() -> None:
    files = context_files()
    assert not [f for f in files if f.startswith((".venv/", "tests/", "bench/", ".git/"))]
    assert not [f for f in files if f.endswith((".gguf", ".safetensors", ".pyc"))]
    size = sum((REPO / f).stat().st_size for f in files)
    assert size < MAX_CONTEXT_BYTES, f"build context is {size} bytes"
    # and pyproject's readme, which setuptools reads while building the wheel, is in it
    assert "README.md" in files and "pyproject.toml" in files


def _builder_tree(dockerfile: Path, dest: Path) -> None:
    """Lay out what the builder stage's COPY instructions put in WORKDIR (context files only)."""
    builder = parse(dockerfile).stages[0]
    assert builder.last("WORKDIR") is not None
    for copy in builder.all("COPY"):
        *sources, target = [w for w in copy.exec_form() if not w.startswith("--")]
        for source in sources:
            src = REPO / source
            files = [src] if src.is_file() else [p for p in src.rglob("*") if p.is_file()]
            for file in files:
                rel = file.relative_to(REPO).as_posix()
                if excluded(rel):
                    continue
                if src.is_file():
                    out = dest / target / file.name if target.endswith("/") else dest / target
                else:
                    out = dest / target / file.relative_to(src)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(file.read_bytes())


@pytest.mark.parametrize("image", ["operator", "runtime-cpu"])
def test_project_wheel_builds_from_what_the_builder_copies(image: str, tmp_path: Path) -> None:
    """`pip install --no-deps .` in the builder works from the copied files alone (a file
    pyproject needs but the Dockerfile or .dockerignore leaves out fails here)."""
    import subprocess
    import sys
    import zipfile

    src = tmp_path / "src"
    _builder_tree(REPO / "docker" / f"{image}.Dockerfile", src)
    # The requirements step, as the Dockerfile runs it (from WORKDIR, stdlib only).
    reqs = subprocess.run([sys.executable, "-I", "docker/image_requirements.py", image],
                          cwd=src, capture_output=True, text=True, check=True).stdout.split()
    assert reqs and not [r for r in reqs if r.startswith("torch")]
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--quiet", "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("argosy-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for package in ("argosy_runtime", "argosy_kernels", "argosy_operator"):
        assert f"{package}/__init__.py" in names
    assert not [n for n in names if n.startswith(("tests/", "docker/", "e2e/"))]
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "argosy = argosy_runtime.cli.main:main" in zipfile.ZipFile(wheel).read(
        entry_points).decode()
