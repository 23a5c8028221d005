"""A program's second, longer prefill method: which chunk takes each part of a prompt, what an
export writes, and that generation with it gives transformers' tokens."""

from __future__ import annotations

import argparse
import os

import pytest
import torch

import hostswap
import hostswap.llm as llm
from hostswap import batching
from hostswap.prefill_chunks import PREFILL_LONG, next_chunk, prefill_calls

from real_models import BY_NAME, VOCAB, build
from test_experts import MOE
from test_generation import transformers_greedy

MAX_SEQ_LEN, CHUNK, LONG = 48, 4, 16
CHUNKS = {llm.PREFILL: CHUNK, PREFILL_LONG: LONG}


def _prompt(n: int, random_state: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(random_state))


# --- the rule ------------------------------------------------------------------------------
@pytest.mark.parametrize("remaining,method", [
    (1, llm.PREFILL),  # the short chunk holds it: no long chunk's padding
    (4, llm.PREFILL),
    (5, PREFILL_LONG),  # two short calls or one long: one weight pass
    (16, PREFILL_LONG),
    (40, PREFILL_LONG),  # more than the longest: the longest
])
def test_the_shortest_chunk_that_holds_the_rest_else_the_longest(remaining, method):
    assert next_chunk(remaining, CHUNKS) == method


def test_a_prompt_takes_one_call_per_long_chunk_and_a_short_one_for_a_short_tail():
    """prefill() with a recording step; the logits it returns are the last prompt token's."""
    calls = []

    def step(method, ids, position):
        calls.append((method, ids.shape[1], position))
        return torch.arange(ids.shape[1], dtype=torch.float32)[None, :, None].expand(1, ids.shape[1], 3) + position

    # 37 tokens: two long calls, then 5 more, which a short chunk cannot hold: a third long one
    last = llm.prefill(step, _prompt(37), CHUNKS, MAX_SEQ_LEN)
    assert calls == [(PREFILL_LONG, LONG, 0), (PREFILL_LONG, LONG, 16), (PREFILL_LONG, LONG, 32)]
    assert last.tolist() == [36.0] * 3  # the call at 32, its 5th row
    calls.clear()
    # 35 tokens: the last 3 in a short call
    llm.prefill(step, _prompt(35), CHUNKS, MAX_SEQ_LEN)
    assert calls == [(PREFILL_LONG, LONG, 0), (PREFILL_LONG, LONG, 16), (llm.PREFILL, CHUNK, 32)]


@pytest.mark.parametrize("prompt,cache,calls", [
    # a short call at 16 would run past a cache of 18: it starts at 14, taking 14 and 15 again
    (17, 18, [(PREFILL_LONG, 0, 16), (llm.PREFILL, 14, 3)]),
    (19, 20, [(PREFILL_LONG, 0, 16), (llm.PREFILL, 16, 3)]),  # ends at the cache's end: as it is
    # the 5 tokens after 16 need a long call, which ends at the cache's end from 6
    (21, 22, [(PREFILL_LONG, 0, 16), (PREFILL_LONG, 6, 15)]),
    (3, 4, [(llm.PREFILL, 0, 3)]),
])
def test_a_call_that_would_run_past_the_cache_starts_early_enough_to_end_at_it(prompt, cache, calls):
    """Never a tail that no chunk fits (it took a call per token: a weight pass each)."""
    assert [(c.method, c.start, c.tokens) for c in prefill_calls(prompt, CHUNKS, cache)] == calls
    recorded = []

    def step(method, ids, position):
        recorded.append((method, position))
        return torch.arange(position, position + ids.shape[1], dtype=torch.float32)[None, :, None]

    last = llm.prefill(step, _prompt(prompt), CHUNKS, cache)
    assert recorded == [(m, s) for m, s, _ in calls]
    assert last.tolist() == [prompt - 1.0]  # the logits of the prompt's last position


def test_a_prompt_that_leaves_no_room_for_a_new_token_is_refused():
    with pytest.raises(ValueError, match="a prompt of 18 tokens, from 0, does not fit a cache of 18 with a new token"):
        prefill_calls(18, CHUNKS, 18)


# --- what an export writes -----------------------------------------------------------------
@pytest.mark.parametrize("max_seq_len,chunk,expected", [(4096, None, 512), (512, None, 512), (511, None, None), (300, None, None), (128, None, None),
                                                        (4096, 512, None), (4096, 600, None), (4096, 256, 512)])
def test_auto_writes_512_where_the_cache_holds_it_and_the_short_chunk_is_shorter(max_seq_len, chunk, expected):
    chunk = llm.default_prefill_chunk(max_seq_len) if chunk is None else chunk
    assert llm.check_long_prefill_chunk("auto", prefill_chunk=chunk, max_seq_len=max_seq_len) == expected


@pytest.mark.parametrize("asked,message", [
    (4, r"long_prefill_chunk=4 is not longer than prefill_chunk=4"),
    (2, r"long_prefill_chunk=2 is not longer than prefill_chunk=4"),
    (64, r"long_prefill_chunk=64 is longer than max_seq_len=48"),
    (0, r"long_prefill_chunk must be a positive int, 'auto' or None, got 0"),
    (True, r"long_prefill_chunk must be a positive int, 'auto' or None, got True"),
    (16.0, r"long_prefill_chunk must be a positive int, 'auto' or None, got 16.0"),
    ("long", r"long_prefill_chunk must be a number of tokens, 'auto' or None, got 'long'"),
])
def test_a_bad_long_chunk_is_refused_by_name_before_anything_is_traced(tmp_path, asked, message):
    model = build(BY_NAME["Llama"])[0]
    with pytest.raises(llm.GenerationError, match=message):
        llm.export(model, tmp_path / "m", max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK, long_prefill_chunk=asked)
    with pytest.raises(llm.GenerationError, match=message):
        batching.export(model, tmp_path / "b", max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK, long_prefill_chunk=asked, max_batch_size=2)
    assert not os.listdir(tmp_path)


def test_the_cli_takes_a_number_auto_or_0_for_none():
    from hostswap.cli import _long_chunk

    assert _long_chunk("auto") == "auto" and _long_chunk("1024") == 1024 and _long_chunk("0") is None
    with pytest.raises(argparse.ArgumentTypeError, match="a number of tokens, 'auto' or 0 \\(none\\), got 'big'"):
        _long_chunk("big")


@pytest.mark.parametrize("batched", [False, True])
def test_a_program_that_names_a_long_chunk_without_its_method_is_refused_at_load(tmp_path, batched):
    model = build(BY_NAME["Llama"])[0]
    programs, constants = llm.export_programs(model, max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK, long_prefill_chunk=LONG,
                                              max_batch_size=2 if batched else None)
    del programs[PREFILL_LONG]
    pte, ptd = hostswap.save(programs, os.path.join(tmp_path, "m"), constant_methods=constants)
    with pytest.raises(llm.GenerationError, match=r"gives a long prefill chunk but has no method 'prefill_long' that reads weights"):
        (batching.BatchGenerator if batched else llm.Generator)(pte, ptd, device="cpu")


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("constant,value,message", [
    (llm.LONG_PREFILL_CHUNK, MAX_SEQ_LEN + 1, rf"gives long_prefill_chunk={MAX_SEQ_LEN + 1}, which a cache of max_seq_len={MAX_SEQ_LEN} positions cannot take"),
    (llm.PREFILL_CHUNK, 0, rf"gives prefill_chunk=0, which a cache of max_seq_len={MAX_SEQ_LEN} positions cannot take"),
])
def test_a_program_whose_chunk_the_cache_cannot_take_is_refused_at_load(tmp_path, batched, constant, value, message):
    """Export refuses such chunks; a program written otherwise is refused at load, not at its
    first prompt."""
    model = build(BY_NAME["Llama"])[0]
    programs, constants = llm.export_programs(model, max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK, long_prefill_chunk=LONG,
                                              max_batch_size=2 if batched else None)
    constants[constant] = value
    pte, ptd = hostswap.save(programs, os.path.join(tmp_path, "m"), constant_methods=constants)
    with pytest.raises(llm.GenerationError, match=message):
        (batching.BatchGenerator if batched else llm.Generator)(pte, ptd, device="cpu")


# --- generation with it ---------------------------------------------------------------------
class TwoChunkPrograms:
    """One model written twice: with the long chunk and with the short chunk alone."""

    def __init__(self, model, directory):
        self.model = model
        model.save_pretrained(directory)
        self.directory = directory
        self.pte, self.ptd = llm.export(model, os.path.join(directory, "long"), max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK, long_prefill_chunk=LONG)
        self.short_pte, self.short_ptd = llm.export(model, os.path.join(directory, "short"), max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK,
                                                    long_prefill_chunk=None)

    def transformers_tokens(self, prompt, new):
        from transformers import AutoModelForCausalLM

        return transformers_greedy(AutoModelForCausalLM.from_pretrained(self.directory).eval(), prompt, new, MAX_SEQ_LEN)


@pytest.fixture(scope="module", params=["Llama", "Qwen3-MoE"])
def two(request, tmp_path_factory):
    torch.manual_seed(0)
    model = build(BY_NAME["Llama"])[0] if request.param == "Llama" else MOE[request.param]().eval()
    return TwoChunkPrograms(model, tmp_path_factory.mktemp(request.param))


def _generate(pte, ptd, prompt, new) -> tuple[torch.Tensor, int, dict]:
    """Greedy tokens at the "auto" budget, the prefill calls they took, the prefill methods."""
    with llm.Generator(pte, ptd, device="cpu") as g:
        before = g.module.stats["forwards"]
        g.generate(_prompt(1), new, eos_token_id=[])  # one prefill call: the rest are decode's
        decode_calls = g.module.stats["forwards"] - before - 1
        before = g.module.stats["forwards"]
        out = g.generate(prompt, new, eos_token_id=[])
        return out, g.module.stats["forwards"] - before - decode_calls, g.prefill_chunks


@pytest.mark.parametrize("prompt_tokens,long_calls,short_calls", [(3, 1, 1), (9, 1, 3), (21, 2, 6), (37, 3, 10)])
def test_tokens_equal_transformers_and_the_short_chunk_alone(two, prompt_tokens, long_calls, short_calls):
    """Prompts of one short call, one long, two long and three long; each call is a forward
    of every weight (a weight pass where they are streamed)."""
    prompt = _prompt(prompt_tokens)
    expected = two.transformers_tokens(prompt, 6)
    out, calls, chunks = _generate(two.pte, two.ptd, prompt, 6)
    short_out, short, short_chunks = _generate(two.short_pte, two.short_ptd, prompt, 6)
    assert chunks == CHUNKS and short_chunks == {llm.PREFILL: CHUNK}
    assert torch.equal(out, expected), (out.tolist(), expected.tolist())
    assert torch.equal(short_out, expected)
    assert (calls, short) == (long_calls, short_calls)


def _windowed(name: str, window: int | None):
    model = build(BY_NAME[name])[0].eval()
    if window is not None:
        model.config.sliding_window = window
    return model


@pytest.mark.parametrize("name,window", [("Llama", None), ("Mistral", 4), ("Gemma3", 4)])
def test_a_last_call_past_the_cache_gives_transformers_logits_and_tokens(tmp_path, name, window):
    """Chunks of 4 and 16 and the longest prompt one new token allows. In a cache of 18, 17
    tokens take a long call and a short one from 14 (its padding at 17); in a cache of 22, 21
    tokens two long calls, the second from 6 (the room left after 16 takes a short call, not
    the 5 tokens: the chunks that fit it would leave one for decode). The prompt's last logits are transformers' (the
    tokens taken again are written as they were: wrong ones there move them by 0.07 or more),
    and so is the token. Sliding windows shorter than the prompt (Mistral; Gemma3 mixes
    sliding and full layers) read the same cache."""
    for cache in (18, 22):
        pte, ptd = llm.export(_windowed(name, window), tmp_path / f"m{cache}", max_seq_len=cache, prefill_chunk=CHUNK, long_prefill_chunk=LONG)
        prompt = _prompt(cache - 1, cache)
        with torch.no_grad():
            want = _windowed(name, window)(prompt).logits[0, -1]
        with llm.Generator(pte, ptd, device="cpu") as g:
            got = llm.prefill(g._step, prompt, g.prefill_chunks, g.max_seq_len)
            g.module.reset_state()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        expected = transformers_greedy(_windowed(name, window), prompt, 1, cache)
        out, calls, _ = _generate(pte, ptd, prompt, 1)
        assert torch.equal(out, expected), (cache, out.tolist(), expected.tolist())
        assert calls == 2


def test_a_batched_last_call_that_starts_early_beside_decoding_sequences_gives_transformers_tokens(tmp_path):
    """A 21-token prompt in a batched cache of 22 joins while another sequence decodes: its two
    calls (the second from 6) come between decode steps, which write every slot's row; its
    token, and the other sequence's, are transformers'. Mistral with a window of 4."""
    cache = 22
    pte, ptd = batching.export(_windowed("Mistral", 4), tmp_path / "b", max_seq_len=cache, max_batch_size=2, prefill_chunk=CHUNK, long_prefill_chunk=LONG)
    short, long = _prompt(5, 3)[0].tolist(), _prompt(cache - 1, 4)[0].tolist()
    with batching.BatchGenerator(pte, ptd, device="cpu") as b:
        first = b.begin(short, 8, eos_token_id=[])
        while not b.prefill_next(first):
            pass
        b.step()
        second = b.begin(long, 1, eos_token_id=[])
        assert not b.prefill_next(second) and second.prefilled == 16
        b.step()  # the first sequence decodes between the second's calls
        assert b.prefill_next(second) and second.prefilled == cache - 1
        while first.decoding:
            b.step()
        got = (list(first.tokens), list(second.tokens))
    for prompt, tokens, new in ((short, got[0], 8), (long, got[1], 1)):
        assert tokens == transformers_greedy(_windowed("Mistral", 4), torch.tensor([prompt]), new, cache)[0, len(prompt):].tolist()


def test_the_activations_of_both_prefill_methods_are_counted(two):
    with llm.Generator(two.pte, two.ptd, device="cpu") as g:
        arenas = {name: m.executor.arena_bytes for name, m in g.module._probed.items()}
        assert set(arenas) == {llm.PREFILL, PREFILL_LONG, llm.DECODE}
        assert arenas[PREFILL_LONG] > arenas[llm.PREFILL]
        assert g.stats["activation_arena_bytes"] == sum(arenas.values())
        # what the load counts, from the plans (view planning may then elide some copies' bytes)
        assert g.module._arena_sizes()[1] >= sum(arenas.values()) > max(arenas.values())


def test_a_batched_program_prefills_long_prompts_in_long_chunks(tmp_path):
    """A batched program with a long chunk: each sequence's tokens are the unbatched
    Generator's, and a 37-token prompt is three calls, not ten. In a cache of 44 positions its
    last call would run past the cache from 32: it starts at 28 and ends at the cache's end."""
    torch.manual_seed(0)
    model = build(BY_NAME["Llama"])[0]
    cache = 44
    pte, ptd = batching.export(model, tmp_path / "b", max_seq_len=cache, max_batch_size=2, prefill_chunk=CHUNK, long_prefill_chunk=LONG)
    single_pte, single_ptd = llm.export(model, tmp_path / "s", max_seq_len=cache, prefill_chunk=CHUNK, long_prefill_chunk=None)
    prompts = [_prompt(37, 1)[0].tolist(), _prompt(5, 2)[0].tolist()]
    with batching.BatchGenerator(pte, ptd, device="cpu") as b:
        assert b.prefill_chunks == CHUNKS
        sequence = b.begin(prompts[0], 4)
        calls = 0
        while not b.prefill_next(sequence):
            calls += 1
        assert calls + 1 == 3
        b.release(sequence)
        outs = b.generate(prompts, 6, eos_token_id=[])
    with llm.Generator(single_pte, single_ptd, device="cpu") as g:
        for prompt, out in zip(prompts, outs):
            assert out == g.generate(torch.tensor([prompt]), 6, eos_token_id=[])[0, len(prompt):].tolist()
