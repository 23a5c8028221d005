"""Streamed generation (hostswap.llm) on transformers decoder LMs: tiny random configs saved with
``save_pretrained`` and loaded back, as a user would, against transformers' own ``generate``."""

from __future__ import annotations

import os

import pytest
import torch

import hostswap
import hostswap.llm as llm
from hostswap.schedules import load_weight_schedules

from real_models import BY_NAME, VOCAB, build

MB = 2**20
MAX_SEQ_LEN = 30  # not a multiple of the chunk: a prompt ending near it takes a last call that starts early
CHUNK = 4
# the decoder LMs of the support table that generation supports (Gemma3: local/global layers)
GENERATION_ARCHITECTURES = ["Llama", "Qwen2", "Qwen3", "Mistral", "Phi-3", "Gemma", "GPT-2", "Gemma3", "Falcon"]


def transformers_greedy(model, prompt: torch.Tensor, new: int, max_seq_len: int) -> torch.Tensor:
    """``model``'s greedy generate of exactly ``new`` tokens after ``prompt`` [1, n], with a static
    cache of ``max_seq_len`` positions: the reference hostswap's programs are held to."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        cache_implementation="static", cache_config={"batch_size": 1, "max_cache_len": max_seq_len},
        do_sample=False, max_new_tokens=new, min_new_tokens=new, eos_token_id=None, pad_token_id=0,
    )
    with torch.no_grad():
        return model.generate(prompt)


class Exported:
    def __init__(self, name: str, directory):
        from transformers import AutoModelForCausalLM

        build(BY_NAME[name])[0].save_pretrained(directory)
        self.directory = directory
        self.model = AutoModelForCausalLM.from_pretrained(directory).eval()
        self.programs, constants = llm.export_programs(self.model, max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK)
        # the programs as exported, before lowering: the bitwise reference of what hostswap runs
        self.reference = {name: ep.module() for name, ep in self.programs.items()}
        self.pte, self.ptd = hostswap.save(self.programs, os.path.join(directory, "model"), constant_methods=constants)
        self.floor = max(s.floor_bytes for s in load_weight_schedules(self.pte).values())
        self.total = load_weight_schedules(self.pte)["decode"].total_bytes

    def reset_reference_cache(self) -> None:
        for ep in self.programs.values():
            llm.reset_state(ep)

    def transformers_tokens(self, prompt: torch.Tensor, new: int) -> torch.Tensor:
        """transformers' greedy generate with the same static cache, from a fresh load."""
        from transformers import AutoModelForCausalLM

        return transformers_greedy(AutoModelForCausalLM.from_pretrained(self.directory).eval(), prompt, new, MAX_SEQ_LEN)


_exported: dict[str, Exported] = {}


@pytest.fixture(scope="module", params=GENERATION_ARCHITECTURES)
def exported(request, tmp_path_factory):
    if request.param not in _exported:
        _exported[request.param] = Exported(request.param, tmp_path_factory.mktemp(request.param.replace(" ", "_")))
    return _exported[request.param]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """One architecture for the paths that do not depend on it."""
    if "Llama" not in _exported:
        _exported["Llama"] = Exported("Llama", tmp_path_factory.mktemp("Llama"))
    return _exported["Llama"]


def _prompt(n: int, random_state: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(random_state))


@pytest.mark.parametrize("policy,budget", [("planned", "floor"), ("lru", "total")])
def test_greedy_tokens_equal_transformers_generate(exported, policy, budget):
    """Prompt of 7 tokens (a full chunk and a padded one), 12 new tokens."""
    prompt = _prompt(7)
    expected = exported.transformers_tokens(prompt, 12)
    mb = (exported.floor if budget == "floor" else exported.total) / MB
    with llm.Generator(exported.pte, exported.ptd, weight_offload_budget_mb=mb, device="cpu", policy=policy) as g:
        out = g.generate(prompt, 12, eos_token_id=[])
        assert torch.equal(out, expected), (out.tolist(), expected.tolist())
        again = g.generate(prompt, 12, eos_token_id=[])  # a second generation reuses the cache as it is
        assert torch.equal(again, expected)
        s = g.stats
        assert s["new_tokens"] == 12 and s["prompt_tokens"] == 7 and s["kv_cache_bytes"] > 0
        if policy == "planned":
            # one pool for both methods: every call copies exactly the plan's streamed bytes
            module = g.module.stats
            assert module["bytes_h2d"] == module["forwards"] * g.module.pool.layout.streamed_bytes


def test_logits_bitwise_equal_to_the_exported_program(exported):
    """Each method's logits, step after step through the shared cache, are bitwise those of
    the program torch.export traced (itself within 1e-6 of eager transformers)."""
    ids = _prompt(CHUNK, random_state=3)
    exported.reset_reference_cache()
    steps = [("prefill", ids, torch.arange(CHUNK)), ("decode", ids[:, :1], torch.tensor([CHUNK])), ("decode", ids[:, 1:2], torch.tensor([CHUNK + 1]))]
    with torch.no_grad():
        expected = [exported.reference[m](input_ids=x, cache_position=p) for m, x, p in steps]
    with llm.Generator(exported.pte, exported.ptd, weight_offload_budget_mb=exported.floor / MB, device="cpu") as g:
        for (method, x, p), want in zip(steps, expected):
            (got,) = g.module.run_method(method, [x, p])
            assert torch.equal(got, want), (method, (got - want).abs().max().item())


def test_prompt_ending_near_max_seq_len_takes_a_last_call_that_starts_early(llama):
    prompt = _prompt(MAX_SEQ_LEN - 1)  # 28 tokens in chunks; a call from 28 would run past the cache: the last starts at 26
    expected = llama.transformers_tokens(prompt, 1)
    with llm.Generator(llama.pte, llama.ptd, weight_offload_budget_mb=llama.floor / MB, device="cpu") as g:
        assert torch.equal(g.generate(prompt, 1, eos_token_id=[]), expected)


def test_stops_at_end_of_sequence(llama):
    prompt = _prompt(7)
    full = llama.transformers_tokens(prompt, 12)[0, 7:].tolist()
    with llm.Generator(llama.pte, llama.ptd, weight_offload_budget_mb=llama.floor / MB, device="cpu") as g:
        seen = []
        out = g.generate(prompt, 12, eos_token_id=full[3], on_token=seen.append)
        assert out[0, 7:].tolist() == full[: full.index(full[3]) + 1] == seen


def test_errors_name_the_argument_before_any_work(llama):
    with llm.Generator(llama.pte, llama.ptd, weight_offload_budget_mb=llama.floor / MB, device="cpu") as g:
        forwards = g.module.stats["forwards"]  # the warm-up's
        with pytest.raises(llm.GenerationError, match=r"prompt \(20 tokens\) \+ max_new_tokens \(11\) = 31 exceeds the program's max_seq_len=30"):
            g.generate(_prompt(20), 11)
        with pytest.raises(llm.GenerationError, match="one sequence"):
            g.generate(torch.zeros(2, 3, dtype=torch.long), 2)
        with pytest.raises(llm.GenerationError, match="max_new_tokens must be a positive int, got 0"):
            g.generate(_prompt(3), 0)
        with pytest.raises(llm.GenerationError, match="integer token ids, got torch.float32"):
            g.generate(torch.zeros(1, 3), 2)
        with pytest.raises(llm.GenerationError, match="must be a tensor of token ids, got list"):
            g.generate([1, 2, 3], 2)
        with pytest.raises(llm.GenerationError, match="input_ids is empty"):
            g.generate(torch.zeros(1, 0, dtype=torch.long), 2)
        with pytest.raises(llm.GenerationError, match=rf"token id {VOCAB}, outside the model's vocabulary of {VOCAB} ids"):
            g.generate(torch.tensor([[1, VOCAB, 2]]), 2)
        with pytest.raises(llm.GenerationError, match="token id -1, outside"):
            g.generate(torch.tensor([[1, -1]]), 2)
        with pytest.raises(llm.GenerationError, match="eos_token_id must be a token id or a list of them, got 'x'"):
            g.generate(_prompt(3), 2, eos_token_id="x")
        assert g.module.stats["forwards"] == forwards  # nothing ran


def test_errors_at_export_and_load(lowered_by_name, tmp_path):
    with pytest.raises(llm.GenerationError, match="prefill_chunk=64 is longer than max_seq_len=32"):
        llm.export(build(BY_NAME["Llama"])[0], tmp_path / "m", max_seq_len=32, prefill_chunk=64)
    with pytest.raises(llm.GenerationError, match="max_seq_len must be a positive int, got 0"):
        llm.export(build(BY_NAME["Llama"])[0], tmp_path / "m", max_seq_len=0)
    with pytest.raises(llm.GenerationError, match="takes a transformers causal LM"):
        llm.export(torch.nn.Linear(2, 2), tmp_path / "m", max_seq_len=8, prefill_chunk=4)
    with pytest.raises(ValueError, match="device must name a device such as 'cuda', 'cuda:1' or 'cpu', got 'gpu0'"):
        llm.Generator(tmp_path / "missing.pte", weight_offload_budget_mb=100, device="gpu0")
    demo = lowered_by_name("demo_transformer")
    with pytest.raises(llm.GenerationError, match="has no method 'prefill' that reads weights: write it with hostswap.llm.export"):
        llm.Generator(demo.pte, demo.ptd, weight_offload_budget_mb=100, device="cpu")


def test_decode_queues_the_next_step_before_the_host_reads_a_token():
    """Each decode step is called with the previous token and its position as tensors, before
    the host reads that token; an end-of-sequence token's one extra step is dropped."""
    vocab, calls, seen = 10, [], []

    def step(method, ids, positions):
        assert method == llm.DECODE and isinstance(positions, torch.Tensor)
        calls.append((int(ids), int(positions), len(seen)))  # len(seen): tokens the host had read by then
        logits = torch.zeros(1, 1, vocab)
        logits[0, 0, (int(ids) + 3) % vocab] = 1  # the next token: the fed one plus 3
        return logits

    first = torch.zeros(vocab)
    first[1] = 1
    new = llm.decode_tokens(step, first, 5, 6, on_token=seen.append)
    assert new == seen == [1, 4, 7, 0, 3, 6]
    # the step for token i+1 is queued while the host has read only tokens before i
    assert calls == [(1, 5, 0), (4, 6, 1), (7, 7, 2), (0, 8, 3), (3, 9, 4)]
    calls.clear()
    seen.clear()
    assert llm.decode_tokens(step, first, 5, 6, eos={7}, on_token=seen.append) == seen == [1, 4, 7]
    assert [c[0] for c in calls] == [1, 4, 7]  # the step after the end token ran, its token dropped


def test_cache_counter_copies_do_not_copy_the_state_arena(llama):
    """Each layer's static cache keeps a 0-d counter that decode updates with ``copy.out``;
    ATen's kernel for it copies the whole storage, here the state arena of every layer's cache."""
    from hostswap.runtime.instructions import ELEMENTWISE_OUT_OPS

    with llm.Generator(llama.pte, llama.ptd, weight_offload_budget_mb=llama.floor / MB, device="cpu") as g:
        ops = [ins.op for ins in g.module._probed[llm.DECODE].executor.instructions if ins.tag == "kernel"]
    assert ops.count(ELEMENTWISE_OUT_OPS[("aten::copy", "out")]) >= 1
    assert torch.ops.aten.copy.out not in ops


@pytest.mark.parametrize("max_seq_len,chunk", [(16, 16), (64, 64), (128, 128), (4096, 128)])
def test_default_prefill_chunk_is_the_largest_that_fits(max_seq_len, chunk):
    assert llm.default_prefill_chunk(max_seq_len) == chunk


def test_a_short_max_seq_len_exports_with_the_default_chunk(tmp_path):
    """max_seq_len 16, below the default chunk of 128: the program takes chunks of 16."""
    model = build(BY_NAME["Llama"])[0]
    pte, ptd = llm.export(model, tmp_path / "m", max_seq_len=16)
    prompt = _prompt(20)[:, :9]
    with llm.Generator(pte, ptd, device="cpu") as g:  # the budget "auto"
        assert g.prefill_chunk == 16 and g.max_seq_len == 16
        assert g.module.auto_budget is not None and g.module.budget_bytes == g.module.schedule.resident_bytes  # all fit in RAM
        out = g.generate(prompt, 5, eos_token_id=[])
    expected = model.generate(prompt, do_sample=False, max_new_tokens=5, min_new_tokens=5, pad_token_id=0, eos_token_id=None,
                              cache_implementation="static", cache_config={"batch_size": 1, "max_cache_len": 16})
    assert torch.equal(out, expected), (out.tolist(), expected.tolist())


def test_warm_up_pays_the_first_call_at_load_and_changes_no_token(llama):
    """The warm-up runs a call of each prefill method and a decode step, then zeroes the KV
    cache: tokens and logits afterwards are those of a Generator that never warmed up."""
    prompt = _prompt(7)
    with llm.Generator(llama.pte, llama.ptd, weight_offload_budget_mb=llama.floor / MB, device="cpu") as warm:
        assert warm.warm_up_seconds > 0 and warm.stats["warm_up_s"] == warm.warm_up_seconds
        assert warm.prefill_chunks == {llm.PREFILL: CHUNK}  # "auto": no long chunk in a cache shorter than 512
        assert warm.module.stats["forwards"] == 2
        assert all(int(t.count_nonzero()) == 0 for t in warm.module.state.values())  # the cache as at load
        warm_out = warm.generate(prompt, 8, eos_token_id=[])
        warm_logits = warm._step(llm.DECODE, warm_out[:, -1:], 15)
        assert "warm-up" in warm.summary()
    with llm.Generator(llama.pte, llama.ptd, weight_offload_budget_mb=llama.floor / MB, device="cpu", warm_up=False) as cold:
        assert cold.warm_up_seconds is None and cold.module.stats["forwards"] == 0
        cold_out = cold.generate(prompt, 8, eos_token_id=[])
        cold_logits = cold._step(llm.DECODE, cold_out[:, -1:], 15)
        assert "no warm-up" in cold.summary()
    assert torch.equal(warm_out, cold_out) and torch.equal(warm_logits, cold_logits)
    with pytest.raises(llm.GenerationError, match="warm_up must be True or False, got 'yes'"):
        llm.Generator(llama.pte, llama.ptd, weight_offload_budget_mb=llama.floor / MB, device="cpu", warm_up="yes")
