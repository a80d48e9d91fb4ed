"""Per-tenant limits: requests and tokens per minute as token buckets, and in-flight requests.

A bucket holds up to its per-minute amount and refills continuously at amount / 60 per
second, so a tenant may burst its whole minute at once and then proceeds at the steady rate.

- requests: admission takes 1 from the requests bucket, and needs 1 there;
- tokens: a request's tokens are only known after its answer (the replica's `usage`), so
  admission only needs the tokens bucket above zero, and the answer's tokens are taken from
  it afterwards. A large answer may take it below zero; that debt then holds back the
  tenant's next requests until the refill pays it off (the usual approach when the cost is
  known only afterwards);
- concurrency: at most `max_concurrent` requests admitted and not yet released.

When the tenants config is reloaded (proxy/tenant_gate.py), a tenant that stays keeps its
limiter and `set_limits` applies its new numbers to it: what the tenant used of its old
budget counts against the new one (`TokenBucket.set_per_minute`), its requests in flight
keep their slots, and a limit it did not have before starts with a full bucket.

The clock is injectable, so tests drive refills without sleeping.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from argosy_runtime.gateway.config import TenantConfig

Clock = Callable[[], float]

# Which limit refused a request (the `limit` label of argosy:gateway_tenant_rate_limited_total).
REQUESTS, TOKENS, CONCURRENCY = "requests", "tokens", "concurrency"


class TokenBucket:
    """`per_minute` units of capacity, refilled continuously at per_minute / 60 a second."""

    def __init__(self, per_minute: int, clock: Clock) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0  # units per second
        self._clock = clock
        self._level = self.capacity
        self._updated = clock()

    @property
    def level(self) -> float:
        """What the bucket holds now (negative while in debt)."""
        now = self._clock()
        self._level = min(self.capacity, self._level + (now - self._updated) * self.rate)
        self._updated = now
        return self._level

    def set_per_minute(self, per_minute: int) -> None:
        """A new limit. What was used of the old one (capacity - level) stays used: raising
        the limit gives the difference at once, lowering it may leave the bucket empty but
        never deeper in debt than it already was (for a requests bucket: never in debt, so a
        lowered limit never locks a tenant out for longer than one request's refill)."""
        level = self.level  # refilled at the old rate up to now
        used = self.capacity - level
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self._level = max(self.capacity - used, min(level, 0.0))

    def take(self, amount: float) -> None:
        """Remove `amount`; the level may go below zero (debt)."""
        self._level = self.level - amount

    def seconds_until(self, level: float) -> float:
        """How long until the bucket holds at least `level` (0 when it does now)."""
        return max(0.0, (level - self.level) / self.rate)


@dataclass(frozen=True)
class Refusal:
    """A request over one of its tenant's limits."""

    tenant: str
    limit: str  # REQUESTS, TOKENS or CONCURRENCY
    retry_after_s: int  # whole seconds until a retry would be admitted (>= 1)

    @property
    def message(self) -> str:
        what = {
            REQUESTS: "requests per minute limit",
            TOKENS: "tokens per minute limit",
            CONCURRENCY: "limit of concurrent requests (max_concurrent)",
        }[self.limit]
        return (f"tenant {self.tenant!r} is over its {what}; retry after "
                f"{self.retry_after_s} s")


class Lease:
    """One admitted request: holds its concurrency slot until released, and takes the
    answer's tokens from the tenant's bucket as they are charged."""

    def __init__(self, limiter: TenantLimiter) -> None:
        self._limiter = limiter
        self._released = False

    def charge(self, tokens: int) -> None:
        if self._limiter.tokens is not None and tokens > 0:
            self._limiter.tokens.take(tokens)

    def release(self) -> None:
        """Free the concurrency slot (once: later calls do nothing)."""
        if not self._released:
            self._released = True
            self._limiter.in_flight -= 1


class TenantLimiter:
    """One tenant's buckets and in-flight count."""

    def __init__(self, tenant: TenantConfig, clock: Clock = time.monotonic) -> None:
        self.tenant = tenant.name
        self._clock = clock
        self.requests: TokenBucket | None = None
        self.tokens: TokenBucket | None = None
        self.in_flight = 0
        self.set_limits(tenant)

    def set_limits(self, tenant: TenantConfig) -> None:
        """Apply `tenant`'s limits (a reloaded config), keeping what was used (module
        docstring). Requests in flight keep their slots; when `max_concurrent` drops below
        their number, new requests wait until enough of them end."""
        self.requests = self._bucket(self.requests, tenant.requests_per_minute)
        self.tokens = self._bucket(self.tokens, tenant.tokens_per_minute)
        self.max_concurrent = tenant.max_concurrent

    def _bucket(self, bucket: TokenBucket | None, per_minute: int | None) -> TokenBucket | None:
        if not per_minute:
            return None
        if bucket is None:
            return TokenBucket(per_minute, self._clock)
        bucket.set_per_minute(per_minute)
        return bucket

    def admit(self) -> Lease | Refusal:
        """A Lease when every limit allows one more request now (it takes one request from
        the bucket and a concurrency slot), else the Refusal with the longest wait."""
        # Whole seconds after which a retry is admitted (Retry-After), per limit over.
        waits: dict[str, int] = {}
        if self.requests is not None and self.requests.level < 1:
            waits[REQUESTS] = math.ceil(round(self.requests.seconds_until(1), 6))
        if self.tokens is not None and self.tokens.level <= 0:
            # Admission needs the bucket above zero: the first whole second after the debt
            # is paid off.
            waits[TOKENS] = math.floor(round(self.tokens.seconds_until(0), 6)) + 1
        if self.max_concurrent is not None and self.in_flight >= self.max_concurrent:
            waits[CONCURRENCY] = 1  # a slot frees when any request ends: unknown when
        if waits:
            limit = max(waits, key=lambda name: waits[name])
            return Refusal(self.tenant, limit, max(1, waits[limit]))
        if self.requests is not None:
            self.requests.take(1)
        self.in_flight += 1
        return Lease(self)

    def headers(self) -> dict[str, str]:
        """OpenAI's `x-ratelimit-*` headers for the limits this tenant has: limit, what
        remains now, and the time until the bucket is full again."""
        out: dict[str, str] = {}
        for kind, bucket in ((REQUESTS, self.requests), (TOKENS, self.tokens)):
            if bucket is not None:
                level = bucket.level
                out[f"x-ratelimit-limit-{kind}"] = str(int(bucket.capacity))
                out[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(level)))
                out[f"x-ratelimit-reset-{kind}"] = format_duration(
                    bucket.seconds_until(bucket.capacity))
        return out


def format_duration(seconds: float) -> str:
    """A wait in OpenAI's header format: `0s`, `20ms`, `1.5s`, `6m0s`."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 1000) / 1000:g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"
