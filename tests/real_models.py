"""transformers models for the support matrix: tiny random-init configs built in code.

Each entry builds a model nobody on the team wrote, with the inputs a user would export it
with. The test matrix (tests/test_real_models.py) runs every entry through hostswap, and the
README's support table is rendered from this list (``python -m tests.real_models``), so the
two cannot disagree: a test checks the README holds exactly that table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

VOCAB = 128
SEQ = 8
BATCH = 2
EXPORT_MODES = ("export", "export under no_grad")


@dataclasses.dataclass(frozen=True)
class Architecture:
    name: str  # as the support table shows it
    model_class: str  # transformers class
    notes: str
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[torch.Generator], tuple[tuple, dict]]
    refused: str | None = None  # why hostswap refuses it, if it does
    # False where lowering decomposes an op eager PyTorch runs whole: outputs are then bitwise
    # equal to the lowered program and within 1e-5 of eager
    bitwise_to_eager: bool = True


def _decoder_common(**extra) -> dict:
    return dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, use_cache=False, **extra,
    )


def _ids(g: torch.Generator) -> tuple[tuple, dict]:
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),), {}


def _seq2seq(g: torch.Generator) -> tuple[tuple, dict]:
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),), {"decoder_input_ids": torch.randint(0, VOCAB, (BATCH, 4), generator=g)}


def _pixels(g: torch.Generator) -> tuple[tuple, dict]:
    return (torch.randn(BATCH, 3, 32, 32, generator=g),), {}


def _mel(g: torch.Generator) -> tuple[tuple, dict]:
    return (torch.randn(BATCH, 16, 64, generator=g),), {}


def _gpt2():
    import transformers as T

    return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, use_cache=False))


def _llama():
    import transformers as T

    return T.LlamaForCausalLM(T.LlamaConfig(**_decoder_common(num_key_value_heads=2)))


def _qwen2():
    import transformers as T

    return T.Qwen2ForCausalLM(T.Qwen2Config(**_decoder_common(num_key_value_heads=2)))


def _qwen3():
    import transformers as T

    return T.Qwen3ForCausalLM(T.Qwen3Config(**_decoder_common(num_key_value_heads=2, head_dim=16)))


def _mistral():
    import transformers as T

    return T.MistralForCausalLM(T.MistralConfig(**_decoder_common(num_key_value_heads=2)))


def _phi3():
    import transformers as T

    return T.Phi3ForCausalLM(T.Phi3Config(**_decoder_common(num_key_value_heads=2, pad_token_id=0)))


def _gemma():
    import transformers as T

    return T.GemmaForCausalLM(T.GemmaConfig(**_decoder_common(num_key_value_heads=2, head_dim=16)))


def _gemma2():
    import transformers as T

    return T.Gemma2ForCausalLM(T.Gemma2Config(**_decoder_common(num_key_value_heads=2, head_dim=16)))


def _mixtral():
    import transformers as T

    return T.MixtralForCausalLM(T.MixtralConfig(**_decoder_common(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)))


def _t5():
    import transformers as T

    return T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0, use_cache=False,
    ))


def _bert():
    import transformers as T

    return T.BertModel(T.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128))


def _vit():
    import transformers as T

    return T.ViTModel(T.ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128))


def _whisper_encoder():
    import transformers as T

    config = T.WhisperConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16, max_source_positions=32, max_target_positions=32,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
    )
    return T.WhisperForConditionalGeneration(config).model.encoder


def _resnet():
    import transformers as T

    return T.ResNetModel(T.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_channels=3))


def _qwen2_moe():
    import transformers as T

    return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(**_decoder_common(
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
    )))


def _stablelm():
    import transformers as T

    return T.StableLmForCausalLM(T.StableLmConfig(**_decoder_common(num_key_value_heads=4)))


def _opt():
    import transformers as T

    return T.OPTForCausalLM(T.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                                        max_position_embeddings=64, word_embed_proj_dim=64, use_cache=False))


def _gpt_neox():
    import transformers as T

    return T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**_decoder_common()))


def _falcon():
    import transformers as T

    return T.FalconForCausalLM(T.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, use_cache=False))


def _phi():
    import transformers as T

    return T.PhiForCausalLM(T.PhiConfig(**_decoder_common()))


def _olmo():
    import transformers as T

    return T.OlmoForCausalLM(T.OlmoConfig(**_decoder_common()))


def _gemma3():
    import transformers as T

    return T.Gemma3ForCausalLM(T.Gemma3TextConfig(**_decoder_common(num_key_value_heads=2, head_dim=16)))


def _granite():
    import transformers as T

    return T.GraniteForCausalLM(T.GraniteConfig(**_decoder_common()))


def _bart():
    import transformers as T

    return T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64, use_cache=False,
    ))


def _distilbert():
    import transformers as T

    return T.DistilBertModel(T.DistilBertConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, hidden_dim=128))


def _clip_text():
    import transformers as T

    return T.CLIPTextModel(T.CLIPTextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4))


def _swin():
    import transformers as T

    return T.SwinModel(T.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4))


def _convnext():
    import transformers as T

    return T.ConvNextModel(T.ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2))


ARCHITECTURES = [
    Architecture("GPT-2", "GPT2LMHeadModel", "tied LM head", _gpt2, _ids),
    Architecture("Llama", "LlamaForCausalLM", "GQA, rotary", _llama, _ids),
    Architecture("Qwen2", "Qwen2ForCausalLM", "GQA, q/k/v bias", _qwen2, _ids),
    Architecture("Qwen3", "Qwen3ForCausalLM", "GQA, q/k norm", _qwen3, _ids),
    Architecture("Mistral", "MistralForCausalLM", "GQA, sliding window", _mistral, _ids),
    Architecture("Phi-3", "Phi3ForCausalLM", "fused qkv and gate/up", _phi3, _ids),
    Architecture("Gemma", "GemmaForCausalLM", "scaled embedding, tied head", _gemma, _ids),
    Architecture("Gemma2", "Gemma2ForCausalLM", "soft-capping, local/global layers", _gemma2, _ids),
    Architecture("Mixtral", "MixtralForCausalLM", "MoE, default experts implementation (a custom op)", _mixtral, _ids),
    Architecture("T5", "T5ForConditionalGeneration", "encoder-decoder, relative position bias", _t5, _seq2seq),
    Architecture("BERT", "BertModel", "encoder", _bert, _ids),
    Architecture("ViT", "ViTModel", "vision encoder", _vit, _pixels),
    Architecture("Whisper encoder", "WhisperEncoder", "audio encoder, conv stem", _whisper_encoder, _mel),
    Architecture("ResNet", "ResNetModel", "convolutions, batch norm", _resnet, _pixels),
    Architecture("Qwen2-MoE", "Qwen2MoeForCausalLM", "MoE with a shared expert (a custom op)", _qwen2_moe, _ids),
    Architecture("StableLM", "StableLmForCausalLM", "partial rotary, layer norm", _stablelm, _ids),
    Architecture("OPT", "OPTForCausalLM", "learned positions, tied head", _opt, _ids),
    Architecture("GPT-NeoX", "GPTNeoXForCausalLM", "parallel attention and MLP, fused qkv", _gpt_neox, _ids),
    Architecture("Falcon", "FalconForCausalLM", "multi-query attention, parallel block", _falcon, _ids),
    Architecture("Phi", "PhiForCausalLM", "partial rotary, parallel block", _phi, _ids),
    Architecture("OLMo", "OlmoForCausalLM", "non-parametric layer norm", _olmo, _ids),
    Architecture("Gemma3", "Gemma3ForCausalLM", "q/k norm, local/global layers", _gemma3, _ids),
    Architecture("Granite", "GraniteForCausalLM", "scaled residuals and logits", _granite, _ids),
    Architecture("BART", "BartForConditionalGeneration", "encoder-decoder, a constant created in forward", _bart, _ids),
    Architecture("DistilBERT", "DistilBertModel", "encoder", _distilbert, _ids),
    Architecture("CLIP text", "CLIPTextModel", "causal text encoder", _clip_text, _ids),
    Architecture("Swin", "SwinModel", "windowed attention, relative position bias", _swin, _pixels),
    Architecture("ConvNeXt", "ConvNextModel", "depthwise convolutions, layer scale", _convnext, _pixels, bitwise_to_eager=False),
]
BY_NAME = {a.name: a for a in ARCHITECTURES}


def build(arch: Architecture, random_state: int = 0) -> tuple[torch.nn.Module, tuple, dict]:
    """The model in eval mode with random weights and inputs drawn from ``random_state``."""
    torch.manual_seed(random_state)
    model = arch.build().eval()
    args, kwargs = arch.inputs(torch.Generator().manual_seed(random_state + 1))
    return model, args, kwargs


def support_table() -> str:
    """The README's support table: one row per architecture, a column per export mode."""
    lines = [
        "| architecture | transformers class | what it exercises | " + " | ".join(EXPORT_MODES) + " |",
        "|---|---|---|" + "---|" * len(EXPORT_MODES),
    ]
    for a in ARCHITECTURES:
        status = f"refused: {a.refused}" if a.refused else "bitwise" if a.bitwise_to_eager else "bitwise to the lowered program, 1e-5 to eager"
        lines.append(f"| {a.name} | `{a.model_class}` | {a.notes} | " + " | ".join(status for _ in EXPORT_MODES) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(support_table())
