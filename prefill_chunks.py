"""Which prefill method takes the next part of a prompt.

A program's prefill methods take fixed chunks (the runtime plans their activations at load
and a fixed shape can be graphed). Each call streams every weight the budget does not hold
once, so where weights are streamed a prompt costs one weight pass per call, whatever the
chunk's length. A program can carry a second, longer prefill method: a long prompt then
takes a weight pass per ``long_prefill_chunk`` tokens instead of per ``prefill_chunk``,
while a short one still pays for a short chunk's compute and activations, not a long one's
padding. The long chunk's default, 512 tokens, is llama.cpp's default micro-batch.

``next_chunk`` is the one rule both generators follow (``hostswap.llm`` and
``hostswap.batching``): the shortest chunk that takes the rest of the prompt in one call,
else the longest; ``next_call`` places it in the cache, and ``prefill_calls`` lists a whole
prompt's.
"""

from __future__ import annotations

import dataclasses

import torch

PREFILL_LONG = "prefill_long"  # the long chunk's method, beside ``prefill``
DEFAULT_LONG_PREFILL_CHUNK = 512
AUTO = "auto"


class ChunkError(ValueError):
    """A prefill chunk length an export cannot take; the message names it."""


def long_prefill_chunk_for(asked, *, prefill_chunk: int, max_seq_len: int) -> int | None:
    """The long chunk an export writes: ``asked`` checked, or for ``"auto"`` 512 tokens where
    the cache holds that many and ``prefill_chunk`` is shorter; None: none. A shorter cache
    holds no prompt of more than a few short chunks, so it gets no long method to write,
    load and warm up (ask for one by its length)."""
    if asked is None:
        return None
    if isinstance(asked, str):
        if asked != AUTO:
            raise ChunkError(f"long_prefill_chunk must be a number of tokens, 'auto' or None, got {asked!r}")
        return DEFAULT_LONG_PREFILL_CHUNK if prefill_chunk < DEFAULT_LONG_PREFILL_CHUNK <= max_seq_len else None
    if isinstance(asked, bool) or not isinstance(asked, int) or asked < 1:
        raise ChunkError(f"long_prefill_chunk must be a positive int, 'auto' or None, got {asked!r}")
    if asked <= prefill_chunk:
        raise ChunkError(f"long_prefill_chunk={asked} is not longer than prefill_chunk={prefill_chunk}: give a longer one, or None (0 on the command line) for the short chunk alone")
    if asked > max_seq_len:
        raise ChunkError(f"long_prefill_chunk={asked} is longer than max_seq_len={max_seq_len}")
    return asked


def next_chunk(remaining: int, chunks: dict[str, int]) -> str:
    """The method (of ``chunks``: method -> tokens a call takes) that prefills the next part of a
    prompt with ``remaining`` tokens to go: the shortest chunk that takes them all in one call,
    else the longest. The fewest calls, so the fewest weight passes, and the least padding in
    the last."""
    if remaining < 1:
        raise ValueError(f"next_chunk: remaining must be positive, got {remaining}")
    fitting = sorted((length, method) for method, length in chunks.items())
    for length, method in fitting:
        if length >= remaining:
            return method
    return fitting[-1][1]


@dataclasses.dataclass(frozen=True)
class Call:
    """One prefill call: ``method`` on the ``tokens`` prompt tokens from position ``start``,
    padded to the method's chunk; its logits at row ``tokens - 1`` are the prompt's last token's
    once ``start + tokens`` is the prompt's length."""

    method: str
    start: int
    tokens: int

    @property
    def end(self) -> int:
        """The prompt position after the call's last token."""
        return self.start + self.tokens


def next_call(position: int, prompt: int, chunks: dict[str, int], max_seq_len: int) -> Call:
    """The call that prefills a ``prompt``-token prompt from ``position`` into a cache of
    ``max_seq_len`` positions: ``next_chunk``'s method from ``position``, or, where that chunk
    would run past the cache, from the position at which it ends at the cache's last one.

    Such a call takes again the last tokens the cache already holds: they are written again
    at their own positions, from the same tokens before them, so they are the same keys and
    values, up to the rounding of a matmul of another shape. That is one call for the rest of
    the prompt, where the chunks that fit the room left could leave a tail no chunk fits,
    which would take a weight pass per token. It is always the prompt's last call: it ends at
    the cache's end, and a prompt leaves a position for a new token."""
    if not 0 <= position < prompt < max_seq_len:
        raise ValueError(f"next_call: a prompt of {prompt} tokens, from {position}, does not fit a cache of {max_seq_len} with a new token")
    method = next_chunk(prompt - position, chunks)
    chunk = chunks[method]
    if chunk > max_seq_len:
        raise ValueError(f"next_call: the {method} chunk of {chunk} tokens is longer than the cache of {max_seq_len}")
    start = min(position, max_seq_len - chunk)
    return Call(method, start, min(start + chunk, prompt) - start)


def padded(piece: torch.Tensor, chunk: int) -> torch.Tensor:
    """A call's prompt tokens ``piece`` [1, n] padded to its method's ``chunk`` by repeating the
    last: the padding's keys land after the prompt, masked, then overwritten by decode."""
    n = piece.shape[1]
    return piece if n == chunk else torch.cat([piece, piece[:, -1:].expand(1, chunk - n)], dim=1)


def prefill_calls(prompt: int, chunks: dict[str, int], max_seq_len: int) -> list[Call]:
    """The calls that prefill a ``prompt``-token prompt into a cache of ``max_seq_len``
    positions, by ``next_call``."""
    calls = [next_call(0, prompt, chunks, max_seq_len)]
    while calls[-1].end < prompt:
        calls.append(next_call(calls[-1].end, prompt, chunks, max_seq_len))
    return calls
