"""POST /tokenize and /detokenize (vLLM's routes): count a prompt's tokens, exactly as a
generation request would see them, without running the model."""

from __future__ import annotations

from typing import Any

from argosy_runtime.server.errors import bad_request
from argosy_runtime.server.protocol import DetokenizeRequest, TokenizeRequest
from argosy_runtime.server.serving_chat import render_chat_text
from argosy_runtime.server.serving_common import ServingContext, check_token_ids, encode_texts


async def tokenize(req: TokenizeRequest, ctx: ServingContext) -> dict[str, Any]:
    """The prompt's token ids. Not limited to max_model_len (a client may count a long
    document to split it), but a long text is tokenized off the event loop."""
    ctx.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    if req.chat_template_kwargs is not None and req.messages is None:
        raise bad_request("chat_template_kwargs applies to messages only", "chat_template_kwargs")
    if req.tools is not None and req.messages is None:  # only a chat template shows them
        raise bad_request("tools applies to messages only", "tools")
    if req.messages is not None:  # as chat completions does: the template holds any BOS
        text = render_chat_text(ctx, req.messages, req.tools, req.add_generation_prompt,
                                req.chat_template_kwargs, req.continue_final_message)
        add_special = bool(req.add_special_tokens)
    else:  # as completions does
        text = req.prompt
        add_special = req.add_special_tokens is not False
    [tokens] = await encode_texts(ctx, [text], add_special_tokens=add_special)
    return {"count": len(tokens), "max_model_len": ctx.max_model_len, "tokens": tokens}


def detokenize(req: DetokenizeRequest, ctx: ServingContext) -> dict[str, Any]:
    ctx.check_model(req.model)
    check_token_ids(req.tokens, ctx.tokenizer.vocab_size, "tokens")
    return {"prompt": ctx.tokenizer.decode(req.tokens, skip_special_tokens=False)}
