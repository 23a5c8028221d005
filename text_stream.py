"""Text of generated tokens, released as it comes: for the server's streamed responses and the
CLI's printed answer.

A byte-level tokenizer (GPT-2's, Llama 3's, Qwen's) can split one character across tokens:
decoded alone, the first part is U+FFFD, which the next token turns into the character. So the
text after a token is released only up to any U+FFFD it ends with, which waits for the next
token; at the end of a completion the whole decoded text is released, an incomplete last
character as the tokenizer decodes it, as transformers' ``TextIteratorStreamer.end`` does.
"""

from __future__ import annotations

import sys
from typing import Callable, Sequence

REPLACEMENT = "\ufffd"  # what a tokenizer decodes an incomplete character's bytes to


class TextStream:
    """Text of the tokens generated so far, released in deltas: an incomplete character and a
    tail that may begin a stop string are held back; a stop string ends the text before it.

    ``context``: token ids decoded before the generated ones (a prompt), whose text is not
    released: a tokenizer can decode a token otherwise after them than alone (a leading space)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = (), context: Sequence[int] = ()):
        self.decode, self.stop = decode, stop
        self.context = [int(t) for t in context]
        self.skip = len(decode(self.context)) if self.context else 0  # characters of the context's text
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters released
        self.stopped = False  # a stop string ended the text

    def _decoded(self) -> str:
        return self.decode(self.context + self.ids)[self.skip :]

    def push(self, token: int) -> tuple[str, bool]:
        """(text to release, whether a stop string ended the completion)."""
        self.ids.append(int(token))
        return self._release(self._decoded().rstrip(REPLACEMENT), final=False)

    def rest(self) -> str:
        """What was held back, released at the end of a completion no stop string ended: the
        whole decoded text, with any incomplete last character."""
        return self._release(self._decoded() if self.ids else "", final=True)[0]

    def _release(self, text: str, final: bool) -> tuple[str, bool]:
        self.text = text
        hits = [i for i in (text.find(s, max(0, self.sent - len(s))) for s in self.stop) if i >= 0]
        if hits:
            end = max(min(hits), self.sent)
            delta, self.sent = text[self.sent : end], end
            self.text = text[:end]
            self.stopped = True
            return delta, True
        hold = 0 if final else max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        upto = max(self.sent, len(text) - hold)
        delta, self.sent = text[self.sent : upto], upto
        return delta, False


class TokenPrinter:
    """An ``on_token`` callback that writes each token's text to ``stream`` as it comes: what
    it adds to the decoded ``prompt_ids`` with ``decode`` (a tokenizer's), else its id; call
    ``finish`` after the last token for any text held back."""

    def __init__(self, decode: Callable[[list[int]], str] | None = None, prompt_ids: Sequence[int] = (), stream=None):
        self.stream = stream or sys.stdout
        self.text = TextStream(decode, context=prompt_ids) if decode is not None else None

    def __call__(self, token: int) -> None:
        self.stream.write(f"{token} " if self.text is None else self.text.push(token)[0])
        self.stream.flush()

    def finish(self) -> None:
        if self.text is not None:
            self.stream.write(self.text.rest())
            self.stream.flush()
