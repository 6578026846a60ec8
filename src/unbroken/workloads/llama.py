"""A Llama-style decoder: RMSNorm, rotary position embeddings, SwiGLU, grouped-query attention.

Written here rather than imported so that the LLM workload depends on torch alone. The
shapes follow Llama 3 (pre-norm blocks, no biases, untied output head); the sizes are
named configurations from ``tiny`` (trains on two CPU cores in a test) to ``llama3-8b``.

Weights are initialized block by block under a seed derived from the block's number, on
the CPU, before the block is sharded (see ``unbroken.workloads.llm.build``): the same seed
gives the same model whatever the world size, and no rank ever holds the whole model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    dim: int
    layers: int
    heads: int
    kv_heads: int
    """Grouped-query attention: ``heads / kv_heads`` query heads share each key/value head."""
    ffn_dim: int
    max_seq_len: int
    vocab_size: int = 0
    """Set from the prepared data's tokenizer (``with_vocab``)."""
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.dim % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"dim {self.dim}, heads {self.heads}, kv_heads {self.kv_heads}: dim must divide by heads, heads by kv_heads")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def with_vocab(self, vocab_size: int) -> LlamaConfig:
        return LlamaConfig(**{**self.__dict__, "vocab_size": vocab_size})

    def parameters(self) -> int:
        """Parameter count (embedding and head included)."""
        attention = self.dim * self.dim * 2 + self.dim * self.kv_heads * self.head_dim * 2
        block = attention + 3 * self.dim * self.ffn_dim + 2 * self.dim
        return self.layers * block + 2 * self.vocab_size * self.dim + self.dim


CONFIGS: dict[str, LlamaConfig] = {
    # CI on two CPU cores: a few ms per step.
    "tiny": LlamaConfig(dim=64, layers=2, heads=4, kv_heads=2, ffn_dim=176, max_seq_len=64),
    # A laptop or one GPU: ~30 M parameters with an 8 k vocabulary.
    "small": LlamaConfig(dim=512, layers=8, heads=8, kv_heads=4, ffn_dim=1408, max_seq_len=512),
    # Llama 3.2 1B's shape and Llama 3 8B's: for GPU nodes.
    "llama3-1b": LlamaConfig(dim=2048, layers=16, heads=32, kv_heads=8, ffn_dim=8192, max_seq_len=2048),
    "llama3-8b": LlamaConfig(dim=4096, layers=32, heads=32, kv_heads=8, ffn_dim=14336, max_seq_len=8192),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(head_dim: int, seq_len: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's rotation angle per pair of head dimensions, ``[seq, head_dim / 2]``."""
    inverse = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inverse)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (even, odd) pair of ``x`` ``[batch, seq, heads, head_dim]`` by its position's angle."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.heads, config.kv_heads, config.head_dim
        self.wq = nn.Linear(config.dim, config.heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.heads * config.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = apply_rotary(self.wq(x).view(batch, seq, self.heads, self.head_dim), cos, sin)
        k = apply_rotary(self.wk(x).view(batch, seq, self.kv_heads, self.head_dim), cos, sin)
        v = self.wv(x).view(batch, seq, self.kv_heads, self.head_dim)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config.dim, config.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        if config.vocab_size < 1:
            raise ValueError("the config has no vocabulary size; set it from the tokenizer (LlamaConfig.with_vocab)")
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]`` of the next token at every position of ``tokens`` ``[batch, seq]``."""
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"sequence of {seq} tokens exceeds max_seq_len {self.config.max_seq_len}")
        h = self.tok_embeddings(tokens)
        cos, sin = rotary_tables(self.config.head_dim, seq, self.config.rope_theta, h.device)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def init_module(module: nn.Module, seed: int, *, depth: int, skip: str | None = None) -> None:
    """Llama-style init of one module's weights under ``seed``: normal(0, 0.02), output
    projections of a block scaled down by the depth (as GPT-2 and torchtitan do), norms one.
    Parameters whose name starts with ``skip`` are left alone (blocks initialized already)."""
    generator = torch.Generator().manual_seed(seed)
    for name, parameter in sorted(module.named_parameters()):
        if skip is not None and name.startswith(skip):
            continue
        with torch.no_grad():
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2 * depth) if name.endswith(("wo.weight", "w2.weight")) else 0.02
                parameter.copy_(torch.empty_like(parameter, device="cpu").normal_(0.0, std, generator=generator))
