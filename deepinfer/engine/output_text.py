"""`OutputText`: a request's generated text, grown one detokenized delta at a time without copying what came
before it.

Why not a `str` with `+=`: CPython appends in place only to a string nothing else holds (and never through an
attribute), so every token copied the request's whole text, and a cumulative output holding the previous
text forced the copy anyway: at batch 128 and 32K-token outputs (V4's thinking traces) that was ~12 ms a
step of text copies, beside the outputs' list copies (BENCHMARKS.md, the seventeenth session's section at
the top of the engine's step). Here an append is a list append; the
stop-string check and a streaming delta read only the tail they need (`since`), and the whole text is
joined only when an output asks for it (`value`, once per step for a CUMULATIVE output, once at the end
otherwise).

Must not: detokenize or know stop strings (the engine and `StopChecker` do).
"""
from __future__ import annotations


_CHUNK = 64  # small parts joined into one: a 32K-token text is ~500 strings, not 32K (~55 bytes each)


class OutputText:
    __slots__ = ("_parts", "_length", "_loose")

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._length = 0
        self._loose = 0  # appended parts at the end not yet joined into a chunk

    def __len__(self) -> int:
        return self._length

    def append(self, delta: str) -> None:
        if delta:
            self._parts.append(delta)
            self._length += len(delta)
            self._loose += 1
            if self._loose == _CHUNK:  # join the last _CHUNK parts: O(1) per append on average
                self._parts[-_CHUNK:] = ["".join(self._parts[-_CHUNK:])]
                self._loose = 0

    def since(self, start: int) -> str:
        """text[start:] (start clamped to [0, len]): walks back over the parts it needs, slicing only the first."""
        need = self._length - max(start, 0)
        if need <= 0:
            return ""
        parts, i, have = self._parts, len(self._parts), 0
        while have < need:
            i -= 1
            have += len(parts[i])
        head = parts[i][have - need:]  # the needed suffix of the first part (the whole part if have == need)
        return head + "".join(parts[i + 1:]) if i + 1 < len(parts) else head

    def value(self) -> str:
        """The whole text; joined once and kept as one part, so asking again before the next append is free."""
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
            self._loose = 0
        return self._parts[0] if self._parts else ""

    def truncate(self, length: int) -> None:
        """Keep the first `length` characters (a stop string's cut: the request ends there)."""
        if length < self._length:
            kept = self.value()[:max(length, 0)]
            self._parts[:] = [kept] if kept else []
            self._length, self._loose = len(kept), 0
