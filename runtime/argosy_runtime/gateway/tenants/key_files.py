"""`api_keys_file`: the tenants' keys, re-read while the gateway runs.

A tenant's keys file is usually a mounted Kubernetes Secret. When the Secret changes, kubelet
writes the new files into a fresh timestamped folder and swaps the mount's `..data` symlink
to it, so the file's path stays the same while its content (and, oddly, not always its mtime)
changes. Every POLL_SECONDS the gate's watcher (proxy/tenant_gate.py) calls `sync`, which
reads each file again and compares the keys in it with the ones served (as digests, never by
mtime); when they differ, the tenant's keys are replaced in the KeyRing at once: new keys
work and removed ones get a 401 from the next request on. The tenant's limiter (its buckets
and in-flight count) is kept by tenant name, not by key, so it carries on untouched.

A file that cannot be read, holds no key or an invalid one, is logged once (a warning, not one
every poll) and the tenant keeps the keys it had: a half-written Secret must not lock every
user out. So is a change that would give a key to two tenants (the warning names both tenants,
never the key). Once the file is valid again, it applies. Inline `api_keys`, and which file
a tenant reads, come from the config file's `tenants` section (tenants/config_file.py); when
that changes, the gate builds a new KeyFiles for the new tenants.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from argosy_runtime.gateway.config import TenantConfig, read_keys_file
from argosy_runtime.gateway.tenants.keys import KeyRing, key_digest

logger = logging.getLogger(__name__)

# How often the gateway re-reads its config file's tenants and the keys files (kubelet
# refreshes a mounted Secret or ConfigMap within about a minute of its change anyway).
POLL_SECONDS = 5.0


def _key_count(n: int) -> str:
    return f"{n} key" if n == 1 else f"{n} keys"


class KeyFiles:
    """Keeps a KeyRing in step with the tenants' `api_keys_file`s."""

    def __init__(self, tenants: Iterable[TenantConfig], ring: KeyRing) -> None:
        tenants = list(tenants)
        self.ring = ring
        # tenant -> its keys file (tenants with inline keys have none)
        self.paths = {t.name: t.api_keys_file for t in tenants if t.api_keys_file is not None}
        # tenant -> the digests of the keys served now, every tenant (inline ones take part in
        # the one-tenant-per-key check)
        self.digests = {t.name: frozenset(key_digest(key) for key in t.keys) for t in tenants}
        self._problems: dict[str, str] = {}  # tenant -> the problem last logged for its file

    def sync(self) -> list[str]:
        """Read every keys file and apply the ones that changed; the tenants whose keys
        changed."""
        proposed = dict(self.digests)
        problems: dict[str, str] = {}
        for tenant, path in self.paths.items():
            try:
                keys = read_keys_file(f"tenants[{tenant}].api_keys_file", path)
            except ValueError as exc:
                problems[tenant] = str(exc)
                continue
            proposed[tenant] = frozenset(key_digest(key) for key in keys)
        changed = {t for t in self.paths if proposed[t] != self.digests[t]}
        # Files are read together so that a key moved from one tenant to another in one
        # Secret update moves in one sync. A change that gives a key two tenants is refused
        # (both changes when both tenants changed); refusing one may show another that only
        # the refused tenant's previous keys collide with, hence the loop. It ends: the keys
        # served now have no key in two tenants.
        while refused := self._clashes(proposed, changed):
            for tenant, other in refused.items():
                proposed[tenant] = self.digests[tenant]
                changed.discard(tenant)
                problems[tenant] = (
                    f"tenants[{tenant}].api_keys_file: a key of {tenant!r} is also a key of "
                    f"{other!r}; a key must name one tenant")
        if changed:
            self.ring.set_digests(proposed)
        for tenant in changed:
            logger.info("tenant %r: keys reloaded from %s: %s now (was %d)", tenant,
                        self.paths[tenant], _key_count(len(proposed[tenant])),
                        len(self.digests[tenant]))
        for tenant, problem in problems.items():
            if self._problems.get(tenant) != problem:  # once, not every poll
                logger.warning("%s; tenant %r keeps its previous %s", problem, tenant,
                               _key_count(len(self.digests[tenant])))
                self._problems[tenant] = problem
        for tenant in [t for t in self._problems if t not in problems]:
            del self._problems[tenant]
            if tenant not in changed:
                logger.info("tenant %r: %s is valid again (%s, unchanged)", tenant,
                            self.paths[tenant], _key_count(len(proposed[tenant])))
        self.digests = proposed
        return sorted(changed)

    @staticmethod
    def _clashes(proposed: dict[str, frozenset[bytes]], changed: set[str]) -> dict[str, str]:
        """Changed tenants that share a key with another tenant -> that other tenant."""
        owners: dict[bytes, str] = {}
        refused: dict[str, str] = {}
        for tenant, digests in proposed.items():
            for digest in digests:
                other = owners.setdefault(digest, tenant)
                if other == tenant:
                    continue
                for one, two in ((tenant, other), (other, tenant)):
                    if one in changed:
                        refused.setdefault(one, two)
        return refused
