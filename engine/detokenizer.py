"""Incremental detokenization: a sequence's text, decoded as its tokens arrive, equal to
decoding all of them at once, at a cost per token that does not grow with the text.

Each update decodes a window: the new tokens after those of the update before (from its first
token a decode does not skip), which are context: a token is written differently at the start
of a text (Metaspace drops its space, WordPiece joins with one) and byte-level tokens split
characters. A window that ends inside a UTF-8 character waits for the next token.
"""
from __future__ import annotations

from engine.tokenizer import Tokenizer


class Detokenizer:
    def __init__(self, tok: Tokenizer, start: int):
        """Decodes token_ids[start:]."""
        self.tok = tok
        self.prefix = self.read = start     # token_ids[prefix:read]: context, decoded as prefix_text
        self.prefix_text = ""

    def update(self, token_ids: list[int], final: bool = False) -> str:
        """The text that the tokens since the last update complete. `final`: the sequence
        ends here, so an incomplete character is written as a whole decode writes it."""
        text = self.tok.decode(token_ids[self.prefix:])
        if text.endswith("\ufffd") and not final:
            return ""
        new = text[len(self.prefix_text):]
        for i in range(self.read, len(token_ids)):
            if token_ids[i] not in self.tok.special_ids:
                self.prefix = i
                break
        self.read = len(token_ids)
        self.prefix_text = self.tok.decode(token_ids[self.prefix:self.read])
        return new
