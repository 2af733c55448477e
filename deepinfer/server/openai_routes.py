"""/v1/completions and /v1/chat/completions: request -> prompt ids + SamplingParams -> `Generation`,
with the endpoint's response shapes (OpenAI's, plus vLLM's `return_token_ids` extra).

Logprobs are the engine's own (`RequestOutput.outputs[0].logprobs`), the values the offline API returns.
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from deepinfer.server.errors import APIError, bad_request
from deepinfer.server.protocol import ChatRequest, CompletionRequest, check_length, parse, sampling_params
from deepinfer.server.reasoning import ReasoningSplitter, split
from deepinfer.server.serving import Choice, Generation, finish_reason, new_id, top_entries

router = APIRouter()
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left


class CompletionFormat:
    object_name, chunk_object_name = "text_completion", "text_completion"

    def __init__(self, tokenizer, num_logprobs: int | None, token_ids: bool) -> None:
        self.tok, self.num, self.token_ids = tokenizer, num_logprobs, token_ids

    def _logprobs(self, c: Choice, first: int, last: int, offset: int) -> dict | None:
        if self.num is None or c.output is None or c.output.logprobs is None:
            return None
        res = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i in range(first, min(last, len(c.output.logprobs))):
            t = c.output.token_ids[i]
            lp, top = top_entries(c.output.logprobs[i], t, self.num)
            piece = self.tok.decode([t])
            res["tokens"].append(piece)
            res["token_logprobs"].append(lp)
            res["top_logprobs"].append({self.tok.decode([u]): v for u, v in top})
            res["text_offset"].append(offset)
            offset += len(piece)
        return res

    def choice(self, c: Choice) -> dict:
        out = {"index": c.index, "text": c.output.text, "logprobs": self._logprobs(c, 0, len(c.output.token_ids), 0),
               "finish_reason": finish_reason(c), "stop_reason": c.output.stop_reason}
        if self.token_ids:
            out["token_ids"] = list(c.output.token_ids)
        return out

    def deltas(self, c: Choice, text: str, first: int, last: int) -> list[dict]:
        out = {"index": c.index, "text": text, "logprobs": self._logprobs(c, first, last, c.sent_chars),
               "finish_reason": finish_reason(c)}
        if self.token_ids and c.output is not None:
            out["token_ids"] = list(c.output.token_ids[first:last])
        return [out]


class ChatFormat:
    object_name, chunk_object_name = "chat.completion", "chat.completion.chunk"

    def __init__(self, tokenizer, num_logprobs: int | None, thinking: bool, token_ids: bool) -> None:
        self.tok, self.num, self.thinking, self.token_ids = tokenizer, num_logprobs, thinking, token_ids

    def _logprobs(self, c: Choice, first: int, last: int) -> dict | None:
        if self.num is None or c.output is None or c.output.logprobs is None:
            return None

        def item(t: int, lp: float) -> dict:
            return {"token": self.tok.decode([t]), "logprob": lp, "bytes": list(self.tok.token_bytes(t))}

        content = []
        for i in range(first, min(last, len(c.output.logprobs))):
            t = c.output.token_ids[i]
            lp, top = top_entries(c.output.logprobs[i], t, self.num)
            content.append({**item(t, lp), "top_logprobs": [item(u, v) for u, v in top]})
        return {"content": content}

    def choice(self, c: Choice) -> dict:
        reasoning, content = split(c.output.text, self.thinking)
        msg = {"role": "assistant", "content": content}
        if self.thinking:
            msg["reasoning_content"] = reasoning
        out = {"index": c.index, "message": msg, "logprobs": self._logprobs(c, 0, len(c.output.token_ids)),
               "finish_reason": finish_reason(c), "stop_reason": c.output.stop_reason}
        if self.token_ids:
            out["token_ids"] = list(c.output.token_ids)
        return out

    def deltas(self, c: Choice, text: str, first: int, last: int) -> list[dict]:
        splitter = c.state.setdefault("splitter", ReasoningSplitter(self.thinking))
        reasoning, content = splitter.feed(text)
        if c.finished:
            r2, c2 = splitter.flush()
            reasoning, content = reasoning + r2, content + c2
        delta: dict = {}
        if not c.state.get("role_sent"):
            c.state["role_sent"] = True
            delta["role"] = "assistant"
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content or (not reasoning and "role" in delta):
            delta["content"] = content
        out = {"index": c.index, "delta": delta, "logprobs": self._logprobs(c, first, last),
               "finish_reason": finish_reason(c)}
        if self.token_ids and c.output is not None:
            out["token_ids"] = list(c.output.token_ids[first:last])
        return [out]


def _model_name(request: Request, asked: str | None) -> str:
    state = request.app.state
    if asked is not None and asked not in state.model_names:
        raise APIError(404, f"The model `{asked}` does not exist.", param="model", code="model_not_found")
    return state.model_names[0]


async def _respond(request: Request, gen: Generation, stream: bool, include_usage: bool):
    await gen.start(stream)
    if stream:
        return StreamingResponse(gen.stream(include_usage), media_type="text/event-stream")
    return JSONResponse(await gen.collect())


@router.post("/v1/completions")
async def completions(request: Request):
    state = request.app.state
    req = parse(CompletionRequest, await state.read_json(request))
    model = _model_name(request, req.model)
    if req.suffix is not None or req.echo:
        raise bad_request("suffix and echo are not supported", param="suffix" if req.suffix is not None else "echo")
    prompts = req.prompt
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise bad_request("prompt must not be empty", param="prompt")
    tok = state.engine.engine.tokenizer
    gen = Generation(state.engine, new_id("cmpl"), model,
                     CompletionFormat(tok, req.logprobs, req.return_token_ids))
    for p in prompts:
        ids = tok.encode(p) if isinstance(p, str) else list(p)
        if not ids:
            raise bad_request("prompt must not be empty", param="prompt")
        max_tokens = check_length(len(ids), req.max_tokens, state.max_model_len, DEFAULT_COMPLETION_MAX_TOKENS)
        gen.add_prompt(ids, sampling_params(req, max_tokens, req.logprobs))
    opts = req.stream_options
    return await _respond(request, gen, req.stream, bool(opts and opts.include_usage))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    state = request.app.state
    req = parse(ChatRequest, await state.read_json(request))
    model = _model_name(request, req.model)
    if not req.messages:
        raise bad_request("messages must not be empty", param="messages")
    kwargs = req.chat_template_kwargs or {}
    thinking = kwargs.get("thinking", kwargs.get("enable_thinking", False))
    effort = kwargs.get("reasoning_effort", req.reasoning_effort)
    if not isinstance(thinking, bool):
        raise bad_request("chat_template_kwargs.thinking must be a bool", param="chat_template_kwargs")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")
    tok = state.engine.engine.tokenizer
    try:  # the encoder validates roles, contents and tool calls; whatever it rejects is the client's input
        ids = tok.apply_chat(req.messages, thinking=thinking, reasoning_effort=effort, tools=req.tools)
    except Exception as e:  # noqa: BLE001 - any failure here comes from the messages
        raise bad_request(f"invalid messages: {e}", param="messages") from None
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    try:
        max_tokens = check_length(len(ids), asked, state.max_model_len, None)
    except APIError as e:
        e.param = e.param if e.param != "max_tokens" else param
        raise
    num = (req.top_logprobs or 0) if req.logprobs else None
    gen = Generation(state.engine, new_id("chatcmpl"), model, ChatFormat(tok, num, thinking, req.return_token_ids))
    gen.add_prompt(ids, sampling_params(req, max_tokens, num))
    opts = req.stream_options
    return await _respond(request, gen, req.stream, bool(opts and opts.include_usage))
