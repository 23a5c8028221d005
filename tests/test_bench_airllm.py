"""bench/airllm_peer.py: AirLLM on a tiny Llama checkpoint from bench/checkpoints.py, on the CPU
(and on the GPU where there is one). Skipped where airllm is not installed (CI does not
install it)."""

import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("airllm")

import bench_scripts

ROOT = bench_scripts.ROOT
checkpoints, peer = bench_scripts.load("checkpoints"), bench_scripts.load("airllm_peer")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("airllm") / "ckpt"
    config = checkpoints._config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2)
    checkpoints.write_checkpoint(folder, config, shard_bytes=1e5, sync=False)  # several shards
    return folder


def _reference(checkpoint, prompt, new_tokens, device="cpu"):
    """transformers' greedy tokens with the whole model in memory."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).to(device)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=device), do_sample=False, pad_token_id=0, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    return out[0, len(prompt):].tolist()


def test_airllm_streams_the_checkpoint_and_generates_transformers_tokens(checkpoint, tmp_path):
    prompt = peer.prompt_of_length(8, 256)
    r = peer.run_airllm(checkpoint, tmp_path / "work", prompt, 3, device="cpu")
    assert r["tokens"] == _reference(checkpoint, prompt, 3)
    assert not r["split_reused"] and r["split_seconds"] > 0 and r["split_bytes"] >= checkpoints.checkpoint_bytes(
        checkpoints._config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2))
    assert sorted(p.name for p in (tmp_path / "work" / "splitted_model").glob("*.safetensors")) == sorted(
        ["model.embed_tokens.safetensors", "model.norm.safetensors", "lm_head.safetensors"] + [f"model.layers.{i}.safetensors" for i in range(3)])
    assert r["settings"]["compression"] is None and r["settings"]["prefetching"] is True and r["settings"]["streamed_modules"] == 6
    assert len(r["decode_token_ms"]) == 2 and r["ms_per_token"] == pytest.approx(sum(r["decode_token_ms"]) / 2)
    assert r["first_token_s"] > 0 and r["timing"].startswith("steady-state")
    assert r["clean_memory_calls"] == 3 * 6  # AirLLM cleans up after each module of each pass
    # a second run finds the split done, and a page-cache drop after every token changes nothing but time
    again = peer.run_airllm(checkpoint, tmp_path / "work", prompt, 3, device="cpu", drop_cache="every-token", prefetching=False)
    assert again["split_reused"] and again["tokens"] == r["tokens"] and again["settings"]["prefetching"] is False


def test_cli_prints_json_and_reports_errors_as_json(checkpoint, tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "airllm_peer.py"), str(checkpoint), "--work", str(tmp_path / "work"),
                          "--device", "cpu", "--new-tokens", "1", "--prompt-len", "4", "--out", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    r = json.loads(run.stdout)  # AirLLM's prints went to stderr
    assert r == json.loads((tmp_path / "r.json").read_text())
    assert len(r["tokens"]) == 1 and r["timing"].startswith("one new token") and r["prompt_tokens"] == 4

    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "airllm_peer.py"), str(tmp_path / "missing"), "--work", str(tmp_path / "w2"),
                          "--device", "cpu", "--prompt-ids", "1,2"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1
    assert json.loads(bad.stdout)["error"].startswith("FileNotFoundError")


@pytest.mark.gpu
def test_airllm_on_the_gpu(checkpoint, tmp_path):
    prompt = peer.prompt_of_length(8, 256)
    r = peer.run_airllm(checkpoint, tmp_path / "work", prompt, 3, device="cuda")
    assert r["gpu_peak_bytes"] > 0 and r["gpu_reserved_peak_bytes"] >= r["gpu_peak_bytes"]
    assert r["tokens"] == _reference(checkpoint, prompt, 3, "cuda")
