"""`LLM`: offline batch generation on top of `LLMEngine`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from argosy_runtime.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    advance_searches,
    live_requests,
)
from argosy_runtime.engine import LLMEngine
from argosy_runtime.engine_args import EngineArgs
from argosy_runtime.outputs import RequestOutput
from argosy_runtime.pooling_params import PoolingParams
from argosy_runtime.sampling_params import SamplingParams
from argosy_runtime.scoring import (
    cosine_scores,
    cross_encoder_max_length,
    cross_encoder_prompt,
    cross_encoder_score,
    pair_up,
)
from argosy_runtime.tokenizer import load_chat_template


class LLM:
    """Generate for many prompts at once with continuous batching.

        llm = LLM(model="smollm2-135m")
        outs = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))
        print(outs[0].outputs[0].text)
        vectors = [o.embedding for o in llm.embed(["Hello", "Bonjour"])]
        # a *ForSequenceClassification checkpoint:
        probs = [o.classification.probs for o in LLM(model=folder).classify(["Great!"])]
        scores = llm.score("a query", ["a document", "another"])  # cosines of embeddings
        best = llm.beam_search(["Hello"], BeamSearchParams(beam_width=4, max_tokens=16))
        print(best[0].sequences[0].text)
    """

    def __init__(self, model: str = EngineArgs.model, **kwargs: Any) -> None:
        self.engine = LLMEngine(model=model, **kwargs)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_name: str | None = None,
        *,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts` (a str, a list of token ids or a vLLM prompt
        dict, `{"prompt": text}` or `{"prompt_token_ids": ids}`, counts as one),
        on the base model or the LoRA adapter `lora_name` (one of `lora_modules`).
        `sampling_params=` (vLLM's name for `params`) and `use_tqdm` (no progress bar is
        shown) are accepted so that vLLM code runs unchanged."""
        del use_tqdm
        if sampling_params is not None:
            if params is not None:
                raise TypeError("give params or sampling_params (the same argument), not both")
            params = sampling_params
        prompts = self._prompt_list(prompts)
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        # Checked here: a PoolingParams failed on len() with a TypeError naming nothing, and
        # one inside a list silently turned the generation into an embedding.
        if isinstance(params, (str, bytes)) or not isinstance(params, Sequence) or not all(
                isinstance(p, SamplingParams) for p in params):
            raise TypeError("params must be a SamplingParams or a list of them, one per "
                            f"prompt (LLM.embed takes PoolingParams); got {_type_names(params)}")
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        outs = self._run(prompts, params, lora_name)
        _fill_decoded_tokens(outs, self.engine.tokenizer)  # here: beam_search needs none
        return outs

    def beam_search(self, prompts: str | Sequence[str] | Sequence[list[int]],
                    params: BeamSearchParams, lora_name: str | None = None, *,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """The `params.beam_width` most probable continuations of each prompt, best first
        (beam_search.py: transformers' beam search). All prompts' beams share each step.
        `use_tqdm` (vLLM's) is accepted and ignored."""
        del use_tqdm
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        tokenizer = self.engine.tokenizer
        searches = [BeamSearch(tokenizer.encode(p) if isinstance(p, str) else p, params,
                               self.engine.end_token_ids) for p in self._prompt_list(prompts)]
        for search in searches:
            if len(search.prompt) + params.max_tokens > self.engine.max_model_len:
                raise ValueError(f"prompt ({len(search.prompt)} tokens) + max_tokens "
                                 f"({params.max_tokens}) exceeds max_model_len "
                                 f"({self.engine.max_model_len})")
        scoring = [s.scoring_params() for s in searches[:1]]  # the same for every search
        while requests := live_requests(searches):
            outs = self._run([r for _, r in requests], scoring * len(requests), lora_name)
            advance_searches(requests, outs)
        return [s.output(tokenizer) for s in searches]

    def embed(self, prompts: str | Sequence[str] | Sequence[list[int]],
              params: PoolingParams | None = None,
              lora_name: str | None = None, *, pooling_params: PoolingParams | None = None,
              use_tqdm: bool = False) -> list[RequestOutput]:
        """Embeddings in the order of `prompts`: each output's `embedding` is the pooled
        (default: last token), L2-normalized final hidden state (pooling_params.py).
        `pooling_params=` (vLLM's keyword for `params`) and `use_tqdm` are accepted so that
        vLLM code runs unchanged."""
        del use_tqdm
        if pooling_params is not None:
            if params is not None:
                raise TypeError("give params or pooling_params (the same argument), not both")
            params = pooling_params
        prompts = self._prompt_list(prompts)
        if params is not None and not isinstance(params, PoolingParams):
            # A SamplingParams here generated text instead, and returned no embeddings.
            raise TypeError(f"params must be a PoolingParams, got {type(params).__name__} "
                            "(LLM.generate takes SamplingParams)")
        return self._run(prompts, [params or PoolingParams()] * len(prompts), lora_name)

    def classify(self, prompts: str | Sequence[str] | Sequence[list[int]],
                 lora_name: str | None = None, *, use_tqdm: bool = False
                 ) -> list[RequestOutput]:
        """Classes in the order of `prompts`, for a sequence-classification checkpoint
        (`*ForSequenceClassification`: a classifier, reward model or cross-encoder): each
        output's `classification` holds the head's `logits` at the last token, `probs`
        (softmax; sigmoid for one label) and the most probable `label`. `use_tqdm`
        (vLLM's) is accepted and ignored."""
        del use_tqdm
        prompts = self._prompt_list(prompts)
        return self._run(prompts, [PoolingParams(task="classify")] * len(prompts), lora_name)

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str],
              lora_name: str | None = None, *, chat_template: str | None = None,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = False
              ) -> list[float]:
        """The score of each (text_1, text_2) pair, as POST /v1/score answers: pairs 1-to-1,
        1-to-N or N-to-N (scoring.pair_up). An embedding model scores by the cosine of the
        two embeddings (each distinct text embedded once); a cross-encoder (a one-label
        classification head) by the sigmoid of its logit over the pair as one prompt
        (scoring.cross_encoder_prompt). `chat_template` (vLLM's): a cross-encoder's score
        template, jinja over the messages [{"role": "query", "content": text_1},
        {"role": "document", "content": text_2}] (the text, or a file holding it).
        `truncate_prompt_tokens` (vLLM's, cross-encoders): each pair's prompt cut to k tokens
        from its end, as /v1/score cuts it (-1: the model's length; see
        scoring.cross_encoder_prompt). `use_tqdm` (vLLM's) is accepted and ignored."""
        del use_tqdm
        firsts = _texts("text_1", text_1)
        seconds = _texts("text_2", text_2)
        if not firsts or not seconds:
            raise ValueError("text_1 and text_2 must each hold at least one text")
        pairs = pair_up(firsts, seconds)
        num_labels = self.engine.spec.num_labels
        if num_labels > 1:
            raise ValueError(f"model: a classifier with {num_labels} labels is no scorer; "
                             "scores need a one-label head (a cross-encoder) or an embedding "
                             "model")
        if num_labels == 1:
            template = load_chat_template(chat_template) if chat_template is not None else None
            max_length = cross_encoder_max_length(truncate_prompt_tokens,
                                                  self.engine.max_model_len)
            spec = self.engine.spec
            prompts = [cross_encoder_prompt(self.engine.tokenizer, a, b, score_template=template,
                                            use_sep_token=spec.use_sep_token,
                                            max_length=max_length,
                                            token_types=spec.takes_token_types)
                       for a, b in pairs]
            params = [PoolingParams(task="classify", token_type_start=p.token_type_start)
                      for p in prompts]
            outs = self._run([p.token_ids for p in prompts], params, lora_name)
            return [cross_encoder_score(out.classification.logits, spec.score_activation)
                    for out in outs]
        if truncate_prompt_tokens is not None:
            raise ValueError("truncate_prompt_tokens: LLM.score truncates a cross-encoder's "
                             "pairs; an embedding model's texts are not truncated offline "
                             "(send token ids cut as you need to LLM.embed)")
        if chat_template is not None:
            raise ValueError("chat_template: a score template is for a cross-encoder (a "
                             "one-label classification head); an embedding model scores by "
                             "the cosine of the two texts' embeddings")
        distinct = list(dict.fromkeys(firsts + seconds))
        row = {text: i for i, text in enumerate(distinct)}
        vectors = [out.embedding for out in self.embed(distinct, lora_name=lora_name)]
        return cosine_scores(vectors, [(row[a], row[b]) for a, b in pairs])

    @staticmethod
    def _prompt_list(prompts: str | Sequence[str] | Sequence[list[int]]) -> list[Any]:
        # None, a number or a generator failed on indexing with a TypeError (or a KeyError)
        # naming nothing; each prompt itself is checked by the engine.
        if isinstance(prompts, dict):
            return [_prompt_of_dict(prompts, "prompts")]  # one vLLM prompt dict
        if isinstance(prompts, bytes) or not isinstance(prompts, Sequence):
            raise TypeError("prompts must be a string, a list of token ids, a prompt dict, or "
                            f"a list of those; got {type(prompts).__name__}")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            return [prompts]  # a str or a list of token ids counts as one
        return [_prompt_of_dict(p, f"prompts[{i}]") if isinstance(p, dict) else p
                for i, p in enumerate(prompts)]

    def _run(self, prompts: list[Any], params: Sequence[SamplingParams | PoolingParams],
             lora_name: str | None) -> list[RequestOutput]:
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        added: list[str] = []
        finished: dict[str, RequestOutput] = {}
        try:
            for i, (rid, prompt, p) in enumerate(zip(ids, prompts, params)):
                try:
                    self.engine.add_request(rid, prompt, p, lora_name=lora_name)
                except ValueError as exc:
                    if len(prompts) == 1:
                        raise
                    # Which of many prompts is wrong: the engine's message cannot say.
                    raise ValueError(f"prompts[{i}]: {exc}") from exc
                added.append(rid)
            # Only this call's requests count: `LLM.engine` is public, and a request a caller
            # added there directly finishing here made len(finished) reach len(ids) early,
            # so the return below raised a KeyError with this call's requests still running
            # (never aborted: they held their KV blocks and ran on in later calls).
            pending = set(ids)
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        finished[out.request_id] = out
        except BaseException:
            # A bad prompt, a failing step (the model raised, out of memory) or Ctrl-C: no
            # request of this call may stay in the engine holding KV blocks, nor show up in
            # a later call's steps.
            self.engine.abort_request(added)
            raise
        return [finished[rid] for rid in ids]

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             lora_name: str | None = None, *,
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Render each conversation as POST /v1/chat/completions renders it (its
        render_chat_text: content parts joined, "developer" as "system", tool-call arguments
        as objects, `tools` and `chat_template_kwargs` shown to the template), then generate.
        `chat_template` (the text, or a file holding it) replaces the model's for this call.
        `sampling_params=` and `use_tqdm` as LLM.generate takes them (vLLM's chat examples
        call `llm.chat(messages, sampling_params=..., use_tqdm=False)`: a TypeError here)."""
        del use_tqdm
        # The server's own renderer, imported here: `import argosy_runtime` stays free of
        # fastapi, and the two can never render a conversation differently.
        from pydantic import ValidationError

        from argosy_runtime.server.errors import APIError
        from argosy_runtime.server.protocol import ChatMessage, ChatTool
        from argosy_runtime.server.serving_chat import render_chat_text

        single = bool(messages) and isinstance(messages, list) and isinstance(messages[0], dict)
        conversations = [messages] if single else messages
        _check_conversations(conversations, single)
        tokenizer = self.engine.tokenizer
        # render_chat_text reads the server context's tokenizer only
        context = SimpleNamespace(tokenizer=tokenizer if chat_template is None else
                                  _WithTemplate(tokenizer, load_chat_template(chat_template)))

        def parse(name: str, model: Any, value: Any) -> Any:
            try:
                return model.model_validate(value)
            except ValidationError as exc:
                raise ValueError(f"{name}: {exc.errors()[0]['msg']} "
                                 f"(at {exc.errors()[0]['loc']}): {value!r:.80}") from None

        tool_models = [parse(f"tools[{i}]", ChatTool, t) for i, t in enumerate(tools or ())]
        prompts, texts = [], []
        for i, conversation in enumerate(conversations):
            name = "messages" if single else f"messages[{i}]"
            parsed = [parse(f"{name}[{j}]", ChatMessage, m) for j, m in enumerate(conversation)]
            try:
                text = render_chat_text(context, parsed, tool_models or None,
                                        add_generation_prompt, chat_template_kwargs,
                                        continue_final_message)
            except APIError as exc:  # the server's 400: the same message, named here
                raise ValueError(f"{exc.param or name}: {exc.message}") from None
            # The template already holds any BOS it wants: encode without special tokens.
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
            texts.append(text)
        outs = self.generate(prompts, params, lora_name, sampling_params=sampling_params)
        for out, text in zip(outs, texts, strict=True):
            out.prompt = text  # the rendered conversation, as vLLM's chat outputs hold it
        return outs


class _WithTemplate:
    """A tokenizer whose apply_chat_template renders with another template (LLM.chat's
    `chat_template`)."""

    def __init__(self, tokenizer: Any, template: str) -> None:
        self._tokenizer = tokenizer
        self._template = template

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        return self._tokenizer.render_template(self._template, messages,
                                               add_generation_prompt, **kwargs)


def _prompt_of_dict(prompt: dict[str, Any], where: str) -> str | list[int]:
    """vLLM's prompt dicts, so that vLLM code runs unchanged: a TextPrompt
    (`{"prompt": "text"}`) is its text, a TokensPrompt (`{"prompt_token_ids": [...]}`,
    perhaps with the `prompt` text they came from) its token ids. What a text-only engine
    cannot honour (multi_modal_data, mm_processor_kwargs, ...) is refused, not dropped."""
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
    if unknown:
        hint = (" (give it as SamplingParams(cache_salt=...))" if "cache_salt" in unknown
                else "")
        raise ValueError(f"{where}: prompt dict key(s) {unknown} are not supported{hint}; a "
                         "prompt dict holds 'prompt' (text) or 'prompt_token_ids'")
    if "prompt_token_ids" in prompt:
        return prompt["prompt_token_ids"]
    if "prompt" in prompt:
        return prompt["prompt"]
    raise ValueError(f"{where}: a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")


def _fill_decoded_tokens(outs: list[RequestOutput], tokenizer: Any) -> None:
    """Each Logprob's `decoded_token`, as vLLM's LLM returns it: the engine leaves it None
    (the server decodes its JSON itself), so `lp.decoded_token` of LLM.generate was always
    None where vLLM code reads the token's text. Each token decoded alone with its special
    tokens, as vLLM's convert_ids_list_to_tokens (and the server's token_text) do."""
    cache: dict[int, str] = {}

    def fill(position: dict[int, Any] | None) -> None:
        for token, lp in (position or {}).items():
            if lp.decoded_token is None:
                if token not in cache:
                    cache[token] = tokenizer.decode([token], skip_special_tokens=False)
                lp.decoded_token = cache[token]

    for out in outs:
        for position in out.prompt_logprobs or ():
            fill(position)
        for seq in out.outputs:
            for position in seq.logprobs or ():
                fill(position)


def _type_names(value: Any) -> str:
    """`PoolingParams`, or `list of [SamplingParams, dict]`: what a caller passed."""
    if isinstance(value, (list, tuple)):
        names = list(dict.fromkeys(type(v).__name__ for v in value))
        return f"{type(value).__name__} of [{', '.join(names)}]"
    return type(value).__name__


def _texts(name: str, texts: str | Sequence[str]) -> list[str]:
    """LLM.score's `text_1` / `text_2` as a list of strings; TypeError naming the argument."""
    if isinstance(texts, str):
        return [texts]
    if not isinstance(texts, Sequence) or not all(isinstance(t, str) for t in texts):
        raise TypeError(f"{name} must be a string or a list of strings, got "
                        f"{_type_names(texts)}")
    return list(texts)


def _check_conversations(conversations: Any, single: bool) -> None:
    """Each conversation a list of {"role": str, "content": ...} dicts (or, an assistant
    turn, "tool_calls"): the chat template otherwise failed with a jinja UndefinedError
    ("'str object' has no attribute 'role'") naming neither the argument nor the message."""
    if not isinstance(conversations, list):
        raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts (or "
                        f"a list of such lists), got {type(conversations).__name__}")
    for i, conversation in enumerate(conversations):
        name = "messages" if single else f"messages[{i}]"
        if not isinstance(conversation, list) or not conversation:
            raise TypeError(f"{name} must be a non-empty list of message dicts, got "
                            f"{conversation!r:.80}")
        for j, message in enumerate(conversation):
            if (not isinstance(message, dict) or not isinstance(message.get("role"), str)
                    or ("content" not in message and "tool_calls" not in message)):
                raise TypeError(f"{name}[{j}] must be a dict with a 'role' string and its "
                                f"'content', got {message!r:.80}")
