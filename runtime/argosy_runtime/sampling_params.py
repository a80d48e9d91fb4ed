"""Per-request sampling options (vLLM-compatible names)."""

from __future__ import annotations

from dataclasses import dataclass, field

from argosy_runtime.structured_output.params import StructuredOutputsParams

# Bounds that keep one request from hurting the others (a 10^9 top_logprobs would allocate
# a vocabulary-sized list per token); values past them are client mistakes.
MAX_N = 16
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, +100 all but forces it
MAX_BAD_WORDS = 128  # vLLM's default VLLM_MAX_NUM_BAD_WORDS (it counts token sequences)
# The engine thread tokenizes bad words when it admits the request (twice each): 128 words of
# 100k characters held every other request for ~6 s. A word or phrase is far shorter.
MAX_BAD_WORD_CHARS = 256
# Every step of the request scans each stop string on the engine thread: a million of them
# cost ~0.25 s per token, for everyone in the batch. OpenAI takes at most 4.
MAX_STOP_STRINGS = 256
# Temperatures below this decode greedily (vLLM's _SAMPLING_EPS): dividing float32 logits by
# ~1e-38 or less overflows them to inf, and the softmax then samples NaNs (token 0 every step).
GREEDY_TEMPERATURE = 1e-5
# The sampler divides a seen token's positive float32 logit by repetition_penalty: below
# ~1e-37 that overflows to inf (or the penalty itself rounds to 0), the softmax is all NaN and
# every step samples token 0. Anything under ~1e-2 already just forces repetition, so this
# floor takes nothing a client could want and keeps logits finite (up to ~1e32).
MIN_REPETITION_PENALTY = 1e-6


@dataclass
class SamplingParams:
    """How to sample one request's output.

    `temperature == 0` (or below GREEDY_TEMPERATURE) means greedy. `top_k <= 0` and
    `top_p == 1` disable those filters.
    `logprobs=k` returns the sampled token's logprob plus the top-k alternatives per generated
    token; `prompt_logprobs=k` does the same for every prompt token after the first.
    `max_tokens=0` is a prompt-only request: the prompt runs (scored with `prompt_logprobs`)
    and nothing is generated, so a prompt may fill the whole context (max_model_len).
    Every field is validated here; a bad value raises `ValueError` naming the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # token id -> value added to its logit before sampling (greedy decoding sees it too)
    logit_bias: dict[int, float] | None = None
    # only these token ids may be sampled (vLLM's): every other logit is -inf
    allowed_token_ids: list[int] | None = None
    # words never generated (vLLM's semantics, see bad_words.py): the last token of a word is
    # banned whenever the output so far ends with the word's other tokens
    bad_words: list[str] | None = None
    # constrain the output to a JSON schema, regex, choice or grammar (see structured_output)
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's cache_salt: requests with different salts share no prefix-cache blocks, so one
    # tenant cannot tell from its time to first token what another's prompts held
    cache_salt: str | None = None
    # Filled in by the engine: tokens that end generation unless ignore_eos (the model's EOS).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # Filled in by the engine: the token sequences of `bad_words` (bad_words.py).
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # A list (or tuple) only: list() of an int raised a TypeError naming nothing, and of
        # a dict or a set silently took its keys (in no reliable order) as the stop strings.
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids,
                                                              (list, tuple)):
            raise ValueError("stop_token_ids must be a list of token ids, got "
                             f"{self.stop_token_ids!r}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        # A truthy string ("false") or None would silently mean the opposite of what was meant.
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        _check_int("n", self.n, 1, MAX_N)
        _check_number("temperature", self.temperature, 0.0, 100.0)
        _check_number("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise ValueError("top_p must be in (0, 1], got 0")
        _check_int("top_k", self.top_k, -1, 1 << 30)
        _check_number("min_p", self.min_p, 0.0, 1.0)
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_number("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY,
                      100.0)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 0, 1 << 30)
        _check_int("min_tokens", self.min_tokens, 0, 1 << 30)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if self.seed is not None:
            _check_int("seed", self.seed, -(1 << 63), (1 << 64) - 1)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        check_cache_salt(self.cache_salt)
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop[{i}] must be a non-empty string")
        self.stop = list(dict.fromkeys(self.stop))  # a repeat can stop nothing more
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS}")
        for i, t in enumerate(self.stop_token_ids):
            _check_int(f"stop_token_ids[{i}]", t, 0, 1 << 31)
        # Repeats dropped: each step tests the sampled token against this list, and the
        # sampler indexes the logits with allowed_token_ids, so a 16 MiB body of one id
        # repeated slowed every step of the batch several times over.
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("logit_bias must map token ids to numbers")
            for token, bias in self.logit_bias.items():
                _check_int("logit_bias token id", token, 0, 1 << 31)
                _check_number(f"logit_bias[{token}]", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be a non-empty list of token ids "
                                 f"(None allows every token), got {self.allowed_token_ids!r}")
            self.allowed_token_ids = list(self.allowed_token_ids)
            for i, t in enumerate(self.allowed_token_ids):
                _check_int(f"allowed_token_ids[{i}]", t, 0, 1 << 31)
            self.allowed_token_ids = list(dict.fromkeys(self.allowed_token_ids))
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or not isinstance(self.bad_words, (list, tuple)):
                raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r}")
            for i, word in enumerate(self.bad_words):
                if not isinstance(word, str) or not word.strip():
                    raise ValueError(f"bad_words[{i}] must be a non-blank string, got {word!r}")
                if len(word) > MAX_BAD_WORD_CHARS:
                    raise ValueError(f"bad_words[{i}] has {len(word)} characters; at most "
                                     f"{MAX_BAD_WORD_CHARS}")
            self.bad_words = list(dict.fromkeys(self.bad_words))  # vLLM drops repeats too
            if len(self.bad_words) > MAX_BAD_WORDS:
                raise ValueError(f"bad_words has {len(self.bad_words)} words; at most "
                                 f"{MAX_BAD_WORDS}")
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def clone(self) -> SamplingParams:
        import copy

        return copy.deepcopy(self)


def check_cache_salt(value: object) -> None:
    """ValueError unless `value` is None or a non-empty string (SamplingParams' and
    PoolingParams' `cache_salt`)."""
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"cache_salt must be a non-empty string, got {value!r}")


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")


def _check_number(name: str, value: object, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value != value or not lo <= value <= hi:  # value != value catches NaN
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
