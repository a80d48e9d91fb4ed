"""Long conversations go through the chat template on a worker thread: jinja runs Python per
message, and rendering 500k tiny messages (a 16 MiB body) inline held the event loop, and every
stream on it, for seconds. Short chats stay inline (cheaper than a thread hop). Same prompt
either way, with the embedded model's real tokenizer and template."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from argosy_runtime.model_loader.resolve import resolve_model_path
from argosy_runtime.server.protocol import ChatMessage
from argosy_runtime.server.serving_chat import RENDER_OFF_LOOP_MESSAGES, render_messages
from argosy_runtime.tokenizer import Tokenizer
from gguf import GGUFReader


class ThreadRecordingTokenizer:
    """The real tokenizer, noting the thread each chat template render ran on."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.render_threads: list[int] = []

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> str:
        self.render_threads.append(threading.get_ident())
        return self.tokenizer.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


async def test_long_conversations_render_on_a_worker_thread_short_ones_inline() -> None:
    tokenizer = ThreadRecordingTokenizer(
        Tokenizer.from_gguf(GGUFReader(resolve_model_path("smollm2-135m")[0])))
    ctx = SimpleNamespace(tokenizer=tokenizer, max_model_len=1 << 20)
    turns = [ChatMessage(role="user" if i % 2 == 0 else "assistant", content=f"m{i}")
             for i in range(RENDER_OFF_LOOP_MESSAGES)]
    short, long = turns[:-1], turns
    short_ids = await render_messages(ctx, short)
    long_ids = await render_messages(ctx, long)
    inline, worker = tokenizer.render_threads
    assert inline == threading.get_ident() and worker != inline
    # The same template and tokenizer: the long prompt is the short one plus its last turn.
    expected = tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in long], True), add_special_tokens=False)
    assert long_ids == expected and len(long_ids) > len(short_ids)
