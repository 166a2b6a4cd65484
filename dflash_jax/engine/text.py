"""Text from generated token ids, as a user prints it: decoded incrementally, so that a multi-byte
character split over tokens is released whole, and with spacing right across pieces."""
from __future__ import annotations

from typing import Sequence


class IncrementalDetokenizer:
    """Text deltas for a growing token sequence. A delta is released only once the text so far
    does not end in an incomplete UTF-8 sequence (a multi-byte character split over tokens), and
    it is cut from a decode that includes the previous tokens, so spacing stays right."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start for decoding (a clean boundary)
        self._read = 0  # tokens whose text has been released

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(int(i) for i in new_ids)
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (e.g. bytes of a character that never completed)."""
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return after[len(before):]
