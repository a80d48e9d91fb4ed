"""Review fixes of the text routing reads: each test fails without its fix."""

from __future__ import annotations

from argosy_runtime.gateway.request_text import content_text, prompt_text, routing_text

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"


def test_a_tool_using_conversation_reads_alike_in_chat_and_responses() -> None:
    """The replica turns Responses items into chat messages (responses/input_items.py): a
    function_call is an assistant turn's tool call, a function_call_output a tool turn, a
    reasoning item no turn at all; a developer turn is a system turn (serving_chat.py). The
    routing key must read them the same, or the same conversation (and its cached prefix)
    would be placed two ways."""
    chat = prompt_text(CHAT, {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21C, sunny"},
    ]})
    responses = prompt_text(RESPONSES, {"input": [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text",
                                                           "text": "call the tool"}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "21C, sunny"},
    ]})
    assert responses == chat
    # Two tool outputs differ in the key (they differ in what the replica caches).
    other = prompt_text(RESPONSES, {"input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "rain"},
    ]})
    assert other != responses.replace("system\x1fBe brief.\x1e", "")


def test_content_parts_join_as_the_replica_joins_them() -> None:
    """The replica joins a message's text (and refusal) parts with newlines (as vLLM): parts
    and the string they make are one prompt, cached once."""
    as_parts = {"messages": [{"role": "assistant", "content": [
        {"type": "text", "text": "a"}, {"type": "refusal", "refusal": "no"}]}]}
    as_string = {"messages": [{"role": "assistant", "content": "a\nno"}]}
    assert prompt_text(CHAT, as_parts) == prompt_text(CHAT, as_string)
    assert content_text(CHAT, as_parts) == "a\nno"
    # A malformed part (the replica's 400) reads as no text, never an error here.
    assert prompt_text(CHAT, {"messages": [{"role": "user", "content": [
        {"type": ["text"], "text": "x"}, {"type": "text", "text": "y"}]}]}) == "user\x1fy\x1e"


WEATHER = {"name": "weather", "description": "Current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def test_routing_reads_the_tools_where_templates_render_them() -> None:
    """Chat templates render `tools` after the system turns: requests sharing a tool list
    share that prefix in the replica's cache, and another tool list starts another prefix
    right after the system prompt. Routing that ignored the tools saw neither."""
    system = {"role": "system", "content": "Be brief."}

    def chat(tools: list, question: str) -> str:
        return routing_text(CHAT, {"messages": [system, {"role": "user", "content": question}],
                                   "tools": tools})

    tools = [{"type": "function", "function": WEATHER}]
    paris, rome = chat(tools, "Weather in Paris?"), chat(tools, "Weather in Rome?")
    assert paris.startswith("system\x1fBe brief.\x1etools\x1f")
    shared = len(paris) - len("user\x1fWeather in Paris?\x1e")
    assert paris[:shared] == rome[:shared] and paris != rome
    other_tools = chat([{"type": "function", "function": {**WEATHER, "name": "forecast"}}],
                       "Weather in Paris?")
    before_tools = len("system\x1fBe brief.\x1etools\x1f")
    assert other_tools[:before_tools] == paris[:before_tools] and other_tools != paris
    # Responses' flat function tools are the chat tools the replica makes of them.
    responses = routing_text(RESPONSES, {"instructions": "Be brief.", "input": "Weather in Paris?",
                                         "tools": [{"type": "function", **WEATHER}]})
    assert responses == paris
    # No tools (or an empty list): the prompt as the cascade reads it.
    for body in ({"messages": [system]}, {"messages": [system], "tools": []}):
        assert routing_text(CHAT, body) == prompt_text(CHAT, body)
