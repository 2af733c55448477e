"""What the engine hands back, shaped as vLLM users expect (`out.outputs[0].token_ids`, `.text`,
`.finish_reason`, `.logprobs` = one dict per generated token: token id -> `Logprob`). What an output holds
depends on its request's `SamplingParams.output_kind`: everything so far (CUMULATIVE, the default), what is
new since the request's last output (DELTA), or the whole result once, at the end (FINAL_ONLY).

Must not: compute anything; values come from the sampler's output for the very logits that were sampled.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)  # not frozen: a frozen init costs 3x (the engine makes 1 + k of these per token)
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token: chosen + top alternatives
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # first entry None (no context)
    finished: bool = False
    error: str | None = None
    # whatever the output kind carries (sampling.RequestOutputKind): the request's generated tokens so far,
    # and when its first token reached the host (time.monotonic()), for usage and latency metrics
    num_output_tokens: int = 0
    first_token_time: float | None = None
