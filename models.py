"""Built-in models: random weights from a fixed random state, no downloads. Used by tests, examples and benches."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


def _rotary_tables(seq: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def _apply_rotary(x, cos, sin):
    x1, x2 = x[..., ::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


class DecoderBlock(nn.Module):
    """Pre-norm decoder block: causal SDPA attention, MLP (GELU, or SwiGLU for llama=True)."""

    def __init__(self, hidden: int, heads: int, intermediate: int, llama: bool):
        super().__init__()
        self.heads, self.llama = heads, llama
        norm = RMSNorm if llama else nn.LayerNorm
        self.attn_norm, self.mlp_norm = norm(hidden), norm(hidden)
        self.q_proj = nn.Linear(hidden, hidden, bias=not llama)
        self.k_proj = nn.Linear(hidden, hidden, bias=not llama)
        self.v_proj = nn.Linear(hidden, hidden, bias=not llama)
        self.o_proj = nn.Linear(hidden, hidden, bias=not llama)
        if llama:
            self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=not llama)
        self.down_proj = nn.Linear(intermediate, hidden, bias=not llama)

    def forward(self, x, cos=None, sin=None):
        b, s, h = x.shape
        y = self.attn_norm(x)
        q, k, v = (proj(y).view(b, s, self.heads, h // self.heads).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.llama:
            q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(b, s, h))
        y = self.mlp_norm(x)
        if self.llama:
            y = F.silu(self.gate_proj(y)) * self.up_proj(y)
        else:
            y = F.gelu(self.up_proj(y))
        return x + self.down_proj(y)


class DecoderLM(nn.Module):
    """A decoder-only language model; ``llama=True`` gives RMSNorm, rotary attention and SwiGLU."""

    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, intermediate: int, max_seq: int = 2048, llama: bool = False):
        super().__init__()
        self.llama = llama
        self.embed = nn.Embedding(vocab, hidden)
        if not llama:
            self.pos = nn.Embedding(max_seq, hidden)
        self.layers = nn.ModuleList(DecoderBlock(hidden, heads, intermediate, llama) for _ in range(layers))
        self.norm = RMSNorm(hidden) if llama else nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        if llama:
            cos, sin = _rotary_tables(max_seq, hidden // heads)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens):
        s = tokens.shape[1]
        x = self.embed(tokens)
        cos = sin = None
        if self.llama:
            cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        else:
            x = x + self.pos(torch.arange(s, device=tokens.device))
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def demo_transformer(random_state: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The demo's model: 4 layers, hidden 256, vocabulary 4096, about 8 MB of float32 weights."""
    torch.manual_seed(random_state)
    model = DecoderLM(vocab=4096, hidden=256, layers=4, heads=4, intermediate=1024, max_seq=128).eval()
    tokens = torch.randint(0, 4096, (1, 32))
    return model, (tokens,)


def tiny_llama(random_state: int = 0):
    """A transformers LlamaForCausalLM with random weights: 4 layers, hidden 256, GQA, vocabulary 4096 (about 17 MB of float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(random_state)
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def llama_decoder(layers: int, hidden: int = 4096, intermediate: int = 11008, vocab: int = 32000, heads: int = 32, max_seq: int = 4096, random_state: int = 0, dtype=torch.bfloat16, device="cpu") -> nn.Module:
    """The benchmark's Llama-style decoder (untied lm head), random weights from ``random_state``."""
    torch.manual_seed(random_state)
    with torch.device(device):
        model = DecoderLM(vocab, hidden, layers, heads, intermediate, max_seq=max_seq, llama=True)
    return model.to(dtype).eval()


class ConvNet(nn.Module):
    """Convolutions with batch-norm buffers (eval mode), pooling and a classifier."""

    def __init__(self, random_state: int = 0):
        super().__init__()
        torch.manual_seed(random_state)
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1, stride=2), nn.BatchNorm2d(64), nn.ReLU(),
        )
        self.classifier = nn.Linear(64, 10)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):  # non-trivial running statistics
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
        self.eval()

    def forward(self, x):
        return self.classifier(self.features(x).mean((2, 3)))


class TiedLM(nn.Module):
    """Embedding and output projection share one weight (read by two kernels)."""

    def __init__(self, vocab: int = 512, hidden: int = 64, random_state: int = 0):
        super().__init__()
        torch.manual_seed(random_state)
        self.embed = nn.Embedding(vocab, hidden)
        self.mix = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.eval()

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


class NonUniformMLP(nn.Module):
    """Weights of very different sizes (a large outlier among small ones) and a tensor constant."""

    def __init__(self, random_state: int = 0):
        super().__init__()
        torch.manual_seed(random_state)
        self.small1 = nn.Linear(32, 32)
        self.big = nn.Linear(32, 2048)
        self.small2 = nn.Linear(2048, 16)
        self.fused = nn.Linear(16, 16)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))
        self.eval()

    def forward(self, x):
        x = torch.relu(self.small1(x))
        x = torch.relu(self.big(x))
        x = self.small2(x) * self.scale
        # addmm with a weight and a bias plus a second weight in one kernel
        return self.fused(x) + x @ self.fused.weight.t()
