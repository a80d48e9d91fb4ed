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
TO_CLIENT = ("content-type", "content-disposition", "retry-after", "x-request-id",
             "cache-control")


def to_replica(headers: Mapping[str, str], *, content_type: bool = True) -> dict[str, str]:
    """The client's headers a replica gets (`content_type=False` when the gateway sends a body
    of its own, such as a re-encoded multipart upload)."""
    names = TO_REPLICA if content_type else TO_REPLICA[1:]
    return {k: v for k, v in headers.items() if k.lower() in names}


def to_client(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() in TO_CLIENT}
