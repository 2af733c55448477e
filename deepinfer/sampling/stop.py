"""`StopChecker`: when a request ends on a token (stop_token_ids, EOS unless ignore_eos) or on a stop
string in its incrementally detokenized text, and what text it may show.

Stop strings are matched on text, not tokens, because a stop string may span token boundaries
("lo Wo" in "Hel" + "lo W" + "orld"). After each new token the detokenizer passes the whole output text
and how many characters just arrived; only matches that end inside the new characters are searched for
(older ones were seen before), and the earliest such match wins. As vLLM does by default the stop string
is cut from the output (`include_stop_str_in_output` keeps it). While streaming, the last
len(longest stop) - 1 characters are held back, since they may be the start of a stop string.

Must not: detokenize (it takes text) or touch the scheduler (the engine calls Scheduler.finish).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from deepinfer.sampling.params import SamplingParams


@dataclass(frozen=True)
class StopMatch:
    stop: str  # the stop string that matched (the request's stop_reason)
    text: str  # the output text to keep (cut before the stop string, or after it when it is included)


class StopChecker:
    def __init__(self, stop: Iterable[str] = (), stop_token_ids: Iterable[int] = (),
                 include_stop_str_in_output: bool = False) -> None:
        self.stop = tuple(stop)
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        self.stop_token_ids = frozenset(stop_token_ids)
        self.include_stop_str_in_output = include_stop_str_in_output
        # how many characters before the new ones a match may start in (the longest stop string - 1): a
        # caller holding a long text passes `find` only its tail of lookback + new characters
        self.lookback = max((len(s) for s in self.stop), default=1) - 1
        self._hold_back = 0 if include_stop_str_in_output else self.lookback

    @classmethod
    def from_params(cls, params: SamplingParams, eos_token_id: int | None) -> StopChecker:
        return cls(params.stop, params.stop_token_set(eos_token_id), params.include_stop_str_in_output)

    def check_token(self, token_id: int) -> bool:
        """True when this sampled token ends the request (it stays in output_token_ids)."""
        return token_id in self.stop_token_ids

    def find(self, text: str, num_new_chars: int) -> tuple[int, str] | None:
        """(start, stop string) of the earliest stop string ending within the last `num_new_chars`
        characters of `text`, or None."""
        if num_new_chars <= 0 or not self.stop:
            return None
        best: tuple[int, str] | None = None
        for s in self.stop:
            # a match ending in the new chars starts at or after len(text) - num_new_chars - len(s) + 1
            begin = max(0, len(text) - num_new_chars - len(s) + 1)
            at = text.find(s, begin)
            if at != -1 and (best is None or at < best[0]):
                best = (at, s)
        return best

    def cut(self, start: int, stop: str) -> int:
        """Where the output text ends for a match of `stop` at `start` (after it when it is included)."""
        return start + len(stop) if self.include_stop_str_in_output else start

    def check_text(self, text: str, num_new_chars: int) -> StopMatch | None:
        """Look for a stop string ending within the last `num_new_chars` characters of `text`."""
        found = self.find(text, num_new_chars)
        if found is None:
            return None
        at, s = found
        return StopMatch(s, text[: self.cut(at, s)])

    def streamable_length(self, text: str, finished: bool) -> int:
        """How many leading characters of `text` are safe to send now (all of them once finished)."""
        return self.safe_length(len(text), finished)

    def safe_length(self, length: int, finished: bool) -> int:
        """`streamable_length` of a text of `length` characters."""
        return length if finished else max(0, length - self._hold_back)
