"""Names shared by the CRD, the builders, the handlers and the manifests."""

from __future__ import annotations

GROUP = "argosy.dev"
VERSION = "v1alpha1"
PLURAL = "llmdeployments"
KIND = "LLMDeployment"
API_VERSION = f"{GROUP}/{VERSION}"

# Images built by the images issue; the CUDA image is the default when gpus > 0.
RUNTIME_IMAGE_CUDA = "ghcr.io/argosy-project/argosy-runtime-cuda:0.1.0"
RUNTIME_IMAGE_CPU = "ghcr.io/argosy-project/argosy-runtime-cpu:0.1.0"
OPERATOR_IMAGE = "ghcr.io/argosy-project/argosy-operator:0.1.0"
# Fetches s3:// sources in the model-download init container (the runtime image has no AWS CLI).
S3_DOWNLOADER_IMAGE = "amazon/aws-cli:2.17.0"

OPERATOR_NAME = "argosy-operator"

# Labels on every child; the selector uses only LABEL_LLMD (selectors are immutable, keep them
# minimal).
LABEL_LLMD = "argosy.dev/llmdeployment"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
APP_NAME = "argosy-runtime"
COMPONENT = "llm-server"

# The JSON of the last manifest the operator applied to a child (like kubectl's
# last-applied-configuration): the base of the three-way merge patch, so that fields the
# operator stops setting are removed and fields others set are left alone.
ANNOTATION_LAST_APPLIED = "argosy.dev/last-applied"

# Scale from zero: a gateway holding requests for an LLMDeployment that has no ready replica
# stamps this annotation with the time (RFC3339); the autoscaler wakes the deployment while the
# stamp is fresh (autoscaling/activation.py). The gateway spells it literally, so that it does
# not import the operator package.
ANNOTATION_ACTIVATION = "argosy.dev/activation-requested"

# The runtime container's contract (see `argosy serve`).
RUNTIME_CONTAINER = "runtime"
RUNTIME_PORT = 8000
RUNTIME_PORT_NAME = "http"
MODEL_VOLUME = "model"
MODEL_MOUNT = "/models"
TMP_VOLUME = "tmp"
# The Batch API's files and batches, on the /tmp emptyDir: it outlives a container restart,
# so a batch cut by one resumes in the same pod (docs/batch.md).
BATCH_DIR = "/tmp/argosy-batches"
# With spec.runtime.batchVolumeClaim: the shared claim's mount; --batch-dir is <mount>/<name>.
BATCH_VOLUME = "batches"
BATCH_MOUNT = "/var/lib/argosy/batches"
SHM_VOLUME = "dshm"
RUN_AS_USER = 1000

# LoRA adapters live in a ConfigMap (named like the LLMDeployment) mounted into the runtime
# container, not in its args: the runtime re-reads the file (`--lora-modules-file`), so adding
# or removing an adapter patches the ConfigMap and rolls no pod.
LORA_VOLUME = "lora-adapters"
LORA_MOUNT = "/etc/argosy/lora"
LORA_FILE_KEY = "adapters.json"

# Condition types. The autoscaler (argosy_operator.autoscaling) owns ScalingActive and
# ScalingLimited; the reconciler owns the others. Stalled (kstatus' name for a failure that
# retrying cannot fix: GitOps tools report the object failed) appears once a spec is refused.
COND_READY = "Ready"
COND_PROGRESSING = "Progressing"
COND_DEGRADED = "Degraded"
COND_STALLED = "Stalled"
OWNED_CONDITIONS = (COND_READY, COND_PROGRESSING, COND_DEGRADED, COND_STALLED)
