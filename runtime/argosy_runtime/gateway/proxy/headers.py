"""Which headers the gateway passes between clients and replicas (hop-by-hop ones, Host and
encodings are not)."""

from __future__ import annotations

from collections.abc import Mapping

# `authorization`: the client's own; with tenants, tenant_gate.py has already swapped the
# tenant's key for the gateway's replica key (or removed it) before any handler runs.
# `x-argosy-owner`: the tenant, set by tenant_gate.py (which drops a client's own), so that
# replicas keep each tenant's stored objects to itself.
TO_REPLICA = ("content-type", "authorization", "accept", "x-request-id", "traceparent",
              "x-argosy-owner")
# `x-accel-buffering`: the runtime marks its event streams "no" so that an nginx in front of
# the gateway relays each event at once instead of buffering the stream.
# `www-authenticate`: a replica's 401 is passed through as it was said, its challenge included.
TO_CLIENT = ("content-type", "content-disposition", "retry-after", "x-request-id",
             "cache-control", "x-accel-buffering", "www-authenticate")


def to_replica(headers: Mapping[str, str], *, content_type: bool = True) -> dict[str, str]:
    """The client's headers a replica gets (`content_type=False` when the gateway sends a body
    of its own, such as a re-encoded multipart upload).

    Always `Accept-Encoding: identity`: otherwise aiohttp asks for gzip and deflate on every
    request, and a replica behind a compressing proxy would answer compressed bytes that the
    gateway relays to a client that never asked for them (and cannot read the usage, logprobs
    or ids it parses from answers)."""
    names = TO_REPLICA if content_type else TO_REPLICA[1:]
    out = {k: v for k, v in headers.items() if k.lower() in names}
    out["Accept-Encoding"] = "identity"
    return out


def to_client(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() in TO_CLIENT}
