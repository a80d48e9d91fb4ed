"""How the gateway reads a Responses API request for routing (no replicas needed)."""

from __future__ import annotations

from argosy_runtime.gateway.backends.replica import Replica
from argosy_runtime.gateway.policies import RouteRequest
from argosy_runtime.gateway.proxy.responses_routes import PinnedPolicy
from argosy_runtime.gateway.request_text import prompt_text, requested_max_tokens


def test_a_responses_request_reads_as_the_chat_it_becomes() -> None:
    chat = prompt_text("/v1/chat/completions", {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]})
    assert chat == prompt_text("/v1/responses", {"instructions": "Be brief.", "input": "Hi"})
    assert chat == prompt_text("/v1/responses", {"instructions": "Be brief.", "input": [
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Hi"}]}]})
    assert prompt_text("/v1/responses", {"input": 3}) == ""


def test_max_output_tokens_counts_for_the_cascade() -> None:
    assert requested_max_tokens({"max_output_tokens": 64}) == 64


def test_pinned_policy_picks_only_its_replica() -> None:
    a, b = Replica("http://a"), Replica("http://b")
    policy = PinnedPolicy("http://b")
    assert policy.choose([a, b], RouteRequest()) is b
    assert policy.choose([a], RouteRequest()) is None
