"""The part of /v1/completions and /v1/chat/completions that is the same for both: fan a request out into
engine requests (prompts x n choices), then either wait for all of them or stream their deltas as SSE.

Route modules give a `Formatter` that turns one choice's progress into the endpoint's JSON shape.
Streaming text is held back by (longest stop string - 1) characters so a stop string that is completed
by a later token is never half sent (the engine trims it from the final text).
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from deepinfer.engine.outputs import CompletionOutput, RequestOutput
from deepinfer.sampling import SamplingParams
from deepinfer.server.async_engine import AsyncEngine
from deepinfer.server.errors import APIError, bad_request


@dataclass
class Choice:
    """Progress of one choice (one engine request) as far as it was sent to the client."""
    index: int
    prompt_len: int
    params: SamplingParams
    hold_back: int
    sent_chars: int = 0
    sent_tokens: int = 0
    output: CompletionOutput | None = None
    finished: bool = False
    state: dict = field(default_factory=dict)  # per-formatter scratch (the reasoning splitter)


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
            hold = max((len(s) for s in p.stop), default=1) - 1
            self.choices[rid] = Choice(len(self.items), len(prompt_ids), p, hold)
            self.items.append((rid, prompt_ids, p))

    async def start(self) -> None:
        try:
            self.queue = await self.engine.add(self.items)
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
            c = self.choices[out.request_id]
            c.output, c.finished = out.outputs[0], out.finished
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
        o = c.output
        text = o.text if o is not None else ""
        upto = len(text) if c.finished else max(c.sent_chars, len(text) - c.hold_back)
        ntok = len(o.token_ids) if o is not None else 0
        if upto == c.sent_chars and ntok == c.sent_tokens and not c.finished:
            return []
        parts = self.fmt.deltas(c, text[c.sent_chars:upto], c.sent_tokens, ntok)
        c.sent_chars, c.sent_tokens = upto, ntok
        return parts


def finish_reason(c: Choice) -> str | None:
    if c.state.get("abort"):
        return "abort"
    return c.output.finish_reason if c.output is not None and c.finished else None


def top_entries(entry: dict, chosen: int, num: int) -> tuple[float, list[tuple[int, float]]]:
    """(chosen token's logprob, the top `num` (id, logprob) by rank) from one engine logprobs entry."""
    top = sorted(((t, lp) for t, lp in entry.items() if lp.rank <= num), key=lambda x: x[1].rank)[:num]
    return entry[chosen].logprob, [(t, lp.logprob) for t, lp in top]
