"""DeepSeek-V4 chat prompt encoding and completion parsing.

This module owns the conversion of OpenAI-style chat messages into the exact
prompt string DeepSeek-V4 was trained on (`encode_messages`), its ids
(`encode_chat`), and the inverse for one generated assistant turn
(`parse_message_from_completion_text`: reasoning / content / DSML tool calls).

Source of truth: DeepSeek's `encoding/encoding_dsv4.py` shipped in the model
repository deepseek-ai/DeepSeek-V4-Flash @ 60d8d70770c6776ff598c94bb586a859a38244f1
(sha256 bdbd57c132a1b372...). Read from a verbatim public mirror:
AI-Hypercomputer/maxtext `tests/utils/deepseek4_reference/encoding_dsv4.py`
(commit 8ddb0a602d82bb954fe24fb71d8aced6b0e8f186), cross-checked against
supermy/ds4rs `encoding/encoding_dsv4.py`. This is an independent rewrite that
reproduces its output byte for byte; the official golden vectors
(`encoding/tests/test_{input,output}_{1..4}`) live in tests/fixtures/encoding/.

Rendering rules (all from the official file):
- BOS once, at the start, unless `context` (an already-encoded prefix) is given.
- system: raw content (+ "\\n\\n## Tools..." / "\\n\\n## Response Format..." blocks).
- user: `<｜User｜>` + content; `tool` messages are merged into a user turn as
  `<tool_result>...</tool_result>` blocks joined by blank lines, ordered like the
  preceding assistant's tool_calls; consecutive user turns merge the same way.
  developer: like user, content required. Content is a string (no list parts).
- latest_reminder: `<｜latest_reminder｜>` + content.
- assistant: [reasoning `</think>`] content ["\\n\\n" DSML tool_calls block] EOS.
- after a user/developer turn that is last or followed by assistant/latest_reminder:
  `<｜Assistant｜>` then `<think>` in thinking mode (with drop_thinking: only for
  the last user turn, earlier ones get `</think>`), `</think>` in chat mode.
- drop_thinking (thinking mode, default): reasoning of assistant turns before the
  last user turn is removed and developer turns before it are dropped; it is
  switched off whenever any message carries `tools`.
- reasoning_effort="max" prefixes the first message with REASONING_EFFORT_MAX in
  thinking mode; "high" and None render nothing.
- a message's `task` appends a quick-instruction token (`<｜action｜>` etc.).

Deviations (only where the official code asserts, crashes or renders garbage):
- bad input raises ValueError naming the problem (official: AssertionError /
  TypeError / silent "None"); `messages` must be non-empty; user content None
  renders as "" (official: TypeError).
- a tool call whose `arguments` is already a dict is used as is (official wraps
  it as a single `arguments` parameter); non-object JSON arguments are rejected.
- parse errors raise ValueError (official mixes AssertionError and ValueError).
- `tools=` argument: request-level tools are attached to a leading system or
  developer message, or a new `{"role": "system"}` is inserted (as vLLM does);
  the official function has no such argument.

Besides the golden files, this was checked against a transcription of the
official file on 20,000 random conversations (all roles, tools, tasks, context
splits, both modes): identical output. That harness is not part of the suite.
"""

from __future__ import annotations

import copy
import json
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deepinfer.tokenizer import Tokenizer

Message = dict[str, Any]

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
TASK_TOKENS: dict[str, str] = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

THINKING_MODES = ("chat", "thinking")
REASONING_EFFORTS = (None, "high", "max")
ROLES = ("system", "user", "developer", "assistant", "tool", "latest_reminder")

REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve "
    "the root cause, rigorously stress-testing your logic against all potential paths, edge cases, "
    "and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

TOOLS_BLOCK_NAME = "tool_calls"
TOOL_CALLS_START = f"<{DSML}{TOOLS_BLOCK_NAME}>"
TOOL_CALLS_END = f"</{DSML}{TOOLS_BLOCK_NAME}>"

_TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think_start}), you MUST output your complete reasoning inside {think_start}...{think_end} BEFORE any tool calls or final response.

Otherwise, output directly after {think_end} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

_RESPONSE_FORMAT_TEMPLATE = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"


# ---------------------------------------------------------------------------- helpers


def _to_json(value: Any) -> str:
    # Non-ASCII stays literal (ensure_ascii=False), as in the official encoder.
    return json.dumps(value, ensure_ascii=False)


def render_tools(tools: list[dict[str, Any]]) -> str:
    """The '## Tools' system-prompt section for OpenAI-format `tools`."""
    schemas = "\n".join(_to_json(_tool_function(t, i)) for i, t in enumerate(tools))
    return _TOOLS_TEMPLATE.format(dsml=DSML, think_start=THINK_START, think_end=THINK_END, schemas=schemas)


def _tool_function(tool: Any, i: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
        raise ValueError(f"tools[{i}] must be an OpenAI tool {{'type': 'function', 'function': {{...}}}}, got {tool!r}")
    return tool["function"]


def _call_arguments(call: dict[str, Any], where: str) -> dict[str, Any]:
    """Arguments of one tool call as a dict (official: JSON string, else one 'arguments' param)."""
    raw = call.get("arguments")
    if isinstance(raw, dict):
        return raw
    if not isinstance(raw, str):
        raise ValueError(f"{where}: arguments must be a JSON string or dict, got {type(raw).__name__}")
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError:
        return {"arguments": raw}
    if not isinstance(parsed, dict):
        raise ValueError(f"{where}: arguments must encode a JSON object, got {raw!r}")
    return parsed


def _render_tool_calls(tool_calls: list[Any], where: str) -> str:
    invokes = []
    for j, tc in enumerate(tool_calls):
        loc = f"{where}.tool_calls[{j}]"
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{loc} must be {{'function': {{'name': str, 'arguments': str}}}}, got {tc!r}")
        params = []
        for key, value in _call_arguments(fn, loc).items():
            is_str = isinstance(value, str)
            params.append(
                f'<{DSML}parameter name="{key}" string="{"true" if is_str else "false"}">'
                f"{value if is_str else _to_json(value)}</{DSML}parameter>"
            )
        invokes.append(f'<{DSML}invoke name="{fn["name"]}">\n' + "\n".join(params) + f"\n</{DSML}invoke>")
    return f"\n\n{TOOL_CALLS_START}\n" + "\n".join(invokes) + f"\n{TOOL_CALLS_END}"


def _system_extras(msg: Message) -> str:
    """Tools and response-format sections appended to a system/developer message."""
    out = ""
    if msg.get("tools"):
        out += "\n\n" + render_tools(msg["tools"])
    if msg.get("response_format"):
        out += "\n\n" + _RESPONSE_FORMAT_TEMPLATE.format(schema=_to_json(msg["response_format"]))
    return out


def _tool_result_text(content: Any) -> str:
    # A tool result may be a list of content parts: text is kept, other parts are
    # replaced by a marker, joined by blank lines (official behaviour).
    if isinstance(content, list):
        return "\n\n".join(
            p.get("text", "") if p.get("type") == "text" else f"[Unsupported {p.get('type')}]" for p in content
        )
    return content


def _last_user_index(messages: list[Message]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") in ("user", "developer"):
            return i
    return -1


# ---------------------------------------------------------------------- validation


def _validate(messages: Any, name: str) -> None:
    if not isinstance(messages, list):
        raise ValueError(f"{name} must be a list of message dicts, got {type(messages).__name__}")
    for i, msg in enumerate(messages):
        where = f"{name}[{i}]"
        if not isinstance(msg, dict):
            raise ValueError(f"{where} must be a dict, got {type(msg).__name__}")
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}: unknown role {role!r}; expected one of {', '.join(ROLES)}")
        content = msg.get("content")
        if role == "tool":
            if content is not None and not isinstance(content, (str, list)):
                raise ValueError(
                    f"{where}: tool content must be a string or list of parts, got {type(content).__name__}"
                )
            if isinstance(content, list) and not all(isinstance(p, dict) for p in content):
                raise ValueError(f"{where}: tool content parts must be dicts")
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"{where}: content must be a string, got {type(content).__name__}")
        if role == "developer" and not content:
            raise ValueError(f"{where}: a developer message needs non-empty content")
        if role == "latest_reminder" and not isinstance(content, str):
            raise ValueError(f"{where}: a latest_reminder message needs string content")
        reasoning = msg.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ValueError(f"{where}: reasoning_content must be a string, got {type(reasoning).__name__}")
        task = msg.get("task")
        if task is not None and task not in TASK_TOKENS:
            raise ValueError(f"{where}: unknown task {task!r}; expected one of {', '.join(TASK_TOKENS)}")
        for key in ("tools", "tool_calls"):
            if msg.get(key) is not None and not isinstance(msg[key], list):
                raise ValueError(f"{where}: {key} must be a list, got {type(msg[key]).__name__}")
        if msg.get("tool_calls") and not all(isinstance(tc, dict) for tc in msg["tool_calls"]):
            raise ValueError(f"{where}: each tool call must be a dict")
        blocks = msg.get("content_blocks")
        if blocks is not None and (not isinstance(blocks, list) or not all(isinstance(b, dict) for b in blocks)):
            raise ValueError(f"{where}: content_blocks must be a list of dicts")


# -------------------------------------------------------------------- preprocessing


def merge_tool_messages(messages: list[Message]) -> list[Message]:
    """Fold `tool` messages into user turns as `tool_result` content blocks (copies input).

    V4 has no tool role: consecutive tool results (and a user message right after
    them) become one user turn.
    """
    merged: list[Message] = []
    for msg in messages:
        msg = copy.deepcopy(msg)
        role = msg.get("role")
        prev = merged[-1] if merged else None
        open_user = prev is not None and prev.get("role") == "user" and "content_blocks" in prev
        if role == "tool":
            block = {
                "type": "tool_result",
                "tool_use_id": msg.get("tool_call_id", ""),
                "content": msg.get("content", ""),
            }
            if open_user:
                prev["content_blocks"].append(block)
            else:
                merged.append({"role": "user", "content_blocks": [block]})
        elif role == "user":
            # content None renders as empty (the official code would crash on it).
            block = {"type": "text", "text": msg.get("content") or ""}
            # A task-tagged user turn stays separate: its task token must follow it.
            if open_user and prev.get("task") is None:
                prev["content_blocks"].append(block)
            else:
                new = {"role": "user", "content": msg.get("content", ""), "content_blocks": [block]}
                for key in ("task", "wo_eos", "mask"):
                    if key in msg:
                        new[key] = msg[key]
                merged.append(new)
        else:
            merged.append(msg)
    return merged


def sort_tool_results_by_call_order(messages: list[Message]) -> list[Message]:
    """Reorder tool_result blocks of each user turn to follow the last assistant's call order.

    Clients may return results in completion order; the model saw them in call
    order. Blocks without a known id sort as position 0. Mutates and returns `messages`.
    """
    order: dict[str, int] = {}
    for msg in messages:
        role = msg.get("role")
        if role == "assistant" and msg.get("tool_calls"):
            order = {}
            for i, tc in enumerate(msg["tool_calls"]):
                tc_id = tc.get("id") or tc.get("function", {}).get("id", "")
                if tc_id:
                    order[tc_id] = i
        elif role == "user" and msg.get("content_blocks"):
            results = [b for b in msg["content_blocks"] if b.get("type") == "tool_result"]
            if len(results) > 1 and order:
                ordered = iter(sorted(results, key=lambda b: order.get(b.get("tool_use_id", ""), 0)))
                msg["content_blocks"] = [
                    next(ordered) if b.get("type") == "tool_result" else b for b in msg["content_blocks"]
                ]
    return messages


def _drop_thinking(messages: list[Message]) -> list[Message]:
    """Before the last user turn: strip assistant reasoning and drop developer turns."""
    last_user = _last_user_index(messages)
    kept: list[Message] = []
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if i >= last_user or role in ("user", "system", "tool", "latest_reminder", "direct_search_results"):
            kept.append(msg)
        elif role == "assistant":
            msg = dict(msg)
            msg.pop("reasoning_content", None)
            kept.append(msg)
    return kept


# ------------------------------------------------------------------------- rendering


def _render(
    index: int, messages: list[Message], thinking: bool, drop_thinking: bool, reasoning_effort: str | None
) -> str:
    """One message of the (preprocessed) conversation, plus what must follow it."""
    msg = messages[index]
    role = msg.get("role")
    content = msg.get("content")
    last_user = _last_user_index(messages)
    out = ""

    if index == 0 and thinking and reasoning_effort == "max":
        out += REASONING_EFFORT_MAX

    if role == "system":
        out += (content or "") + _system_extras(msg)
    elif role == "developer":
        out += USER + content + _system_extras(msg)
    elif role == "user":
        out += USER
        blocks = msg.get("content_blocks")
        if blocks:
            parts = []
            for block in blocks:
                kind = block.get("type")
                if kind == "text":
                    parts.append(block.get("text", ""))
                elif kind == "tool_result":
                    parts.append(f"<tool_result>{_tool_result_text(block.get('content', ''))}</tool_result>")
                else:
                    parts.append(f"[Unsupported {kind}]")
            out += "\n\n".join(parts)
        else:
            out += content or ""
    elif role == "latest_reminder":
        out += LATEST_REMINDER + content
    elif role == "assistant":
        reasoning = ""
        # The answer to a quick-instruction task carries no thinking block.
        after_task = index > 0 and messages[index - 1].get("task") is not None
        if thinking and not after_task and (not drop_thinking or index > last_user):
            reasoning = (msg.get("reasoning_content") or "") + THINK_END
        calls = _render_tool_calls(msg["tool_calls"], f"messages[{index}]") if msg.get("tool_calls") else ""
        out += reasoning + (content or "") + calls
        if not msg.get("wo_eos", False):
            out += EOS
    else:  # `tool` was merged away and roles were validated; reaching here is a bug.
        raise ValueError(f"cannot render role {role!r}")

    # Generation prompt / task token only where no user-side turn follows.
    nxt = messages[index + 1].get("role") if index + 1 < len(messages) else None
    if nxt is not None and nxt not in ("assistant", "latest_reminder"):
        return out

    task = msg.get("task")
    if task is not None:
        if task == "action":
            out += ASSISTANT + (THINK_START if thinking else THINK_END) + TASK_TOKENS[task]
        else:
            out += TASK_TOKENS[task]
    elif role in ("user", "developer"):
        open_think = thinking and (not drop_thinking or index >= last_user)
        out += ASSISTANT + (THINK_START if open_think else THINK_END)
    return out


def _attach_tools(messages: list[Message], tools: list[dict[str, Any]]) -> list[Message]:
    messages = list(messages)
    if messages and messages[0].get("role") in ("system", "developer"):
        messages[0] = {**messages[0], "tools": tools}
    else:
        messages.insert(0, {"role": "system", "tools": tools})
    return messages


def encode_messages(
    messages: list[Message],
    thinking_mode: str = "chat",
    context: list[Message] | None = None,
    drop_thinking: bool = True,
    add_default_bos_token: bool = True,
    reasoning_effort: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """Render `messages` as the DeepSeek-V4 prompt string.

    thinking_mode: "chat" (answer directly, `</think>` is pre-filled) or "thinking".
    context: messages already encoded earlier in this sequence; they shape the
      rendering (e.g. which turn is "last") but are not emitted, and no BOS is added.
    drop_thinking: remove reasoning of earlier turns (ignored if any message has tools).
    reasoning_effort: None, "high" (both render nothing) or "max".
    tools: OpenAI-format tools for the whole request (see module doc).
    """
    if thinking_mode not in THINKING_MODES:
        raise ValueError(f"unknown thinking_mode {thinking_mode!r}; expected 'chat' or 'thinking'")
    if reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"unknown reasoning_effort {reasoning_effort!r}; expected None, 'high' or 'max'")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    context = context or []
    if tools:
        if not isinstance(tools, list):
            raise ValueError(f"tools must be a list, got {type(tools).__name__}")
        messages = _attach_tools(messages, tools)
    _validate(context, "context")
    _validate(messages, "messages")

    # Context and new messages are merged separately (a tool result at the start of
    # `messages` must not fold into the context), but tool-call order carries over.
    ctx = merge_tool_messages(context)
    full = sort_tool_results_by_call_order(ctx + merge_tool_messages(messages))
    thinking = thinking_mode == "thinking"

    drop = drop_thinking and not any(m.get("tools") for m in full)
    if thinking and drop:
        full = _drop_thinking(full)
        start = len(_drop_thinking(ctx))
    else:
        start = len(ctx)

    prompt = BOS if add_default_bos_token and not ctx else ""
    for i in range(start, len(full)):
        prompt += _render(i, full, thinking, drop, reasoning_effort)
    return prompt


def encode_chat(
    tokenizer: Tokenizer,
    messages: list[Message],
    thinking_mode: str = "chat",
    **kwargs: Any,
) -> list[int]:
    """Prompt token ids: `encode_messages(...)` tokenized without extra special tokens."""
    return tokenizer.encode(encode_messages(messages, thinking_mode=thinking_mode, **kwargs))


# --------------------------------------------------------------------------- parsing


def _read_until(text: str, start: int, stops: tuple[str, ...]) -> tuple[int, str, str | None]:
    """Text from `start` to the earliest of `stops`; returns (index after stop, text, stop)."""
    best, found = len(text), None
    for stop in stops:
        pos = text.find(stop, start)
        if pos != -1 and pos < best:
            best, found = pos, stop
    if found is None:
        return len(text), text[start:], None
    return best + len(found), text[start:best], found


_INVOKE_NAME_RE = re.compile(r'^\s*name="(.*?)">\n$', re.DOTALL)
_PARAM_RE = re.compile(r'^ name="(.*?)" string="(true|false)">(.*?)<$', re.DOTALL)


def _parse_tool_calls(text: str, index: int) -> tuple[int, list[dict[str, str]]]:
    """Parse the invokes after `<｜DSML｜tool_calls` (already consumed)."""
    calls: list[dict[str, str]] = []
    invoke_open, invoke_close = f"<{DSML}invoke", f"</{DSML}invoke"
    param_open, param_close = f"<{DSML}parameter", f"/{DSML}parameter"
    while index < len(text):
        index, gap, stop = _read_until(text, index, (invoke_open, TOOL_CALLS_END))
        if gap != ">\n":
            raise ValueError(f"tool call format error: expected '>\\n' but got {gap!r}")
        if stop == TOOL_CALLS_END:
            break
        if stop is None:
            raise ValueError("tool calls block is not closed")
        index, head, stop = _read_until(text, index, (param_open, invoke_close))
        name = _INVOKE_NAME_RE.findall(head)
        if len(name) != 1:
            raise ValueError(f"tool name format error: {head!r}")
        params: dict[str, tuple[str, bool]] = {}
        while stop == param_open:
            index, body, stop = _read_until(text, index, (param_close,))
            kv = _PARAM_RE.findall(body)
            if len(kv) != 1:
                raise ValueError(f"parameter format error: {body!r}")
            key, is_str, value = kv[0]
            if key in params:
                raise ValueError(f"duplicate parameter name: {key!r}")
            params[key] = (value, is_str == "true")
            index, gap, stop = _read_until(text, index, (param_open, invoke_close))
            if gap != ">\n":
                raise ValueError(f"parameter format error: expected '>\\n' but got {gap!r}")
        # Arguments are rebuilt as a JSON object string: string params are quoted,
        # the others are already JSON literals and are pasted verbatim.
        args = ", ".join(f"{_to_json(k)}: {_to_json(v) if s else v}" for k, (v, s) in params.items())
        calls.append({"name": name[0], "arguments": "{" + args + "}"})
    return index, calls


def parse_message_from_completion_text(text: str, thinking_mode: str) -> Message:
    """Split one generated assistant turn into reasoning, content and tool calls.

    `text` is what the model produced after the prompt (which ended in `<think>`
    for thinking mode, `</think>` for chat mode), including the final EOS; the
    EOS may be absent only after a tool-calls block. Malformed text raises ValueError.
    Returns {"role", "content", "reasoning_content", "tool_calls" (OpenAI format)}.
    """
    if thinking_mode not in THINKING_MODES:
        raise ValueError(f"unknown thinking_mode {thinking_mode!r}; expected 'chat' or 'thinking'")
    if not isinstance(text, str):
        raise ValueError(f"text must be a string, got {type(text).__name__}")
    calls_start = f"\n\n<{DSML}{TOOLS_BLOCK_NAME}"
    index, reasoning, calls = 0, "", []

    if thinking_mode == "thinking":
        index, reasoning, stop = _read_until(text, index, (THINK_END, calls_start))
        if stop != THINK_END:
            raise ValueError("invalid thinking format: missing </think>")

    index, content, stop = _read_until(text, index, (EOS, calls_start))
    if stop == calls_start:
        index, calls = _parse_tool_calls(text, index)
        index, trailing, stop = _read_until(text, index, (EOS,))
        if trailing:
            raise ValueError(f"unexpected content after tool calls: {trailing!r}")
    elif stop != EOS:
        raise ValueError("invalid format: missing end-of-sentence token")
    if index != len(text):
        raise ValueError(f"unexpected content at end: {text[index:]!r}")

    for token in (BOS, EOS, THINK_START, THINK_END, DSML):
        if token in content or token in reasoning:
            raise ValueError(f"unexpected special token {token!r} in content")

    return {
        "role": "assistant",
        "content": content,
        "reasoning_content": reasoning,
        "tool_calls": [
            {"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls
        ],
    }
