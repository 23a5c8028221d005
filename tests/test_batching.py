"""Many sequences in one program: a slotted KV cache, each sequence at its own position.

Every sequence of a batch must get the tokens transformers' greedy ``generate`` gives it alone
(static cache, fp32, CPU), however many others share its steps and whenever it joins; its
logits may differ from batch-1 logits only by the rounding of batched kernels (stated below).
"""

from __future__ import annotations

import os
import types

import pytest
import torch

from hostswap import batching, llm
from hostswap.sampling import SamplingError, SamplingParams, TokenChooser
from hostswap.schedules.serialization import load_weight_schedules
from hostswap.schedules.weight_schedule import load_floor_bytes

from real_models import BY_NAME, VOCAB, build
from test_generation import transformers_greedy

MB = 2**20
MAX_SEQ_LEN, CHUNK, SLOTS = 40, 4, 3
# (architecture, sliding window to set, or None): sliding windows shorter than the sequences
# exercise the per-layer masks (Gemma3 mixes full and sliding layers)
CASES = [("Llama", None), ("Qwen3", None), ("GPT-2", None), ("Gemma3", 4), ("Mistral", 4), ("Mixtral", None)]
# batched rows and single rows run matmuls of other shapes: their logits may differ by this
BATCH_TOLERANCE = dict(atol=1e-5, rtol=1e-5)


def _model(name: str, window: int | None):
    model = build(BY_NAME[name])[0].eval()
    if window is not None:
        model.config.sliding_window = window
    return model


class Batched:
    def __init__(self, name: str, window: int | None, directory):
        self.name, self.window = name, window
        self.pte, self.ptd = batching.export(_model(name, window), os.path.join(directory, "m"), max_seq_len=MAX_SEQ_LEN, max_batch_size=SLOTS, prefill_chunk=CHUNK)
        schedules = load_weight_schedules(self.pte)
        self.floor = load_floor_bytes(schedules)
        self.total = schedules["decode"].resident_bytes + sum(b.table_bytes for b in schedules["decode"].expert_blocks) + max(s.expert_scratch_bytes for s in schedules.values())

    def transformers_tokens(self, prompt: list[int], new: int) -> list[int]:
        return transformers_greedy(_model(self.name, self.window), torch.tensor([prompt]), new, MAX_SEQ_LEN)[0, len(prompt):].tolist()


_built: dict = {}


@pytest.fixture(scope="module", params=CASES, ids=[f"{n}" + (f"-window{w}" if w else "") for n, w in CASES])
def batched(request, tmp_path_factory):
    if request.param not in _built:
        _built[request.param] = Batched(*request.param, tmp_path_factory.mktemp(request.param[0]))
    return _built[request.param]


def _prompts(lengths, random_state=0):
    g = torch.Generator().manual_seed(random_state)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("budget", ["floor", "total"])
def test_each_sequence_gets_its_own_greedy_tokens(batched, budget):
    """Five prompts of 2 to 12 tokens through three slots: sequences join as others leave."""
    prompts, news = _prompts([5, 3, 9, 2, 12]), [6, 9, 4, 7, 5]
    expected = [batched.transformers_tokens(p, n) for p, n in zip(prompts, news)]
    mb = (batched.floor if budget == "floor" else batched.total) / MB
    with batching.BatchGenerator(batched.pte, batched.ptd, weight_offload_budget_mb=mb, device="cpu") as b:
        assert b.max_batch_size == SLOTS
        out = b.generate(prompts, news, eos_token_id=[])
        assert out == expected
        assert b.free_slots() == SLOTS


def test_a_sequences_logits_do_not_depend_on_its_companions(tmp_path_factory):
    """The same sequence decoded beside two different sets of others: bitwise the same logits
    (each row is its own), and within the stated tolerance of decoding it alone."""
    batched = _built.get(CASES[0]) or Batched(*CASES[0], tmp_path_factory.mktemp("alone"))
    target = _prompts([6], random_state=5)[0]

    def logits_with(companions: list[list[int]]) -> list[torch.Tensor]:
        seen = []
        with batching.BatchGenerator(batched.pte, batched.ptd, weight_offload_budget_mb=batched.total / MB, device="cpu") as b:
            sequences = [b.add(target, 6, eos_token_id=[])] + [b.add(c, 6, eos_token_id=[]) for c in companions]
            original = b.module.run_method

            def recording(name, inputs, **options):
                outputs = original(name, inputs, **options)
                if name == "decode":
                    seen.append(outputs[0][sequences[0].slot].clone())
                return outputs

            b.module.run_method = recording
            while not sequences[0].finished:
                b.step()
        return seen

    alone, first, second = logits_with([]), logits_with(_prompts([3, 8], 1)), logits_with(_prompts([11, 2], 2))
    assert len(first) == len(second) == len(alone) == 5
    for a, b_, c in zip(first, second, alone):
        assert torch.equal(a, b_)
        torch.testing.assert_close(a, c, **BATCH_TOLERANCE)


def test_seeded_sampling_in_a_batch_is_reproducible(tmp_path_factory):
    batched = _built.get(CASES[0]) or Batched(*CASES[0], tmp_path_factory.mktemp("seeded"))
    prompts = _prompts([4, 7, 5])
    sampling = [SamplingParams(temperature=1.3, top_k=20, seed=s) for s in (1, 2, 1)]
    runs = []
    for _ in range(2):
        with batching.BatchGenerator(batched.pte, batched.ptd, weight_offload_budget_mb=batched.total / MB, device="cpu") as b:
            runs.append(b.generate(prompts, 10, eos_token_id=[], sampling=sampling))
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1]
    # a sequence whose logits hold a NaN gets an error naming it, not a token
    with batching.BatchGenerator(batched.pte, batched.ptd, weight_offload_budget_mb=batched.total / MB, device="cpu") as b:
        chooser = TokenChooser(sampling[0], torch.device("cpu"), VOCAB, torch.tensor([[1]]))
        with pytest.raises(SamplingError, match="hold a NaN"):
            b._choose(types.SimpleNamespace(chooser=chooser), torch.full((VOCAB,), float("nan")))


def test_bad_requests_and_programs_are_named(tmp_path_factory, tmp_path):
    batched = _built.get(CASES[0]) or Batched(*CASES[0], tmp_path_factory.mktemp("bad"))
    with batching.BatchGenerator(batched.pte, batched.ptd, weight_offload_budget_mb=batched.total / MB, device="cpu") as b:
        with pytest.raises(llm.GenerationError, match=r"prompt \(38 tokens\) \+ max_new_tokens \(5\) exceeds the program's max_seq_len=40"):
            b.generate([[1] * 38], 5)
        with pytest.raises(llm.GenerationError, match="a prompt is empty"):
            b.generate([[]], 5)
        with pytest.raises(llm.GenerationError, match=rf"token id {VOCAB}, outside the model's vocabulary"):
            b.generate([[1, VOCAB]], 5)
        with pytest.raises(llm.GenerationError, match="2 prompts, 3 max_new_tokens"):
            b.generate([[1], [2]], [1, 2, 3])
        for _ in range(SLOTS):
            b.begin([1, 2], 3)
        with pytest.raises(llm.GenerationError, match=f"all {SLOTS} slots are taken"):
            b.begin([1, 2], 3)
    with pytest.raises(llm.GenerationError, match=r"is a batched program \(export with max_batch_size\): run it with hostswap.batching.BatchGenerator"):
        llm.Generator(batched.pte, batched.ptd, weight_offload_budget_mb=batched.total / MB, device="cpu")
    pte, ptd = llm.export(build(BY_NAME["Llama"])[0], tmp_path / "one", max_seq_len=16, prefill_chunk=4)
    with pytest.raises(llm.GenerationError, match="is not a batched program"):
        batching.BatchGenerator(pte, ptd, weight_offload_budget_mb=64, device="cpu")
    with pytest.raises(llm.GenerationError, match="max_batch_size must be a positive int, got 0"):
        batching.export(build(BY_NAME["Llama"])[0], tmp_path / "zero", max_seq_len=16, max_batch_size=0)


@pytest.mark.parametrize("name", ["Llama", "Mixtral"])
def test_batched_decode_compiled_gives_the_executors_tokens(name, tmp_path_factory):
    """Batched decode compiled into one inductor graph (``compiled=("decode",)``, what
    ``serve --compiled`` asks for), the experts' op inside it for Mixtral: each sequence's
    tokens are those the executor's run of the same program gives."""
    from hostswap.runtime.compiled_method import CompiledExecutor

    key = (name, None)
    if key not in _built:
        _built[key] = Batched(name, None, tmp_path_factory.mktemp(name))
    b = _built[key]
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    outs = []
    for compiled in (False, ("decode",)):
        with batching.BatchGenerator(b.pte, b.ptd, weight_offload_budget_mb=b.total / 2**20, device="cpu", compiled=compiled) as g:
            assert isinstance(g.module._probed["decode"].executor, CompiledExecutor) == bool(compiled)
            outs.append(g.generate(prompts, 8, eos_token_id=[]))
    assert outs[0] == outs[1], outs


def test_a_prompt_prefilled_between_decode_steps_keeps_its_keys(tmp_path_factory):
    """A server admits a long prompt chunk by chunk between the decode steps of the sequences
    already running. The decode step runs every slot, the prefilling one too: its row must write
    where the prompt's keys are not. The interleaved sequence's logits equal those it gets
    prefilled at once, bitwise."""
    batched = _built.get(CASES[0]) or Batched(*CASES[0], tmp_path_factory.mktemp("interleaved"))
    running, long = _prompts([3], random_state=7)[0], _prompts([3 * CHUNK + 1], random_state=8)[0]

    def logits(interleaved: bool) -> list[torch.Tensor]:
        seen = []
        with batching.BatchGenerator(batched.pte, batched.ptd, weight_offload_budget_mb=batched.total / MB, device="cpu") as b:
            b.add(running, 12, eos_token_id=[])
            if interleaved:
                sequence = b.begin(long, 4, eos_token_id=[])
                while not b.prefill_next(sequence):
                    b.step()  # the others decode while the prompt is half in
            else:
                sequence = b.add(long, 4, eos_token_id=[])
            original = b.module.run_method

            def recording(name, inputs, **options):
                outputs = original(name, inputs, **options)
                if name == "decode":
                    seen.append(outputs[0][sequence.slot].clone())
                return outputs

            b.module.run_method = recording
            while not sequence.finished:
                b.step()
        return seen

    at_once, interleaved = logits(False), logits(True)
    assert len(at_once) == len(interleaved) == 3
    for a, b_ in zip(at_once, interleaved):
        assert torch.equal(a, b_)
