"""Which tenant an `Authorization: Bearer <key>` header names.

Keys are held only as SHA-256 digests. A lookup hashes the presented token, finds a digest
equal to it in a dict and confirms the match with `hmac.compare_digest`: what is compared is
never the key itself but its digest, whose bytes have no visible relation to the key's, so the
time a lookup takes tells nothing about how much of a guessed key was right. Nothing here logs
or returns a key.

The ring can be swapped for a new one while the gateway serves (`set_digests`, called when an
`api_keys_file` changes: key_files.py); a lookup sees either the old ring or the new one.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping

from argosy_runtime.gateway.config import TenantConfig


def key_digest(key: str) -> bytes:
    """The SHA-256 digest a key is held as.

    `surrogatepass`: a presented header's bytes that are not UTF-8 reach the gateway as
    surrogate escapes, which strict UTF-8 refuses (a 500); so encoded, such a key is just
    one no tenant has (a 401). Valid keys encode exactly as before."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (the scheme case-insensitive, as
    the runtime server reads it), else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class KeyRing:
    """Every tenant's keys, looked up in constant time."""

    def __init__(self, tenants: Iterable[TenantConfig]) -> None:
        # digest -> (the same digest, tenant name): the stored digest to compare against
        self._by_digest: dict[bytes, tuple[bytes, str]] = {}
        self.set_digests({t.name: [key_digest(key) for key in t.keys] for t in tenants})

    def set_digests(self, digests_by_tenant: Mapping[str, Iterable[bytes]]) -> None:
        """Replace every tenant's keys, given as their digests (`key_digest`)."""
        by_digest: dict[bytes, tuple[bytes, str]] = {}
        for tenant, digests in digests_by_tenant.items():
            for digest in digests:
                by_digest[digest] = (digest, tenant)
        self._by_digest = by_digest  # one assignment: lookups never see a half-built ring

    def tenant_of(self, authorization: str | None) -> str | None:
        """The name of the tenant whose key the header carries, or None (missing, malformed,
        or an unknown key)."""
        token = bearer_token(authorization)
        if token is None:
            return None
        presented = key_digest(token)
        stored, tenant = self._by_digest.get(presented, (b"", ""))
        return tenant if hmac.compare_digest(stored, presented) else None
