"""The policy interface and what a policy may look at in a request."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from argosy_runtime.gateway.backends.replica import Replica


@dataclass(frozen=True)
class RouteRequest:
    """What routing sees of a request: the leading text of its prompt (or flattened chat),
    the LoRA adapter it names (None for a base model), the tenant that sends it (its
    `X-Argosy-Owner`; None without tenants), its `cache_salt` (vLLM's field: replicas
    share cached blocks only between requests with the same salt), and its
    `prompt_cache_key` (OpenAI's field: a hint that requests with the same key belong
    together; replicas do not divide their cache by it)."""

    prefix: str = ""
    adapter: str | None = None
    owner: str | None = None
    cache_salt: str | None = None
    cache_key: str | None = None


class Policy(ABC):
    """Picks one replica among `candidates` (all in rotation, none tried yet for this request).

    Policies keep their own small state (a counter, a hash ring) and read the replicas' load
    fields; they never mutate replicas (the proxy counts in-flight requests).
    """

    name: str = ""

    @abstractmethod
    def choose(self, candidates: Sequence[Replica], request: RouteRequest) -> Replica | None:
        """The replica to try, or None when `candidates` is empty."""

    def adopt(self, previous: Policy) -> None:
        """Take over what `previous` learned, where it still holds under this policy's
        settings: `previous` is the policy this one replaces when the gateway reloads its
        routing settings (gateway/routing.py). Only the same kind of policy has anything to
        give; nothing by default."""
        return None  # a stateless policy keeps nothing
