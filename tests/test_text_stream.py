"""Generated tokens' text, released as it comes: a character split across tokens is never
printed twice or lost, and the whole decoded text is what a completion gives."""

from __future__ import annotations

import io

from hostswap.text_stream import TextStream, TokenPrinter


def byte_level(ids: list[int]) -> str:
    """A byte-level tokenizer's decode: a token is one byte, an incomplete character U+FFFD."""
    return bytes(ids).decode("utf-8", errors="replace")


def tokens(text: str) -> list[int]:
    return list(text.encode())


def _pushed(stream: TextStream, ids: list[int]) -> list[str]:
    return [stream.push(t)[0] for t in ids]


def test_a_character_split_across_tokens_is_released_once_whole():
    text = "I like 日本 and 😀!"
    stream = TextStream(byte_level)
    deltas = _pushed(stream, tokens(text))
    assert "".join(deltas) + stream.rest() == text
    assert not any("\ufffd" in d for d in deltas)


def test_the_end_releases_the_whole_decoded_text_with_an_incomplete_last_character():
    """One token of a space and half an emoji: the space comes out at once, the half at the end
    as the tokenizer decodes it (nothing the usage counts is dropped)."""
    ids = tokens(" ") + tokens("😀")[:2]
    stream = TextStream(byte_level)
    assert _pushed(stream, ids) == [" ", "", ""]
    assert stream.rest() == "\ufffd"
    assert " \ufffd" == byte_level(ids)


def test_a_stop_string_split_across_tokens_ends_the_text_before_it():
    stream = TextStream(byte_level, stop=("STOP",))
    released, stopped = "", False
    for t in tokens("abc STxSTOP more"):
        delta, stopped = stream.push(t)
        released += delta
        if stopped:
            break
    assert stopped and released == "abc STx"


def test_a_stop_string_held_back_at_the_end_is_released_when_no_stop_came():
    stream = TextStream(byte_level, stop=("STOP",))
    assert "".join(_pushed(stream, tokens("abc ST"))) == "abc "
    assert stream.rest() == "ST"


def test_the_printer_writes_the_prompt_s_continuation_once():
    """The command line's answer, a multibyte character split across tokens: each character
    once, after the prompt the command printed itself."""
    prompt, answer = "Emojis: 😀 😃", " 😄 日本 😁"
    out = io.StringIO()
    printer = TokenPrinter(byte_level, tokens(prompt), stream=out)
    for t in tokens(answer):
        printer(t)
    printer.finish()
    assert out.getvalue() == answer


def test_the_printer_takes_the_text_a_token_adds_after_the_prompt():
    """A tokenizer that drops a leading space when a text starts with it (as SentencePiece's
    does): the answer's first word keeps its space after the prompt."""
    words = {1: " Hello", 2: " world", 3: "!"}
    decode = lambda ids: "".join(words[i] for i in ids).lstrip()  # noqa: E731
    out = io.StringIO()
    printer = TokenPrinter(decode, [1], stream=out)
    printer(2)
    printer(3)
    printer.finish()
    assert out.getvalue() == " world!"


def test_without_a_tokenizer_the_printer_writes_ids():
    out = io.StringIO()
    printer = TokenPrinter(None, [1, 2], stream=out)
    printer(7)
    printer(8)
    printer.finish()
    assert out.getvalue() == "7 8 "


def test_a_stop_string_the_end_completes_ends_the_text_there():
    """A stop string ending in U+FFFD is whole only in the end's text: it still ends the text,
    and the stream says so (the server then reports finish_reason "stop")."""
    stream = TextStream(byte_level, stop=("x\ufffd",))
    assert "".join(_pushed(stream, tokens("ab x") + tokens("😀")[:2])) == "ab "
    assert not stream.stopped
    assert stream.rest() == "" and stream.stopped
