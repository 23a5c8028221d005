"""Export from a checkpoint folder without loading the model (hostswap.checkpoint): the same
program, weight bytes and digest as exporting the loaded model, the same tokens, and a clear
error for every bad checkpoint."""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import tempfile

import pytest
import torch

import hostswap
import hostswap.llm as llm
from hostswap.checkpoint import CheckpointError, export_checkpoint
from hostswap.runtime.ptd import PtdFile
from hostswap.schedules.pte_program import read_program
from hostswap.schedules.serialization import saved_weights_digest

from real_models import BY_NAME, VOCAB, build
from test_generation import GENERATION_ARCHITECTURES

import bench_scripts

MB = 2**20
# bench/ is scripts beside the package: its checkpoint writer is loaded from the file itself
checkpoints = bench_scripts.load("checkpoints")
MAX_SEQ_LEN, CHUNK = 30, 4


def _saved(name: str, folder, **save_options):
    build(BY_NAME[name])[0].save_pretrained(folder, **save_options)
    return folder


# Falcon's attention creates a tensor in its forward: the streamed export refuses it by name
STREAMED = [name for name in GENERATION_ARCHITECTURES if name != "Falcon"]


def test_the_streamed_export_of_falcon_names_what_it_cannot_trace(tmp_path):
    from hostswap.passes.lowering import UntracedConstantError

    with pytest.raises(UntracedConstantError, match=r"creates a tensor in its forward \('model\.transformer\.h\.0\.self_attention\."):
        export_checkpoint(_saved("Falcon", tmp_path / "ckpt"), tmp_path / "streamed", max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK)


@pytest.mark.parametrize("name", STREAMED)
def test_streamed_export_is_the_in_memory_export(name, tmp_path):
    """Schedules, every weight's bytes, the weights digest and greedy tokens are those of
    hostswap.llm.export on the model loaded from the same checkpoint."""
    from transformers import AutoModelForCausalLM

    ckpt = _saved(name, tmp_path / "ckpt")
    loaded = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    pte_a, ptd_a = llm.export(loaded, tmp_path / "loaded", max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK)
    pte_b, ptd_b = export_checkpoint(ckpt, tmp_path / "streamed", max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK)
    schedules_a, schedules_b = hostswap.schedules.load_weight_schedules(pte_a), hostswap.schedules.load_weight_schedules(pte_b)
    assert schedules_a.keys() == schedules_b.keys()
    for method in schedules_a:
        a, b = schedules_a[method], schedules_b[method]
        assert a.probe_fqns() == b.probe_fqns() and a.floor_bytes == b.floor_bytes and a.total_bytes == b.total_bytes, method
    with PtdFile(ptd_a) as fa, PtdFile(ptd_b) as fb:
        assert fa.entries.keys() == fb.entries.keys()
        for fqn in fa.entries:
            assert torch.equal(fa.host_tensor(fqn).reshape(-1).view(torch.uint8), fb.host_tensor(fqn).reshape(-1).view(torch.uint8)), fqn
        assert fa.index.checksums == fb.index.checksums
    assert saved_weights_digest(read_program(pte_a)) == saved_weights_digest(read_program(pte_b))
    prompt = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    tokens = []
    for pte, ptd in ((pte_a, ptd_a), (pte_b, ptd_b)):
        with llm.Generator(pte, ptd, weight_offload_budget_mb=schedules_b["decode"].floor_bytes / MB + 1, device="cpu") as g:
            tokens.append(g.generate(prompt, 8, eos_token_id=[]))
    assert torch.equal(tokens[0], tokens[1])


def test_sharded_checkpoint_with_a_dtype_conversion(tmp_path):
    """Shards of an index, read one tensor at a time and converted to the asked dtype: the
    same weights as the loaded model converted."""
    from transformers import AutoModelForCausalLM

    ckpt = _saved("Llama", tmp_path / "ckpt", max_shard_size="100KB")
    assert os.path.exists(ckpt / "model.safetensors.index.json")
    loaded = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    _, ptd_a = llm.export(loaded, tmp_path / "loaded", max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK)
    _, ptd_b = export_checkpoint(ckpt, tmp_path / "streamed", max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK, dtype="bfloat16")
    with PtdFile(ptd_a) as fa, PtdFile(ptd_b) as fb:
        assert fa.index.checksums == fb.index.checksums
        assert {e.dtype for e in fb.entries.values()} >= {torch.bfloat16}


def _expect(tmp_path, ckpt, match):
    with pytest.raises(CheckpointError, match=match):
        export_checkpoint(ckpt, tmp_path / "out", max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK)
    assert not any(p.name.startswith("out") for p in tmp_path.iterdir())  # nothing under the final names


def test_bad_checkpoints_are_named(tmp_path):
    ckpt = _saved("Llama", tmp_path / "ckpt", max_shard_size="100KB")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))

    missing = tmp_path / "missing_shard"
    shutil.copytree(ckpt, missing)
    os.remove(missing / shards[1])
    _expect(tmp_path, missing, rf"shard {shards[1]} of .*missing_shard is missing \(the index puts '.+' in it\)")

    truncated = tmp_path / "truncated"
    shutil.copytree(ckpt, truncated)
    with open(truncated / shards[0], "r+b") as f:
        f.truncate(os.path.getsize(truncated / shards[0]) // 2)
    _expect(tmp_path, truncated, rf"{shards[0]}.*truncated")

    unindexed = tmp_path / "unindexed"
    shutil.copytree(ckpt, unindexed)
    dropped = "model.layers.1.mlp.down_proj.weight"
    index_copy = dict(index, weight_map={k: v for k, v in index["weight_map"].items() if k != dropped})
    (unindexed / "model.safetensors.index.json").write_text(json.dumps(index_copy))
    _expect(tmp_path, unindexed, rf"tensor '{dropped}' of the model is in no shard of .*unindexed")

    reshaped = tmp_path / "reshaped"
    shutil.copytree(ckpt, reshaped)
    config = json.loads((reshaped / "config.json").read_text())
    config["intermediate_size"] += 8
    (reshaped / "config.json").write_text(json.dumps(config))
    _expect(tmp_path, reshaped, r"tensor 'model.layers.0.mlp.gate_proj.weight' in shard .* has shape \[\d+, \d+\]; the model built from its config has")

    bin_only = tmp_path / "bin_only"
    bin_only.mkdir()
    shutil.copy(ckpt / "config.json", bin_only / "config.json")
    torch.save({}, bin_only / "pytorch_model.bin")
    _expect(tmp_path, bin_only, r"has no safetensors .*its weights are in pytorch_model.bin.*convert once")


# the peak is VmHWM, not ru_maxrss: after an exec, ru_maxrss starts from the parent's peak (this test process's)
PEAK_RSS = """
import sys
import torch, transformers, executorch.exir, hostswap.llm, hostswap.checkpoint
if sys.argv[1] == "export":
    hostswap.checkpoint.export_checkpoint(sys.argv[2], sys.argv[3], max_seq_len=64)
print(next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


def _room(nbytes: int, *candidates):
    """The first of ``candidates`` (folders) whose filesystem has ``nbytes`` free, or a skip that
    says what each has. tmpfs counts: files read and written with plain reads and writes there
    are in no process's RSS."""
    free = {}
    for folder in candidates:
        if os.path.isdir(folder):
            stat = os.statvfs(folder)
            free[folder] = stat.f_bavail * stat.f_frsize
            if free[folder] >= nbytes:
                return folder
    pytest.skip(f"needs {nbytes / 2**30:.1f} GiB of room for a checkpoint and its export; "
                + ", ".join(f"{f} has {b / 2**30:.1f} GiB" for f, b in free.items()))


def test_export_memory_stays_within_one_tensor_of_the_baseline(tmp_path):
    """A 3.7 GB bf16 checkpoint, about three times what the bound leaves: the export's peak
    RSS stays within the process's own baseline (torch, transformers and executorch imported)
    + 1 GiB + the largest tensor, and its weights are the checkpoint's."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=8, num_attention_heads=32,
                         num_key_value_heads=32, max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    needed = 2 * sum(math.prod(shape) * 2 for shape in checkpoints.tensor_shapes(config).values()) + 2**28  # bf16 in, bf16 out
    with tempfile.TemporaryDirectory(dir=_room(needed, str(tmp_path), "/dev/shm")) as room:
        _export_memory_within_bound(config, pathlib.Path(room))


def _export_memory_within_bound(config, tmp_path):
    import subprocess
    import sys

    largest = checkpoints.write_checkpoint(tmp_path / "ckpt", config)["largest_tensor_bytes"]
    checkpoint_bytes = sum(p.stat().st_size for p in (tmp_path / "ckpt").glob("*.safetensors"))
    run = lambda *a: subprocess.run([sys.executable, "-c", PEAK_RSS, *a], capture_output=True, text=True, timeout=1800)
    baseline = run("baseline")
    exported = run("export", str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert baseline.returncode == 0 and exported.returncode == 0, exported.stderr[-3000:]
    base, peak = int(baseline.stdout.split()[-1]), int(exported.stdout.split()[-1])
    allowed = base + 2**30 + largest
    print(f"checkpoint {checkpoint_bytes / 2**30:.2f} GiB, largest tensor {largest / 2**20:.0f} MiB; peak RSS {peak / 2**30:.2f} GiB, "
          f"baseline {base / 2**30:.2f} GiB, bound {allowed / 2**30:.2f} GiB")
    assert checkpoint_bytes > 2.5 * (2**30 + largest)  # the bound could not hold the weights
    assert peak <= allowed, (peak, allowed)
    with PtdFile(tmp_path / "out.ptd") as ptd:
        from safetensors import safe_open

        with safe_open(sorted((tmp_path / "ckpt").glob("*.safetensors"))[0], "pt") as shard:
            name = next(iter(shard.keys()))
            assert torch.equal(ptd.host_tensor("model." + name), shard.get_tensor(name))


def test_no_room_on_disk_is_refused_before_writing_and_named_when_a_write_fails(tmp_path):
    """A filesystem reporting too little room stops the export before its first byte; one that
    fills up mid-write (here a file-size limit, as a full disk) stops it with the file and the
    bytes named, and nothing is left under the final names."""
    import subprocess
    import sys

    from hostswap.passes.ptd_writer import DiskFullError, check_room

    with pytest.raises(DiskFullError, match=f"{tmp_path} has 0.00 GiB free; the weights need 1.00 GiB"):
        check_room(str(tmp_path), 2**30, free_bytes=1000)
    ckpt = _saved("Llama", tmp_path / "ckpt")
    script = (
        "import resource, signal, sys\n"
        "from hostswap.checkpoint import export_checkpoint\n"
        "from hostswap.passes.ptd_writer import DiskFullError\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"  # a write past the limit fails with EFBIG instead of ending the process
        "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))\n"
        "try:\n"
        "    export_checkpoint(sys.argv[1], sys.argv[2], max_seq_len=30, prefill_chunk=4)\n"
        "except DiskFullError as e:\n"
        "    print('REFUSED', e)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(ckpt), str(tmp_path / "out")], capture_output=True, text=True, timeout=600)
    assert "REFUSED" in done.stdout, done.stderr[-3000:]
    assert "weights.ptd stopped at about" in done.stdout and "File too large" in done.stdout
    assert not (tmp_path / "out.pte").exists() and not (tmp_path / "out.ptd").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hostswap-save-")]


@pytest.mark.parametrize("name", ["Llama", "Qwen2", "Phi-3"])
def test_quantized_streamed_export_is_the_quantized_in_memory_export(name, tmp_path):
    """int8 while writing, one linear at a time: the weights, checksums and tokens of
    hostswap.llm.quantize + export on the loaded model."""
    from transformers import AutoModelForCausalLM

    ckpt = _saved(name, tmp_path / "ckpt")
    loaded = llm.quantize(AutoModelForCausalLM.from_pretrained(ckpt).eval(), "int8")
    pte_a, ptd_a = llm.export(loaded, tmp_path / "loaded", max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK)
    pte_b, ptd_b = export_checkpoint(ckpt, tmp_path / "streamed", max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK, quantize="int8")
    with PtdFile(ptd_a) as fa, PtdFile(ptd_b) as fb:
        assert any(f.endswith(".weight_qdata") for f in fb.entries)
        assert fa.index.checksums == fb.index.checksums
    assert saved_weights_digest(read_program(pte_a)) == saved_weights_digest(read_program(pte_b))
    prompt = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    tokens = []
    for pte, ptd in ((pte_a, ptd_a), (pte_b, ptd_b)):
        with llm.Generator(pte, ptd, weight_offload_budget_mb="auto", device="cpu") as g:
            tokens.append(g.generate(prompt, 6, eos_token_id=[]))
    assert torch.equal(tokens[0], tokens[1])


@pytest.mark.parametrize("name, quantize", [("Llama", "int8"), ("Qwen2", None)])
def test_streamed_export_with_fused_linears_is_the_in_memory_one(name, quantize, tmp_path):
    """fuse_linears while writing (a draft's q/k/v and gate/up stacked, each part read by its
    name, quantized or not, Qwen2's biases too): the weights, checksums and tokens of
    hostswap.llm.export(fuse_linears=True) on the loaded model."""
    from transformers import AutoModelForCausalLM

    ckpt = _saved(name, tmp_path / "ckpt")
    loaded = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    if quantize:
        loaded = llm.quantize(loaded, quantize)
    pte_a, ptd_a = llm.export(loaded, tmp_path / "loaded", max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK, fuse_linears=True)
    pte_b, ptd_b = export_checkpoint(ckpt, tmp_path / "streamed", max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK, quantize=quantize,
                                     fuse_linears=True)
    with PtdFile(ptd_a) as fa, PtdFile(ptd_b) as fb:
        assert any("q_proj_k_proj_v_proj" in f for f in fb.entries) and not any(".k_proj." in f for f in fb.entries)
        assert fa.index.checksums == fb.index.checksums
    assert saved_weights_digest(read_program(pte_a)) == saved_weights_digest(read_program(pte_b))
    prompt = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    tokens = []
    for pte, ptd in ((pte_a, ptd_a), (pte_b, ptd_b)):
        with llm.Generator(pte, ptd, weight_offload_budget_mb="auto", device="cpu") as g:
            tokens.append(g.generate(prompt, 6, eos_token_id=[]))
    assert torch.equal(tokens[0], tokens[1])


def test_quantized_streamed_export_refuses_what_it_cannot_quantize(tmp_path):
    ckpt = _saved("Llama", tmp_path / "ckpt")
    with pytest.raises(llm.GenerationError, match="quantization must be one of"):
        export_checkpoint(ckpt, tmp_path / "out", max_seq_len=MAX_SEQ_LEN, quantize="int3")
    if not torch.cuda.is_available():
        with pytest.raises(llm.GenerationError, match="int4 .* packs and runs on CUDA only"):
            export_checkpoint(ckpt, tmp_path / "out", max_seq_len=MAX_SEQ_LEN, quantize="int4", dtype=torch.bfloat16)
    with pytest.raises(llm.GenerationError, match="int4 takes bfloat16 weights"):
        export_checkpoint(ckpt, tmp_path / "out", max_seq_len=MAX_SEQ_LEN, quantize="int4")  # the checkpoint's float32
    assert not (tmp_path / "out.pte").exists()
