"""`AsyncEngine`: one background thread drives `LLMEngine` for an asyncio server.

`LLMEngine` is not thread-safe and `step()` blocks for a whole forward pass, so a single
worker thread owns it. asyncio callers never touch the engine: `add()` and `abort()` post
commands that the worker applies *between* steps, so a new request joins the running batch
at the very next step (continuous batching), and an abort frees its KV blocks before the
next forward pass. torch releases the GIL during the forward pass, so the event loop stays
responsive while a step runs.

Outputs are cumulative (`token_ids`/`text` since the request began), so each request keeps
only its newest output: a slow consumer skips intermediate states instead of queueing them.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any, Protocol

from argosy_runtime.outputs import EngineStats, RequestOutput
from argosy_runtime.pooling_params import PoolingParams
from argosy_runtime.sampling_params import SamplingParams

logger = logging.getLogger("argosy.async_engine")


class QueueFullError(RuntimeError):
    """The bounded waiting queue (`max_waiting`) is full; the caller should retry later."""


class EngineDeadError(RuntimeError):
    """The engine failed while running this request (the server keeps serving others)."""


class RequestAbortedError(EngineDeadError):
    """The server aborted the request (`abort_all`: a drain that ran out of time); the
    client should send it again, to another replica."""


class RequestObserver(Protocol):
    """Receives per-request timings (the server's Prometheus histograms implement this)."""

    def on_scheduled(self, queue_time_s: float) -> None: ...
    def on_first_token(self, ttft_s: float) -> None: ...
    def on_tokens(self, gap_s: float, num_tokens: int) -> None: ...
    def on_finished(self, e2e_s: float, num_prompt_tokens: int, num_generation_tokens: int,
                    finish_reason: str | None) -> None: ...


@dataclasses.dataclass
class _Tracker:
    """Per-request bookkeeping kept by the worker thread (monotonic seconds)."""

    arrival: float
    scheduled: bool = False  # its queue time was observed
    first_token: float | None = None
    num_tokens: int = 0
    # per sequence (n > 1): tokens seen and when its last one came, for inter-token latency
    seq_tokens: dict[int, int] = dataclasses.field(default_factory=dict)
    seq_last_token: dict[int, float] = dataclasses.field(default_factory=dict)

    def finish(self, observer: RequestObserver | None, reason: str) -> None:
        """Count a request that ended without its last output ("abort", "error")."""
        if observer is not None:
            observer.on_finished(time.monotonic() - self.arrival, 0, self.num_tokens, reason)


class RequestStream:
    """The outputs of one request, newest first; iterate with `async for`.

    Closing the iterator early (client gone, timeout) aborts the request in the engine.
    """

    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self.request_id = request_id
        self._engine = engine
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self.finished = False
        self.added: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def _put(self, output: RequestOutput) -> None:
        self._latest = output
        self._event.set()

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._event.set()
        if not self.added.done():
            self.added.set_exception(exc)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                await self._event.wait()
                self._event.clear()
                if self._error is not None:
                    raise self._error
                output, self._latest = self._latest, None
                if output is None:
                    continue
                if output.finished:
                    self.finished = True
                yield output
                if self.finished:
                    return
        finally:
            self.close()

    def close(self) -> None:
        """Abort the request unless it finished; safe to call more than once."""
        if self._engine._streams.pop(self.request_id, None) is not None and not self.finished:
            self._engine.abort(self.request_id)


class AsyncEngine:
    """Drives one `LLMEngine` from a dedicated thread; safe to use from one event loop."""

    def __init__(self, engine: Any, observer: RequestObserver | None = None,
                 max_waiting: int | None = None, max_num_seqs: int | None = None) -> None:
        if max_waiting is not None and max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 (0: unbounded), got {max_waiting}")
        self.engine = engine
        self.observer = observer
        self.max_waiting = max_waiting
        # Batch capacity: requests that fit in it are about to run, not waiting. Unknown
        # (None) counts every queued request as waiting, which errs towards 429.
        self.max_num_seqs = max_num_seqs
        self._cond = threading.Condition()
        self._commands: list[tuple[str, Any]] = []
        # Every count of waiting work here is in sequences, as the engine's (a request with
        # n > 1 runs as n sequences, each taking a seat).
        self._pending_adds: collections.Counter[int] = collections.Counter()  # by priority
        # Requests added since the last step (id -> (priority, sequences)): the scheduler has
        # not tried them yet. Those it tried and left waiting beside free seats lack KV blocks
        # (or budget): the seats do not make them about to run. The engine thread keeps the
        # ids; the event loop reads the count by priority, published with each change (an
        # add counting the dict itself cost O(requests) per add in a burst).
        self._untried: dict[str, tuple[int, int]] = {}
        self._untried_by_priority: collections.Counter[int] = collections.Counter()
        # Adds waiting for their LoRA adapter (max_loaded_loras: loading it, or every loaded
        # slot held) before they are posted, by priority: waiting requests like any other.
        self._lora_waits: collections.Counter[int] = collections.Counter()
        self._streams: dict[str, RequestStream] = {}
        self._trackers: dict[str, _Tracker] = {}  # worker thread only
        self._stats = EngineStats()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dead: BaseException | None = None
        self.num_step_errors = 0

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the worker thread; call from the event loop that will consume outputs."""
        self._loop = asyncio.get_running_loop()
        if self._lazy_loras():  # adapters load on short-lived threads (_hold_lora), never here
            self.engine.lora_loads_inline = False
        self._stats = dataclasses.replace(self.engine.get_stats())
        self._thread = threading.Thread(target=self._run, name="argosy-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        stop_workers = getattr(self.engine, "shutdown", None)  # a tensor-parallel engine's
        if stop_workers is not None:
            stop_workers()

    @property
    def is_alive(self) -> bool:
        """The engine thread runs and can run steps: a tensor-parallel engine whose worker
        died, or whose ranks fell out of step, answers every request 503 from then on, and
        /health must say so for the liveness probe to restart it."""
        workers = getattr(self.engine, "tensor_parallel_workers", None)
        return (self._thread is not None and self._thread.is_alive() and self.dead is None
                and (workers is None or workers.is_alive))

    # ------------------------------------------------------------------- queries
    @property
    def stats(self) -> EngineStats:
        """The snapshot taken after the newest step (gauges and counters)."""
        return self._stats

    @property
    def num_waiting(self) -> int:
        """Requests that cannot join the running batch at the next step: the engine's waiting
        queue plus adds not yet applied, less the batch's free slots that the requests not
        yet tried by a step can take (one a step left waiting beside free seats is short of
        KV blocks), plus adds waiting for their LoRA adapter (`argosy:num_requests_waiting`)."""
        return self.num_waiting_ahead_of(None)

    def num_waiting_ahead_of(self, priority: int | None) -> int:
        """Like `num_waiting`, counting only the requests a new one of `priority` would wait
        behind: those with the same or a lower priority value (None: all)."""
        stats = self._stats

        def count(by_priority: Mapping[int, int]) -> int:
            return sum(n for p, n in by_priority.items() if priority is None or p <= priority)

        queued = count(stats.num_waiting_by_priority) + count(self._pending_adds)
        if self.max_num_seqs is not None:
            untried = count(self._pending_adds) + count(self._untried_by_priority)
            free_seats = max(0, self.max_num_seqs - stats.num_requests_running)
            queued = max(0, queued - min(untried, free_seats))
        # Free batch slots do not help these: their adapter is not theirs yet.
        return queued + count(self._lora_waits)

    @property
    def num_active(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------------ requests
    async def add(self, request_id: str, prompt: str | list[int],
                  params: SamplingParams | PoolingParams,
                  priority: int = 0, lora_name: str | None = None) -> RequestStream:
        """Queue a request; returns once the engine accepted it.

        Raises QueueFullError when `max_waiting` requests of the same or a more urgent
        priority already wait (less urgent ones, such as batch requests, would wait behind
        it, so they never keep it out), ValueError when the engine rejects the request (its
        message names the field).

        With max_loaded_loras, a request on an adapter that is not loaded first holds it
        (loading it, or waiting for a free slot; `_hold_lora`) and counts as waiting
        meanwhile; it is posted to the engine once it holds the adapter.
        """
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        arrival = time.monotonic()
        ahead = self.num_waiting_ahead_of(priority)
        if self.max_waiting and ahead >= self.max_waiting:
            raise QueueFullError(f"{ahead} requests are already waiting")
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream  # abort_all reaches it while it waits for an adapter
        held = lora_name if lora_name is not None and self._lazy_loras() else None
        seqs = _num_seqs(params)
        if held is not None:
            self._lora_waits[priority] += seqs
            try:
                await self._hold_lora(held, stream.added)
            except BaseException:
                if self._streams.get(request_id) is stream:
                    del self._streams[request_id]
                raise
            finally:
                # No await from here to the post below: the request never drops out of
                # num_waiting on its way from this count to _pending_adds.
                self._lora_waits[priority] -= seqs
        with self._cond:
            self._pending_adds[priority] += seqs
            self._commands.append(("add", (request_id, prompt, params, arrival, priority,
                                           lora_name, held)))
            self._cond.notify()
        try:
            await asyncio.shield(stream.added)
        except asyncio.CancelledError:
            stream.close()
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return stream

    def _lazy_loras(self) -> bool:
        registry = getattr(self.engine, "lora_registry", None)
        return registry is not None and registry.is_lazy

    async def _hold_lora(self, name: str, ended: asyncio.Future[None]) -> None:
        """Hold adapter `name` once (registry.acquire): at once when it is loaded, else on a
        new short-lived thread (a thread running torch ops keeps an OpenMP pool as long as it
        lives; see server/lora_admin.py), which loads it or waits for a slot. ValueError: not
        registered, or its load failed. `ended` fails when the server ends the request
        meanwhile (abort_all, a dead engine): its error is raised. A caller cancelled or
        ended meanwhile leaves nothing held."""
        registry = self.engine.lora_registry
        if registry.acquire(name, wait=False, load=False) is not None:
            return
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()

        def settle(error: BaseException | None) -> None:
            if future.done():  # cancelled: the request went away while it waited
                if error is None:
                    registry.release(name)
            elif error is not None:
                future.set_exception(error)
            else:
                future.set_result(None)

        def target() -> None:
            error: BaseException | None = None
            try:
                registry.acquire(name)
            except BaseException as exc:  # re-raised in the awaiting coroutine
                error = exc
            try:
                loop.call_soon_threadsafe(settle, error)
            except RuntimeError:  # the loop closed (shutdown): nobody waits any more
                pass

        threading.Thread(target=target, name="argosy-lora", daemon=True).start()
        try:
            await asyncio.wait((future, ended), return_when=asyncio.FIRST_COMPLETED)
            if ended.done():
                ended.result()  # the server ended the request: raises why
            future.result()  # raises a failed load's error
        except BaseException:
            if not future.done():
                future.cancel()  # settle gives the hold back when the thread gets it
            elif not future.cancelled() and future.exception() is None:
                registry.release(name)  # held, but nobody will post the request
            raise

    def abort(self, request_id: str) -> None:
        """Abort a request (frees its KV blocks before the next step)."""
        self._streams.pop(request_id, None)
        with self._cond:
            self._commands.append(("abort", request_id))
            self._cond.notify()

    def abort_all(self, reason: str = "the server is shutting down") -> None:
        """Abort every request. Unlike a client's `close`, someone still waits on each
        stream, so each ends with RequestAbortedError(reason) instead of going silent. A
        request that already finished (its last output not read yet: a slow reader) keeps
        its answer."""
        for request_id, stream in list(self._streams.items()):
            if stream.finished:
                continue
            self.abort(request_id)
            stream.finished = True  # freed in the engine; `close` must not abort it again
            stream._fail(RequestAbortedError(f"request aborted: {reason}; send it again"))

    # ------------------------------------------------------------- worker thread
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stop and not self._commands and not self._has_work():
                        self._cond.wait(timeout=1.0)
                    if self._stop:
                        return
                    commands, self._commands = self._commands, []
                if commands:
                    self._apply(commands)
                if self._has_work():
                    self._step()
        except BaseException as exc:  # the thread must never die silently
            logger.exception("engine loop died")
            self.dead = exc
            self._call(self._fail_all, EngineDeadError(f"engine loop died: {exc!r}"))

    def _has_work(self) -> bool:
        return bool(self.engine.has_unfinished_requests())

    def _apply(self, commands: list[tuple[str, Any]]) -> None:
        results: list[tuple[str, BaseException | None]] = []
        applied: collections.Counter[int] = collections.Counter()
        untried = self._untried  # in command order: an id aborted, then added again
        for kind, payload in commands:
            if kind == "add":
                request_id, prompt, params, arrival, priority, lora_name, held = payload
                seqs = _num_seqs(params)
                applied[priority] += seqs
                try:
                    self.engine.add_request(request_id, prompt, params, arrival_time=arrival,
                                            priority=priority, lora_name=lora_name)
                    self._trackers[request_id] = _Tracker(arrival)
                    results.append((request_id, None))
                    untried[request_id] = (priority, seqs)
                except Exception as exc:  # ValueError: bad request; anything else: engine bug
                    results.append((request_id, exc))
                finally:
                    if held is not None:  # the request holds the adapter itself now
                        self.engine.lora_registry.release(held)
            else:
                untried.pop(payload, None)  # gone: not waiting any more
                tracker = self._trackers.pop(payload, None)
                if tracker is not None:
                    self.engine.abort_request(payload)
                    tracker.finish(self.observer, "abort")
        stats = dataclasses.replace(self.engine.get_stats())  # the engine reuses its object
        with self._cond:
            # Replaced, not updated in place: the event loop reads it unlocked (`-=` would
            # drop keys at zero under an iteration there: "dictionary changed size").
            self._pending_adds = self._pending_adds - applied
            # replaced, not mutated: the event loop reads it unlocked
            self._untried_by_priority = _by_priority(untried.values())
            self._stats = stats
        self._call(self._acknowledge, results)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            # One bad step must not take the server down: fail the requests in flight,
            # free them, and keep serving new ones.
            logger.exception("engine step failed; aborting the requests in flight")
            self.num_step_errors += 1
            ids = list(self._trackers)
            for tracker in self._trackers.values():
                tracker.finish(self.observer, "error")
            self._trackers.clear()
            try:
                self.engine.abort_request(ids)
                # A fresh snapshot: the old one still counts the aborted requests, and a queue
                # it shows full refuses every add (QueueFullError) before one could refresh it.
                stats = dataclasses.replace(self.engine.get_stats())
                with self._cond:
                    self._stats = stats
                    self._untried_by_priority = collections.Counter()
                self._untried.clear()
            except Exception:
                logger.exception("abort after a failed step failed")
            self._call(self._fail_ids, ids, EngineDeadError(f"engine step failed: {exc!r}"))
            return
        now = time.monotonic()
        snapshots = [self._observe(out, now) for out in outputs]
        stats = dataclasses.replace(self.engine.get_stats())
        with self._cond:
            self._stats = stats
            self._untried_by_priority = collections.Counter()
        self._untried.clear()  # the step tried every waiting request
        self._call(self._dispatch, snapshots)

    def _observe(self, out: RequestOutput, now: float) -> RequestOutput:
        """Record timings for metrics and copy the output (the engine keeps mutating it)."""
        tracker = self._trackers.get(out.request_id)
        num_tokens = sum(len(c.token_ids) for c in out.outputs)
        if tracker is not None and self.observer is not None:
            m = out.metrics
            if not tracker.scheduled and m is not None and m.first_scheduled_time is not None:
                # Every request, those that produce no token too (embeddings, prompt-only).
                tracker.scheduled = True
                self.observer.on_scheduled(max(0.0, m.first_scheduled_time - m.arrival_time))
            if num_tokens > tracker.num_tokens and tracker.first_token is None:
                tracker.first_token = now
                self.observer.on_first_token(now - tracker.arrival)
            for seq in out.outputs:  # every sequence's tokens after its first: inter-token
                new = len(seq.token_ids) - tracker.seq_tokens.get(seq.index, 0)
                if new <= 0:
                    continue
                last = tracker.seq_last_token.get(seq.index)
                if last is not None:  # > 1 token: speculative decoding, a grammar's jump
                    self.observer.on_tokens(now - last, new)
                tracker.seq_tokens[seq.index] = len(seq.token_ids)
                tracker.seq_last_token[seq.index] = now
            tracker.num_tokens = num_tokens
            if out.finished:
                # An embedding request has no sequences: it finished by producing its vector.
                reasons = {c.finish_reason for c in out.outputs} or {"stop"}
                self.observer.on_finished(now - tracker.arrival, len(out.prompt_token_ids),
                                          num_tokens, "stop" if "stop" in reasons
                                          else next(iter(reasons)))
        elif tracker is not None:
            tracker.num_tokens = num_tokens
        if out.finished:
            self._trackers.pop(out.request_id, None)
        return dataclasses.replace(out, outputs=[
            dataclasses.replace(c, token_ids=list(c.token_ids),
                                logprobs=None if c.logprobs is None else list(c.logprobs))
            for c in out.outputs
        ])

    def _call(self, fn: Any, *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # loop closed between the check and the call
                pass

    # ------------------------------------------------------- event-loop callbacks
    def _acknowledge(self, results: list[tuple[str, BaseException | None]]) -> None:
        for request_id, exc in results:
            stream = self._streams.get(request_id)
            if stream is None:  # cancelled while queued: the abort command follows
                continue
            if exc is None:
                if not stream.added.done():
                    stream.added.set_result(None)
            else:
                stream._fail(exc)
                self._streams.pop(request_id, None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream._put(out)
                if out.finished:
                    stream.finished = True

    def _fail_ids(self, ids: list[str], exc: BaseException) -> None:
        for request_id in ids:
            stream = self._streams.get(request_id)
            if stream is not None and not stream.finished:  # finished: its answer stands
                del self._streams[request_id]
                stream.finished = True  # already freed in the engine
                stream._fail(exc)

    def _fail_all(self, exc: BaseException) -> None:
        self._fail_ids(list(self._streams), exc)


def _num_seqs(params: SamplingParams | PoolingParams) -> int:
    """The sequences a request runs as (the engine counts each as a request)."""
    return max(1, getattr(params, "n", 1) or 1)


def _by_priority(entries: Iterable[tuple[int, int]]) -> collections.Counter[int]:
    counts: collections.Counter[int] = collections.Counter()
    for priority, seqs in entries:
        counts[priority] += seqs
    return counts
