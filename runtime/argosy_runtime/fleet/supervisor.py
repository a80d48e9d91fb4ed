"""The local fleet: N `argosy serve` processes on loopback ports with the gateway in front.

The whole serving stack on one machine, no Kubernetes: the embedded default for trying the
system and for end-to-end tests. With `min_replicas`/`max_replicas` set, the autoscaler's pure
decision function (argosy_operator.autoscaling.decide, the same one the operator runs in a
cluster) is fed the replicas' scraped KV usage and queue depth every scrape interval, and the
fleet starts replica processes or drains them (out of rotation first, then SIGTERM) to match.
A replica process that dies unexpectedly is taken out of rotation and replaced; so is one
that fails its liveness check (/health answering an error, or nothing, for
`liveness_timeout_s`: a hung process or a dead engine thread), as the operator's pods'
livenessProbe does in a cluster: SIGTERM, then SIGKILL to its whole process group (its
tensor-parallel workers too) after LIVENESS_KILL_GRACE_S.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import logging
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import aiohttp
from aiohttp import web

from argosy_runtime.fleet.replica_process import ReplicaProcess, free_port
from argosy_runtime.gateway.config import (
    POLICIES,
    ActivationConfig,
    GatewayConfig,
    HealthConfig,
    ModelRouteConfig,
    RoutingConfig,
)
from argosy_runtime.gateway.proxy.app import Gateway, start_gateway

logger = logging.getLogger(__name__)

# `argosy serve` flags the fleet gives every replica itself: one of them among the serve args
# (after `--`) would override it (argparse keeps the last), e.g. a replica on another port than
# the one the fleet polls for /ready and routes to.
FLEET_SET_SERVE_FLAGS = ("--model", "--served-model-name", "--host", "--port")
RESTART_BACKOFF_MAX_S = 60.0
# A replica that exits within this long of becoming ready crashed at start (a model that
# loads but fails its first step, a bad flag found late): in a row, such exits are a crash
# loop, and each replacement waits twice as long as the last (up to RESTART_BACKOFF_MAX_S).
CRASH_LOOP_WINDOW_S = 60.0
# Tries to start a replica whose port another process took before it could listen.
PORT_ATTEMPTS = 3
# One /health probe's limit (the operator's livenessProbe timeoutSeconds).
LIVENESS_PROBE_TIMEOUT_S = 5.0
# A replica past its own --drain-timeout aborts what still runs, then exits: time for that
# before SIGKILL (as the operator's GRACE_MARGIN_SECONDS over the drain timeout).
DRAIN_MARGIN_S = 15.0
# A replica that fails its liveness check gets SIGTERM, then SIGKILL (its whole process group)
# this long after if it has not exited: time to log and let go of its workers, not to drain
# (its requests are not going to finish). `argosy serve` gives its HTTP server 5 s too.
LIVENESS_KILL_GRACE_S = 5.0


@dataclass(frozen=True)
class FleetConfig:
    """What `argosy fleet` runs."""

    model: str = "smollm2-135m"
    served_model_name: str | None = None  # default: the model value
    replicas: int = 2
    host: str = "127.0.0.1"  # the gateway's address; replicas always bind 127.0.0.1
    port: int = 8080  # the gateway's port (0: any free port)
    policy: str = "prefix-affinity"
    # Autoscaling between these bounds when both are set (camelCase overrides of the policy,
    # as in an LLMDeployment's spec.autoscaling, in `autoscaling`).
    min_replicas: int | None = None
    max_replicas: int | None = None
    autoscaling: dict[str, Any] = field(default_factory=dict)
    serve_args: tuple[str, ...] = ()
    log_dir: str | None = None
    ready_timeout_s: float = 300.0
    drain_timeout_s: float = 60.0
    restart: bool = True
    health_interval_s: float = 1.0
    # A ready replica whose /health fails this long is killed and replaced (0: never).
    # 60 s: the operator's livenessProbe (4 failures, 15 s apart).
    liveness_timeout_s: float = 60.0
    serve_command: tuple[str, ...] | None = None  # default: `argosy serve` (this interpreter)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {POLICIES}, got {self.policy!r}")
        if not (self.liveness_timeout_s == 0 or self.liveness_timeout_s >= 1):  # NaN too
            # Below a second, an ordinary pause (a long step holding the GIL) would kill
            # healthy replicas.
            raise ValueError(f"liveness_timeout: must be 0 (off) or at least 1 second, got "
                             f"{self.liveness_timeout_s}")
        if not 0 <= self.port <= 65535:  # else found out only once every replica has loaded
            raise ValueError(f"port: must be a TCP port (0-65535), got {self.port}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("min_replicas: give both --min and --max to autoscale")
        if self.min_replicas is not None and self.max_replicas is not None:
            if not 0 <= self.min_replicas <= self.replicas <= self.max_replicas or self.max_replicas < 1:
                raise ValueError(
                    f"replicas: need 0 <= min ({self.min_replicas}) <= replicas "
                    f"({self.replicas}) <= max ({self.max_replicas}), max >= 1"
                )
        elif not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"replicas: must be an integer >= 1, got {self.replicas!r}")
        for arg in self.serve_args:
            flag = arg.split("=", 1)[0]
            # argparse also takes an unambiguous prefix (--po for --port).
            if len(flag) > 2 and any(f.startswith(flag) for f in FLEET_SET_SERVE_FLAGS):
                raise ValueError(
                    f"serve_args: {arg} is set by the fleet for every replica (replicas listen "
                    "on free loopback ports; give --model/--served-model-name to the fleet)"
                )
        # --min/--max set these: in --autoscaling they were silently overridden.
        overridden = [k for k in ("enabled", "minReplicas", "maxReplicas") if k in self.autoscaling]
        if overridden:
            raise ValueError(f"--autoscaling: {', '.join(overridden)} cannot be set there (the "
                             "fleet autoscales between --min and --max)")
        if self.autoscaled:
            try:  # a bad --autoscaling fails here, not in the background
                self.autoscaling_policy()
            except OverflowError as exc:  # an integer too large for a float (YAML 1000...0)
                raise ValueError(f"--autoscaling: a value is out of range ({exc})") from None

    def autoscaling_policy(self) -> Any:
        """The AutoscalingPolicy from --min/--max and the --autoscaling overrides."""
        from argosy_operator.autoscaling import AutoscalingPolicy

        spec = {**self.autoscaling, "enabled": True, "minReplicas": self.min_replicas,
                "maxReplicas": self.max_replicas}  # fmt: skip
        return AutoscalingPolicy.from_spec(spec)

    @functools.cached_property
    def batches_shared(self) -> bool:
        """Every replica gets the same serve args, so a --batch-dir among them is one folder
        they all share: a drained replica's batches are taken over by the others. Read as
        the replicas' own argparse reads them: `--batch-d DIR` (an abbreviation) is the
        same folder."""
        return _serve_arg(self.serve_args, "batch_dir") is not None

    @functools.cached_property
    def replica_drain_s(self) -> float | None:
        """`--drain-timeout` among the serve args (the replicas' drain on SIGTERM); None
        when not there (its default, 30 s, is within drain_timeout_s's default) or not valid
        (no replica starts)."""
        value = _serve_arg(self.serve_args, "drain_timeout")
        return value if value is not None and value >= 0 else None  # NaN fails ">= 0" too

    @property
    def kill_after_s(self) -> float:
        """How long a draining replica gets before SIGKILL: drain_timeout_s, or longer when
        the serve args give the replicas a longer --drain-timeout (a SIGKILL at 60 s cut the
        requests `-- --drain-timeout 300` was letting finish)."""
        if self.replica_drain_s is None:
            return self.drain_timeout_s
        return max(self.drain_timeout_s, self.replica_drain_s + DRAIN_MARGIN_S)

    @property
    def scales_from_zero(self) -> bool:
        """--min 0: the gateway holds requests while no replica runs and the autoscaler wakes
        one for them."""
        return self.min_replicas == 0

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    @property
    def autoscaled(self) -> bool:
        return self.min_replicas is not None


class Fleet:
    """Start with `await fleet.start()`, stop with `await fleet.stop()`."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.log_dir = config.log_dir or tempfile.mkdtemp(prefix="argosy-fleet-")
        self.processes: list[ReplicaProcess] = []
        self.gateway: Gateway | None = None
        self.gateway_url = ""
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self.decisions: list[Any] = []  # autoscaler decisions, newest last
        self._quick_exits = 0  # replicas in a row that exited soon after becoming ready
        self._last_quick_exit = float("-inf")  # time.monotonic() of the last of them
        # Replacements waiting to start (_replace's backoff): without them, the autoscaler
        # would start replicas of its own for the ones missing, a crash loop's backoff aside.
        self._replacing = 0
        # Scale-ups that failed in a row (the replica never became ready), and when the
        # autoscaler may try again: each failure doubles the wait (1 s up to
        # RESTART_BACKOFF_MAX_S), so a model that no longer loads is not restarted every tick.
        self._failed_scale_ups = 0
        self._scale_up_after = 0.0
        self._hold_logged = False

    # -- replicas ----------------------------------------------------------------------------

    def _new_process(self) -> ReplicaProcess:
        # free_port() lets go of the port it found, so it may find one again that a replica
        # still starting was given but has not bound yet: two replicas on one port, the second
        # answered by the first's /ready, then exiting ("address in use") and taking the
        # first's URL out of rotation with it.
        taken = {p.port for p in self.processes}
        port = free_port()
        while port in taken:
            port = free_port()
        return ReplicaProcess(
            self.config.model,
            self.config.name,
            port,
            extra_args=self.config.serve_args,
            log_dir=self.log_dir,
            serve_command=self.config.serve_command,
            orphan_grace_s=self.config.kill_after_s,
        )

    async def _launch(self) -> ReplicaProcess:
        """Start one replica and wait until it is ready; raise with its log if it is not.
        A replica whose free port was taken by another process before it could listen (the
        port is picked here, bound there) is started again on another port."""
        attempt = 0
        while True:
            attempt += 1
            proc = self._new_process()
            self.processes.append(proc)
            try:
                await proc.start()
            except OSError as exc:  # its log cannot be written (the log dir gone), fork failed
                self.processes.remove(proc)  # else a replica that never runs counts as one
                raise RuntimeError(f"replica {proc.url} could not start: {exc}") from None
            if await proc.wait_ready(self.config.ready_timeout_s):
                return proc
            if proc in self.processes:  # stop() may have drained and forgotten it meanwhile
                self.processes.remove(proc)
            code = proc.process.returncode if proc.process is not None else None
            await proc.kill()
            tail = proc.log_tail()
            if code is not None and attempt < PORT_ATTEMPTS and _port_taken(tail):
                logger.warning("replica %s could not listen (the port was taken meanwhile); "
                               "starting it on another port", proc.url)
                continue
            why = (f"exited ({_exit_reason(code)}) before it was ready" if code is not None
                   else f"was not ready within {self.config.ready_timeout_s:g} s")
            raise RuntimeError(f"replica {proc.url} {why}; the end of its log "
                               f"({proc.log_path}):\n{tail or '(empty)'}")

    async def add_replica(self) -> ReplicaProcess:
        """Start a replica and put it into rotation once ready."""
        proc = await self._launch()
        if self.gateway is not None:
            self.gateway.pools[self.config.name].add(proc.url)
        logger.info("replica %s in rotation (%d running)", proc.url, len(self.live))
        return proc

    async def drain_replica(self, proc: ReplicaProcess) -> int | None:
        """Out of rotation first (no new requests), then SIGTERM: in-flight ones finish."""
        proc.draining = True
        if self.gateway is not None:
            self.gateway.pools[self.config.name].remove(proc.url)
        code = await proc.drain(self.config.kill_after_s)
        if proc in self.processes:
            self.processes.remove(proc)
        logger.info("replica %s drained (exit %s)", proc.url, code)
        return code

    @property
    def live(self) -> list[ReplicaProcess]:
        """Replicas not being drained (starting ones included)."""
        return [p for p in self.processes if not p.draining]

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # Say what failed (a replica that never became ready, with its log) now, not as an
            # "exception never retrieved" whenever the task is garbage-collected.
            logger.error("%s", task.exception())

    async def _replace(self, wait: float = 0.0) -> None:
        """Start a replacement for a replica that exited (after `wait` seconds: a crash
        loop's backoff), retrying with backoff while it fails (its model no longer loads,
        memory not yet freed): the fleet must neither stay a replica short for good nor
        restart a failing one in a tight loop. The caller has counted it in `_replacing`
        (while none runs, the autoscaler counts it as starting); this uncounts it."""
        try:
            await asyncio.sleep(wait)
            delay = max(1.0, min(2 * wait, RESTART_BACKOFF_MAX_S))
            while True:
                self._replacing -= 1  # in self.processes while it starts
                try:
                    await self.add_replica()
                    return
                except RuntimeError as exc:
                    logger.error("%s\nretrying in %.0f s", exc, delay)
                    self._refuse_held(exc)
                finally:
                    self._replacing += 1
                await asyncio.sleep(delay)
                delay = min(2 * delay, RESTART_BACKOFF_MAX_S)
        finally:
            self._replacing -= 1

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> str:
        """Start the replicas and the gateway; returns the gateway's URL. RuntimeError when a
        replica never becomes ready or the gateway cannot listen (nothing is left running)."""
        from argosy_runtime.cli.serve import check_listen_address  # light: no torch

        c = self.config
        try:  # before minutes of model loading, not after
            check_listen_address(c.host, c.port)
        except ValueError as exc:
            raise RuntimeError(f"cannot serve the gateway: {exc}") from None
        try:
            Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RuntimeError(f"--log-dir {self.log_dir}: {exc.strerror or exc}") from None
        launches = [asyncio.ensure_future(self._launch()) for _ in range(c.replicas)]
        try:
            await asyncio.gather(*launches)
            await self._start_gateway()
        except BaseException:
            # One replica failed: the others' start-ups end here, not run on behind stop()
            # (a replica started again on another port after the fleet stopped, an exception
            # nobody reads); what they started is in self.processes for stop() to drain.
            for launch in launches:
                launch.cancel()
            await asyncio.gather(*launches, return_exceptions=True)
            await self.stop()
            raise
        self._tasks.append(asyncio.get_running_loop().create_task(self._watch_processes()))
        # Loops that must never die silently: the fleet would stop replacing hung replicas
        # or scaling, unnoticed.
        if c.liveness_timeout_s:
            self._tasks.append(asyncio.get_running_loop().create_task(
                _logged_if_it_stops(self._check_liveness(), "liveness checks")))
        if c.autoscaled:
            self._tasks.append(asyncio.get_running_loop().create_task(
                _logged_if_it_stops(self._autoscale_loop(), "autoscaler")))
        logger.info("fleet of %d x %s behind %s", len(self.processes), c.name, self.gateway_url)
        return self.gateway_url

    async def _start_gateway(self) -> None:
        c = self.config
        gw_config = GatewayConfig(
            host=c.host,
            port=c.port,
            models=(
                ModelRouteConfig(
                    name=c.name,
                    backends=tuple(p.url for p in self.processes),
                    activation=ActivationConfig(timeout_s=c.ready_timeout_s)
                    if c.scales_from_zero
                    else None,
                ),
            ),
            routing=RoutingConfig(policy=c.policy),
            health=HealthConfig(interval_s=c.health_interval_s, timeout_s=2.0),
            # On stop, the answers in flight get as long as a replica's drain would give them
            # (the gateway's own default, 30 s, cut those a longer --drain-timeout allowed).
            drain_timeout_s=GatewayConfig.drain_timeout_s if c.replica_drain_s is None
            else c.replica_drain_s,
        )
        self.gateway = Gateway(gw_config)
        try:
            self._runner, port = await start_gateway(self.gateway, c.host, c.port)
        except OSError as exc:  # the port was taken while the replicas loaded
            raise RuntimeError(f"cannot serve the gateway on {c.host}:{c.port}: "
                               f"{exc.strerror or exc}") from None
        self.gateway_url = f"http://{c.host}:{port}"

    async def stop(self) -> None:
        """Stop autoscaling, close the gateway, drain every replica."""
        for task in self._tasks + list(self._background):
            task.cancel()
        for task in self._tasks + list(self._background):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        if self.gateway is not None:
            # Requests held for a replica (scale from zero) are answered 503 now: none will
            # start, and the gateway's drain would wait for them (drain_timeout_s) in vain.
            for activator in self.gateway.activators.values():
                activator.refuse("the fleet is stopping: no replica will start")
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        # One being stopped for failing its liveness check (its stop was cancelled above) is
        # hung: killed, not drained, or it would hold the fleet's exit for drain_timeout_s.
        await asyncio.gather(
            *(p.kill() if p.stopping and not p.draining else p.drain(self.config.kill_after_s)
              for p in self.processes),
            return_exceptions=True,
        )
        self.processes.clear()

    def kill(self) -> None:
        """SIGKILL every replica (and its workers) now: a stop() waiting for them to drain
        returns at once."""
        for proc in self.processes:
            proc.kill_group()

    async def _watch_processes(self) -> None:
        """Replace replicas that exit without being drained."""
        while True:
            await asyncio.sleep(1.0)
            for proc in list(self.processes):
                # One still starting is _launch's to give up on (else it is replaced twice).
                if not proc.ready or proc.alive or proc.draining:
                    continue
                logger.warning("replica %s exited (%s); the end of its log (%s):\n%s", proc.url,
                               _exit_reason(proc.process.returncode), proc.log_path,
                               proc.log_tail() or "(empty)")
                self.processes.remove(proc)
                proc.kill_group()  # workers it left behind (a crash runs no clean-up)
                if self.gateway is not None:
                    self.gateway.pools[self.config.name].remove(proc.url)
                if self.config.restart:
                    # Counted as starting from now, not from when the task first runs: the
                    # autoscaler may run before it and would start a replica of its own.
                    self._replacing += 1
                    self._spawn(self._replace(self._restart_wait(proc)))

    async def _scale_up(self) -> None:
        """One more replica for the autoscaler; a failure delays the next scale-up."""
        try:
            await self.add_replica()
        except RuntimeError as exc:
            now = time.monotonic()
            if now >= self._scale_up_after:  # the first failure of its round
                if now - self._scale_up_after > RESTART_BACKOFF_MAX_S:
                    self._failed_scale_ups = 0  # the last failure is long past
                self._failed_scale_ups += 1
                self._scale_up_after = now + _backoff(self._failed_scale_ups)
                self._hold_logged = False
            logger.error("autoscaler: scale-up failed (%d in a row; the next in %.0f s at the "
                         "earliest): %s", self._failed_scale_ups, self._scale_up_after - now, exc)
            self._refuse_held(exc)
        else:
            self._failed_scale_ups = 0

    def _refuse_held(self, exc: RuntimeError) -> None:
        """A replica started for requests held at zero failed to start: answer them 503 with
        why now, not after the hold's timeout (the replica start-up timeout, minutes)."""
        activator = self.gateway.activators.get(self.config.name) if self.gateway else None
        if activator is not None and activator.needed():
            # The first line only ("replica URL exited (code 1) before it was ready"): the
            # log's end is for the fleet's operator, not for clients.
            why = str(exc).split(";", 1)[0].splitlines()[0]
            activator.refuse(f"no replica of {self.config.name!r} could start ({why}); retry "
                             "later")

    async def _check_liveness(self) -> None:
        """Stop a ready replica whose /health has failed for liveness_timeout_s (SIGTERM, then
        SIGKILL to its process group after LIVENESS_KILL_GRACE_S, in the background: the
        others are still probed meanwhile); _watch_processes then replaces it. Starting,
        draining and stopping replicas are not probed (start-up has its own timeout; a drain
        its own)."""
        timeout = aiohttp.ClientTimeout(total=min(LIVENESS_PROBE_TIMEOUT_S,
                                                  self.config.liveness_timeout_s))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                await asyncio.sleep(self.config.health_interval_s)
                probed = [p for p in self.processes
                          if p.ready and p.alive and not p.draining and not p.stopping]
                failures = await asyncio.gather(*(_health_failure(session, p.url)
                                                  for p in probed))
                now = time.monotonic()
                for proc, failure in zip(probed, failures):
                    if failure is None:
                        proc.failing_since = None
                        continue
                    if proc.failing_since is None:
                        proc.failing_since = now
                        logger.warning("replica %s failed its liveness check: %s", proc.url,
                                       failure)
                    elif proc.draining or proc not in self.processes:
                        continue  # drained (or gone) while it was probed: not ours to kill
                    elif now - proc.failing_since >= self.config.liveness_timeout_s:
                        logger.error("replica %s has failed its liveness check for %.0f s "
                                     "(%s): stopping it to replace it (SIGTERM, SIGKILL to "
                                     "its process group after %g s)", proc.url,
                                     now - proc.failing_since, failure, LIVENESS_KILL_GRACE_S)
                        proc.stopping = True  # not probed again while the task below runs
                        self._spawn(proc.terminate(LIVENESS_KILL_GRACE_S,
                                                   "its liveness check failed"))

    def _restart_wait(self, proc: ReplicaProcess) -> float:
        """How long to wait before replacing `proc`, which exited: at once, unless replicas
        keep exiting soon after becoming ready (a crash loop: 2, 4, 8... s)."""
        now = time.monotonic()
        # The longest a crash loop's next exit can take: its backoff, a start-up, the window.
        # Quick exits further apart are not a loop (else one that ended long ago, its
        # replicas serving since, delayed the next quick exit's replacement by up to 60 s).
        loop_gap = RESTART_BACKOFF_MAX_S + self.config.ready_timeout_s + CRASH_LOOP_WINDOW_S
        if now - (proc.ready_at or 0.0) >= CRASH_LOOP_WINDOW_S:
            self._quick_exits = 0
        else:
            in_a_row = now - self._last_quick_exit <= loop_gap
            self._quick_exits = self._quick_exits + 1 if in_a_row else 1
            self._last_quick_exit = now
        if self._quick_exits < 2:
            return 0.0
        wait = _backoff(self._quick_exits)
        logger.error("replicas keep exiting soon after becoming ready (%d in a row): the next "
                     "one starts in %.0f s (see the log above)", self._quick_exits, wait)
        return wait

    # -- autoscaling -------------------------------------------------------------------------

    async def _autoscale_loop(self) -> None:
        from argosy_operator.autoscaling import (
            DecisionState,
            MetricsSample,
            MetricsWindow,
            ReplicaSample,
            decide,
        )

        c = self.config
        policy = c.autoscaling_policy()
        window = MetricsWindow(policy.history_seconds + policy.scrape_interval_seconds)
        state = DecisionState()
        while True:
            await asyncio.sleep(policy.scrape_interval_seconds)
            assert self.gateway is not None
            pool = self.gateway.pools[c.name]
            samples = [ReplicaSample(ready=False)] * self._replacing
            for proc in self.live:
                replica = pool.get(proc.url)
                if replica is None or not replica.is_available() or not replica.scraped:
                    samples.append(ReplicaSample(ready=False))  # starting or unhealthy
                    continue
                samples.append(
                    ReplicaSample(
                        ready=True,
                        kv_cache_usage=replica.kv_cache_usage,
                        num_waiting=replica.num_waiting,
                        num_running=replica.num_running,
                        batch_pending=replica.batch_pending,
                        num_finished=replica.num_finished,
                        name=proc.url,
                    )
                )
            activator = self.gateway.activators.get(c.name)
            held = activator.held if activator is not None else 0
            now = time.monotonic()
            window.add(MetricsSample(t=now, replicas=tuple(samples), held_requests=held,
                                     batches_shared=c.batches_shared))
            current = len(self.live) + self._replacing
            decision = decide(policy, current, window.samples(), state, now)
            if decision.desired_replicas > current and now < self._scale_up_after:
                # The last scale-up failed: none now, and the decision state stays as if
                # this tick had not decided one.
                if not self._hold_logged:
                    self._hold_logged = True
                    logger.info("autoscaler: holding the scale-up to %d for %.0f s (the "
                                "last failed)", decision.desired_replicas,
                                self._scale_up_after - now)
                continue
            state = decision.state
            self.decisions.append(decision)
            del self.decisions[:-100]
            if not decision.changed:
                continue
            if decision.desired_replicas > current:
                self._log_decision(decision, current)
                for _ in range(decision.desired_replicas - current):
                    self._spawn(self._scale_up())
                continue
            # Drain the least busy ready replicas, those holding batch requests last (the
            # decision keeps enough replicas for them), failing ones (out of rotation, or
            # being stopped for their liveness) first; never one still starting.
            ready = [(p, r) for p in self.live if (r := pool.get(p.url)) is not None]
            ready.sort(key=lambda pr: (pr[1].batch_pending > 0, pr[1].healthy, pr[1].in_flight))
            # `current` counts replicas still starting and replacements waiting to: they serve
            # nothing yet, so drain ready ones only down to the desired count (else none might
            # serve while they load, or for good should they never start); the next ticks
            # drain the rest once they are ready.
            excess = min(current, len(ready)) - decision.desired_replicas
            if excess <= 0:
                logger.debug("autoscaler: %d -> %d waits for the replicas starting",
                             current, decision.desired_replicas)
                continue
            self._log_decision(decision, current)
            for proc, _ in ready[:excess]:
                self._spawn(self.drain_replica(proc))

    @staticmethod
    def _log_decision(decision: Any, current: int) -> None:
        logger.info(
            "autoscaler: %d -> %d (%s: %s)",
            current, decision.desired_replicas, decision.reason, decision.message,
        )  # fmt: skip


def _backoff(failures: int) -> float:
    """Seconds to wait after `failures` in a row: 1, 2, 4... up to RESTART_BACKOFF_MAX_S."""
    return min(2.0 ** (failures - 1), RESTART_BACKOFF_MAX_S)


async def _logged_if_it_stops(loop: Any, name: str) -> None:
    """Run a background loop; an exception that ends it is logged with its traceback now
    (not whenever the task is collected), then raised."""
    try:
        await loop
    except asyncio.CancelledError:
        raise
    except Exception:
        logger.exception("%s stopped", name)
        raise


async def _health_failure(session: aiohttp.ClientSession, url: str) -> str | None:
    """Why the replica's /health failed (an error status, no answer), None if it is fine."""
    try:
        async with session.get(f"{url}/health") as resp:
            return None if resp.status == 200 else f"/health answered {resp.status}"
    except TimeoutError:
        return "/health did not answer in time"
    except aiohttp.ClientError as exc:
        return f"/health: {exc}"


def _port_taken(log_tail: str) -> bool:
    """Whether a replica's log says its port was in use: `argosy serve`'s check before the
    model loads, or the server's bind after."""
    text = log_tail.lower()
    return "address already in use" in text or "cannot listen there" in text


def _exit_reason(code: int | None) -> str:
    """'code 1', or 'killed by SIGKILL' (a negative return code is the signal's number)."""
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"code {code}"


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # not a usage message and SystemExit
        raise ValueError(message)


def _serve_arg(serve_args: tuple[str, ...], dest: str) -> Any:
    """The value `argosy serve` takes for option `dest` from `serve_args`; None when they
    do not give it, or do not parse (every replica then fails at start, with its own
    message)."""
    from argosy_runtime.cli.serve import add_arguments  # light: no torch

    parser = _RaisingParser(add_help=False)
    add_arguments(parser)
    parser.set_defaults(**{dest: None})
    try:
        namespace, _ = parser.parse_known_args(list(serve_args))
    except ValueError:
        return None
    return getattr(namespace, dest)


def fleet_config_from(**kwargs: Any) -> FleetConfig:
    """FleetConfig from keyword arguments, ignoring None values (CLI defaults)."""
    known = {f.name for f in dataclasses.fields(FleetConfig)}
    return FleetConfig(**{k: v for k, v in kwargs.items() if k in known and v is not None})
