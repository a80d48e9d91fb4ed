"""Gateway configuration: frozen dataclasses, loaded from YAML (`--config`) or built from flags.

A minimal file::

    port: 8080
    models:
      - name: smollm2-135m
        backends: [http://127.0.0.1:8001, http://127.0.0.1:8002]
      - name: big
        kubernetes: {llmdeployment: big, namespace: default}
    cascades:
      - name: auto
        small: smollm2-135m
        large: big
        max_tokens_over: 512
    tenants:                      # optional: API keys and per-tenant rate limits
      - name: team-a
        api_keys_file: /etc/argosy/tenants/team-a
        requests_per_minute: 600

Every validation error is a ValueError that names the offending field (``models[1].policy``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from argosy_runtime.gateway.config_checks import build, check_keys, positive, positive_int

# Kubernetes discovery and tenants are configured in modules of their own; their names are
# importable from here too, as they always were.
from argosy_runtime.gateway.kubernetes_config import (
    DEFAULT_INSTANCE_LABEL,
    DISCOVERY_SOURCES,
    KubernetesBackendConfig,
)
from argosy_runtime.gateway.tenant_config import MAX_TENANT_LIMIT, TenantConfig, read_keys_file

__all__ = [
    "DEFAULT_INSTANCE_LABEL",
    "DISCOVERY_SOURCES",
    "MAX_ROUTING_WEIGHT",
    "MAX_TENANT_LIMIT",
    "POLICIES",
    "ActivationConfig",
    "CascadeConfig",
    "GatewayConfig",
    "HealthConfig",
    "KubernetesBackendConfig",
    "ModelRouteConfig",
    "RoutingConfig",
    "TenantConfig",
    "load_config",
    "parse_backend_flag",
    "read_keys_file",
]

POLICIES = ("round-robin", "least-load", "prefix-affinity")
# The largest least-load weight (routing.w_*): far past any useful ratio between the terms.
MAX_ROUTING_WEIGHT = 1e6


@dataclass(frozen=True)
class HealthConfig:
    """Active probing of replicas: `/ready` and `/metrics` every `interval_s`."""

    interval_s: float = 2.0
    timeout_s: float = 2.0
    # Consecutive failed probes that take a replica out of rotation, and successful ones that
    # put it back. A refused connection while proxying takes it out at once (passive check).
    unhealthy_after: int = 2
    healthy_after: int = 1

    def __post_init__(self) -> None:
        positive("health.interval_s", self.interval_s)
        positive("health.timeout_s", self.timeout_s)
        positive_int("health.unhealthy_after", self.unhealthy_after)
        positive_int("health.healthy_after", self.healthy_after)


@dataclass(frozen=True)
class RoutingConfig:
    """Tuning of the routing policies (shared by all models unless a model overrides policy)."""

    policy: str = "prefix-affinity"
    # prefix-affinity places a prompt by hashing its first `prefix_chars` characters (of the
    # prompt, or of the flattened chat history) onto the ring; prompts shorter than
    # `min_prefix_chars` go to least-load. It also remembers, per `block_chars` boundary of the
    # first `max_prefix_chars` characters, which replica last took that prefix, and prefers the
    # replica holding the longest one (what its prefix cache most likely still holds).
    prefix_chars: int = 256
    min_prefix_chars: int = 16
    block_chars: int = 64
    max_prefix_chars: int = 8192
    affinity_entries: int = 65536
    # Bounded load (Mirrokni et al. 2018): no replica takes more than
    # ceil(load_factor * (total in-flight + 1) / replicas) requests; the excess spills onward.
    load_factor: float = 1.25
    # ...but never below this many: a batching replica runs a few requests at once for about
    # the cost of one, and spilling a prefix's second request would waste its cached KV.
    min_capacity: int = 4
    virtual_nodes: int = 160
    # A replica whose scraped KV-cache usage is at or above this is treated as over its bound.
    kv_high_watermark: float = 0.95
    # least-load score = w_in_flight * in-flight + w_waiting * waiting + w_kv * kv usage (0..1)
    w_in_flight: float = 1.0
    w_waiting: float = 1.0
    w_kv: float = 2.0
    # Requests naming a LoRA adapter go to replicas holding it, else to one replica that loads
    # it and keeps it (policies/adapter_affinity.py); false leaves them to the policy.
    adapter_affinity: bool = True

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing.policy: must be one of {POLICIES}, got {self.policy!r}")
        positive_int("routing.prefix_chars", self.prefix_chars)
        positive_int("routing.min_prefix_chars", self.min_prefix_chars, allow_zero=True)
        positive_int("routing.block_chars", self.block_chars)
        positive_int("routing.max_prefix_chars", self.max_prefix_chars)
        positive_int("routing.affinity_entries", self.affinity_entries)
        positive("routing.load_factor", self.load_factor)
        if self.load_factor < 1.0:
            raise ValueError(f"routing.load_factor: must be >= 1.0, got {self.load_factor!r}")
        positive_int("routing.min_capacity", self.min_capacity)
        positive_int("routing.virtual_nodes", self.virtual_nodes)
        positive("routing.kv_high_watermark", self.kv_high_watermark)
        for name in ("w_in_flight", "w_waiting", "w_kv"):
            value = getattr(self, name)
            positive(f"routing.{name}", value, allow_zero=True)
            # A weight of 1e308 (or .inf) makes a score of two in-flight requests inf; inf -
            # inf is NaN, and least-load's ordering (and its tie rotation) breaks. Weights
            # only matter relative to each other, so a bound far past any useful ratio costs
            # nothing and keeps every score finite.
            if value > MAX_ROUTING_WEIGHT:
                raise ValueError(f"routing.{name}: must be <= {MAX_ROUTING_WEIGHT:g} (weights "
                                 f"only matter relative to each other), got {value!r}")
        if not isinstance(self.adapter_affinity, bool):
            raise ValueError(
                f"routing.adapter_affinity: expected true or false, got {self.adapter_affinity!r}"
            )


@dataclass(frozen=True)
class ActivationConfig:
    """Scale from zero: while a model has no replica in rotation, hold its requests (instead
    of answering 503 at once) and ask for a replica: a Kubernetes route stamps its
    LLMDeployment's `argosy.dev/activation-requested` annotation, which the operator's
    autoscaler answers by scaling 0 -> 1; `argosy fleet` reads the held count directly."""

    # Answer 503 when no replica came within this long (cold starts of big models take minutes).
    timeout_s: float = 300.0
    # Hold at most this many requests per model; beyond, 503 at once.
    max_held: int = 1000
    # While holding, re-stamp the annotation this often (the operator trusts a stamp 60 s).
    refresh_s: float = 15.0

    def __post_init__(self) -> None:
        positive("activation.timeout_s", self.timeout_s)
        positive_int("activation.max_held", self.max_held)
        positive("activation.refresh_s", self.refresh_s)
        if self.refresh_s > 30:
            raise ValueError(
                f"activation.refresh_s: must be <= 30 (the operator trusts a stamp for 60 s), "
                f"got {self.refresh_s!r}"
            )


@dataclass(frozen=True)
class ModelRouteConfig:
    """One model name that clients may request, and where its replicas are."""

    name: str = ""
    backends: tuple[str, ...] = ()
    kubernetes: KubernetesBackendConfig | None = None
    policy: str | None = None  # default: routing.policy
    activation: ActivationConfig | None = None  # scale from zero; None: 503 with no replica

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError("models[].name: required")
        # Checked before use: `backends: [8001]` (a port, not a URL) or a mapping must be
        # this error naming the field, not an AttributeError traceback at start-up.
        if not isinstance(self.backends, list | tuple) or not all(
                isinstance(u, str) for u in self.backends):
            raise ValueError(f"models[{self.name}].backends: expected a list of URLs, got "
                             f"{self.backends!r}")
        object.__setattr__(self, "backends", tuple(u.rstrip("/") for u in self.backends))
        for url in self.backends:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"models[{self.name}].backends: not an http(s) URL: {url!r}")
        # No backends at all is allowed with activation: `argosy fleet --min 0` starts empty
        # and adds replicas as it starts them.
        empty_ok = self.activation is not None and self.kubernetes is None
        if bool(self.backends) == (self.kubernetes is not None) and not empty_ok:
            raise ValueError(
                f"models[{self.name}]: give exactly one of 'backends' or 'kubernetes'"
            )
        if self.policy is not None and self.policy not in POLICIES:
            raise ValueError(
                f"models[{self.name}].policy: must be one of {POLICIES}, got {self.policy!r}"
            )
        if self.activation is not None and self.kubernetes is not None:
            if not self.kubernetes.llmdeployment:
                raise ValueError(
                    f"models[{self.name}].activation: needs kubernetes.llmdeployment (the "
                    "object to wake up)"
                )


@dataclass(frozen=True)
class CascadeConfig:
    """A route name that sends easy requests to `small` and hard ones to `large`.

    The large model is picked up front when any rule fires: the `header` asks for it, the
    prompt is longer than `prompt_chars_over`, `max_tokens` is above `max_tokens_over`, or the
    prompt contains one of `keywords` (case-insensitive). Otherwise the small model answers; for
    non-streamed requests, when `min_mean_logprob` is set and the small answer's mean token
    logprob is below it, the large model is asked again.
    """

    name: str = ""
    small: str = ""
    large: str = ""
    header: str = "x-argosy-cascade"
    prompt_chars_over: int | None = None
    max_tokens_over: int | None = None
    keywords: tuple[str, ...] = ()
    min_mean_logprob: float | None = None

    def __post_init__(self) -> None:
        for key in ("name", "small", "large"):
            if not getattr(self, key) or not isinstance(getattr(self, key), str):
                raise ValueError(f"cascades[].{key}: required")
        if self.small == self.large:
            raise ValueError(f"cascades[{self.name}].large: must differ from small")
        # Read from every request's headers: `header:` left empty in YAML (None) was a
        # TypeError there, a 500 for every request to the route.
        if not isinstance(self.header, str) or not self.header.strip():
            raise ValueError(f"cascades[{self.name}].header: expected a header name, got "
                             f"{self.header!r}")
        for key in ("prompt_chars_over", "max_tokens_over"):
            value = getattr(self, key)
            if value is not None:
                positive(f"cascades[{self.name}].{key}", value, allow_zero=True)
        if not isinstance(self.keywords, list | tuple) or not all(
                isinstance(k, str) and k for k in self.keywords):
            # An empty keyword is in every prompt: every request would go to the large model.
            raise ValueError(f"cascades[{self.name}].keywords: expected a list of non-empty "
                             f"strings, got {self.keywords!r}")
        object.__setattr__(self, "keywords", tuple(k.lower() for k in self.keywords))
        if self.min_mean_logprob is not None and (
            isinstance(self.min_mean_logprob, bool)
            or not isinstance(self.min_mean_logprob, int | float)
            or self.min_mean_logprob > 0
        ):
            raise ValueError(
                f"cascades[{self.name}].min_mean_logprob: must be a number <= 0, "
                f"got {self.min_mean_logprob!r}"
            )


@dataclass(frozen=True)
class GatewayConfig:
    """Everything `argosy gateway` needs."""

    host: str = "127.0.0.1"
    port: int = 8080
    models: tuple[ModelRouteConfig, ...] = ()
    cascades: tuple[CascadeConfig, ...] = ()
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    # Tries per request: the first replica plus retries on other replicas (connection refused,
    # 5xx or a full queue before the first byte of the answer).
    max_attempts: int = 2
    connect_timeout_s: float = 5.0
    # Off by default: a non-streamed answer's first byte comes when its whole generation is
    # done, so any default would cut long generations. When set, a try whose replica sends no
    # byte of the answer in this long is abandoned (the replica drops it) and retried.
    first_byte_timeout_s: float | None = None
    # Off by default (a stream of a request queued behind a long backlog can be quiet for
    # minutes). When set, an answer whose replica sends no new bytes for this long after its
    # first byte (a replica hung mid-stream) is cut like a replica that broke mid-answer.
    stream_idle_timeout_s: float | None = None
    # On SIGTERM the gateway stops accepting connections and gives the answers in flight
    # (streams included) this long to finish before it cuts them and exits.
    drain_timeout_s: float = 30.0
    # The longest the gateway waits for the next bytes of a request's body (nginx's
    # client_body_timeout): a client that sends the headers and then stalls mid-body gets a
    # 408 and its connection closed instead of holding it forever. Between reads, not for the
    # whole body: a 200 MiB batch upload over a slow link must still get through.
    client_body_timeout_s: float = 60.0
    # API keys and rate limits per tenant; empty: no authentication and no limits.
    tenants: tuple[TenantConfig, ...] = ()
    # What the gateway sends replicas as `Authorization: Bearer ...` (their --api-key) in place
    # of a tenant's key, and on its own calls to them; in a file, or $ARGOSY_REPLICA_API_KEY.
    replica_api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"port: must be a TCP port, got {self.port!r}")
        positive_int("max_attempts", self.max_attempts)
        positive("connect_timeout_s", self.connect_timeout_s)
        if self.first_byte_timeout_s is not None:
            positive("first_byte_timeout_s", self.first_byte_timeout_s)
        if self.stream_idle_timeout_s is not None:
            positive("stream_idle_timeout_s", self.stream_idle_timeout_s)
        positive("drain_timeout_s", self.drain_timeout_s, allow_zero=True)
        positive("client_body_timeout_s", self.client_body_timeout_s)
        names = [m.name for m in self.models]
        dupes = {n for n in names if names.count(n) > 1}
        if dupes:
            raise ValueError(f"models: duplicate name(s) {sorted(dupes)}")
        for cascade in self.cascades:
            if cascade.name in names:
                raise ValueError(f"cascades[{cascade.name}].name: clashes with a model name")
            for key in ("small", "large"):
                if getattr(cascade, key) not in names:
                    raise ValueError(
                        f"cascades[{cascade.name}].{key}: {getattr(cascade, key)!r} is not "
                        "a configured model"
                    )
        tenant_names = [t.name for t in self.tenants]
        dupes = {n for n in tenant_names if tenant_names.count(n) > 1}
        if dupes:
            raise ValueError(f"tenants: duplicate name(s) {sorted(dupes)}")
        owner_of_key: dict[str, str] = {}
        for tenant in self.tenants:
            for key in tenant.keys:
                other = owner_of_key.setdefault(key, tenant.name)
                if other != tenant.name:  # the key itself is never named
                    raise ValueError(
                        f"tenants[{tenant.name}].{tenant.key_source}: a key of {tenant.name!r} "
                        f"is also a key of {other!r}; a key must name one tenant"
                    )
        if self.replica_api_key is not None and (
            not isinstance(self.replica_api_key, str) or not self.replica_api_key.strip()
        ):
            raise ValueError("replica_api_key: expected a non-empty string")

    def policy_for(self, model: str) -> str:
        """The routing policy of `model` (its own, else the default)."""
        for route in self.models:
            if route.name == model and route.policy:
                return route.policy
        return self.routing.policy

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GatewayConfig:
        """Build from a parsed YAML/JSON mapping, validating every field."""
        if not isinstance(data, dict):
            raise ValueError("config: expected a mapping at the top level")
        check_keys("config", data, cls)
        data = dict(data)
        models = []
        for i, raw in enumerate(data.pop("models", None) or []):
            if not isinstance(raw, dict):
                raise ValueError(f"models[{i}]: expected a mapping")
            raw = dict(raw)
            if raw.get("kubernetes") is not None:
                raw["kubernetes"] = build(
                    KubernetesBackendConfig, f"models[{i}].kubernetes", raw["kubernetes"]
                )
            activation = raw.get("activation")
            if activation is not None:  # `true` takes the defaults, `false` is off
                raw["activation"] = None if activation is False else build(
                    ActivationConfig, f"models[{i}].activation",
                    {} if activation is True else activation,
                )
            models.append(build(ModelRouteConfig, f"models[{i}]", raw))
        cascades = tuple(
            build(CascadeConfig, f"cascades[{i}]", raw)
            for i, raw in enumerate(data.pop("cascades", None) or [])
        )
        if "tenants" in data and data["tenants"] is not None and not data["tenants"]:
            # Almost surely a mistake: leaving the field out is how the gateway runs open.
            raise ValueError("tenants: an empty list; give at least one tenant, or leave "
                             "'tenants' out to run without API keys")
        tenants = tuple(
            build(TenantConfig, f"tenants[{i}]", raw)
            for i, raw in enumerate(data.pop("tenants", None) or [])
        )
        if not data.get("replica_api_key"):
            data["replica_api_key"] = os.environ.get("ARGOSY_REPLICA_API_KEY") or None
        routing = build(RoutingConfig, "routing", data.pop("routing", None))
        health = build(HealthConfig, "health", data.pop("health", None))
        return cls(
            models=tuple(models), cascades=cascades, routing=routing, health=health,
            tenants=tenants, **data,
        )


def load_config(path: str | Path) -> GatewayConfig:
    """Read a gateway YAML file."""
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    return GatewayConfig.from_dict(data)


def parse_backend_flag(value: str) -> tuple[str, list[str]]:
    """`--backend MODEL=URL[,URL...]` -> (model, urls)."""
    model, sep, urls = value.partition("=")
    if not sep or not model or not urls:
        raise ValueError(f"--backend: expected MODEL=URL[,URL...], got {value!r}")
    return model, [u for u in urls.split(",") if u]
