"""passes/fuse_sibling_linears.py: linears that read one input run as one, with the same tokens
and logits, on transformers models (int8 and full precision, with and without biases)."""

import collections
import copy
import os

import pytest
import torch

from hostswap import llm
from hostswap.passes.fuse_sibling_linears import FUSABLE_OPS


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=64)).eval()


def _qwen2():  # biases on q, k and v
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)).eval()


@pytest.mark.parametrize("name, make, quantized", [("llama-int8", _llama, True), ("qwen2-fp32-biased", _qwen2, False)], ids=lambda v: v if isinstance(v, str) else "")
def test_fused_projections_give_the_same_tokens_and_logits_with_fewer_linears(tmp_path, name, make, quantized):
    model = make()
    if quantized:
        model = llm.quantize(model, "int8")
    prompt = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(1))
    runs = {}
    for fuse in (False, True):
        programs, _ = llm.export_programs(copy.deepcopy(model), max_seq_len=32, prefill_chunk=8, fuse_linears=fuse)
        linears = collections.Counter(n.target for n in programs[llm.DECODE].graph.nodes if n.target in FUSABLE_OPS)
        pte, ptd = llm.export(copy.deepcopy(model), tmp_path / f"fused{fuse}", max_seq_len=32, prefill_chunk=8, fuse_linears=fuse)
        with llm.Generator(pte, ptd, weight_offload_budget_mb=100, device="cpu") as g:
            out = g.generate(prompt, 10, eos_token_id=[])
            logits = g._step(llm.DECODE, out[:, -1:], torch.tensor([out.shape[1] - 1]))
        runs[fuse] = (sum(linears.values()), out, logits, os.path.getsize(ptd))
    (separate, out, logits, size), (fused, fused_out, fused_logits, fused_size) = runs[False], runs[True]
    assert separate == 2 * 7 + 1 and fused == 2 * 4 + 1  # per layer: q/k/v one, gate/up one; o, down and the head alone
    assert torch.equal(fused_out, out) and torch.equal(fused_logits, logits)
    assert fused_size <= size  # each weight stored once, stacked, not beside its parts


def test_linears_that_read_different_inputs_or_mix_biases_stay_apart():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(8, 4, bias=True)  # one input, a bias on one only
            self.c = torch.nn.Linear(4, 4, bias=False)  # another input

        def forward(self, x):
            return self.a(x) + self.b(x) + self.c(x[:, :4])

    from hostswap.passes.fuse_sibling_linears import fuse_sibling_linears

    ep = torch.export.export(Block().eval(), (torch.randn(2, 8),))
    assert fuse_sibling_linears(ep) == {}


def test_a_batched_program_with_fused_linears_is_refused_by_name():
    with pytest.raises(llm.GenerationError, match="fuse_linears and max_batch_size cannot be combined"):
        llm.export_programs(_llama(), max_seq_len=32, prefill_chunk=8, max_batch_size=2, fuse_linears=True)
