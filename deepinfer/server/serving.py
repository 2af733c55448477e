"""The part of /v1/completions and /v1/chat/completions that is the same for both: fan a request out into
engine requests (prompts x n choices), then either wait for all of them or stream their deltas as SSE.

Route modules give a `Formatter` that turns one choice's progress into the endpoint's JSON shape.
A streaming request asks the engine for DELTA outputs (what is new each step; the engine holds text back by
the longest stop string - 1 characters, so a stop string completed by a later token is never half sent),
a non-streaming one for FINAL_ONLY (one output at the end): neither copies the whole output each step,
which a long generation would pay for at every token.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Protocol

from deepinfer.engine.outputs import CompletionOutput, RequestOutput
from deepinfer.sampling import RequestOutputKind, SamplingParams
from deepinfer.server.async_engine import AsyncEngine
from deepinfer.server.errors import APIError, bad_request


@dataclass
class Choice:
    """Progress of one choice (one engine request) as far as it was sent to the client."""
    index: int
    prompt_len: int
    params: SamplingParams
    sent_chars: int = 0
    sent_tokens: int = 0
    # a non-streaming choice: the engine's final output; a streaming one: the deltas so far merged (token
    # ids and logprobs appended; the text is not kept, only what is still to send)
    output: CompletionOutput | None = None
    unsent_text: str = ""
    finished: bool = False
    state: dict = field(default_factory=dict)  # per-formatter scratch (the reasoning splitter)

    def absorb(self, new: CompletionOutput, finished: bool, delta: bool) -> None:
        """Take one engine output of this choice (a DELTA output when streaming, else the final one)."""
        self.finished = finished
        if not delta:
            self.output = new
            return
        if self.output is None:
            self.output = CompletionOutput(self.index, token_ids=[],
                                           logprobs=[] if new.logprobs is not None else None)
        merged = self.output
        merged.token_ids.extend(new.token_ids)
        if new.logprobs is not None and merged.logprobs is not None:
            merged.logprobs.extend(new.logprobs)
        merged.cumulative_logprob, merged.finish_reason, merged.stop_reason = \
            new.cumulative_logprob, new.finish_reason, new.stop_reason
        self.unsent_text += new.text


class Formatter(Protocol):
    object_name: str
    chunk_object_name: str

    def choice(self, c: Choice) -> dict: ...                                   # non-streaming choice
    def deltas(self, c: Choice, text: str, first: int, last: int) -> list[dict]: ...  # streaming choices


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


class Generation:
    def __init__(self, engine: AsyncEngine, request_id: str, model: str, fmt: Formatter) -> None:
        self.engine, self.id, self.model, self.fmt = engine, request_id, model, fmt
        self.created = int(time.time())
        self.items: list[tuple[str, list[int], SamplingParams]] = []
        self.choices: dict[str, Choice] = {}
        self.prompt_tokens = 0

    def add_prompt(self, prompt_ids: list[int], params: list[SamplingParams]) -> None:
        self.prompt_tokens += len(prompt_ids)
        for p in params:
            rid = f"{self.id}-{len(self.items)}"
            self.choices[rid] = Choice(len(self.items), len(prompt_ids), p)
            self.items.append((rid, prompt_ids, p))

    async def start(self, stream: bool) -> None:
        self.streaming = stream
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        items = [(rid, ids, replace(p, output_kind=kind)) for rid, ids, p in self.items]
        try:
            self.queue = await self.engine.add(items)
        except ValueError as e:  # the engine's own validation (token ids out of range, ...)
            raise bad_request(str(e)) from None

    def usage(self) -> dict:
        done = sum(len(c.output.token_ids) for c in self.choices.values() if c.output is not None)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done}

    def _unfinished(self) -> list[str]:
        return [rid for rid, c in self.choices.items() if not c.finished]

    async def _next(self) -> RequestOutput | None:
        out = await self.queue.get()
        if out is not None:
            self.choices[out.request_id].absorb(out.outputs[0], out.finished, self.streaming)
        return out

    async def collect(self) -> dict:
        """Non-streaming: every choice to its end, then one response body."""
        try:
            while self._unfinished():
                out = await self._next()
                if out is None:
                    raise APIError(503, "the request was aborted: the server is shutting down")
                if out.finished and out.error:
                    raise APIError(500, f"generation failed: {out.error}", code="engine_error")
        finally:
            self.engine.abort(self._unfinished())  # handler cancelled (client gone): free the blocks
        choices = [self.fmt.choice(c) for c in sorted(self.choices.values(), key=lambda c: c.index)]
        return {"id": self.id, "object": self.fmt.object_name, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        body = {"id": self.id, "object": self.fmt.chunk_object_name, "created": self.created, "model": self.model,
                "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    async def stream(self, include_usage: bool) -> AsyncIterator[str]:
        """SSE: a chunk per progress of a choice, the usage chunk when asked, then [DONE]. If the client goes
        away the response is cancelled and `finally` aborts what is left (its KV blocks are freed)."""
        try:
            while self._unfinished():
                out = await self._next()
                if out is None:  # shutdown aborted us: close every open choice cleanly
                    for c in self.choices.values():
                        if not c.finished:
                            c.finished = True
                            c.state["abort"] = True
                            yield sse(self._chunk(self._deltas(c)))
                    break
                c = self.choices[out.request_id]
                parts = self._deltas(c)
                if parts:
                    yield sse(self._chunk(parts))
            if include_usage:
                yield sse(self._chunk([], self.usage()))
            yield sse("[DONE]")
        finally:
            self.engine.abort(self._unfinished())

    def _deltas(self, c: Choice) -> list[dict]:
        text = c.unsent_text
        ntok = len(c.output.token_ids) if c.output is not None else 0
        if not text and ntok == c.sent_tokens and not c.finished:
            return []
        parts = self.fmt.deltas(c, text, c.sent_tokens, ntok)
        c.sent_chars, c.sent_tokens, c.unsent_text = c.sent_chars + len(text), ntok, ""
        return parts


def finish_reason(c: Choice) -> str | None:
    if c.state.get("abort"):
        return "abort"
    return c.output.finish_reason if c.output is not None and c.finished else None


def top_entries(entry: dict, chosen: int, num: int) -> tuple[float, list[tuple[int, float]]]:
    """(chosen token's logprob, the top `num` (id, logprob) by rank) from one engine logprobs entry."""
    top = sorted(((t, lp) for t, lp in entry.items() if lp.rank <= num), key=lambda x: x[1].rank)[:num]
    return entry[chosen].logprob, [(t, lp.logprob) for t, lp in top]
