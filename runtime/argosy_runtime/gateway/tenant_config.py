"""The configuration of a tenant (the gateway config file's `tenants:`): its API keys and rate
limits; proxy/tenant_gate.py applies them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from argosy_runtime.gateway.config_checks import positive_int

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
                positive_int(f"{where}.{limit}", value)
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
