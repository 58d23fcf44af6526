"""Output text of one choice as the server sends it: decoded incrementally from token ids, cut before a stop
string (the OpenAI API returns the text *before* the stop sequence; the engine's output ids keep the token that
completed it), and never split inside a multi-byte character; and each token's own text for its log-probability.

Boundary: tokenizer decoding and string handling only; which tokens exist and when a request stops are the
engine's (``sampling.finish_reason``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

_INCOMPLETE = "\ufffd"  # what a byte-level decoder shows for a character whose bytes have not all arrived


class ChoiceText:
    """Text of one choice so far. ``add(ids)`` returns the text that became safe to send; ``finish()`` the rest.

    Text is held back while it could still be the start of a stop string, or while it ends in an incomplete
    character. Each call decodes the whole output again (a prefix of ids can decode differently from the whole,
    e.g. a split character), which is quadratic in the output length but cheap next to a forward.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.token_ids: list[int] = []
        self.sent = 0  # characters already returned

    def text(self) -> str:
        """All text so far, cut before the first stop string."""
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cuts = [text.find(stop) for stop in self.stop if stop in text]
        return text[: min(cuts)] if cuts else text

    def add(self, token_ids: Sequence[int]) -> str:
        self.token_ids += token_ids
        text = self.text()
        safe = len(text) - self._held_back(text)
        return self._advance(text[:safe])

    def finish(self) -> str:
        return self._advance(self.text())

    def _advance(self, text: str) -> str:
        delta = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return delta

    def _held_back(self, text: str) -> int:
        """Characters at the end of ``text`` that may change: an incomplete character, or a prefix of a stop."""
        if text.endswith(_INCOMPLETE):
            return len(text) - len(text.rstrip(_INCOMPLETE))
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest


@dataclass(frozen=True)
class DecodedLogprob:
    """One output token's log-probability with its text (``tokenizer.decode([id])``), its character offset in
    the choice's decoded tokens, and its alternatives' texts."""

    text: str
    logprob: float | None  # None: the prompt's first token (nothing before it)
    top: tuple[tuple[str, float], ...]
    offset: int


class ChoiceLogprobs:
    """Texts of one choice's ``TokenLogprob``s as they arrive; ``offset`` runs over the tokens' own texts."""

    def __init__(self, tokenizer):
        self.tokenizer, self.offset = tokenizer, 0

    def add(self, logprobs: Sequence) -> list[DecodedLogprob]:
        decoded = []
        for entry in logprobs:
            text = self._text(entry.token_id)
            top = tuple((self._text(token), value) for token, value in entry.top)
            decoded.append(DecodedLogprob(text, entry.logprob, top, self.offset))
            self.offset += len(text)
        return decoded

    def add_prompt(self, prompt_ids: Sequence[int], logprobs: Sequence) -> list[DecodedLogprob]:
        """The echoed prompt's entries: ``logprobs`` per prompt token, None for the first."""
        decoded = []
        for token_id, entry in zip(prompt_ids, logprobs):
            if entry is None:
                text = self._text(token_id)
                decoded.append(DecodedLogprob(text, None, (), self.offset))
                self.offset += len(text)
            else:
                decoded += self.add([entry])
        return decoded

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
