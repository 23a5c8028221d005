"""Speculative decoding: a draft proposes k tokens, one pass of the target's verify method checks
them. Greedy output must equal the target's plain greedy output token for token, whatever the
draft proposes: all right, all wrong, or wrong at any one position of a round (after which
both caches hold entries of rejected tokens that the next round must overwrite)."""

from __future__ import annotations

import os
import re

import pytest
import torch

from hostswap import llm
from hostswap.schedules.serialization import load_weight_schedules
from hostswap.schedules.weight_schedule import load_floor_bytes
from hostswap.speculative import SpeculationStats, speculate

from real_models import BY_NAME, VOCAB, build

MB = 2**20
MAX_SEQ_LEN, CHUNK, NEW = 40, 4, 30
from test_generation import GENERATION_ARCHITECTURES as ARCHITECTURES  # noqa: E402


def _prompt(n: int = 7, random_state: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(random_state))


class Pair:
    """One architecture: the target, with a verify method for up to 8 drafted tokens (its plain
    greedy output: the reference), and two drafts: the same weights, and other random ones."""

    def __init__(self, name: str, directory):
        self.target = llm.export(build(BY_NAME[name])[0], os.path.join(directory, "target"), max_seq_len=MAX_SEQ_LEN,
                                 prefill_chunk=CHUNK, speculate_k=8)
        self.same = os.path.join(directory, "target")
        llm.export(build(BY_NAME[name], random_state=5)[0], os.path.join(directory, "other"), max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK)
        self.other = os.path.join(directory, "other")
        self.budget = load_floor_bytes(load_weight_schedules(self.target[0])) / MB + 0.01
        with llm.Generator(*self.target, weight_offload_budget_mb=self.budget, device="cpu") as g:
            self.expected = g.generate(_prompt(), NEW, eos_token_id=[])


_pairs: dict[str, Pair] = {}


@pytest.fixture(scope="module", params=ARCHITECTURES)
def pair(request, tmp_path_factory):
    if request.param not in _pairs:
        _pairs[request.param] = Pair(request.param, tmp_path_factory.mktemp(request.param))
    return _pairs[request.param]


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("draft", ["same", "other"])
def test_greedy_output_is_the_targets_own(pair, k, draft):
    with llm.Generator(*pair.target, weight_offload_budget_mb=pair.budget, device="cpu", draft=getattr(pair, draft), speculate_k=k) as g:
        out = g.generate(_prompt(), NEW, eos_token_id=[])
        assert torch.equal(out, pair.expected), (out.tolist(), pair.expected.tolist())
        stats = g.last_speculation
        assert stats.passes > 0 and stats.drafted == stats.passes * k
        if draft == "same":  # the target's own weights: every drafted token agrees
            assert stats.acceptance == 1.0 and stats.passes <= -(-NEW // (k + 1)) + 1
        assert g.stats["new_tokens"] == NEW


@pytest.mark.parametrize("draft", ["same", "other"])
def test_drafting_ahead_keeps_the_targets_greedy_output(pair, draft):
    """draft_ahead: the next round drafted during each verify pass, kept only where every
    proposal was and the draft's guess at the target's token was right. The same weights are
    always right, so every round after the first starts from what was drafted ahead; after a
    round with a rejection (other weights), the next is drafted in turn."""
    with llm.Generator(*pair.target, weight_offload_budget_mb=pair.budget, device="cpu", draft=getattr(pair, draft), speculate_k=4,
                       draft_ahead=True) as g:
        out = g.generate(_prompt(), NEW, eos_token_id=[])
        assert torch.equal(out, pair.expected), (out.tolist(), pair.expected.tolist())
        stats = g.last_speculation
        assert stats.ahead_steps > 0 and stats.ahead_steps % 5 == 0  # k + 1 steps each time
        if draft == "same":
            assert stats.acceptance == 1.0 and stats.ahead_rounds == stats.passes - 1
            assert stats.draft_steps == 4  # the first round's: the prompt's last token, then three proposals
        else:  # a round after a rejection is never ready (the last round's rejection has no round after it)
            assert stats.ahead_rounds <= stats.passes - 1 - max(stats.rejections - 1, 0)
            assert stats.draft_steps >= 4 + 4 * (stats.passes - 1 - stats.ahead_rounds)  # rounds not ready drafted their proposals in turn


class ScriptedDraft:
    """A draft that proposes the target's own greedy tokens, except at the positions in
    ``wrong``, where it proposes another token: rejections land where the test wants them."""

    def __init__(self, truth: list[int], wrong: set[int], target):
        self.truth, self.wrong = truth, wrong
        self.vocab_size, self.eos_token_ids, self.max_seq_len, self.device = target.vocab_size, target.eos_token_ids, target.max_seq_len, target.device
        self.module = self

    def run_method(self, method: str, inputs):
        position = int(inputs[1][-1]) + 1  # the logits after a token at p predict position p + 1
        token = self.truth[position] if position < len(self.truth) else 0
        if position in self.wrong:
            token = (token + 1) % self.vocab_size
        return [torch.nn.functional.one_hot(torch.tensor([[token]]), self.vocab_size).float()]


@pytest.mark.parametrize("ahead", [False, True], ids=["in-turn", "ahead"])
@pytest.mark.parametrize("reject_at", range(5))
def test_a_rejection_at_every_position_of_a_round_rolls_both_caches_back(tmp_path_factory, reject_at, ahead):
    """k = 4 (the verify call padded to its 9 tokens): in every round the draft is wrong at offset ``reject_at`` (0: its first proposal,
    4: none of the four, the target's bonus token follows); the output stays the target's. Drafting ahead, each round's
    proposals come from the draft's steps during the pass before only where that pass kept all four (reject_at 4)."""
    pair = _pairs.get("Llama") or _pairs.setdefault("Llama", Pair("Llama", tmp_path_factory.mktemp("Llama")))
    truth = pair.expected[0].tolist()
    prompt = _prompt()
    with llm.Generator(*pair.target, weight_offload_budget_mb=pair.budget, device="cpu") as g:
        # prefill as generate does, then speculate with the scripted draft
        last = llm.prefill(g._step, prompt, g.prefill_chunks, g.max_seq_len)
        start = prompt.shape[1]
        # rounds start at start + 5m (each accepts reject_at drafted tokens and the target's own)
        step = reject_at + 1 if reject_at < 4 else 5
        wrong = {start + 1 + reject_at + step * m for m in range(NEW)} if reject_at < 4 else set()
        stats = SpeculationStats()
        new = speculate(g, ScriptedDraft(truth, wrong, g), int(last.argmax()), start, 4, NEW, frozenset(), None, stats, ahead=ahead)
        assert new == truth[start:], (new, truth[start:])
        assert stats.passes > 0
        # k + 1 steps ahead per round with a next round in the cache, none beside the last
        assert stats.ahead_steps % 5 == 0 and (0 < stats.ahead_steps <= 5 * (stats.passes - 1) if ahead else stats.ahead_steps == 0)
        assert (stats.ahead_rounds > 0) == (ahead and reject_at == 4)
        # every round but the last accepts exactly reject_at drafts (the last may draft past the
        # known continuation, where the script has no truth to propose)
        assert (stats.passes - 1) * reject_at <= stats.accepted <= stats.passes * reject_at


def test_bad_drafts_and_requests_are_named(tmp_path_factory, tmp_path):
    pair = _pairs.get("Llama") or _pairs.setdefault("Llama", Pair("Llama", tmp_path_factory.mktemp("Llama")))
    # another vocabulary
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    wider = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB + 8, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=64, eos_token_id=None, bos_token_id=None)).eval()
    llm.export(wider, tmp_path / "wider", max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK)
    with pytest.raises(llm.GenerationError, match=rf"the draft's vocabulary has {VOCAB + 8} ids, the target's {VOCAB}: a draft must share the target's tokenizer"):
        llm.Generator(*pair.target, weight_offload_budget_mb=pair.budget, device="cpu", draft=str(tmp_path / "wider"))
    short = llm.export(build(BY_NAME["Llama"])[0], tmp_path / "short", max_seq_len=20, prefill_chunk=CHUNK)
    with pytest.raises(llm.GenerationError, match="the draft's max_seq_len=20 is shorter than the target's 40"):
        llm.Generator(*pair.target, weight_offload_budget_mb=pair.budget, device="cpu", draft=short[0])
    with pytest.raises(llm.GenerationError, match="has no verify method: export the target with speculate_k"):
        llm.Generator(*short, weight_offload_budget_mb=pair.budget, device="cpu", draft=pair.same)
    with pytest.raises(llm.GenerationError, match="draft_ahead must be True, False or None, got 'yes'"):
        llm.Generator(*pair.target, weight_offload_budget_mb=pair.budget, device="cpu", draft=pair.same, draft_ahead="yes")
    with pytest.raises(llm.GenerationError, match="draft_ahead drafts the next round during each verify pass: it needs a draft"):
        llm.Generator(*pair.target, weight_offload_budget_mb=pair.budget, device="cpu", draft_ahead=True)
    with pytest.raises(llm.GenerationError, match=r"speculate_k must be an int from 1 to 8 \(the program's verify method checks 8\), got 9"):
        llm.Generator(*pair.target, weight_offload_budget_mb=pair.budget, device="cpu", draft=pair.same, speculate_k=9)
    # where the target does not fit beside the draft, the error names the target's budget and the draft's weights and KV cache
    with pytest.raises(ValueError, match=r"below this program's floor.*The draft on cpu holds [\d.]+ MiB besides: weights [\d.]+ MiB, KV cache [\d.]+ MiB"):
        llm.Generator(*pair.target, weight_offload_budget_mb=0.001, device="cpu", draft=pair.same)
    with llm.Generator(*pair.target, weight_offload_budget_mb=pair.budget, device="cpu", draft=pair.same) as g:
        from hostswap.sampling import SamplingParams

        with pytest.raises(llm.GenerationError, match="decoding with a draft keeps no log-probabilities and takes no repetition penalty"):
            g.generate(_prompt(), 4, sampling=SamplingParams(temperature=0.7, repetition_penalty=1.2, seed=1))
        # the verify method is graphed where decode is (on CUDA): asking for it elsewhere, or for a method the program lacks, is named
        assert not g.module.cuda_graph
        with pytest.raises(ValueError, match=r"graph_method\('verify'\) needs a Module loaded with cuda_graph on a CUDA device"):
            g.module.graph_method("verify")
        with pytest.raises(ValueError, match=r"graph_method names 'verfy', which is not a method of .*target.pte that reads weights \(\['prefill', 'decode', 'verify'\]\)"):
            g.module.graph_method("verfy")
    with pytest.raises(llm.GenerationError, match="speculate_k must be a positive int, got 0"):
        llm.export(build(BY_NAME["Llama"])[0], tmp_path / "zero", max_seq_len=MAX_SEQ_LEN, speculate_k=0)
    with pytest.raises(llm.GenerationError, match="speculate_k and max_batch_size cannot be combined"):
        llm.export(build(BY_NAME["Llama"])[0], tmp_path / "both", max_seq_len=MAX_SEQ_LEN, speculate_k=2, max_batch_size=2)


def test_cli_exports_an_int8_self_draft_and_generates_the_plain_tokens(tmp_path):
    """export-llm --draft int8 writes the target (with a verify method) and its quantized
    copy beside it; generate --draft prints the tokens generate prints without it, and the
    draft's acceptance."""
    import subprocess
    import sys

    build(BY_NAME["Llama"])[0].save_pretrained(tmp_path / "ckpt")
    cli = lambda *a: subprocess.run([sys.executable, "-m", "hostswap.cli", *a], capture_output=True, text=True, timeout=600)  # noqa: E731
    exported = cli("export-llm", str(tmp_path / "ckpt"), "--out", str(tmp_path / "m"), "--max-seq-len", "40", "--prefill-chunk", "4", "--draft", "int8")
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert (tmp_path / "m.draft.pte").exists() and load_weight_schedules(str(tmp_path / "m.pte")).keys() == {"prefill", "decode", "verify"}
    run = ["generate", str(tmp_path / "m"), "--prompt-ids", "1,2,3,4,5", "--max-new-tokens", "20", "--device", "cpu", "--budget-mb", "1"]
    plain, drafted = cli(*run), cli(*run, "--draft")
    assert plain.returncode == 0 and drafted.returncode == 0, drafted.stderr[-2000:]
    assert drafted.stdout == plain.stdout and len(plain.stdout.split()) == 20
    assert "tokens per weight pass" in drafted.stderr and "drafted tokens accepted" in drafted.stderr
    assert "rounds drafted during the pass before" not in drafted.stderr  # drafting ahead is on by default on a GPU, not on the CPU
    ahead = cli(*run, "--draft", "--draft-ahead")
    assert ahead.returncode == 0 and ahead.stdout == plain.stdout, ahead.stderr[-2000:]
    assert re.search(r"\d+ of \d+ rounds drafted during the pass before", ahead.stderr), ahead.stderr[-2000:]
    alone = cli(*run, "--draft-ahead")  # without a draft: named
    assert alone.returncode != 0 and "draft_ahead drafts the next round during each verify pass: it needs a draft" in alone.stderr


def test_the_sampling_rule_draws_from_the_targets_distribution():
    """Proposals drawn from the draft's q, kept with probability min(1, p/q), else redrawn from
    max(0, p - q): the tokens that come out follow p (40 000 draws on 5 tokens, every
    frequency within 5 standard errors)."""
    from hostswap.speculative import accept_or_resample

    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    q = torch.tensor([0.1, 0.4, 0.1, 0.3, 0.1])
    draws, kept = 40_000, 0
    counts = torch.zeros(5)
    for _ in range(draws):
        proposed = int(torch.multinomial(q, 1, generator=generator))
        ok, token = accept_or_resample(p, q, proposed, generator)
        kept += ok
        counts[token] += 1
    frequencies = counts / draws
    standard_error = (p * (1 - p) / draws).sqrt()
    assert ((frequencies - p).abs() <= 5 * standard_error).all(), (frequencies, p)
    assert abs(kept / draws - torch.minimum(p, q).sum().item()) < 0.01  # the acceptance rate is the overlap of p and q


def test_sampling_with_a_draft_is_seeded_and_keeps_the_targets_proposals(tmp_path_factory):
    from hostswap.sampling import SamplingParams

    pair = _pairs.get("Llama") or _pairs.setdefault("Llama", Pair("Llama", tmp_path_factory.mktemp("Llama")))
    runs = []
    for seed in (3, 3, 4):
        with llm.Generator(*pair.target, weight_offload_budget_mb=pair.budget, device="cpu", draft=pair.same, speculate_k=4) as g:
            runs.append(g.generate(_prompt(), NEW, eos_token_id=[], sampling=SamplingParams(temperature=1.0, top_k=40, seed=seed)).tolist())
            # the draft is the target's own weights: its proposals are kept but where verify's rounding differs
            assert g.last_speculation.acceptance > 0.9
    assert runs[0] == runs[1] != runs[2]


def test_k_follows_the_acceptance_and_the_costs(tmp_path_factory):
    """best_k: a cheap draft that is always right proposes all the verify method checks; a
    draft that never pays (never right, or nearly as slow as the target) gives way to plain
    decode; without speculate_k the rounds choose k from what they measure, and the output
    stays the target's."""
    from hostswap.speculative import best_k

    assert best_k(1.0, draft_seconds=0.1, verify_seconds=10.0, most=8) == 8
    assert best_k(0.5, draft_seconds=0.1, verify_seconds=1.0, most=8) == 3
    assert best_k(0.9, draft_seconds=0.1, verify_seconds=1.0, most=8) == 8
    # plain decode where no k pays: a draft never right, however cheap, or one whose step costs
    # most of the target's (SmolLM2-135M in bf16 on an H200: int8 draft step 3.3 ms, verify pass 4.6 ms)
    assert best_k(0.0, draft_seconds=0.01, verify_seconds=10.0, most=8) == 0
    assert best_k(0.85, draft_seconds=3.3, verify_seconds=4.6, most=8) == 0
    # drafting ahead hides the draft's steps in the pass while they fit in it: a draft step a
    # fifth of the pass, always right, pays up to k = 4 (five steps beside the pass), where
    # in turn the most the verify method checks pays best
    assert best_k(1.0, draft_seconds=0.2, verify_seconds=1.0, most=8, ahead=True) == 4
    assert best_k(1.0, draft_seconds=0.2, verify_seconds=1.0, most=8) == 8
    assert best_k(0.97, draft_seconds=1.76, verify_seconds=5.4, most=8, ahead=True) > 0
    pair = _pairs.get("Llama") or _pairs.setdefault("Llama", Pair("Llama", tmp_path_factory.mktemp("Llama")))
    for draft in (pair.same, pair.other):
        with llm.Generator(*pair.target, weight_offload_budget_mb=pair.budget, device="cpu", draft=draft) as g:
            assert torch.equal(g.generate(_prompt(), NEW, eos_token_id=[]), pair.expected)
            ks = g.last_speculation.k
            assert ks[:2] == [8, 8] and all(1 <= k <= 8 for k in ks)
            if draft == pair.other:  # random weights agree with the target almost never: plain decode after two rounds
                assert len(ks) == 2 and g.last_speculation.plain_steps > 0


def test_draft_cost_bench_counts_each_layers_kernels(tmp_path):
    """bench/draft_cost.py on the CPU: a decode step's kernels, per layer from two depths of the
    same shape, the seven projections of a Llama layer among them (four with q/k/v and gate/up
    fused)."""
    import json

    from bench_scripts import load

    assert load("draft_cost").main(["--device", "cpu", "--layers", "2", "--vocab", "128", "--schemes", "none,none-fused", "--steps", "2",
                                    "--max-seq-len", "64", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "drafts_cpu.json").read_text())["rows"]
    assert [(row["scheme"], row["compiled"]) for row in rows] == [("none", False), ("none", True), ("none-fused", False), ("none-fused", True)]
    for row in rows:  # the executor's kernels, then one inductor graph
        assert row["kernels_per_step"] == 2 * row["kernels_per_layer"] + row["kernels_outside_layers"]
        assert row["operators_per_layer"]["mm.out"] == (4 if row["scheme"].endswith("-fused") else 7) and row["kernels_per_layer"] > 20
        assert row["ms_per_step"] > 0 and row["gpu_kernels_per_step"] is None
