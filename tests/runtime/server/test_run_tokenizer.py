"""run_tokenizer: short inputs are tokenized inline, long ones on a worker thread so the event
loop keeps serving the other requests meanwhile."""

from __future__ import annotations

import asyncio
import threading
import time

from argosy_runtime.server.serving_common import TOKENIZE_OFF_LOOP_CHARS, run_tokenizer


def test_short_input_runs_inline_long_input_on_a_worker_thread() -> None:
    async def main() -> None:
        loop_thread = threading.get_ident()
        inline = await run_tokenizer(TOKENIZE_OFF_LOOP_CHARS - 1, threading.get_ident)
        worker = await run_tokenizer(TOKENIZE_OFF_LOOP_CHARS, threading.get_ident)
        assert inline == loop_thread and worker != loop_thread

    asyncio.run(main())


def test_loop_keeps_running_while_a_long_input_is_tokenized() -> None:
    async def main() -> None:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        def slow_tokenize() -> str:  # sleeps with the GIL released, as Tokenizer.encode does
            time.sleep(0.3)
            return "ids"

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        before = ticks
        assert await run_tokenizer(10 * TOKENIZE_OFF_LOOP_CHARS, slow_tokenize) == "ids"
        task.cancel()
        assert ticks - before >= 5, ticks - before

    asyncio.run(main())
