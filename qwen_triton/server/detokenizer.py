"""Generated ids to text, one id at a time, as a stream must release it: `IncrementalDetokenizer`.

Two things are held back until they are decided:
- an incomplete UTF-8 character at the end of the bytes so far (a character split across tokens), which the
  tokenizer's StreamDecoder keeps;
- the end of the text that could still be the start of a stop string: released only once the next text shows
  it is not one. When a stop string appears, the text before it is the last released.

So the pieces released, concatenated, are exactly the text of the whole generation cut before its first stop
string, however the ids arrive: a streamed response and an unstreamed one carry the same text.
"""

from __future__ import annotations

from collections.abc import Sequence


class IncrementalDetokenizer:
    """The text of one sequence's generated ids. `feed(id)` returns the text that id releases ("" while it is
    held back); after a stop string, `stopped` is True and feeding ends. `finish()` releases what is held back
    at the end (an incomplete character becomes U+FFFD). Ids past the tokenizer's vocabulary (the embedding's
    padding rows) and special tokens have no text."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self._decoder = tokenizer.stream(skip_special_tokens=True)
        self._vocab_size = tokenizer.vocab_size
        self.stops = [s for s in stop if s]
        self._longest_stop = max((len(s) for s in self.stops), default=0)
        self._held = ""  # decoded text not yet released: it may begin a stop string
        self.text = ""  # released so far
        self.stopped = False

    @property
    def offset(self) -> int:
        """Characters decoded so far, held back or released: where the next id's text begins."""
        return len(self.text) + len(self._held)

    def feed(self, token_id: int) -> str:
        if self.stopped:
            return ""
        piece = self._decoder.feed(token_id) if 0 <= token_id < self._vocab_size else ""
        return self._release(self._held + piece)

    def finish(self) -> str:
        """Release what is held back; the text is then complete."""
        if self.stopped:
            return ""
        rest = self._release(self._held + self._decoder.flush())
        rest += self._held
        self.text += self._held
        self._held = ""
        return rest

    def _release(self, pending: str) -> str:
        """Release the part of `pending` (the held text and the new piece) that cannot begin a stop string."""
        if not self.stops:
            self.text += pending
            self._held = ""
            return pending
        hits = [index for index in (pending.find(stop) for stop in self.stops) if index >= 0]
        if hits:
            released = pending[:min(hits)]
            self.stopped = True
            self._held = ""
            self.text += released
            return released
        keep = self._prefix_length(pending)
        released = pending[:len(pending) - keep]
        self._held = pending[len(pending) - keep:]
        self.text += released
        return released

    def _prefix_length(self, text: str) -> int:
        """The length of the longest end of `text` that is the start of a stop string."""
        for length in range(min(self._longest_stop - 1, len(text)), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self.stops):
                return length
        return 0
