"""Print the pip requirements one container image needs, read from pyproject.toml.

The `argosy` distribution pins `torch==2.13.0` in its core dependencies, which the operator and
gateway images must never contain (their images stay small and never import torch), and which
the runtime images install from a specific wheel index (CPU or CUDA). So every Dockerfile
installs the project itself with `pip install --no-deps .` and installs the third-party
packages listed here first. Reading them from pyproject.toml keeps the images in step with the
extras: there is no second list to forget to update.

Usage (inside a build stage, stdlib only):

    python docker/image_requirements.py operator > /tmp/requirements.txt
    pip install --requirement /tmp/requirements.txt
    pip install --no-deps .
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

# Requirement name at the start of a PEP 508 string ("kopf>=1.37" -> "kopf").
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


@dataclass(frozen=True)
class ImageProfile:
    """Which parts of pyproject's dependencies one image installs.

    `pick`: project names taken from wherever pyproject lists them ([project].dependencies or
    any extra), `"*"` for all of [project].dependencies; `extras`: optional-dependency groups
    taken whole; `exclude`: names dropped from both (torch is installed separately from a chosen
    index; matplotlib only draws benchmark plots).
    """

    pick: tuple[str, ...] = ()
    extras: tuple[str, ...] = ()
    exclude: tuple[str, ...] = field(default=("torch",))


PROFILES: dict[str, ImageProfile] = {
    # kopf and its HTTP client only.
    "operator": ImageProfile(extras=("operator",)),
    # The HTTP server stack without torch; pyyaml reads gateway.yaml, aiohttp talks to the
    # Kubernetes API for backend discovery.
    "gateway": ImageProfile(
        pick=("pyyaml", "aiohttp"), extras=("server",), exclude=("torch", "matplotlib")
    ),
    # The engine's dependencies except torch, which the Dockerfile installs from its index;
    # boto3 (the s3 extra) for s3:// LoRA adapters, which only the runtime loads.
    "runtime-cpu": ImageProfile(
        pick=("*",), extras=("server", "s3"), exclude=("torch", "matplotlib")
    ),
    "runtime-cuda": ImageProfile(
        pick=("*",), extras=("server", "s3", "gpu"), exclude=("torch", "matplotlib")
    ),
}


def normalize(name: str) -> str:
    """PEP 503 normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    """The normalized project name of a PEP 508 requirement string."""
    match = _NAME.match(requirement)
    if match is None:
        raise ValueError(f"pyproject requirement {requirement!r} has no project name")
    return normalize(match.group(1))


def requirements_for(profile_name: str, pyproject: Path) -> list[str]:
    """The requirement strings (as written in pyproject.toml) an image profile installs."""
    if profile_name not in PROFILES:
        raise ValueError(f"profile: unknown image profile {profile_name!r}; one of {sorted(PROFILES)}")
    profile = PROFILES[profile_name]
    project = tomllib.loads(pyproject.read_text())["project"]
    core: list[str] = project.get("dependencies", [])
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})

    chosen = list(core) if "*" in profile.pick else []
    everywhere = core + [r for group in optional.values() for r in group]
    for name in (normalize(n) for n in profile.pick if n != "*"):
        found = [r for r in everywhere if requirement_name(r) == name]
        if not found:
            raise ValueError(f"pick: {name!r} is listed nowhere in pyproject.toml")
        chosen.append(found[0])
    for extra in profile.extras:
        if extra not in optional:
            raise ValueError(f"extras: {extra!r} is not an optional-dependencies group")
        chosen.extend(optional[extra])

    excluded = {normalize(n) for n in profile.exclude}
    result: list[str] = []
    seen: set[str] = set()
    for requirement in chosen:
        name = requirement_name(requirement)
        if name in excluded or name in seen:
            continue
        seen.add(name)
        result.append(requirement)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", choices=sorted(PROFILES))
    parser.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"))
    args = parser.parse_args(argv)
    for requirement in requirements_for(args.profile, args.pyproject):
        print(requirement)
    return 0


if __name__ == "__main__":
    sys.exit(main())
