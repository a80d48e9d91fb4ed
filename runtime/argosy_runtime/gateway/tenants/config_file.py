"""The gateway's config file, re-read while the gateway runs for its `tenants` and `routing`.

In Kubernetes the config file is a mounted ConfigMap: when it is edited, kubelet writes the
new file into a fresh folder and swaps the mount's `..data` symlink, so the path stays the
same while the content changes (and its mtime may not). `ConfigFile.reread_config` reads the
file again, and when its text changed, builds a whole new GatewayConfig from it with the same
function that built the running one (`parse`: the CLI's, so flags still override the file)
and the same validation. It returns the new config and whether its tenants may apply;
applying is the gate's job (proxy/tenant_gate.py: the tenants, then the routing through the
gateway, gateway/routing.py), on the event loop, in one step.

What applies while running: `tenants`, `routing` (every field) and each model's `policy`
(`LIVE`). A change to any other field (models' backends, discovery or activation, cascades,
health, ports, timeouts, the replica key, ...) is logged as needing a restart, and none of it
applies: those bind sockets, start discovery and health tasks, or decide which backends and
routes exist, all set up once at start-up. So is turning tenants on or off (a gateway started
without tenants authenticates nobody and must not start refusing requests mid-flight, nor
one with tenants start accepting everyone). A file that cannot be read, parsed or validated
is refused as a whole: the gateway keeps serving with the tenants and routing it has, and the
refusal is raised once per problem (not every poll); the file is tried again at every poll
until it is valid.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import yaml

from argosy_runtime.gateway.config import GatewayConfig, TenantConfig

logger = logging.getLogger(__name__)

# Top-level fields that apply while the gateway runs; `models` too, for each model's `policy`.
LIVE = ("tenants", "routing")


class ConfigRefused(ValueError):
    """A changed config file that cannot apply; the message says why (never a key)."""


@dataclass(frozen=True)
class Reloaded:
    """A changed, valid config file: the new config (its `routing` and models' `policy`
    apply), and its tenants when they may apply now."""

    config: GatewayConfig
    tenants: tuple[TenantConfig, ...] | None  # None: tenants turned on or off (a restart)


class ConfigFile:
    """The config file the running gateway was started from."""

    def __init__(self, path: str, text: str, started: GatewayConfig,
                 parse: Callable[[str], GatewayConfig]) -> None:
        """`text`: the file's content `started` was built from; `parse`: text -> config,
        raising on an invalid one."""
        self.path = path
        self.started = started
        self.parse = parse
        self._text = text  # the last text that was applied, or settled as not applicable
        self._refused: tuple[str | None, str] | None = None  # the last (text, problem) raised

    @property
    def refused(self) -> bool:
        """Whether the file as last read is refused (the gateway serves older tenants)."""
        return self._refused is not None

    def reread_config(self) -> Reloaded | None:
        """(Blocking: call it on a worker thread.) The file's config when its text changed
        and it is valid, else None; ConfigRefused the first time a problem is met."""
        try:
            with open(self.path, encoding="utf-8") as f:
                text: str | None = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            text, problem = None, f"cannot read it: {getattr(exc, 'strerror', None) or exc}"
        else:
            if text == self._text:
                self._refused = None
                return None
            try:
                config = self.parse(text)
            except yaml.MarkedYAMLError as exc:
                # Not str(exc): it quotes the offending line, which may hold a key.
                mark = exc.problem_mark or exc.context_mark
                where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
                problem = f"not valid YAML: {exc.problem or exc.context}{where}"
            except Exception as exc:  # anything else a bad file raises is a refusal too
                problem = str(exc) or type(exc).__name__
            else:
                self._refused = None
                self._text = text
                return Reloaded(config, self._applicable_tenants(config))
        if self._refused == (text, problem):
            return None  # already raised for this content
        self._refused = (text, problem)
        raise ConfigRefused(f"{self.path}: {problem}")

    def _applicable_tenants(self, config: GatewayConfig) -> tuple[TenantConfig, ...] | None:
        """`config`'s tenants when they may apply now; logs what needs a restart."""
        needs_restart = [f.name for f in dataclasses.fields(GatewayConfig)
                         if f.name not in LIVE
                         and _fixed(config, f.name) != _fixed(self.started, f.name)]
        if needs_restart:
            logger.warning("%s: %s changed; only 'tenants', 'routing' and the models' "
                           "'policy' apply while the gateway runs: restart (roll) the gateway "
                           "to apply the rest", self.path, ", ".join(needs_restart))
        if bool(config.tenants) != bool(self.started.tenants):
            logger.warning("%s: 'tenants' was %s; turning API keys %s needs a restart (roll) "
                           "of the gateway", self.path,
                           "removed" if self.started.tenants else "added",
                           "off" if self.started.tenants else "on")
            return None
        return config.tenants


def _fixed(config: GatewayConfig, name: str) -> object:
    """The part of `config`'s field `name` that only a restart applies (the models without
    their `policy`)."""
    value = getattr(config, name)
    if name == "models":
        return tuple(dataclasses.replace(m, policy=None) for m in value)
    return value
