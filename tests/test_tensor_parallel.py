"""Tensor-parallel streamed generation on the CPU with gloo: each rank runs its own program,
holding its shard of the weights, with the collectives as ops of the program.

Tokens must equal the single-process program's and transformers' greedy tokens, and logits
agree within the reduction-order tolerance (a row-parallel matmul sums its pieces over the
ranks, not in one dot product). A program on the wrong number of ranks is refused naming both
numbers; a rank that dies mid-generation makes the others fail with a clear error, not hang.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import time

import pytest
import torch

import hostswap.llm as llm
from hostswap.runtime.ptd import PtdFile
from hostswap.tensor_parallel import TensorParallelError, plan_tensor_parallel, rank_path

from ports import free_port
from real_models import VOCAB, _decoder_common
from test_generation import transformers_greedy

MAX_SEQ_LEN, CHUNK, NEW = 24, 4, 8
LOGITS_TOLERANCE = 1e-5  # fp32, a sum over ranks instead of one dot product


def _llama():
    import transformers as T

    return T.LlamaForCausalLM(T.LlamaConfig(**_decoder_common(num_key_value_heads=4)))


def _qwen2():
    import transformers as T

    return T.Qwen2ForCausalLM(T.Qwen2Config(**_decoder_common(num_key_value_heads=4)))  # q/k/v biases split with their heads


def _qwen3_moe():
    import transformers as T

    return T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**_decoder_common(
        num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)))


def _mixtral():
    import transformers as T

    return T.MixtralForCausalLM(T.MixtralConfig(**_decoder_common(num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2)))


def _olmoe():
    import transformers as T

    return T.OlmoeForCausalLM(T.OlmoeConfig(**_decoder_common(num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, eos_token_id=None)))


def _phi3():
    import transformers as T

    # fused qkv and gate|up gathered whole, o and down split on their input (rowwise_split_input)
    return T.Phi3ForCausalLM(T.Phi3Config(**_decoder_common(num_key_value_heads=4, pad_token_id=0)))


def _gpt_neox():
    import transformers as T

    return T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**_decoder_common()))  # fused per-head qkv; no KV head count in its config


MODELS = {"Llama": _llama, "Qwen2": _qwen2, "Qwen3-MoE": _qwen3_moe, "Mixtral": _mixtral, "Phi-3": _phi3, "GPT-NeoX": _gpt_neox, "OLMoE": _olmoe}
ON_TWO_RANKS_ONLY = {"Llama", "Mixtral", "Phi-3", "GPT-NeoX", "OLMoE"}  # 4 ranks: Qwen2 (biases split too) and one MoE (Qwen3-MoE) keep the test time down
PROMPT = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))


def _model(name: str):
    torch.manual_seed(0)
    return MODELS[name]().eval()


def _run_rank(rank: int, world: int, port: int, prefix: str, out: str, die_after_warm_up: int | None = None) -> None:
    """One rank: its program generated greedily; rank 0 writes tokens and prefill logits."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    try:
        path = rank_path(prefix, rank)
        with llm.Generator(path + ".pte", path + ".ptd", device="cpu") as g:
            if rank == die_after_warm_up:
                os._exit(3)  # a rank that stops: no goodbye to its peers
            try:
                tokens = g.generate(PROMPT, NEW)
            except Exception as e:  # noqa: BLE001 - what the surviving rank reports is the test's subject
                if rank == 0:
                    torch.save({"error": f"{type(e).__name__}: {e}"}, out)
                if die_after_warm_up is not None:
                    # gloo's process group, its peer gone, can abort in its destructor at
                    # interpreter exit ("terminate called without an active exception"), after
                    # the error this test checks: leave without tearing it down
                    os._exit(0)
                return
            g.module.reset_state()
            logits = g._step(llm.PREFILL, PROMPT[:, :CHUNK], 0)
            stats = g.stats
        if rank == 0:
            torch.save({"tokens": tokens, "logits": logits, "stats": stats}, out)
    finally:
        if die_after_warm_up is None:
            dist.destroy_process_group()


def _spawn(world: int, prefix: str, out: str, die_after_warm_up: int | None = None, timeout: float = 240) -> list[int]:
    """Start ``world`` ranks, wait for them; their exit codes."""
    context = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [context.Process(target=_run_rank, args=(r, world, port, prefix, out, die_after_warm_up)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    codes = []
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
            codes.append(None)
        else:
            codes.append(p.exitcode)
    return codes


_single: dict[str, tuple] = {}


def _single_process(name: str, tmp_path_factory) -> tuple:
    """(tokens, prefill logits) of the one-process program of ``name``, and transformers' tokens."""
    if name not in _single:
        directory = tmp_path_factory.mktemp(f"single-{name}")
        pte, ptd = llm.export(_model(name), directory / "model", max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK)
        with llm.Generator(pte, ptd, device="cpu") as g:
            tokens = g.generate(PROMPT, NEW)
            g.module.reset_state()
            logits = g._step(llm.PREFILL, PROMPT[:, :CHUNK], 0)
        _single[name] = tokens, logits, transformers_greedy(_model(name), PROMPT, NEW, MAX_SEQ_LEN)
    return _single[name]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(MODELS))
def test_tensor_parallel_tokens_equal_single_process(name, world, tmp_path, tmp_path_factory):
    if name in ON_TWO_RANKS_ONLY and world == 4:
        pytest.skip("on 2 ranks only: Qwen2 and Qwen3-MoE run on 4")
    tokens, logits, reference = _single_process(name, tmp_path_factory)
    prefix = str(tmp_path / "model")
    ptes, ptds = llm.export(_model(name), prefix, max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK, tensor_parallel=world)
    assert ptes == [rank_path(prefix, r) + ".pte" for r in range(world)] and all(os.path.exists(p) for p in ptds)
    # each rank's weights are its shard: the split layers' bytes fall by the world size
    single = os.path.getsize(str(tmp_path_factory.getbasetemp() / f"single-{name}0" / "model.ptd"))
    assert all(os.path.getsize(p) < single * 0.75 for p in ptds)
    out = str(tmp_path / "rank0.pt")
    assert _spawn(world, prefix, out) == [0] * world
    got = torch.load(out)
    assert torch.equal(got["tokens"], tokens), (got["tokens"], tokens)
    assert torch.equal(got["tokens"], reference)
    torch.testing.assert_close(got["logits"], logits, rtol=LOGITS_TOLERANCE, atol=LOGITS_TOLERANCE)


BATCH_PROMPTS = [[5, 9, 2], [7, 1, 3, 3, 8, 2], [11]]


def _run_batched_rank(rank: int, world: int, port: int, prefix: str, out: str) -> None:
    """One rank of a batched program: three prompts decoded together; rank 0 writes the tokens."""
    import torch.distributed as dist

    from hostswap.batching import BatchGenerator

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        path = rank_path(prefix, rank)
        with BatchGenerator(path + ".pte", path + ".ptd", device="cpu") as g:
            assert g.tensor_parallel == (rank, world)
            tokens = g.generate(BATCH_PROMPTS, NEW)
        if rank == 0:
            torch.save(tokens, out)
    finally:
        dist.destroy_process_group()


def test_batched_program_on_two_ranks_equals_one_process(tmp_path):
    """A program with slots for several sequences, split over 2 ranks: the sequences decoded
    together get the one-process program's tokens."""
    from hostswap.batching import BatchGenerator

    single = str(tmp_path / "single")
    llm.export(_model("Qwen3-MoE"), single, max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK, max_batch_size=3)
    with BatchGenerator(single + ".pte", single + ".ptd", device="cpu") as g:
        expected = g.generate(BATCH_PROMPTS, NEW)
    prefix = str(tmp_path / "tp")
    llm.export(_model("Qwen3-MoE"), prefix, max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK, max_batch_size=3, tensor_parallel=2)
    out = str(tmp_path / "rank0.pt")
    context = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [context.Process(target=_run_batched_rank, args=(r, 2, port, prefix, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    assert [p.exitcode for p in procs] == [0, 0]
    assert torch.load(out) == expected


@pytest.fixture(scope="module")
def llama_tp2(tmp_path_factory) -> str:
    """The path prefix of a Llama program for 2 ranks."""
    prefix = str(tmp_path_factory.mktemp("llama-tp2") / "model")
    llm.export(_model("Llama"), prefix, max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK, tensor_parallel=2)
    return prefix


def test_a_rank_that_dies_makes_the_others_fail_clearly(llama_tp2, tmp_path):
    prefix = llama_tp2
    out = str(tmp_path / "rank0.pt")
    started = time.monotonic()
    codes = _spawn(2, prefix, out, die_after_warm_up=1, timeout=120)
    assert codes[1] == 3 and codes[0] == 0, codes  # rank 0 returned with an error instead of hanging
    assert time.monotonic() - started < 110
    error = torch.load(out)["error"]
    assert "CollectiveError" in error and "on rank 0 of 2" in error, error


def test_a_program_loaded_on_another_world_size_is_refused(llama_tp2):
    import torch.distributed as dist

    path = rank_path(llama_tp2, 0)
    with pytest.raises(TensorParallelError, match=r"exported for 2 tensor-parallel ranks: run it under torchrun --nproc-per-node 2"):
        llm.Generator(path + ".pte", path + ".ptd", device="cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        with pytest.raises(TensorParallelError, match=r"exported for 2 tensor-parallel ranks; this process group has 1"):
            llm.Generator(path + ".pte", path + ".ptd", device="cpu")
    finally:
        dist.destroy_process_group()


def test_plans_that_cannot_split_are_refused_by_name():
    with pytest.raises(TensorParallelError, match=r"model.layers.0.self_attn.q_proj has 64 features, which 3 ranks cannot split evenly"):
        plan_tensor_parallel(_model("Llama"), 3)
    llama = _model("Llama")
    llama._tp_plan = {**llama._tp_plan, "model.layers.*.self_attn.o_proj": "local_rowwise"}
    with pytest.raises(TensorParallelError, match=r"splits 'model.layers.\*.self_attn.o_proj' as 'local_rowwise', which hostswap does not split"):
        plan_tensor_parallel(llama, 2)
    quantized = llm.quantize(_model("Llama"), "int8")
    with pytest.raises(TensorParallelError, match=r"'model.layers.0.self_attn.q_proj' holds a quantized weight .* cannot split yet"):
        plan_tensor_parallel(quantized, 2)
    with pytest.raises(TensorParallelError, match=r"'model.layers.0.self_attn.q_proj' holds a quantized weight"):
        llm.export(quantized, "unused", max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK, tensor_parallel=2)  # its linears swapped for hostswap's kernel
    with pytest.raises(TensorParallelError, match="positive int"):
        plan_tensor_parallel(_model("Llama"), 0)
    import transformers as T

    gpt2 = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=1, n_head=4))
    with pytest.raises(TensorParallelError, match="GPT2LMHeadModel has no tensor-parallel plan|GPT2LMHeadModel's plan"):
        plan_tensor_parallel(gpt2, 2)


def test_sharded_model_is_put_back_whole():
    from hostswap.llm import prepare_for_export
    from hostswap.tensor_parallel import sharded

    model = _model("Qwen3-MoE")
    prepare_for_export(model)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    heads = (model.config.num_attention_heads, model.config.num_key_value_heads)
    plan = plan_tensor_parallel(model, 2)
    with sharded(model, plan, 1):
        assert model.model.layers[0].self_attn.q_proj.weight.shape[0] == model.model.layers[0].self_attn.q_proj.out_features // 2
        assert model.model.layers[0].mlp.experts.down_proj.shape[-1] == 16
        assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (heads[0] // 2, heads[1] // 2)
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[n], v) for n, v in before.items())
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == heads
    assert not any(m._forward_hooks for m in model.modules())


def test_cli_generate_under_torchrun(llama_tp2, tmp_path_factory):
    import subprocess
    import sys

    tokens, _, _ = _single_process("Llama", tmp_path_factory)
    ids = ",".join(str(t) for t in PROMPT[0].tolist())
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "hostswap.cli", "generate", llama_tp2, "--device", "cpu", "--prompt-ids", ids, "--max-new-tokens", str(NEW)],
                         capture_output=True, text=True, timeout=240, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == [str(t) for t in tokens[0, PROMPT.shape[1]:].tolist()]  # rank 0 alone prints them
    assert "loaded rank 0" in run.stderr and "loaded rank 1" in run.stderr
    # the same program without torchrun: told how to run it
    alone = subprocess.run([sys.executable, "-m", "hostswap.cli", "generate", llama_tp2, "--device", "cpu", "--prompt-ids", ids],
                           capture_output=True, text=True, timeout=240, env=env)
    assert alone.returncode == 2 and "tensor-parallel program of 2 ranks: run it with torchrun --nproc-per-node 2" in alone.stderr


def test_bench_script_on_the_cpu(tmp_path):
    """bench/tensor_parallel.py's paths on gloo: a row per world size and budget, tokens equal to one process's."""
    import json

    from bench_scripts import load

    bench = load("tensor_parallel")
    bench.main(["--worlds", "1,2", "--device", "cpu", "--layers", "1", "--hidden", "64", "--heads", "4", "--kv-heads", "4", "--vocab", "128",
                "--tokens", "3", "--out", str(tmp_path), "--workdir", str(tmp_path)])
    (path,) = tmp_path.glob("tp_cpu.json")
    rows = json.loads(path.read_text())["rows"]
    assert [(r["gpus"], r["budget"]) for r in rows] == [(1, "floor"), (1, "50%"), (2, "floor"), (2, "50%")], rows
    assert all(r["tokens_part_from_one_gpu_at"] is None for r in rows if r["gpus"] == 2)
    assert rows[2]["streamed_mib_per_token_per_rank"] < rows[0]["streamed_mib_per_token_per_rank"]


@pytest.mark.parametrize("name,tied", [("Llama", True), ("Qwen3-MoE", False)])
def test_checkpoint_export_splits_each_tensor_as_the_model_export(name, tied, tmp_path):
    """export_checkpoint(..., tensor_parallel=2) reads each tensor from the shards and writes each
    rank's piece: the same weight bytes as splitting the loaded model (a tied head split apart
    from the whole token table)."""
    from transformers import AutoModelForCausalLM

    model = _model(name)
    model.config.tie_word_embeddings = tied
    if tied:
        model.tie_weights()
    model.save_pretrained(tmp_path / "ckpt")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    _, from_model = llm.export(loaded, tmp_path / "model", max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK, tensor_parallel=2)
    said = {1: [], 2: []}
    llm.export_checkpoint(tmp_path / "ckpt", tmp_path / "one", max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK, progress=said[1].append)
    ptes, from_checkpoint = llm.export_checkpoint(tmp_path / "ckpt", tmp_path / "streamed", max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK,
                                                  tensor_parallel=2, progress=said[2].append)
    assert ptes == [rank_path(tmp_path / "streamed", r) + ".pte" for r in range(2)]
    read = {world: [float(m.split()[1]) for m in messages if m.startswith("read ")] for world, messages in said.items()}  # MiB
    # the ranks' files are written together: each tensor is read once, not once per rank (a
    # tied table is read twice: whole for the embedding, split for the head)
    table = VOCAB * model.config.hidden_size * 4 / 2**20 if tied else 0.0
    assert len(read[2]) == 1 and read[2][0] <= read[1][0] + table + 0.1, read
    for a, b in zip(from_model, from_checkpoint):
        with PtdFile(a) as fa, PtdFile(b) as fb:
            assert fa.entries.keys() == fb.entries.keys()
            for fqn in fa.entries:
                assert torch.equal(fa.host_tensor(fqn).reshape(-1).view(torch.uint8), fb.host_tensor(fqn).reshape(-1).view(torch.uint8)), fqn
            assert fa.index.checksums == fb.index.checksums
    with PtdFile(from_checkpoint[1]) as rank1:
        head = rank1.host_tensor("model.lm_head.weight")
        assert head.shape[0] == VOCAB // 2 and rank1.host_tensor("model.model.embed_tokens.weight").shape[0] == VOCAB
        whole = loaded.lm_head.weight.detach()
        assert torch.equal(head, whole[VOCAB // 2:])  # rank 1 holds the second half of the vocabulary


@pytest.mark.parametrize("batched", [False, True], ids=["one sequence", "continuous batching"])
def test_serve_under_torchrun(batched, tmp_path):
    """``hostswap serve`` on 2 ranks: rank 0 answers over HTTP with the one-process program's
    text; a stop string ends a generation early on every rank, and the next request still runs;
    SIGTERM ends every rank. With a batched program, the requests run at once, joining and
    leaving the batch on every rank alike."""
    import concurrent.futures

    import json
    import signal
    import subprocess
    import sys
    import urllib.request

    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from transformers import AutoTokenizer

    from hostswap.demo import GGUF_FILE, smollm2_folder

    try:
        tokenizer = AutoTokenizer.from_pretrained(smollm2_folder(), gguf_file=GGUF_FILE)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"the tokenizer's package is missing: {e}")
    import transformers as T

    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                             tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=None)).eval()
    single = str(tmp_path / "single")
    llm.export(model, single, max_seq_len=64, prefill_chunk=8)
    prefix = str(tmp_path / "tp")
    llm.export(model, prefix, max_seq_len=64, prefill_chunk=8, tensor_parallel=2, **({"max_batch_size": 4} if batched else {}))
    tokenizer.save_pretrained(prefix + ".tokenizer")
    prompts = ["The capital of France is", "Once upon a time"]
    with llm.Generator(single + ".pte", single + ".ptd", device="cpu") as g:
        expected = []
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            expected.append(tokenizer.decode(g.generate(ids, 12)[0, ids.shape[1]:].tolist(), skip_special_tokens=True))
    port = free_port()
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    process = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                "-m", "hostswap.cli", "serve", prefix, "--device", "cpu", "--port", str(port), "--model-id", "tp"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"

    def complete(prompt: str, **extra) -> str:
        body = json.dumps({"model": "tp", "prompt": prompt, "max_tokens": 12, "temperature": 0, **extra}).encode()
        request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())["choices"][0]

    try:
        deadline = time.time() + 240
        while True:
            assert process.poll() is None, process.stderr.read()[-3000:]
            try:
                if json.loads(urllib.request.urlopen(url + "/health", timeout=1).read())["status"] == "ok":
                    break
            except (OSError, ValueError):
                assert time.time() < deadline, "the server did not start"
                time.sleep(0.5)
        stop = expected[0][len(expected[0]) // 2:][:3]
        requests = [(prompts[0], {}), (prompts[1], {}), (prompts[0], {"stop": [stop]}), (prompts[1], {"temperature": 0.8})]
        with concurrent.futures.ThreadPoolExecutor(len(requests) if batched else 1) as pool:
            answers = list(pool.map(lambda r: complete(r[0], **r[1]), requests))
        assert [a["text"] for a in answers[:2]] == expected
        assert answers[2]["finish_reason"] == "stop" and answers[2]["text"] == expected[0][: expected[0].index(stop)]
        assert answers[3]["finish_reason"] == "length"  # sampled: rank 0 gives every rank its seed
        assert complete(prompts[1])["text"] == expected[1]  # the ranks are still in step
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    errors = process.stderr.read()
    # torchrun reports the signal it was stopped with; the ranks themselves end without an error
    assert not any(e in errors for e in ("Connection closed", "CollectiveError", "generation failed")), errors[-3000:]
    assert "Traceback" not in errors.split("Received 15 death signal")[0], errors[-3000:]
