"""Token ids -> text deltas, with stop strings.

Detokenizing one token at a time is wrong for byte-level BPE (a character can span tokens) and
for tokenizers that merge spaces, so we decode a short window of recent tokens and emit what
grew, holding back a trailing U+FFFD (an incomplete UTF-8 sequence). Stop strings are searched
in the accumulated text; while streaming, text that could be the start of a stop string is held
back until it is clear that it is not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class TextDelta:
    text: str
    stopped: bool  # a stop string was found; `text` ends right before it


@dataclass(slots=True)
class TextAssembler:
    tokenizer: Any
    stop: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    text: str = ""  # all text decoded so far (stop strings not yet cut)
    emitted: int = 0  # characters of `text` already handed out
    _prefix_offset: int = 0
    _read_offset: int = 0

    def push(self, token_id: int) -> TextDelta:
        self.ids.append(token_id)
        self.text += self._decode_new()
        if self.stop:
            cut = self._find_stop()
            if cut is not None:
                delta = self.text[self.emitted : cut]
                self.text = self.text[:cut]
                self.emitted = cut
                return TextDelta(delta, True)
        safe_end = len(self.text) - self._held_back()
        delta = self.text[self.emitted : safe_end]
        self.emitted = max(self.emitted, safe_end)
        return TextDelta(delta, False)

    def flush(self) -> str:
        """Everything not yet handed out, once generation is over without hitting a stop
        string: the held-back tail, and tokens still waiting to complete a character (they
        decode to U+FFFD, as a one-shot decode of the whole answer would)."""
        self.text += self._decode_new(final=True)
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta

    def _decode_new(self, final: bool = False) -> str:
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        after: str = decode(self.ids[self._prefix_offset :], skip_special_tokens=True)
        if (after.endswith("\ufffd") and not final) or len(after) <= len(before):
            # Incomplete character (or nothing visible yet): wait for more tokens.
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        return after[len(before) :]

    def _find_stop(self) -> int | None:
        # Only the region that could contain a new match needs searching.
        longest = max(len(s) for s in self.stop)
        start = max(0, self.emitted - longest)
        hits = [i for s in self.stop if (i := self.text.find(s, start)) != -1]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best
