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
else the longest, among those that fit the cache. ``prefill_calls`` lists a whole prompt's.
"""

from __future__ import annotations

import dataclasses

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
        raise ChunkError(f"long_prefill_chunk={asked} is not longer than prefill_chunk={prefill_chunk}: give a longer one, or None for the short chunk alone")
    if asked > max_seq_len:
        raise ChunkError(f"long_prefill_chunk={asked} is longer than max_seq_len={max_seq_len}")
    return asked


def next_chunk(remaining: int, room: int | None, chunks: dict[str, int]) -> str | None:
    """The method (of ``chunks``: method -> tokens a call takes) that prefills the next part of a
    prompt with ``remaining`` tokens to go and ``room`` positions left in the cache (None: a
    chunk may run past the cache, its padding's positions clamped into it).

    The shortest chunk that takes all ``remaining`` tokens, else the longest: the fewest calls,
    so the fewest weight passes, and the least padding in the last. None where no chunk fits
    the room (the caller takes the rest a token at a time)."""
    if remaining < 1:
        raise ValueError(f"next_chunk: remaining must be positive, got {remaining}")
    fitting = sorted((length, method) for method, length in chunks.items() if room is None or length <= room)
    if not fitting:
        return None
    for length, method in fitting:
        if length >= remaining:
            return method
    return fitting[-1][1]


@dataclasses.dataclass(frozen=True)
class Call:
    """One prefill call: ``method`` (None: one token through decode) on ``tokens`` prompt
    tokens from ``start``, padded to the method's chunk."""

    method: str | None
    start: int
    tokens: int


def prefill_calls(prompt: int, chunks: dict[str, int], max_seq_len: int) -> list[Call]:
    """The calls that prefill a ``prompt``-token prompt into a cache of ``max_seq_len``
    positions, by ``next_chunk``; where no chunk fits the room left, a token at a time."""
    calls, position = [], 0
    while position < prompt:
        method = next_chunk(prompt - position, max_seq_len - position, chunks)
        n = 1 if method is None else min(chunks[method], prompt - position)
        calls.append(Call(method, position, n))
        position += n
    return calls
