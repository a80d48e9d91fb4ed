"""The routing in force: the `routing` settings and each model's policy, as one snapshot.

The gateway routes every request with the `Routing` it finds when the request starts (its
retries included), and a reloaded config file (tenants/config_file.py) replaces the snapshot
whole, on the event loop, without awaiting (`Gateway.apply_routing`): a request is routed
either entirely by the old settings or entirely by the new ones, never by a mix.

Every field of `routing`, and each model's own `policy`, may change while the gateway runs:
they only steer which replica of a model's pool takes a request, and bind no socket and add
or remove no replica. What the policies learned is not thrown away with the old snapshot
(`make_policy(..., previous=)`, `Policy.adopt`), because it describes the replicas, which a
reload leaves as they are:

- prefix affinity keeps its prefix -> replica table (what the replicas' prefix caches hold),
  and its hash rings unless `virtual_nodes` changed;
- adapter affinity keeps its record of where it sent each adapter (what is being loaded);
- round-robin and least-load keep their rotation;
- the load the policies read (in-flight counts, scraped KV usage and queue depth, loaded
  adapters) lives on the replicas, not in a policy, and is untouched.

A model whose policy changes kind starts its new policy empty: a prefix table means nothing
to least-load, and one kept through a switch and back would be stale (the replicas' caches
turned over in between).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from argosy_runtime.gateway.config import GatewayConfig, RoutingConfig
from argosy_runtime.gateway.policies import Policy, make_policy


def _shown(value: Any) -> str:
    """A setting as the YAML file spells it."""
    return str(value).lower() if isinstance(value, bool) else str(value)


@dataclass(frozen=True)
class Routing:
    """Immutable: replaced, never changed, when the config file is reloaded."""

    config: RoutingConfig
    policy_names: Mapping[str, str]  # model -> the name of its policy
    policies: Mapping[str, Policy]  # model -> its policy, built from `config`

    @classmethod
    def build(cls, config: RoutingConfig, policy_names: Mapping[str, str],
              previous: Routing | None = None) -> Routing:
        """The snapshot for `config`, each model routed by the policy `policy_names` gives it;
        the policies take over what `previous`'s learned (module docstring)."""
        old = previous.policies if previous is not None else {}
        policies = {model: make_policy(name, config, old.get(model))
                    for model, name in policy_names.items()}
        return cls(config, dict(policy_names), policies)

    @classmethod
    def of(cls, config: GatewayConfig) -> Routing:
        """The snapshot a gateway starts with."""
        return cls.build(config.routing,
                         {m.name: config.policy_for(m.name) for m in config.models})

    def reloaded(self, config: GatewayConfig) -> Routing:
        """The snapshot after a reload of `config`; `self` when nothing routing reads changed.
        Models stay the ones served now (adding or removing one needs a restart); one that
        the file no longer lists keeps its policy."""
        listed = {m.name for m in config.models}
        names = {model: config.policy_for(model) if model in listed else name
                 for model, name in self.policy_names.items()}
        if config.routing == self.config and names == dict(self.policy_names):
            return self
        return Routing.build(config.routing, names, previous=self)

    def changes(self, new: Routing) -> list[str]:
        """What differs from `self` in `new`, for the log."""
        out = [f"routing.{f.name}: {_shown(getattr(self.config, f.name))} -> "
               f"{_shown(getattr(new.config, f.name))}"
               for f in fields(RoutingConfig)
               if getattr(self.config, f.name) != getattr(new.config, f.name)]
        # A model that follows routing.policy (before and after) is said by the line above.
        out += [f"policy of {model}: {name} -> {new.policy_names[model]}"
                for model, name in self.policy_names.items()
                if new.policy_names[model] != name
                and (name, new.policy_names[model]) != (self.config.policy, new.config.policy)]
        return out
