"""Run Python code here as if inside one of the images: only that image's packages importable.

An image installs `argosy` with --no-deps plus the requirements docker/image_requirements.py
prints for it. This module computes the set of distributions pip would put in the image (those
requirements and, transitively, what they require, read from the installed metadata) and starts
subprocesses in which importing a module from any other installed distribution fails with
ModuleNotFoundError, as it would in the image. torch, for one, is then unimportable for the
operator and gateway profiles.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import subprocess
import sys
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]


def image_requirements(profile: str) -> list[str]:
    """What docker/image_requirements.py prints for `profile` (the script the Dockerfiles run)."""
    out = subprocess.run(
        [sys.executable, str(REPO / "docker" / "image_requirements.py"), profile,
         "--pyproject", str(REPO / "pyproject.toml")],
        capture_output=True, text=True, check=True,
    ).stdout
    return [line for line in out.splitlines() if line.strip()]


def closure(requirements: list[str]) -> set[str]:
    """Canonical names of the requirements' distributions and everything they require.

    Markers are evaluated for this interpreter with the requested extras; a requirement that is
    not installed here raises (the check would be meaningless without its metadata).
    """
    seen: set[str] = set()
    pending: list[tuple[Requirement, frozenset[str]]] = [
        (req, frozenset(req.extras)) for req in map(Requirement, requirements)
    ]
    env = default_environment()
    while pending:
        req, extras = pending.pop()
        name = canonicalize_name(req.name)
        key = name + "[" + ",".join(sorted(extras)) + "]"
        if key in seen:
            continue
        seen.add(key)
        dist = metadata.distribution(req.name)  # PackageNotFoundError if absent here
        for raw in dist.requires or []:
            sub = Requirement(raw)
            if sub.marker is not None and not any(
                sub.marker.evaluate({**env, "extra": extra}) for extra in (extras or {""})
            ):
                continue
            pending.append((sub, frozenset(sub.extras)))
    return {key.split("[", 1)[0] for key in seen}


# Prepended to the code a subprocess runs: every finder on sys.meta_path is wrapped so that a
# top-level module owned only by distributions outside ALLOWED is simply not found, as in the
# image (so `import torch` raises ModuleNotFoundError and `importlib.util.find_spec("torch")`
# is None). Standard-library modules, the project's own packages and modules that no installed
# distribution claims are left alone.
_BLOCKER = """
import importlib.metadata, re, sys
ALLOWED = set({allowed})
_OWNERS = importlib.metadata.packages_distributions()
def _absent(top):
    if top in sys.stdlib_module_names or top.startswith("argosy_"):
        return False
    owners = {{re.sub(r"[-_.]+", "-", d).lower() for d in _OWNERS.get(top, [])}}
    return bool(owners) and not owners & ALLOWED
class _ImageOnly:
    def __init__(self, inner):
        self._inner = inner
    def find_spec(self, fullname, path=None, target=None):
        if _absent(fullname.partition(".")[0]):
            return None
        find = getattr(self._inner, "find_spec", None)
        return find(fullname, path, target) if find else None
    def __getattr__(self, name):  # find_distributions, invalidate_caches, ...
        return getattr(self._inner, name)
sys.meta_path[:] = [_ImageOnly(finder) for finder in sys.meta_path]
"""


def sandboxed_source(profile: str, code: str, extra_requirements: tuple[str, ...] = ()) -> str:
    """`code` prefixed with the import blocker for `profile`'s image.

    `extra_requirements`: what the Dockerfile installs besides the profile (the runtimes' torch,
    from its own index); their dependencies are allowed too.
    """
    allowed = closure(image_requirements(profile) + list(extra_requirements))
    allowed.add("argosy")
    return _BLOCKER.format(allowed=json.dumps(sorted(allowed))) + "\n" + code


def run_as_image(profile: str, code: str, *, timeout: float = 300,
                 extra_requirements: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter that can import only what `profile`'s image holds."""
    source = sandboxed_source(profile, code, extra_requirements)
    return subprocess.run([sys.executable, "-c", source], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, check=False)


IMPORT_ALL = """
import importlib, pkgutil, sys
failures = []
for root in {packages!r}:
    try:
        package = importlib.import_module(root)
    except ModuleNotFoundError as exc:
        if exc.name == root:
            continue  # that package is not built yet
        raise
    for info in pkgutil.walk_packages(package.__path__, root + "."):
        if any(info.name.startswith(skip) for skip in {skip!r}):
            continue
        try:
            importlib.import_module(info.name)
        except Exception as exc:
            failures.append(f"{{info.name}}: {{type(exc).__name__}}: {{exc}}")
print("\\n".join(failures))
print("torch imported:", "torch" in sys.modules)
"""


def import_all_code(packages: list[str], skip: tuple[str, ...] = ()) -> str:
    """Code that imports every module under `packages` and prints the failures."""
    return IMPORT_ALL.format(packages=packages, skip=list(skip))
