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

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

POLICIES = ("round-robin", "least-load", "prefix-affinity")
# The largest least-load weight (routing.w_*): far past any useful ratio between the terms.
MAX_ROUTING_WEIGHT = 1e6
DISCOVERY_SOURCES = ("pods", "endpointslices")
# The label the Argosy operator selects an LLMDeployment's runtime pods by (its value is the
# LLMDeployment's name); equal to argosy_operator.constants.LABEL_LLMD, kept literal here so the
# gateway does not depend on the operator package.
DEFAULT_INSTANCE_LABEL = "argosy.dev/llmdeployment"


def _check_keys(where: str, data: dict[str, Any], cls: type) -> None:
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in known:
            raise ValueError(f"{where}.{key}: unknown field (known: {', '.join(sorted(known))})")


def _build(cls: type, where: str, data: Any) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(data).__name__}")
    _check_keys(where, data, cls)
    try:
        return cls(**data)
    except TypeError as exc:  # a wrong type that __post_init__ did not catch
        raise ValueError(f"{where}: {exc}") from exc


def _positive(where: str, value: Any, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: expected a number, got {value!r}")
    # "not >= 0": NaN (YAML's .nan) compares false with everything, and passed a "< 0" test
    if not value >= 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{where}: must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def _positive_int(where: str, value: Any, *, allow_zero: bool = False) -> None:
    """A count (tries, characters, entries, replicas): an int, not merely a number. A float
    such as `max_attempts: 1.5` would pass `_positive`, start, and then fail every request
    (the code slices and ranges with these), instead of stopping the start-up."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (
            value == 0 and not allow_zero):
        kind = "an integer >= 0" if allow_zero else "a positive integer"
        raise ValueError(f"{where}: expected {kind}, got {value!r}")


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
        _positive("health.interval_s", self.interval_s)
        _positive("health.timeout_s", self.timeout_s)
        _positive_int("health.unhealthy_after", self.unhealthy_after)
        _positive_int("health.healthy_after", self.healthy_after)


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
        _positive_int("routing.prefix_chars", self.prefix_chars)
        _positive_int("routing.min_prefix_chars", self.min_prefix_chars, allow_zero=True)
        _positive_int("routing.block_chars", self.block_chars)
        _positive_int("routing.max_prefix_chars", self.max_prefix_chars)
        _positive_int("routing.affinity_entries", self.affinity_entries)
        _positive("routing.load_factor", self.load_factor)
        if self.load_factor < 1.0:
            raise ValueError(f"routing.load_factor: must be >= 1.0, got {self.load_factor!r}")
        _positive_int("routing.min_capacity", self.min_capacity)
        _positive_int("routing.virtual_nodes", self.virtual_nodes)
        _positive("routing.kv_high_watermark", self.kv_high_watermark)
        for name in ("w_in_flight", "w_waiting", "w_kv"):
            value = getattr(self, name)
            _positive(f"routing.{name}", value, allow_zero=True)
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
class KubernetesBackendConfig:
    """Replicas discovered from the Pods (or EndpointSlices) of an LLMDeployment."""

    llmdeployment: str = ""
    namespace: str = "default"
    # Default selector: `argosy.dev/llmdeployment=<llmdeployment>`.
    label_selector: str | None = None
    source: str = "pods"
    port: int = 8000
    port_name: str = "http"
    # API server URL; default: in-cluster service account, else $KUBECONFIG / ~/.kube/config.
    api_url: str | None = None
    # Re-list this often even when the watch stream is quiet (a safety net, not the mechanism).
    resync_s: float = 300.0

    def __post_init__(self) -> None:
        # Checked here, not at discovery: a selector that is not a string (`label_selector:
        # 5`, or a YAML mapping of labels) fails every list call, which discovery retries
        # forever, logging a warning, and the model never gets a replica. A blank one would
        # select every pod of the namespace.
        if self.label_selector is not None and (
                not isinstance(self.label_selector, str) or not self.label_selector.strip()):
            raise ValueError(
                "kubernetes.label_selector: expected a Kubernetes label selector string such "
                f"as 'app=llm,tier in (a,b)', got {self.label_selector!r}")
        for key in ("llmdeployment", "namespace", "port_name"):
            if not isinstance(getattr(self, key), str):
                raise ValueError(f"kubernetes.{key}: expected a string, got "
                                 f"{getattr(self, key)!r}")
        if self.api_url is not None and not isinstance(self.api_url, str):
            raise ValueError(f"kubernetes.api_url: expected a URL string, got {self.api_url!r}")
        if not self.llmdeployment and not self.label_selector:
            raise ValueError("kubernetes.llmdeployment: required (or give label_selector)")
        if self.source not in DISCOVERY_SOURCES:
            raise ValueError(
                f"kubernetes.source: must be one of {DISCOVERY_SOURCES}, got {self.source!r}"
            )
        if not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ValueError(f"kubernetes.port: must be a TCP port, got {self.port!r}")
        _positive("kubernetes.resync_s", self.resync_s)

    @property
    def selector(self) -> str:
        """The label selector sent to the API server."""
        return self.label_selector or f"{DEFAULT_INSTANCE_LABEL}={self.llmdeployment}"


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
        _positive("activation.timeout_s", self.timeout_s)
        _positive_int("activation.max_held", self.max_held)
        _positive("activation.refresh_s", self.refresh_s)
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
                _positive(f"cascades[{self.name}].{key}", value, allow_zero=True)
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


# The largest value of a tenant's limit: far beyond any real budget, well within a float.
MAX_TENANT_LIMIT = 10**15


@dataclass(frozen=True)
class TenantConfig:
    """One caller of the gateway (a team): its API keys and optional rate limits.

    Keys come inline (`api_keys`, for local use) or from a file holding one key per line
    (`api_keys_file`, a mounted Kubernetes Secret); `keys` holds them either way. Keys are kept
    out of repr() so that a logged config never shows one.
    """

    name: str = ""
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    api_keys_file: str | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None  # prompt + completion tokens
    max_concurrent: int | None = None  # requests in flight at once
    # The most urgent scheduling `priority` (the runtime's: lower runs first, preempts higher)
    # this tenant's generation requests may have; also their default. None: as sent.
    priority: int | None = None
    keys: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError("tenants[].name: required")
        where = f"tenants[{self.name}]"
        if bool(self.api_keys) == (self.api_keys_file is not None):
            raise ValueError(f"{where}: give exactly one of 'api_keys' or 'api_keys_file'")
        if self.api_keys_file is not None:
            keys = read_keys_file(f"{where}.api_keys_file", self.api_keys_file)
        else:
            if isinstance(self.api_keys, str) or not isinstance(self.api_keys, list | tuple):
                raise ValueError(f"{where}.api_keys: expected a list of keys")
            object.__setattr__(self, "api_keys", tuple(self.api_keys))
            keys = _checked_keys(f"{where}.api_keys", self.api_keys)
        object.__setattr__(self, "keys", keys)
        for limit in ("requests_per_minute", "tokens_per_minute", "max_concurrent"):
            value = getattr(self, limit)
            if value is not None:
                _positive_int(f"{where}.{limit}", value)
                # The limiter's buckets hold floats: a number past a float's range would be
                # an OverflowError there (at start-up, or killing the reload watcher).
                if value > MAX_TENANT_LIMIT:
                    raise ValueError(f"{where}.{limit}: at most 10^15")
        if self.priority is not None and (
            isinstance(self.priority, bool) or not isinstance(self.priority, int)
            or not -(1 << 31) <= self.priority < (1 << 31)
        ):
            raise ValueError(f"{where}.priority: expected an integer in [-2^31, 2^31 - 1] "
                             f"(lower runs first), got {self.priority!r}")

    @property
    def key_source(self) -> str:
        """The field the keys came from (for error messages)."""
        return "api_keys_file" if self.api_keys_file is not None else "api_keys"


def _checked_keys(where: str, keys: Any) -> tuple[str, ...]:
    """`keys` without repeats, in order; ValueError when one is not a usable key."""
    for key in keys:
        # The message never quotes the key: errors end up in logs.
        if not isinstance(key, str) or not key or any(c.isspace() for c in key):
            raise ValueError(f"{where}: every key must be a non-empty string without whitespace")
    return tuple(dict.fromkeys(keys))


def read_keys_file(where: str, path: str) -> tuple[str, ...]:
    """The keys in `path`, one per line (surrounding whitespace and blank lines ignored),
    without repeats; ValueError naming `where` when the file cannot be read or holds no valid
    key. The gateway reads each `api_keys_file` with it at start-up and again while it runs
    (gateway/tenants/key_files.py)."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"{where}: expected a file path, got {path!r}")
    try:
        # utf-8-sig: a byte order mark (editors on Windows write one) is invisible and not
        # whitespace, so it would otherwise become part of the first key, which never matches.
        with open(path, encoding="utf-8-sig") as f:
            keys = tuple(line.strip() for line in f if line.strip())
    except OSError as exc:
        raise ValueError(f"{where}: cannot read {path!r}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where}: {path!r} is not UTF-8 text") from exc
    if not keys:
        raise ValueError(f"{where}: {path!r} holds no key (one key per line)")
    return _checked_keys(where, keys)


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
        _positive_int("max_attempts", self.max_attempts)
        _positive("connect_timeout_s", self.connect_timeout_s)
        if self.first_byte_timeout_s is not None:
            _positive("first_byte_timeout_s", self.first_byte_timeout_s)
        _positive("drain_timeout_s", self.drain_timeout_s, allow_zero=True)
        _positive("client_body_timeout_s", self.client_body_timeout_s)
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
        _check_keys("config", data, cls)
        data = dict(data)
        models = []
        for i, raw in enumerate(data.pop("models", None) or []):
            if not isinstance(raw, dict):
                raise ValueError(f"models[{i}]: expected a mapping")
            raw = dict(raw)
            if raw.get("kubernetes") is not None:
                raw["kubernetes"] = _build(
                    KubernetesBackendConfig, f"models[{i}].kubernetes", raw["kubernetes"]
                )
            activation = raw.get("activation")
            if activation is not None:  # `true` takes the defaults, `false` is off
                raw["activation"] = None if activation is False else _build(
                    ActivationConfig, f"models[{i}].activation",
                    {} if activation is True else activation,
                )
            models.append(_build(ModelRouteConfig, f"models[{i}]", raw))
        cascades = tuple(
            _build(CascadeConfig, f"cascades[{i}]", raw)
            for i, raw in enumerate(data.pop("cascades", None) or [])
        )
        if "tenants" in data and data["tenants"] is not None and not data["tenants"]:
            # Almost surely a mistake: leaving the field out is how the gateway runs open.
            raise ValueError("tenants: an empty list; give at least one tenant, or leave "
                             "'tenants' out to run without API keys")
        tenants = tuple(
            _build(TenantConfig, f"tenants[{i}]", raw)
            for i, raw in enumerate(data.pop("tenants", None) or [])
        )
        if not data.get("replica_api_key"):
            data["replica_api_key"] = os.environ.get("ARGOSY_REPLICA_API_KEY") or None
        routing = _build(RoutingConfig, "routing", data.pop("routing", None))
        health = _build(HealthConfig, "health", data.pop("health", None))
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
