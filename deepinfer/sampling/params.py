"""`SamplingParams`: how one request turns logits into tokens and when it stops. Frozen; every bad value
raises `ValueError` naming the field, so the server can answer 400 for that request alone.

Field meanings follow vLLM/OpenAI: temperature 0 = greedy; top_k -1 or 0 = off; top_p 1 = off;
min_p 0 = off; logprobs = number of top logprobs to return besides the chosen token (0 = chosen only);
prompt_logprobs likewise for prompt positions.

Must not: touch tensors (building generators is the sampler's job).
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs
GREEDY_EPS = 1e-5  # temperatures below this are greedy (dividing by them overflows fp32 logits)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class RequestOutputKind(enum.IntEnum):
    """What each of a request's outputs carries (vLLM's names and meanings).

    CUMULATIVE: everything so far (text, token ids, logprobs) at every step: a copy that grows with the output,
    per request and step (a 32K-token output at batch 128 costs tens of ms of host time a step in copies).
    DELTA: only what is new since the request's last output; the server's streaming form.
    Both hold the text's last (longest stop string - 1) characters back until the request ends or they are
    safe, so no output shows text a stop string completed by a later token cuts away.
    FINAL_ONLY: one output, when the request finishes; the offline `LLM.generate` and non-streaming form.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    stop: tuple[str, ...] | list[str] | str | None = None  # normalised to a tuple of non-empty strings
    stop_token_ids: tuple[int, ...] | list[int] | None = None  # normalised to a tuple
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or a positive int, got {self.top_k!r}")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {value!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(f"include_stop_str_in_output must be a bool, got {self.include_stop_str_in_output!r}")
        try:
            if isinstance(self.output_kind, bool):
                raise ValueError
            kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise ValueError(f"output_kind must be a RequestOutputKind (CUMULATIVE, DELTA, FINAL_ONLY), "
                             f"got {self.output_kind!r}") from None
        # frozen: normalise through object.__setattr__ so the stored value is hashable and uniform
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        ids = tuple(self.stop_token_ids or ())
        if any(not _is_int(t) or t < 0 for t in ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", ids)
        object.__setattr__(self, "output_kind", kind)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def top_k_or_off(self) -> int:
        """top_k with both spellings of "off" (-1, 0) mapped to 0."""
        return max(self.top_k, 0)

    def stop_token_set(self, eos_token_id: int | None) -> frozenset[int]:
        """Token ids that end the request: stop_token_ids, plus EOS unless ignore_eos (the scheduler's set)."""
        ids = set(self.stop_token_ids)
        if eos_token_id is not None and not self.ignore_eos:
            ids.add(eos_token_id)
        return frozenset(ids)
