"""Each image's packages import with only that image's distributions installed.

docker/image_requirements.py decides what each image installs besides the project (which goes
in with --no-deps). Here every module of the packages an image runs is imported in a subprocess
that can see only those distributions (tests/images/image_closure.py): a missing dependency
fails here instead of as a crash-looping pod, and torch must stay out of the operator and the
gateway.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from image_closure import closure, image_requirements, import_all_code, run_as_image
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def names(requirements: list[str]) -> set[str]:
    return {Requirement(r).name.lower().replace("_", "-") for r in requirements}


def test_operator_installs_its_extra_and_nothing_of_the_core() -> None:
    assert names(image_requirements("operator")) == names(
        PROJECT["optional-dependencies"]["operator"])


def test_runtime_images_install_every_core_dependency_but_torch() -> None:
    core = names(PROJECT["dependencies"]) - {"torch"}
    for profile in ("runtime-cpu", "runtime-cuda"):
        got = names(image_requirements(profile))
        assert core <= got and "torch" not in got
        assert names(PROJECT["optional-dependencies"]["server"]) - {"matplotlib"} <= got
    assert "triton" in names(image_requirements("runtime-cuda"))
    assert "triton" not in names(image_requirements("runtime-cpu"))


def test_only_the_runtime_images_install_boto3_for_s3_lora_adapters() -> None:
    for profile in ("runtime-cpu", "runtime-cuda"):
        assert names(PROJECT["optional-dependencies"]["s3"]) <= names(image_requirements(profile))
    for profile in ("operator", "gateway"):
        assert not {"boto3", "botocore"} & closure(image_requirements(profile))
    # What lora/s3.py imports resolves with the runtime image's distributions alone.
    proc = run_as_image("runtime-cpu", "import boto3, botocore.exceptions, botocore.config")
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_no_image_pulls_in_torch_or_matplotlib_transitively() -> None:
    for profile in ("operator", "gateway"):
        assert not {"torch", "matplotlib"} & closure(image_requirements(profile))


def test_unknown_profile_is_a_value_error_naming_the_field() -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(REPO / "docker" / "image_requirements.py"),
                           "nope"], capture_output=True, text=True, check=False)
    assert proc.returncode != 0 and "invalid choice" in proc.stderr


def test_the_sandbox_really_hides_other_distributions() -> None:
    """The check below would pass vacuously if the import blocker did nothing."""
    proc = run_as_image("operator", "import kopf\nimport fastapi\n")
    assert proc.returncode != 0 and "No module named 'fastapi'" in proc.stderr
    proc = run_as_image("operator", "import importlib.util as u\nprint(u.find_spec('torch'))")
    assert proc.stdout.strip() == "None", proc.stderr


# image -> (packages whose every module must import there, prefixes not shipped to it)
IMAGE_PACKAGES = {
    "operator": (["argosy_operator"], ()),
    "gateway": (["argosy_runtime.gateway"], ()),
    "runtime-cpu": (["argosy_runtime", "argosy_kernels"],
                    ("argosy_runtime.gateway", "argosy_runtime.benchmarks")),
}


@pytest.mark.parametrize("image", sorted(IMAGE_PACKAGES))
def test_every_module_imports_with_only_the_image_packages(image: str) -> None:
    packages, skip = IMAGE_PACKAGES[image]
    extra = ("torch",) if image.startswith("runtime") else ()
    proc = run_as_image(image, import_all_code(packages, skip), extra_requirements=extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    *failures, torch_line = proc.stdout.strip().splitlines()
    assert [f for f in failures if f] == []
    if not image.startswith("runtime"):
        assert torch_line == "torch imported: False"
