"""Stable hashes the affinity policies place keys with.

Python's hash() is salted per process, and placements must agree across gateway restarts and
across several gateways, so every policy hashes with blake2b through `hash64`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def utf8(text: str) -> bytes:
    """`text` as UTF-8, lone surrogates included: JSON may escape half a UTF-16 pair
    ("\\ud800"), which decodes to a str strict UTF-8 refuses, and a client's prompt must
    not make routing raise (the replica answers such a body with its own 400)."""
    return text.encode("utf-8", "surrogatepass")


def hash64(text: str) -> int:
    """A stable 64-bit hash of `text`."""
    return int.from_bytes(hashlib.blake2b(utf8(text), digest_size=8).digest(), "big")


def rendezvous_order(key: str, members: Sequence[str]) -> list[str]:
    """`members` by decreasing weight hash64(key, member): rendezvous (highest random weight)
    hashing, Thaler and Ravishankar 1998.

    Each key has its own random-looking order, so keys spread evenly over the members, and
    removing a member moves only the keys it came first for (every other member keeps its
    weight). Unlike a ring it needs no state: right for a handful of keys and members.
    """
    return sorted(members, key=lambda member: hash64(f"{key}\x00{member}"), reverse=True)
