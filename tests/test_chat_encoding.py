"""Tests for deepinfer.chat_encoding: DeepSeek's golden vectors plus one test per rendering rule.

Expected strings marked "official" were produced by DeepSeek's encoding_dsv4.py
(the golden files, or vectors published by ports that ran it); the others are
derived by hand from the rules of that file.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from deepinfer.chat_encoding import (
    REASONING_EFFORT_MAX,
    encode_chat,
    encode_messages,
    parse_message_from_completion_text,
    render_tools,
)
from deepinfer.tokenizer import default_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "encoding"

# sha256 of deepseek-ai/DeepSeek-V4-Flash@60d8d707 encoding/tests/* (as published upstream).
UPSTREAM_SHA256 = {
    "test_input_1.json": "10e0c074c977c3a80daab758af28219c6b1c2bd7f3f5cf2890c84b361cc32897",
    "test_input_2.json": "c44ae0db20fafff38a6021e8068d7ed6e28605d76cafd20be80b03398509f447",
    "test_input_3.json": "37bf8ef95e0411ea5f411be0b02fbafec7363438b6ccefddca0c52ec9aeaf69a",
    "test_input_4.json": "c45bbd0a1b7a2f75033d8db4ba74ee5b7653bd01114045a52f79d3b387663465",
    "test_output_1.txt": "9b366d9d2eac842a6e890594aac0b58648e5623717202b33497afadf03e26540",
    "test_output_2.txt": "ca66b01a1ac3a204bb032c928fb607d4877171e998a50f7f89f39fa821b75665",
    "test_output_3.txt": "b3b1cd8748b7b90d3c6be6da3f786f12e4d70be073bd445ea162dfad4dc01a64",
    "test_output_4.txt": "60e1643840ba9e4aeede450feb7b0498fa66ee24e4a939d48855ce04ec6fc375",
}
CASE_MODE = {1: "thinking", 2: "thinking", 3: "thinking", 4: "chat"}

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"
TC_OPEN, TC_CLOSE = "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>"


def load_case(n: int) -> tuple[list[dict[str, Any]], str]:
    """Messages and golden prompt of official case n, set up as DeepSeek's test does."""
    data = json.loads((FIXTURES / f"test_input_{n}.json").read_text(encoding="utf-8"))
    if n == 1:
        messages = data["messages"]
        messages[0]["tools"] = data["tools"]
    else:
        messages = data
    gold = (FIXTURES / f"test_output_{n}.txt").read_text(encoding="utf-8")
    return messages, gold


def call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    tc: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call_id:
        tc["id"] = call_id
    return tc


def dsml_block(*invokes: str) -> str:
    return "\n\n" + TC_OPEN + "\n" + "\n".join(invokes) + "\n" + TC_CLOSE


def invoke(name: str, *params: tuple[str, str, bool]) -> str:
    lines = [
        f'<｜DSML｜parameter name="{k}" string="{"true" if s else "false"}">{v}</｜DSML｜parameter>' for k, v, s in params
    ]
    return f'<｜DSML｜invoke name="{name}">\n' + "\n".join(lines) + "\n</｜DSML｜invoke>"


ECHO_TOOL = {"type": "function", "function": {
    "name": "echo", "description": "Echo the text back.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string", "description": "The text"}},
                   "required": ["text"]}}}


# ----------------------------------------------------------------- official golden vectors


@pytest.mark.parametrize("name", sorted(UPSTREAM_SHA256))
def test_fixture_files_are_byte_identical_to_upstream(name: str) -> None:
    assert hashlib.sha256((FIXTURES / name).read_bytes()).hexdigest() == UPSTREAM_SHA256[name]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_official_golden_output(n: int) -> None:
    messages, gold = load_case(n)
    assert encode_messages(messages, thinking_mode=CASE_MODE[n]) == gold


def test_official_case_1_parse() -> None:
    prompt = encode_messages(load_case(1)[0], thinking_mode="thinking")
    marker = A + "<think>"
    start = prompt.find(marker) + len(marker)
    first = parse_message_from_completion_text(prompt[start:prompt.find(U, start)], thinking_mode="thinking")
    assert first["reasoning_content"] == "The user wants to know the weather in Beijing. I should use the get_weather tool."
    assert first["content"] == ""
    assert [c["function"]["name"] for c in first["tool_calls"]] == ["get_weather"]
    assert first["tool_calls"][0]["function"]["arguments"] == '{"location": "Beijing", "unit": "celsius"}'

    final = parse_message_from_completion_text(prompt[prompt.rfind(marker) + len(marker):], thinking_mode="thinking")
    assert final["reasoning_content"] == "Got the weather data. Let me format a nice response."
    assert final["content"] == "The weather in Beijing is currently sunny with a temperature of 22°C and 45% humidity."
    assert final["tool_calls"] == []


def test_official_case_2_drops_earlier_reasoning_and_parses() -> None:
    prompt = encode_messages(load_case(2)[0], thinking_mode="thinking")
    assert "The user said hello" not in prompt
    marker = A + "<think>"
    parsed = parse_message_from_completion_text(prompt[prompt.rfind(marker) + len(marker):], thinking_mode="thinking")
    assert parsed == {"role": "assistant", "content": "The capital of France is Paris.",
                      "reasoning_content": "The user asks about the capital of France. It is Paris.", "tool_calls": []}


def test_official_case_3_parse_cjk_tool_call() -> None:
    prompt = load_case(3)[1]
    marker = A + "<think>"
    start = prompt.find(marker) + len(marker)
    parsed = parse_message_from_completion_text(prompt[start:prompt.find(U, start)], thinking_mode="thinking")
    assert parsed["reasoning_content"] == "用户想知道小柴胡冲剂和布洛芬能否一起服用。"
    assert parsed["tool_calls"] == [call("search", '{"queries": "小柴胡冲剂 布洛芬 相互作用 一起吃"}')]


def test_request_level_tools_reproduce_golden_1() -> None:
    messages, gold = load_case(1)
    tools = messages[0].pop("tools")
    assert encode_messages(messages, thinking_mode="thinking", tools=tools) == gold


def test_request_level_tools_without_system_insert_one() -> None:
    prompt = encode_messages([{"role": "user", "content": "hi"}], tools=[ECHO_TOOL])
    assert prompt == BOS + "\n\n" + render_tools([ECHO_TOOL]) + U + "hi" + A + "</think>"


# ------------------------------------------------------------------------- token ids


def test_seed_token_vectors() -> None:
    tok = default_tokenizer()
    messages = [{"role": "user", "content": "问题：中国的首都是哪里？"}]
    chat = [0, 128803, 2056, 768, 17607, 2793, 3139, 12108, 1148, 128804, 128822]
    assert encode_chat(tok, messages) == chat
    assert encode_chat(tok, messages, thinking_mode="thinking") == chat[:-1] + [128821]


def test_golden_prompt_tokenizes_markers_to_single_ids() -> None:
    tok = default_tokenizer()
    ids = encode_chat(tok, load_case(1)[0], thinking_mode="thinking")
    assert ids[0] == 0 and ids.count(0) == 1  # BOS only at the start
    assert ids.count(tok.eos_id) == 2 and ids[-1] == tok.eos_id
    # <think> / </think>: twice in the tools instructions, once per assistant turn.
    assert ids.count(128821) == 4 and ids.count(128822) == 4
    assert tok.decode(ids) == load_case(1)[1]


# ------------------------------------------------------------------------ render rules


def test_chat_mode_basic() -> None:
    messages = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "hi"}]
    assert encode_messages(messages) == BOS + "You are helpful." + U + "hi" + A + "</think>"


def test_thinking_mode_opens_think_block() -> None:
    assert encode_messages([{"role": "user", "content": "hi"}], thinking_mode="thinking") == BOS + U + "hi" + A + "<think>"


def test_chat_mode_history_has_no_reasoning() -> None:
    messages = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
                {"role": "user", "content": "q2"}]
    assert encode_messages(messages) == BOS + U + "q1" + A + "</think>a1" + EOS + U + "q2" + A + "</think>"


def test_drop_thinking_false_keeps_all_reasoning() -> None:
    messages = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
                {"role": "user", "content": "q2"}]
    assert encode_messages(messages, thinking_mode="thinking", drop_thinking=False) == (
        BOS + U + "q1" + A + "<think>r1</think>a1" + EOS + U + "q2" + A + "<think>")
    assert encode_messages(messages, thinking_mode="thinking") == (
        BOS + U + "q1" + A + "</think>a1" + EOS + U + "q2" + A + "<think>")


def test_tools_switch_drop_thinking_off() -> None:  # official
    messages = [{"role": "system", "content": "S", "tools": [ECHO_TOOL]}, {"role": "user", "content": "One"},
                {"role": "assistant", "content": "First answer.", "reasoning_content": "First reasoning."},
                {"role": "user", "content": "Two"}]
    assert encode_messages(messages, thinking_mode="thinking") == (
        BOS + "S\n\n" + render_tools([ECHO_TOOL]) + U + "One" + A + "<think>First reasoning.</think>First answer."
        + EOS + U + "Two" + A + "<think>")


def test_render_tools_text() -> None:  # official wording, one JSON line per schema
    text = render_tools([ECHO_TOOL])
    assert text.startswith("## Tools\n\nYou have access to a set of tools")
    assert '\n\n### Available Tool Schemas\n\n{"name": "echo", "description": "Echo the text back.", "parameters": ' in text
    assert text.endswith("You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n")


def test_tool_results_follow_call_order() -> None:  # official
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "", "reasoning_content": "R",
                 "tool_calls": [call("alpha", '{"n": "1"}', "call_A"), call("beta", '{"n": "2"}', "call_B")]},
                {"role": "tool", "tool_call_id": "call_B", "content": "B result"},
                {"role": "tool", "tool_call_id": "call_A", "content": "A result"}]
    assert encode_messages(messages, thinking_mode="thinking") == (
        BOS + "S" + U + "Q" + A + "</think>"
        + dsml_block(invoke("alpha", ("n", "1", True)), invoke("beta", ("n", "2", True))) + EOS
        + U + "<tool_result>A result</tool_result>\n\n<tool_result>B result</tool_result>" + A + "<think>")


def test_text_after_tool_result_joins_the_same_user_turn() -> None:  # official
    messages = [{"role": "user", "content": "Q"},
                {"role": "assistant", "content": "", "reasoning_content": "R",
                 "tool_calls": [call("alpha", '{"n": "1"}', "c1")]},
                {"role": "tool", "tool_call_id": "c1", "content": "result"},
                {"role": "user", "content": "And now this."}]
    assert encode_messages(messages, thinking_mode="thinking") == (
        BOS + U + "Q" + A + "</think>" + dsml_block(invoke("alpha", ("n", "1", True))) + EOS
        + U + "<tool_result>result</tool_result>\n\nAnd now this." + A + "<think>")


def test_non_string_arguments_render_as_json() -> None:  # official
    args = '{"name": "a/b", "count": 7, "flag": false, "list": [1, "two"], "nested": {"k": -1}, "nothing": null}'
    messages = [{"role": "user", "content": "Q"},
                {"role": "assistant", "content": "", "reasoning_content": "R", "tool_calls": [call("mixed", args)]}]
    assert encode_messages(messages, thinking_mode="thinking") == (
        BOS + U + "Q" + A + "<think>R</think>" + dsml_block(invoke(
            "mixed", ("name", "a/b", True), ("count", "7", False), ("flag", "false", False),
            ("list", '[1, "two"]', False), ("nested", '{"k": -1}', False), ("nothing", "null", False))) + EOS)


def test_arguments_that_are_not_json_become_one_string_parameter() -> None:  # official
    messages = [{"role": "user", "content": "Q"},
                {"role": "assistant", "content": "", "reasoning_content": "R", "tool_calls": [call("broken", "not json")]}]
    assert encode_messages(messages, thinking_mode="thinking").endswith(
        dsml_block(invoke("broken", ("arguments", "not json", True))) + EOS)


def test_dict_arguments_are_accepted() -> None:  # deviation: official would nest them
    as_str = [{"role": "user", "content": "Q"}, {"role": "assistant", "tool_calls": [call("f", '{"x": 1}')]}]
    as_dict = copy.deepcopy(as_str)
    as_dict[1]["tool_calls"][0]["function"]["arguments"] = {"x": 1}
    assert encode_messages(as_dict) == encode_messages(as_str)


def test_response_format() -> None:  # official
    messages = [{"role": "system", "content": "S", "response_format": {"type": "json_object", "path": "a/b"}},
                {"role": "user", "content": "Q"}]
    assert encode_messages(messages) == (
        BOS + "S\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
        '{"type": "json_object", "path": "a/b"}' + U + "Q" + A + "</think>")


def test_reasoning_effort() -> None:
    user = [{"role": "user", "content": "Q"}]
    assert encode_messages(user, thinking_mode="thinking", reasoning_effort="max") == (
        BOS + REASONING_EFFORT_MAX + U + "Q" + A + "<think>")
    assert REASONING_EFFORT_MAX.startswith("Reasoning Effort: Absolute maximum with no shortcuts permitted.\n")
    assert REASONING_EFFORT_MAX.endswith("to ensure absolutely no assumption is left unchecked.\n\n")
    # "high" and None render nothing; chat mode ignores the effort.
    plain = encode_messages(user, thinking_mode="thinking")
    assert encode_messages(user, thinking_mode="thinking", reasoning_effort="high") == plain
    assert encode_messages(user, reasoning_effort="max") == BOS + U + "Q" + A + "</think>"
    # The prefix goes before the first message only (here the system prompt).
    sys_user = [{"role": "system", "content": "S"}, *user]
    assert encode_messages(sys_user, thinking_mode="thinking", reasoning_effort="max") == (
        BOS + REASONING_EFFORT_MAX + "S" + U + "Q" + A + "<think>")


def test_latest_reminder_and_developer() -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "latest_reminder", "content": "2026-02-21,广州"},
                {"role": "developer", "content": "D"}]
    assert encode_messages(messages) == BOS + "S<｜latest_reminder｜>2026-02-21,广州" + U + "D" + A + "</think>"


def test_developer_before_last_user_is_dropped_in_thinking_mode() -> None:
    messages = [{"role": "developer", "content": "D"}, {"role": "assistant", "content": "a", "reasoning_content": "r"},
                {"role": "user", "content": "q"}]
    assert encode_messages(messages, thinking_mode="thinking") == BOS + "a" + EOS + U + "q" + A + "<think>"
    assert encode_messages(messages) == BOS + U + "D" + A + "</think>a" + EOS + U + "q" + A + "</think>"


def test_consecutive_user_messages_merge_into_one_turn() -> None:
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert encode_messages(messages) == BOS + U + "a\n\nb" + A + "</think>"
    # ...but not into a task-tagged user turn, whose task token is then never emitted.
    tagged = [{"role": "user", "content": "a", "task": "query"}, {"role": "user", "content": "b"}]
    assert encode_messages(tagged) == BOS + U + "a" + U + "b" + A + "</think>"


def test_user_followed_by_latest_reminder_still_gets_assistant_prefix() -> None:
    messages = [{"role": "user", "content": "q"}, {"role": "latest_reminder", "content": "R"}]
    assert encode_messages(messages) == BOS + U + "q" + A + "</think><｜latest_reminder｜>R"


def test_developer_as_last_turn_in_thinking_mode() -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "developer", "content": "D"}]
    assert encode_messages(messages, thinking_mode="thinking") == BOS + "S" + U + "D" + A + "<think>"


def test_context_shrunk_by_drop_thinking() -> None:
    # The developer turn in the context is dropped; rendering resumes right after the context.
    context = [{"role": "system", "content": "S"}, {"role": "developer", "content": "D"}, {"role": "user", "content": "q"}]
    messages = [{"role": "assistant", "content": "a", "reasoning_content": "r"}]
    assert encode_messages(messages, thinking_mode="thinking", context=context) == "r</think>a" + EOS


def test_quick_instruction_tasks() -> None:
    assert encode_messages([{"role": "user", "content": "classify me", "task": "query"}]) == (
        BOS + U + "classify me<｜query｜>")
    assert encode_messages([{"role": "user", "content": "q", "task": "action"}], thinking_mode="thinking") == (
        BOS + U + "q" + A + "<think><｜action｜>")
    titled = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "task": "title"}]
    assert encode_messages(titled) == BOS + U + "q" + A + "</think>a" + EOS + "<｜title｜>"


def test_answer_to_task_has_no_thinking_block() -> None:
    messages = [{"role": "user", "content": "q", "task": "action"}, {"role": "assistant", "content": "Search"}]
    assert encode_messages(messages, thinking_mode="thinking") == BOS + U + "q" + A + "<think><｜action｜>Search" + EOS


def test_wo_eos_leaves_assistant_turn_open() -> None:
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "partial", "wo_eos": True}]
    assert encode_messages(messages) == BOS + U + "q" + A + "</think>partial"


def test_tool_result_content_parts() -> None:
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [call("f", "{}", "c")]},
                {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "t"}, {"type": "image"}]}]
    assert encode_messages(messages).endswith(U + "<tool_result>t\n\n[Unsupported image]</tool_result>" + A + "</think>")


def test_context_is_not_rendered_and_gets_no_bos() -> None:
    context = [{"role": "system", "content": "S"}, {"role": "user", "content": "One"}]
    assert encode_messages([{"role": "user", "content": "Two"}], context=context) == U + "Two" + A + "</think>"
    assert encode_messages([{"role": "user", "content": "x"}], add_default_bos_token=False) == U + "x" + A + "</think>"


def test_parsed_turn_re_encodes_to_the_same_text() -> None:
    completion = ("  reason  </think>summary" + dsml_block(invoke("lookup", ("query", "value", True), ("limit", "2", False)))
                  + EOS)
    parsed = parse_message_from_completion_text(completion, thinking_mode="thinking")
    assert parsed["content"] == "summary" and parsed["reasoning_content"] == "  reason  "
    assert json.loads(parsed["tool_calls"][0]["function"]["arguments"]) == {"query": "value", "limit": 2}
    context = [{"role": "user", "content": "question"}]
    assert encode_messages([parsed], thinking_mode="thinking", context=context) == completion


def test_encode_does_not_mutate_input() -> None:
    messages, _ = load_case(1)
    before = copy.deepcopy(messages)
    encode_messages(messages, thinking_mode="thinking", tools=[ECHO_TOOL])
    assert messages == before


# --------------------------------------------------------------------------------- parse


def test_parse_chat_mode() -> None:
    assert parse_message_from_completion_text("Hello!" + EOS, thinking_mode="chat") == {
        "role": "assistant", "content": "Hello!", "reasoning_content": "", "tool_calls": []}


def test_parse_tool_calls_without_eos() -> None:
    text = "r</think>" + dsml_block(invoke("f", ("a", "x", True)), invoke("g"))
    parsed = parse_message_from_completion_text(text, thinking_mode="thinking")
    assert parsed["tool_calls"] == [call("f", '{"a": "x"}'), call("g", "{}")]


@pytest.mark.parametrize("text, mode, error", [
    ("no end of thinking" + EOS, "thinking", "missing </think>"),
    ("r</think>no eos", "thinking", "missing end-of-sentence"),
    ("done" + EOS + "more", "chat", "unexpected content at end"),
    ("a<think>b" + EOS, "chat", "unexpected special token"),
    ("x" + dsml_block(invoke("f", ("a", "1", True), ("a", "2", True))) + EOS, "chat", "duplicate parameter"),
    ("x" + dsml_block(invoke("f")) + "tail" + EOS, "chat", "after tool calls"),
    ("x\n\n" + TC_OPEN + "\n<｜DSML｜invoke nam=\"f\">\n</｜DSML｜invoke>\n" + TC_CLOSE, "chat", "tool name format"),
])
def test_parse_rejects_malformed_text(text: str, mode: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_message_from_completion_text(text, thinking_mode=mode)


# -------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("kwargs, error", [
    ({"messages": []}, "non-empty"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "unknown role 'robot'"),
    ({"messages": [{"content": "x"}]}, "unknown role None"),
    ({"messages": [{"role": "user", "content": 5}]}, r"messages\[0\]: content must be a string, got int"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}, "content must be a string"),
    ({"messages": [{"role": "tool", "content": 3}]}, "tool content"),
    ({"messages": [{"role": "developer", "content": ""}]}, "developer message needs non-empty content"),
    ({"messages": [{"role": "latest_reminder"}]}, "latest_reminder message needs string content"),
    ({"messages": [{"role": "user", "content": "x", "task": "dance"}]}, "unknown task 'dance'"),
    ({"messages": [{"role": "assistant", "reasoning_content": 1}]}, "reasoning_content must be a string"),
    ({"messages": [{"role": "assistant", "tool_calls": ["f()"]}]}, "each tool call must be a dict"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"name": "f"}]}]}, r"tool_calls\[0\] must be"),
    ({"messages": [{"role": "assistant", "tool_calls": [call("f", "[1, 2]")]}]}, "JSON object"),
    ({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "medium"}, "unknown reasoning_effort 'medium'"),
    ({"messages": [{"role": "user", "content": "x"}], "thinking_mode": "deep"}, "unknown thinking_mode 'deep'"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f"}]}, r"tools\[0\] must be an OpenAI tool"),
    ({"messages": [{"role": "user", "content": "x"}], "context": [{"role": "bot"}]}, r"context\[0\]: unknown role"),
])
def test_bad_input_raises_value_error(kwargs: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        encode_messages(**kwargs)


def test_parse_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="unknown thinking_mode"):
        parse_message_from_completion_text("x" + EOS, thinking_mode="fast")
