"""Split a V4 thinking-mode completion into `reasoning_content` and `content` at `</think>`, also
incrementally: a delta that ends in part of `</think>` is held back until the next delta decides it.

In chat (non-thinking) mode the prompt already ends in `</think>`, so everything is content.
"""
from __future__ import annotations

from deepinfer.chat_encoding import THINK_END


class ReasoningSplitter:
    def __init__(self, thinking: bool) -> None:
        self.in_reasoning = thinking
        self._held = ""

    def feed(self, delta: str) -> tuple[str, str]:
        """-> (reasoning delta, content delta)."""
        if not self.in_reasoning:
            return "", delta
        text = self._held + delta
        at = text.find(THINK_END)
        if at != -1:
            self.in_reasoning, self._held = False, ""
            return text[:at], text[at + len(THINK_END):]
        keep = 0  # longest suffix of text that is a prefix of </think>
        for k in range(min(len(THINK_END) - 1, len(text)), 0, -1):
            if THINK_END.startswith(text[-k:]):
                keep = k
                break
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], ""

    def flush(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        return (held, "") if self.in_reasoning else ("", held)


def split(text: str, thinking: bool) -> tuple[str | None, str]:
    """Whole-text form: (reasoning_content or None, content)."""
    if not thinking:
        return None, text
    reasoning, sep, content = text.partition(THINK_END)
    return reasoning, content if sep else ""
