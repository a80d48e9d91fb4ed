"""Tenants without HTTP: token buckets on a fake clock, key lookup, config validation, usage
extraction from JSON bodies and SSE streams."""

from __future__ import annotations

import json

import pytest
from argosy_runtime.gateway.config import GatewayConfig, ModelRouteConfig, TenantConfig
from argosy_runtime.gateway.tenants import keys as keys_module
from argosy_runtime.gateway.tenants.keys import KeyRing
from argosy_runtime.gateway.tenants.limiter import (
    CONCURRENCY,
    REQUESTS,
    TOKENS,
    Lease,
    Refusal,
    TenantLimiter,
    format_duration,
)
from argosy_runtime.gateway.tenants.usage import Usage, UsageMeter, usage_of

SECRET = "sk-team-a-0123456789"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def limiter(clock: FakeClock, **limits: int) -> TenantLimiter:
    return TenantLimiter(TenantConfig(name="a", api_keys=("k",), **limits), clock)


def refused(result: Lease | Refusal) -> Refusal:
    assert isinstance(result, Refusal), "expected a refusal"
    return result


# -- limiter -----------------------------------------------------------------------------------

def test_requests_bucket_bursts_its_minute_then_refills_continuously() -> None:
    clock = FakeClock()
    lim = limiter(clock, requests_per_minute=6)  # one every 10 s
    for _ in range(6):
        assert isinstance(lim.admit(), Lease)
    refusal = refused(lim.admit())
    assert (refusal.limit, refusal.retry_after_s) == (REQUESTS, 10)
    assert "'a'" in refusal.message and "requests per minute" in refusal.message
    clock.advance(4)
    assert refused(lim.admit()).retry_after_s == 6  # 6 s to go, a refusal took nothing
    clock.advance(6)
    assert isinstance(lim.admit(), Lease)
    assert refused(lim.admit()).retry_after_s == 10
    clock.advance(3600)  # never more than one minute's worth
    for _ in range(6):
        assert isinstance(lim.admit(), Lease)
    assert isinstance(lim.admit(), Refusal)


def test_tokens_are_charged_after_the_answer_and_debt_delays_the_next_requests() -> None:
    clock = FakeClock()
    lim = limiter(clock, tokens_per_minute=600)  # 10 tokens a second
    lease = lim.admit()
    assert isinstance(lease, Lease)
    lease.charge(1000)  # a large answer: 400 tokens of debt
    lease.release()
    # Paid off after 40 s, but admission needs the bucket above zero: 41 s.
    refusal = refused(lim.admit())
    assert (refusal.limit, refusal.retry_after_s) == (TOKENS, 41)
    assert "tokens per minute" in refusal.message
    clock.advance(39)
    assert refused(lim.admit()).retry_after_s == 2  # -10 left
    clock.advance(1)
    assert refused(lim.admit()).retry_after_s == 1  # exactly paid off is not above zero
    clock.advance(1)
    assert isinstance(lim.admit(), Lease)


def test_concurrency_slots_are_freed_once_per_lease() -> None:
    clock = FakeClock()
    lim = limiter(clock, max_concurrent=2, requests_per_minute=60)
    first, second = lim.admit(), lim.admit()
    assert isinstance(first, Lease) and isinstance(second, Lease)
    refusal = refused(lim.admit())
    assert (refusal.limit, refusal.retry_after_s) == (CONCURRENCY, 1)
    assert lim.requests is not None and lim.requests.level == 58  # the refusal took nothing
    first.release()
    first.release()  # released twice (every path releases): still one slot
    assert lim.in_flight == 1
    third = lim.admit()
    assert isinstance(third, Lease) and isinstance(lim.admit(), Refusal)
    second.release()
    third.release()
    assert lim.in_flight == 0


def test_the_longest_wait_decides_retry_after() -> None:
    clock = FakeClock()
    lim = limiter(clock, requests_per_minute=60, tokens_per_minute=60)
    lease = lim.admit()
    assert isinstance(lease, Lease)
    lease.charge(120)  # 60 tokens of debt: 61 s, while a request is back in 1 s
    lease.release()
    for _ in range(59):
        assert lim.requests is not None
        lim.requests.take(1)
    refusal = refused(lim.admit())
    assert refusal.limit == TOKENS and refusal.retry_after_s == 61


def tenant(**limits: int) -> TenantConfig:
    return TenantConfig(name="a", api_keys=("k",), **limits)


def test_new_limits_keep_what_was_used() -> None:
    clock = FakeClock()
    lim = limiter(clock, requests_per_minute=60, tokens_per_minute=600)
    requests, tokens = lim.requests, lim.tokens
    for _ in range(10):
        lease = lim.admit()
        assert isinstance(lease, Lease)
    lease.charge(900)  # 300 tokens of debt
    lim.set_limits(tenant(requests_per_minute=60, tokens_per_minute=600))  # the same: no-op
    assert requests is not None and tokens is not None
    assert (requests.level, tokens.level) == (50, -300)
    # Raised: 10 requests and 900 tokens used, of 120 and 1200 now.
    lim.set_limits(tenant(requests_per_minute=120, tokens_per_minute=1200))
    assert lim.requests is requests and lim.tokens is tokens  # the same buckets
    assert (requests.level, requests.capacity, requests.rate) == (110, 120, 2)
    assert tokens.level == 300
    # Lowered below what was used: the requests bucket is empty, not in debt (the next request
    # in one refill), and a debt stays as deep as it was, no deeper.
    tokens.take(700)  # -400
    lim.set_limits(tenant(requests_per_minute=6, tokens_per_minute=60))
    assert (requests.level, tokens.level) == (0, -400)
    assert refused(lim.admit()).retry_after_s == 401  # the tokens' debt, at 1 token/s
    tokens.take(-401)
    assert refused(lim.admit()).retry_after_s == 10  # one request every 10 s
    clock.advance(10)
    assert isinstance(lim.admit(), Lease)
    assert lim.headers()["x-ratelimit-limit-requests"] == "6"


def test_a_limit_added_starts_full_and_a_removed_one_is_gone() -> None:
    clock = FakeClock()
    lim = limiter(clock, requests_per_minute=1)
    first = lim.admit()
    assert isinstance(first, Lease) and isinstance(lim.admit(), Refusal)
    lim.set_limits(tenant(tokens_per_minute=100))
    assert lim.requests is None and lim.tokens is not None and lim.tokens.level == 100
    assert isinstance(lim.admit(), Lease)
    first.charge(30)  # a lease taken before the change charges the new bucket
    assert lim.tokens.level == 70


def test_a_lowered_max_concurrent_lets_requests_in_flight_finish() -> None:
    lim = limiter(FakeClock(), max_concurrent=3)
    leases = [lim.admit() for _ in range(3)]
    lim.set_limits(tenant(max_concurrent=1))
    assert lim.in_flight == 3 and refused(lim.admit()).limit == CONCURRENCY
    for lease in leases[:2]:
        assert isinstance(lease, Lease)
        lease.release()
    assert isinstance(lim.admit(), Refusal)  # one still in flight: the new limit's 1
    assert isinstance(leases[2], Lease)
    leases[2].release()
    assert isinstance(lim.admit(), Lease)


def test_no_limits_admit_everything() -> None:
    lim = limiter(FakeClock())
    leases = [lim.admit() for _ in range(1000)]
    assert all(isinstance(x, Lease) for x in leases)
    assert lim.headers() == {}


def test_ratelimit_headers() -> None:
    clock = FakeClock()
    lim = limiter(clock, requests_per_minute=60, tokens_per_minute=6000)
    lease = lim.admit()
    assert isinstance(lease, Lease)
    lease.charge(600)
    assert lim.headers() == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-tokens": "5400",
        "x-ratelimit-reset-tokens": "6s",
    }
    lease.charge(6000)  # in debt: nothing remains
    assert lim.headers()["x-ratelimit-remaining-tokens"] == "0"
    assert lim.headers()["x-ratelimit-reset-tokens"] == "1m6s"


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0s"), (0.02, "20ms"), (0.0201, "21ms"), (1, "1s"), (1.5, "1.5s"), (59.25, "59.25s"),
    (60, "1m0s"), (360, "6m0s"), (61.2, "1m2s"),
])
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


# -- keys --------------------------------------------------------------------------------------

def test_key_lookup_names_the_tenant_and_compares_in_constant_time(monkeypatch) -> None:
    ring = KeyRing([TenantConfig(name="a", api_keys=(SECRET, "sk-a2")),
                    TenantConfig(name="b", api_keys=("sk-b",))])
    compared: list[tuple[bytes, bytes]] = []
    real = keys_module.hmac.compare_digest

    def recording(x: bytes, y: bytes) -> bool:
        compared.append((x, y))
        return real(x, y)

    monkeypatch.setattr(keys_module.hmac, "compare_digest", recording)
    assert ring.tenant_of(f"Bearer {SECRET}") == "a"
    assert ring.tenant_of("bearer sk-a2") == "a"  # the scheme is case-insensitive
    assert ring.tenant_of("Bearer sk-b") == "b"
    assert len(compared) == 3
    # Only digests are compared, never the key itself.
    assert all(len(x) == len(y) == 32 and SECRET.encode() not in x for x, y in compared)
    assert ring.tenant_of("Bearer sk-unknown") is None
    assert ring.tenant_of(f"Bearer {SECRET}x") is None
    assert ring.tenant_of(f"Basic {SECRET}") is None
    assert ring.tenant_of("Bearer ") is None
    assert ring.tenant_of(None) is None
    assert ring.tenant_of("") is None


# -- config ------------------------------------------------------------------------------------

def gateway_dict(*tenants: dict) -> dict:
    return {"models": [{"name": "tiny", "backends": ["http://127.0.0.1:1"]}],
            "tenants": list(tenants)}


def test_tenants_from_yaml_with_keys_inline_and_in_a_file(tmp_path) -> None:
    keys_file = tmp_path / "team-b"
    keys_file.write_text("\n  sk-b1  \nsk-b2\n\n")
    config = GatewayConfig.from_dict(gateway_dict(
        {"name": "team-a", "api_keys": [SECRET], "requests_per_minute": 600,
         "tokens_per_minute": 200000, "max_concurrent": 32},
        {"name": "team-b", "api_keys_file": str(keys_file), "priority": 2},
    ))
    a, b = config.tenants
    assert a.keys == (SECRET,) and a.requests_per_minute == 600 and a.max_concurrent == 32
    assert b.keys == ("sk-b1", "sk-b2") and b.tokens_per_minute is None
    assert (a.priority, b.priority) == (None, 2)
    # Keys stay out of every printed form of the config.
    assert SECRET not in repr(config) and "sk-b1" not in str(config)


def test_no_tenants_is_no_auth_and_the_replica_key_comes_from_the_environment(
        monkeypatch) -> None:
    monkeypatch.delenv("ARGOSY_REPLICA_API_KEY", raising=False)
    config = GatewayConfig.from_dict({"models": gateway_dict()["models"]})
    assert config.tenants == () and config.replica_api_key is None
    monkeypatch.setenv("ARGOSY_REPLICA_API_KEY", "replica-secret")
    config = GatewayConfig.from_dict({"models": gateway_dict()["models"]})
    assert config.replica_api_key == "replica-secret"
    assert "replica-secret" not in repr(config)
    config = GatewayConfig.from_dict({"models": gateway_dict()["models"],
                                      "replica_api_key": "from-file"})
    assert config.replica_api_key == "from-file"  # the file wins


@pytest.mark.parametrize(("tenant", "message"), [
    ({"api_keys": ["k"]}, "tenants[].name: required"),
    ({"name": "a"}, "tenants[a]: give exactly one of 'api_keys' or 'api_keys_file'"),
    ({"name": "a", "api_keys": ["k"], "api_keys_file": "/x"}, "tenants[a]: give exactly one"),
    ({"name": "a", "api_keys": "k"}, "tenants[a].api_keys: expected a list"),
    ({"name": "a", "api_keys": ["two words"]}, "tenants[a].api_keys: every key must be"),
    ({"name": "a", "api_keys": [123]}, "tenants[a].api_keys: every key must be"),
    ({"name": "a", "api_keys_file": "/nonexistent/keys"}, "tenants[a].api_keys_file: cannot read"),
    ({"name": "a", "api_keys": ["k"], "requests_per_minute": 0},
     "tenants[a].requests_per_minute: expected a positive integer"),
    ({"name": "a", "api_keys": ["k"], "tokens_per_minute": 1.5},
     "tenants[a].tokens_per_minute: expected a positive integer"),
    ({"name": "a", "api_keys": ["k"], "max_concurrent": True},
     "tenants[a].max_concurrent: expected a positive integer"),
    ({"name": "a", "api_keys": ["k"], "max_concurrent": -3},
     "tenants[a].max_concurrent: expected a positive integer"),
    ({"name": "a", "api_keys": ["k"], "priority": "low"}, "tenants[a].priority: expected an int"),
    ({"name": "a", "api_keys": ["k"], "priority": 1 << 31}, "tenants[a].priority: expected an int"),
    ({"name": "a", "api_keys": ["k"], "priority": False}, "tenants[a].priority: expected an int"),
    ({"name": "a", "api_keys": ["k"], "rpm": 3}, "tenants[0].rpm: unknown field"),
])
def test_tenant_errors_name_the_field(tenant: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        GatewayConfig.from_dict(gateway_dict(tenant))
    assert message in str(err.value)


def test_a_keys_file_must_hold_a_key(tmp_path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n  \n")
    with pytest.raises(ValueError, match=r"tenants\[a\].api_keys_file: .* holds no key"):
        GatewayConfig.from_dict(gateway_dict({"name": "a", "api_keys_file": str(empty)}))


def test_names_are_unique_and_a_key_names_one_tenant_without_being_shown(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"tenants: duplicate name\(s\) \['a'\]"):
        GatewayConfig.from_dict(gateway_dict({"name": "a", "api_keys": ["k1"]},
                                             {"name": "a", "api_keys": ["k2"]}))
    shared = tmp_path / "b"
    shared.write_text(f"sk-other\n{SECRET}\n")
    with pytest.raises(ValueError) as err:
        GatewayConfig.from_dict(gateway_dict({"name": "a", "api_keys": [SECRET]},
                                             {"name": "b", "api_keys_file": str(shared)}))
    assert "tenants[b].api_keys_file: a key of 'b' is also a key of 'a'" in str(err.value)
    assert SECRET not in str(err.value)
    with pytest.raises(ValueError, match="tenants: an empty list"):
        GatewayConfig.from_dict(gateway_dict())
    with pytest.raises(ValueError, match="replica_api_key: expected a non-empty string"):
        GatewayConfig(models=(ModelRouteConfig(name="m", backends=("http://x",)),),
                      replica_api_key=" ")


# -- usage -------------------------------------------------------------------------------------

def test_usage_of_chat_completions_and_responses_answers() -> None:
    assert usage_of({"usage": {"prompt_tokens": 5, "completion_tokens": 7}}) == Usage(5, 7)
    assert usage_of({"object": "response", "usage": {"input_tokens": 3,
                                                     "output_tokens": 4}}) == Usage(3, 4)
    assert usage_of({"type": "response.completed",
                     "response": {"usage": {"input_tokens": 2, "output_tokens": 9}}}) == Usage(2, 9)
    assert usage_of({"choices": [], "usage": None}) is None
    # vLLM's rerank answer: only total_tokens, every one of them input
    assert usage_of({"results": [], "usage": {"total_tokens": 12}}) == Usage(12, 0)
    assert usage_of({"usage": {"prompt_tokens": "5", "completion_tokens": 1}}) is None
    assert usage_of([1, 2]) is None


def feed_in_pieces(meter: UsageMeter, data: bytes, size: int) -> None:
    for i in range(0, len(data), size):
        meter.feed(data[i:i + size])


def test_a_json_answer_reports_its_usage_across_chunks() -> None:
    body = json.dumps({"choices": [{"text": "hi"}],
                       "usage": {"prompt_tokens": 11, "completion_tokens": 3}}).encode()
    meter = UsageMeter(40, streamed=False, status=200)
    feed_in_pieces(meter, body, 7)
    assert meter.result() == Usage(11, 3)
    cut = UsageMeter(40, streamed=False, status=200)
    cut.feed(body[:20])  # the replica broke mid-body: the prompt estimate
    assert cut.result() == Usage(10, 0, estimated=True)
    error = UsageMeter(40, streamed=False, status=400)
    error.feed(b'{"error": {"message": "bad"}}')
    assert error.result() == Usage(0, 0)


def sse(*events: object) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def chunk(content: str | None, **delta: object) -> dict:
    return {"choices": [{"index": 0, "delta": {**delta, **({"content": content} if content
                                                           else {})}, "finish_reason": None}]}


STREAM_EVENTS = [chunk(None, role="assistant"), chunk("Hel"), chunk("lo"), chunk(" you"),
                 {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]


@pytest.mark.parametrize("piece", [1, 5, 4096])
def test_a_stream_with_a_usage_chunk_reports_it(piece: int) -> None:
    usage_chunk = {"choices": [], "usage": {"prompt_tokens": 21, "completion_tokens": 3}}
    meter = UsageMeter(100, streamed=True, status=200)
    feed_in_pieces(meter, sse(*STREAM_EVENTS, usage_chunk), piece)
    assert meter.result() == Usage(21, 3)


@pytest.mark.parametrize("piece", [1, 5, 4096])
def test_a_stream_without_usage_is_estimated(piece: int) -> None:
    meter = UsageMeter(101, streamed=True, status=200)
    feed_in_pieces(meter, sse(*STREAM_EVENTS), piece)
    # 3 content chunks (not the role or finish chunks) + ceil(101 / 4) prompt tokens
    assert meter.result() == Usage(26, 3, estimated=True)
    completions = UsageMeter(8, streamed=True, status=200)
    feed_in_pieces(completions, sse({"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]}),
                   piece)
    assert completions.result() == Usage(2, 2, estimated=True)


def test_a_stream_cut_short_charges_what_was_relayed() -> None:
    meter = UsageMeter(4, streamed=True, status=200)
    meter.feed(sse(chunk("a"), chunk("b"))[:-30])  # the second event never completed
    assert meter.result() == Usage(1, 1, estimated=True)


def test_a_responses_api_stream_reports_its_usage() -> None:
    events = (b'event: response.created\ndata: {"type": "response.created"}\n\n'
              b'event: response.output_text.delta\n'
              b'data: {"type": "response.output_text.delta", "delta": "Hi"}\n\n'
              b'event: response.completed\ndata: {"type": "response.completed", "response": '
              b'{"usage": {"input_tokens": 6, "output_tokens": 1}}}\n\n')
    meter = UsageMeter(10, streamed=True, status=200)
    feed_in_pieces(meter, events, 9)
    assert meter.result() == Usage(6, 1)
    no_usage = UsageMeter(10, streamed=True, status=200)
    no_usage.feed(events.split(b"event: response.completed")[0])
    assert no_usage.result() == Usage(3, 1, estimated=True)


def test_an_overlong_sse_line_is_skipped_not_buffered() -> None:
    meter = UsageMeter(0, streamed=True, status=200)
    meter.feed(b"data: " + b"x" * (2 << 20))
    meter.feed(b"\n\n" + sse(chunk("a")))
    assert meter.result() == Usage(0, 1, estimated=True)
    assert len(meter._pending) == 0
