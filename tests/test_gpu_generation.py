"""Generation on CUDA as a user runs it: a bf16 transformers checkpoint saved with
``save_pretrained``, exported with ``hostswap export-llm``, run with ``hostswap generate`` and
``Generator``: the same tokens in every process, at every budget, graphed or eager; the
speed a short run reports is the speed a long one reports; the default budget ("auto") runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import hostswap
from hostswap.runtime.compiled_method import CompiledExecutor

pytestmark = pytest.mark.gpu
MB = 2**20
PROMPT = 40
VOCAB = 32000


def _cli(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "hostswap.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    """A 12-layer Qwen2-shaped model (q/k/v bias, GQA, tied embeddings), bf16, random weights,
    saved as a checkpoint and exported from it by the CLI with its defaults."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder = tmp_path_factory.mktemp("qwen2")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                         num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder / "ckpt")
    exported = _cli("export-llm", str(folder / "ckpt"), "--out", str(folder / "qwen2"), "--max-seq-len", "256")
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert "exporting prefill (128 tokens)" in exported.stderr
    return str(folder / "qwen2")


def _prompt() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))


RUNS = """
import json, sys, torch
import hostswap, hostswap.llm as llm
base, budgets = sys.argv[1], [float(b) for b in sys.argv[2].split(",")]
prompt = torch.randint(0, {vocab}, (1, {prompt}), generator=torch.Generator().manual_seed(1))
out = {{}}
for budget in budgets:
    for graphed in (True, False):
        with llm.Generator(base + ".pte", base + ".ptd", weight_offload_budget_mb=budget, device="cuda", cuda_graph=graphed) as g:
            out[f"{{budget:.0f}} MB {{'graphed' if graphed else 'eager'}}"] = g.generate(prompt, 64)[0, {prompt}:].tolist()
print(json.dumps(out))
"""


def test_bf16_greedy_tokens_are_the_same_in_every_process_budget_and_mode(program):
    """64 greedy tokens of a near-flat random-weight bf16 model (near-ties everywhere), in two
    processes, at the floor and at half the weights, graphed and eager: all identical."""
    schedule = hostswap.schedules.load_weight_schedule(program + ".pte", "decode")
    floor = max(s.floor_bytes for s in hostswap.schedules.load_weight_schedules(program + ".pte").values())
    budgets = f"{floor / MB + 1},{max(floor, schedule.total_bytes // 2) / MB}"
    script = RUNS.format(vocab=VOCAB, prompt=PROMPT)
    runs = {}
    for process in ("first", "second"):
        result = subprocess.run([sys.executable, "-c", script, program, budgets], capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, result.stderr[-3000:]
        runs.update({f"{process} process, {name}": tokens for name, tokens in json.loads(result.stdout.strip().splitlines()[-1]).items()})
    reference_name, reference = next(iter(runs.items()))
    for name, tokens in runs.items():
        first = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)
        print(f"{name}: {'same as ' + reference_name if first is None else f'differs from token {first}'}")
    assert all(tokens == reference for tokens in runs.values()), runs


def test_a_short_run_reports_the_speed_of_a_long_one(program):
    """`hostswap generate` at the floor, 32 then 128 then 32 new tokens, each a fresh process:
    the warm-up at load takes the first call's costs, so 32 tokens report the ms/token of 128
    (within 15 %)."""
    import re

    floor = max(s.floor_bytes for s in hostswap.schedules.load_weight_schedules(program + ".pte").values())
    prompt = ",".join(str(t) for t in _prompt()[0].tolist())
    per_token = {}
    for new in (32, 128, 32):
        result = _cli("generate", program, "--budget-mb", f"{floor / MB + 1:.2f}", "--prompt-ids", prompt, "--max-new-tokens", str(new))
        assert result.returncode == 0, result.stderr[-3000:]
        summary = result.stderr.strip().splitlines()[-1]
        print(f"--max-new-tokens {new}: {summary}")
        assert f", {new} new tokens;" in summary and "one-time: load" in summary and "warm-up" in summary
        per_token.setdefault(new, []).append(float(re.search(r"([0-9.]+) ms/token", summary).group(1)))
    short, long = min(per_token[32]), per_token[128][0]
    assert 0.85 < short / long < 1.15, per_token


def test_generate_without_a_budget_takes_auto_and_prints_its_choice(program):
    result = _cli("generate", program, "--prompt-ids", ",".join(str(i) for i in range(1, 11)), "--max-new-tokens", "16")
    assert result.returncode == 0, result.stderr[-3000:]
    print(result.stderr)
    assert "weight budget auto:" in result.stderr and "every weight resident" in result.stderr  # 0.1 GiB on an 80 GB GPU
    assert "one-time: load" in result.stderr and "ms/token" in result.stderr and len(result.stdout.split()) == 16


def test_weights_read_from_disk_give_the_tokens_of_weights_in_pinned_memory(program):
    """At the floor, host budgets of nothing and half the weights (read through the pinned
    staging ring, decode eager) give the 32 tokens of every weight pinned (decode graphed);
    an explicit cuda_graph with weights on disk is refused."""
    import hostswap.llm as llm

    schedules = hostswap.schedules.load_weight_schedules(program + ".pte")
    floor = max(s.floor_bytes for s in schedules.values()) / MB + 1
    total = schedules["decode"].total_bytes / MB
    tokens, disk = {}, {}
    for host in (total, total / 2, 0):
        with llm.Generator(program + ".pte", program + ".ptd", weight_offload_budget_mb=floor, host_memory_budget_mb=host, device="cuda") as g:
            tokens[host] = g.generate(_prompt(), 32)[0, PROMPT:].tolist()
            disk[host] = (g.stats["bytes_from_disk_per_token"], g.module.cuda_graph, g.module.stats["disk_reads"])
            print(f"host budget {host:.0f} MiB: {g.summary()}; {g.module.host_budget.explain(g.module.tiers)}")
    assert disk[total][0] == 0 and disk[total][1]  # all pinned: graphed decode, nothing from disk
    assert disk[total / 2][0] > 0 and disk[0][0] > disk[total / 2][0] and not disk[0][1]
    assert tokens[total / 2] == tokens[total] and tokens[0] == tokens[total], tokens
    with pytest.raises(ValueError, match="cuda_graph needs every streamed weight in pinned host memory"):
        llm.Generator(program + ".pte", program + ".ptd", weight_offload_budget_mb=floor, host_memory_budget_mb=0, device="cuda", cuda_graph=True)


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_quantized_streamed_export_is_the_quantized_in_memory_export_on_cuda(scheme, tmp_path):
    """Each linear quantized on the GPU as it is written gives the weights, checksums and tokens
    of hostswap.llm.quantize + export on the loaded model (int4 packs on CUDA only)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    import hostswap.llm as llm
    from hostswap.checkpoint import export_checkpoint
    from hostswap.runtime.ptd import PtdFile

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, bos_token_id=None, eos_token_id=None)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "ckpt")
    loaded = llm.quantize(AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16).eval(), scheme)
    a = llm.export(loaded, tmp_path / "loaded", max_seq_len=64)
    b = export_checkpoint(tmp_path / "ckpt", tmp_path / "streamed", max_seq_len=64, quantize=scheme)
    with PtdFile(a[1]) as fa, PtdFile(b[1]) as fb:
        assert any(f.endswith(".weight_qdata") for f in fb.entries)
        differ = sorted(f for f in fa.entries if fa.index.checksums[f] != fb.index.checksums.get(f))
        print(f"{scheme}: {len(differ)} of {len(fa.entries)} weights differ: {differ[:4]}")
        assert not differ
    tokens = []
    for pte, ptd in (a, b):
        with llm.Generator(pte, ptd, device="cuda") as g:
            tokens.append(g.generate(_prompt()[:, :16], 16, eos_token_id=[])[0].tolist())
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("name", ["Mixtral", "Qwen3-MoE", "gpt-oss"])
def test_routed_experts_decode_graphed_on_the_device(name, tmp_path):
    """MoE decode as one CUDA graph per token, its experts read in place from the mapped
    .ptd or through a device cache, run a kernel per instruction or compiled into one inductor
    graph: the tokens of the eager run, of the run with every expert table resident, and of
    transformers' greedy generate (fp32); the graph reads each token's
    top-k per layer, nothing more, and the cache's misses only."""
    import hostswap.llm as llm
    from test_experts import ExportedMoE

    torch.manual_seed(0)
    moe = ExportedMoE(name, tmp_path)
    prompt = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(1))
    expected = moe.transformers_tokens(prompt, 12)
    runs = {}
    per_token = sum(b.top_k * b.unit_bytes for b in moe.schedules["decode"].expert_blocks)
    scratch = max(s.expert_scratch_bytes for s in moe.schedules.values())
    # on CUDA the budget holds no gathered scratch: every weight but the experts on the device,
    # and the test's cache slots beside them
    in_place, cached = moe.schedules["decode"].resident_bytes, moe.cached - scratch
    # on CUDA the products read each step's picks in place: the floor adds no gathered scratch
    with pytest.raises(hostswap.runtime.BudgetError, match=rf"at least {moe.floor - scratch} bytes \("):
        llm.Generator(moe.pte, moe.ptd, weight_offload_budget_mb=(moe.floor - scratch - 1) / MB, device="cuda")
    for label, budget, graphed in (("floor graphed", moe.floor, True), ("floor eager", moe.floor, False), ("resident graphed", moe.everything, True),
                                   ("in-place floor graphed", moe.floor - scratch, True),
                                   ("cache graphed", cached, True), ("cache eager", cached, False), ("cache graphed, guess prefetched", cached, True),
                                   ("in place graphed, compiled", in_place, True), ("cache graphed, compiled, guess prefetched", cached, True)):
        prefetch = label.endswith("prefetched")
        compiled = (llm.DECODE,) if "compiled" in label else False  # one inductor graph, the experts' op inside it
        with llm.Generator(moe.pte, moe.ptd, weight_offload_budget_mb=budget / MB, device="cuda", cuda_graph=graphed, expert_prefetch=prefetch,
                           compiled=compiled) as g:
            runs[label] = g.generate(prompt, 12, eos_token_id=[]).cpu()
            assert g.module.cuda_graph == graphed
            if compiled:
                assert g.module._probed[llm.DECODE].compiled and not g.module.resident_experts
            if label == "floor graphed":
                assert g.stats["expert_bytes_per_token"] == per_token
            if label == "in-place floor graphed":
                assert g.module.expert_scratch_bytes == 0 and not g.module.expert_caches and g.stats["expert_bytes_per_token"] == per_token
            if label.startswith("cache"):  # the device cache, looked up, filled and prefetched into inside the graph
                reads = g.stats["expert_reads"]
                assert all(r["cache_slots"] == moe.cache_slots and r["hits"] > 0 and r["hits"] + r["misses"] == r["experts"] for r in reads.values()), reads
                # every block but the first is guessed by the one before, on a side stream (a guess
                # whose picks are all cached copies nothing)
                counts = [r["prefetched"] for r in reads.values()]
                assert counts[0] == 0 and (sum(counts) > 0) == prefetch, reads
                assert all(r["prefetch_hits"] <= r["prefetched"] for r in reads.values()), reads
                if not prefetch:
                    assert 0 < g.stats["expert_bytes_per_token"] < per_token
    for label, tokens in runs.items():
        assert torch.equal(tokens, runs["floor eager"]), label
    # transformers' greedy tokens, fp32 on the CPU: a tiny model's margins exceed the kernels' rounding
    assert torch.equal(runs["floor eager"], expected), (runs["floor eager"].tolist(), expected.tolist())


@pytest.mark.parametrize("name", ["Mixtral", "Qwen3-MoE", "gpt-oss"])
def test_routed_experts_read_from_disk_on_the_device(name, tmp_path):
    """Expert tables left on disk behind a host cache of one call's picks per block: decode
    runs eagerly by default (a graph is refused, naming why), its products read the host slots
    in place or through a device cache, and the tokens are those of the tables pinned whole."""
    import hostswap.llm as llm
    from hostswap.runtime.expert_store import minimum_host_cache_bytes
    from test_experts import ExportedMoE

    torch.manual_seed(0)
    moe = ExportedMoE(name, tmp_path)
    prompt = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(1))
    blocks = moe.schedules["decode"].expert_blocks
    least = minimum_host_cache_bytes(blocks) / MB
    scratch = max(s.expert_scratch_bytes for s in moe.schedules.values())
    with llm.Generator(moe.pte, moe.ptd, weight_offload_budget_mb=moe.floor / MB, device="cuda") as g:
        pinned = g.generate(prompt, 12, eos_token_id=[]).cpu()
        assert g.module.cuda_graph and not g.module.host_experts
    with pytest.raises(ValueError, match="cuda_graph needs the routed experts in pinned host memory; expert tables .* read from the disk"):
        llm.Generator(moe.pte, moe.ptd, weight_offload_budget_mb=moe.floor / MB, device="cuda", cuda_graph=True, expert_host_cache_mb=least)
    for label, budget in (("in place", moe.floor - scratch), ("device cache", moe.cached - scratch)):
        with llm.Generator(moe.pte, moe.ptd, weight_offload_budget_mb=budget / MB, device="cuda", expert_host_cache_mb=least) as g:
            out = g.generate(prompt, 12, eos_token_id=[]).cpu()
            assert torch.equal(out, pinned), (label, out.tolist(), pinned.tolist())
            assert not g.module.cuda_graph and set(g.module.host_experts) == {b.block for b in blocks}
            assert all(t.is_cuda for c in g.module.host_experts.values() for t in c.tables)  # device views of the pinned slots
            s = g.stats
            assert s["expert_disk_bytes_read"] > 0 and s["bytes_from_disk_per_token"] > 0
            assert all(c["misses"] > 0 for c in s["expert_host_cache"].values())
            # the tables themselves are not registered, only their host slots (a page at either
            # end may be, for a weight beside it)
            base = g.module.ptd.base_pointer
            tables = [g.module.ptd.entries[t] for b in blocks for t in b.tables]
            assert any(e.nbytes > 2 * 4096 for e in tables)  # (gpt-oss' bias tables are a page each)
            for e in tables:
                covered = sum(max(0, min(start + length, base + e.offset + e.nbytes) - max(start, base + e.offset)) for start, length in g.module.ptd.registered)
                assert covered <= 2 * 4096, (e.fqn, covered, e.nbytes)
            if label == "device cache":
                assert all(r["cache_hits"] > 0 for r in s["expert_reads"].values())


def test_batched_decode_graphed_gives_each_sequence_its_own_tokens(tmp_path):
    """Eight slots, decode graphed, twelve prompts of different lengths joining and leaving:
    in bf16 each sequence gets bitwise the tokens it gets alone in the same program (a row's
    arithmetic does not depend on its companions); in fp32 those of the batch-1 program."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import hostswap.llm as llm
    from hostswap import batching

    def model(dtype):
        torch.manual_seed(0)
        config = Qwen2Config(vocab_size=VOCAB, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
        return Qwen2ForCausalLM(config).to(dtype).eval()

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 40, 17, 3, 64, 9, 33, 21, 2, 50, 12, 28)]
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        pte, ptd = batching.export(model(dtype), tmp_path / f"eight-{name}", max_seq_len=128, max_batch_size=8, prefill_chunk=32)
        floor = hostswap.schedules.load_floor_bytes(hostswap.schedules.load_weight_schedules(pte))
        with batching.BatchGenerator(pte, ptd, weight_offload_budget_mb=floor / MB * 1.5, device="cuda") as b:
            assert b.module.cuda_graph
            together = b.generate(prompts, 24, eos_token_id=[])
            alone = [b.generate([p], 24, eos_token_id=[])[0] for p in prompts]
        assert together == alone, name
        if dtype == torch.float32:
            one_pte, one_ptd = llm.export(model(dtype), tmp_path / "one", max_seq_len=128, prefill_chunk=32)
            with llm.Generator(one_pte, one_ptd, weight_offload_budget_mb=floor / MB * 1.5, device="cuda") as one:
                single = [one.generate(torch.tensor([p]), 24, eos_token_id=[])[0, len(p):].tolist() for p in prompts]
            assert together == single


def _batched_moe_case():
    """Five prompts of 3 to 11 tokens, and the tiny Qwen3-MoE (top-2 of 8 experts) they go through."""
    from test_experts import MOE

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 11, 3, 8, 6)]

    def model():
        torch.manual_seed(0)
        return MOE["Qwen3-MoE"]().eval()

    return prompts, model


def test_batched_moe_decode_graphed_reads_the_union_of_its_live_rows(tmp_path):
    """A batched decode step of an MoE model, graphed, its experts read in place from host
    memory (top-2 of 8 experts, 2 and 4 slots): each replay reads each expert its live rows
    picked once, counted on the device. One sequence alone reads its 2 picks a step; several
    read at most 2 a live row and at most the 8 experts. Each sequence gets its tokens alone in
    the same program (a row's products do not depend on its companions), and the batch-1
    program's (products within float32 rounding of its per-pick ones). Five prompts join and
    leave."""
    import hostswap.llm as llm
    from hostswap import batching

    prompts, model = _batched_moe_case()

    one_pte, one_ptd = llm.export(model(), tmp_path / "one", max_seq_len=64, prefill_chunk=8)
    floor = hostswap.schedules.load_floor_bytes(hostswap.schedules.load_weight_schedules(one_pte))
    with llm.Generator(one_pte, one_ptd, weight_offload_budget_mb=floor / MB, device="cuda") as one:
        single = [one.generate(torch.tensor([p]), 10, eos_token_id=[])[0, len(p):].tolist() for p in prompts]
    for slots in (2, 4):
        pte, ptd = batching.export(model(), tmp_path / f"b{slots}", max_seq_len=64, max_batch_size=slots, prefill_chunk=8)
        floor = hostswap.schedules.load_floor_bytes(hostswap.schedules.load_weight_schedules(pte))
        with batching.BatchGenerator(pte, ptd, weight_offload_budget_mb=floor / MB, device="cuda") as b:
            assert b.module.cuda_graph and not b.module.expert_caches and not b.module.resident_experts
            alone = [b.generate([p], 10, eos_token_id=[])[0] for p in prompts]
            before = {block: r.experts for block, r in b.module._settled_expert_reads().items()}
            calls = {block: r.calls for block, r in b.module.expert_reads.items()}
            together = b.generate(prompts, 10, eos_token_id=[])
            # a replay counts its call on the host and its union on the device
            replay = b.module._probed[batching.DECODE].replay_expert_reads
            assert replay and all((r.calls, r.experts, r.row_experts) == (1, 0, 0) for r in replay.values()), replay
            reads = b.module._settled_expert_reads()
            for block, r in reads.items():
                steps = r.calls - calls[block]  # the prefill chunks' calls among them read their union eagerly
                assert 0 < r.experts - before[block] <= 8 * steps, (block, steps)
            sequence = b.add(prompts[0], 6, eos_token_id=[])
            before = {block: r.experts for block, r in b.module._settled_expert_reads().items()}
            steps = 0
            while not sequence.finished:
                b.step()
                steps += 1
            assert all(r.experts - before[block] == steps * 2 for block, r in b.module._settled_expert_reads().items()), (steps, before)
        assert together == alone, (slots, together, alone)
        assert together == single, (slots, together, single)


def test_batched_moe_decode_graphed_runs_its_pairs_from_the_expert_cache(tmp_path):
    """A graphed batched decode step of 4 slots (top-2 of 8 experts) at a budget that gives each
    block a cache of 5 slots: the tokens looked up two at a time, each pair multiplied from its
    slot. Each sequence gets its tokens alone in the same program and the batch-1 program's; a
    replay looks up every live row's picks once (2 per row and block: one sequence alone looks
    up 2 a step) and the bus carries the misses only."""
    import hostswap.llm as llm
    from hostswap import batching

    prompts, model = _batched_moe_case()

    def cached_budget(pte, slots):  # on CUDA no gathered scratch
        decode = hostswap.schedules.load_weight_schedules(pte)["decode"]
        return decode.resident_bytes + sum(slots * b.unit_bytes for b in decode.expert_blocks)

    one_pte, one_ptd = llm.export(model(), tmp_path / "one", max_seq_len=64, prefill_chunk=8)
    with llm.Generator(one_pte, one_ptd, weight_offload_budget_mb=cached_budget(one_pte, 5) / MB, device="cuda") as one:
        assert all(c.slots == 5 for c in one.module.expert_caches.values())
        single = [one.generate(torch.tensor([p]), 10, eos_token_id=[])[0, len(p):].tolist() for p in prompts]
    pte, ptd = batching.export(model(), tmp_path / "b4", max_seq_len=64, max_batch_size=4, prefill_chunk=8)
    with batching.BatchGenerator(pte, ptd, weight_offload_budget_mb=cached_budget(pte, 5) / MB, device="cuda") as b:
        caches = b.module.expert_caches
        assert b.module.cuda_graph and caches and all(c.slots == 5 and c.top_k == 2 for c in caches.values())
        alone = [b.generate([p], 10, eos_token_id=[])[0] for p in prompts]
        before = {block: c.counts() for block, c in caches.items()}
        together = b.generate(prompts, 10, eos_token_id=[])
        replay = b.module._probed[batching.DECODE].replay_expert_reads
        assert replay and all((r.calls, r.experts, r.row_experts) == (1, 0, 2) for r in replay.values()), replay
        steps = {block: sum(c.counts()[:2]) - sum(before[block][:2]) for block, c in caches.items()}
        assert len(set(steps.values())) == 1 and next(iter(steps.values())) % 2 == 0 and next(iter(steps.values())) > 0, steps
        reads = b.module.stats["expert_reads"]
        assert all(0 < r["hits"] < r["experts"] and r["hits"] + r["misses"] == r["experts"] for r in reads.values()), reads
        sequence = b.add(prompts[0], 6, eos_token_id=[])
        before = {block: c.counts() for block, c in caches.items()}
        steps = 0
        while not sequence.finished:
            b.step()
            steps += 1
        assert all(sum(c.counts()[:2]) - sum(before[block][:2]) == 2 * steps for block, c in caches.items())
    assert together == alone, (together, alone)
    assert together == single, (together, single)


def test_speculative_decode_on_the_device_gives_the_plain_greedy_tokens(tmp_path):
    """fp32 Qwen2-shaped target at its floor with a verify method of 5 tokens, and two drafts
    held on the device: the target's own weights (every proposal accepted: 5 tokens per pass)
    and an int8 copy; both give the plain greedy tokens of the same program."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import hostswap.llm as llm

    def model():
        torch.manual_seed(0)
        config = Qwen2Config(vocab_size=VOCAB, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
        return Qwen2ForCausalLM(config).eval()

    target = llm.export(model(), tmp_path / "target", max_seq_len=128, prefill_chunk=32, speculate_k=4)
    llm.export(llm.quantize(model(), "int8"), tmp_path / "int8", max_seq_len=128, prefill_chunk=32)
    floor = hostswap.schedules.load_floor_bytes(hostswap.schedules.load_weight_schedules(target[0]))
    prompt = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    with llm.Generator(*target, weight_offload_budget_mb=floor / MB, device="cuda") as plain:
        expected = plain.generate(prompt, 48, eos_token_id=[]).cpu()
    with llm.Generator(*target, weight_offload_budget_mb=floor / MB, device="cuda", draft=str(tmp_path / "int8")) as g:
        assert g.draft_ahead  # the default on CUDA
    for draft in (str(tmp_path / "target"), str(tmp_path / "int8")):
        # the draft's decode as the executor's kernels, and as one inductor graph (the default on
        # CUDA); drafting in turn, and ahead on a stream of its own during each verify pass
        for compiled, ahead in ((False, False), (True, False), (True, True), (False, True)):
            with llm.Generator(*target, weight_offload_budget_mb=floor / MB, device="cuda", draft=draft, compile_draft=compiled, draft_ahead=ahead) as g:
                assert isinstance(g.draft.module._probed[llm.DECODE].executor, CompiledExecutor) == compiled
                assert torch.equal(g.generate(prompt, 48, eos_token_id=[]).cpu(), expected), (draft, compiled, ahead)
                assert (g.last_speculation.ahead_rounds > 0) == ahead, (draft, compiled, ahead)
                if draft.endswith("target"):
                    # the same weights: every proposal agrees (compiled, within inductor's rounding of fp32 sums)
                    assert g.last_speculation.acceptance == 1.0 if not compiled else g.last_speculation.acceptance > 0.9


def test_a_long_prompt_in_long_chunks_gives_the_short_chunks_logits_on_the_device(tmp_path):
    """fp32 Qwen2-shaped model exported with a long prefill chunk and with the short chunk
    alone: a 200-token prompt (two long calls and a short one, against seven short calls), at
    the floor, where each call streams the weights, and all resident, graphed decode after it.
    The prompt's last logits agree within fp32's rounding of other GEMM shapes, and the greedy
    tokens after it are the same."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import hostswap.llm as llm

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    model = Qwen2ForCausalLM(config).eval()
    long = llm.export(model, tmp_path / "long", max_seq_len=256, prefill_chunk=32, long_prefill_chunk=96)
    short = llm.export(model, tmp_path / "short", max_seq_len=256, prefill_chunk=32, long_prefill_chunk=None)
    floor = hostswap.schedules.load_floor_bytes(hostswap.schedules.load_weight_schedules(long[0]))
    prompt = torch.randint(0, VOCAB, (1, 200), generator=torch.Generator().manual_seed(1))
    for budget in (floor / MB, "auto"):
        logits, tokens = {}, {}
        for name, program in (("long", long), ("short", short)):
            with llm.Generator(*program, weight_offload_budget_mb=budget, device="cuda") as g:
                assert llm.PREFILL_LONG in g.prefill_chunks if name == "long" else g.long_prefill_chunk is None
                before = g.module.stats["forwards"]
                logits[name] = llm.prefill(g._step, prompt, g.prefill_chunks, g.max_seq_len).float().cpu()
                assert g.module.stats["forwards"] - before == (3 if name == "long" else 7)
                g.module.reset_state()
                tokens[name] = g.generate(prompt, 24, eos_token_id=[]).cpu()
        assert torch.allclose(logits["long"], logits["short"], rtol=1e-4, atol=1e-4), (budget, (logits["long"] - logits["short"]).abs().max())
        assert torch.equal(tokens["long"], tokens["short"]), budget
