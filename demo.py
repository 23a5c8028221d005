"""``hostswap demo``: streamed generation with a built-in transformers Llama (random weights,
no downloads): export, pass, lower, save, inspect, then generate within a budget of a
multiple of the floor and check the tokens against transformers' own ``generate``."""

from __future__ import annotations

import os
import time

import torch

PROMPT_TOKENS, NEW_TOKENS = 24, 32


def _say(message: str) -> None:
    print(f"[hostswap demo] {message}", flush=True)


def demo_llama(random_state: int = 0):
    """A transformers LlamaForCausalLM with random weights: 4 layers, hidden 256, GQA, vocabulary 4096 (about 17 MB of float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(random_state)
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def _transformers_tokens(model, prompt: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(cache_implementation="static", cache_config={"batch_size": 1, "max_cache_len": max_seq_len},
                                               do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0)
    with torch.no_grad():
        return model.generate(prompt)


def run_demo(out_dir: str = "out", budget_factor: float = 1.5, device: str | None = None) -> int:
    import hostswap
    import hostswap.llm as llm

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = demo_llama()
    n_params = sum(p.numel() for p in model.parameters())
    _say(f"built a random-weight transformers LlamaForCausalLM ({n_params / 1e6:.1f} M parameters)")
    start = time.perf_counter()
    max_seq_len = 128
    pte, ptd = llm.export(model, os.path.join(out_dir, "llama"), max_seq_len=max_seq_len, prefill_chunk=16,
                          progress=lambda m: _say(f"  {m}"))
    _say(f"exported prefill and decode in {time.perf_counter() - start:.1f} s: {pte}, {ptd}")
    schedule = hostswap.schedules.load_weight_schedule(pte, "decode")
    budget = int(schedule.floor_bytes * budget_factor)
    print(f"\n$ hostswap inspect {pte} --budget-mb {budget / 2**20:.2f}\n")
    print(schedule.table(budget))
    prompt = torch.randint(0, 4096, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(1))
    expected = _transformers_tokens(demo_llama(), prompt, max_seq_len)
    failures = 0
    for policy in ("planned", "lru"):
        print(f"\n$ hostswap generate {os.path.splitext(pte)[0]} --budget-mb {budget / 2**20:.2f} --policy {policy} "
              f"--prompt-ids <{PROMPT_TOKENS} ids> --max-new-tokens {NEW_TOKENS} --device {device}")
        with llm.Generator(pte, ptd, weight_offload_budget_mb=budget / 2**20, device=device, policy=policy) as g:
            out = g.generate(prompt, NEW_TOKENS, on_token=llm.print_tokens())
            print()
            same = torch.equal(out.cpu(), expected)
            failures += not same
            print(f"same tokens as transformers' generate: {'yes' if same else 'NO'}")
            print(g.summary())
    return 1 if failures else 0
