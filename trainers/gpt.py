"""A GPT-style decoder-only transformer: token and position embeddings, pre-norm blocks of causal
self-attention and a 4x GELU MLP, a final LayerNorm and a linear head over the vocabulary.

Attention goes through torch's scaled_dot_product_attention (flash or memory-efficient kernels
where the device has them). The head is not tied to the token embedding: every parameter is its
own tensor, which keeps checkpoints and gradient buckets plain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTShape:
    vocab_size: int = 256
    context: int = 128
    layers: int = 4
    heads: int = 4
    width: int = 128
    dropout: float = 0.0

    def check(self) -> None:
        for name in ("vocab_size", "context", "layers", "heads", "width"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.width % self.heads:
            raise ValueError(f"width={self.width} must be a multiple of heads={self.heads}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")


class CausalSelfAttention(nn.Module):
    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.heads, self.dropout = shape.heads, shape.dropout
        self.qkv = nn.Linear(shape.width, 3 * shape.width)
        self.out = nn.Linear(shape.width, shape.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, time, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.out(y.transpose(1, 2).contiguous().view(batch, time, width))


class Block(nn.Module):
    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(shape.width), nn.LayerNorm(shape.width)
        self.attention = CausalSelfAttention(shape)
        self.mlp = nn.Sequential(nn.Linear(shape.width, 4 * shape.width), nn.GELU(), nn.Linear(4 * shape.width, shape.width), nn.Dropout(shape.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, shape: GPTShape) -> None:
        shape.check()
        super().__init__()
        self.shape = shape
        self.tokens = nn.Embedding(shape.vocab_size, shape.width)
        self.positions = nn.Embedding(shape.context, shape.width)
        self.drop = nn.Dropout(shape.dropout)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.norm = nn.LayerNorm(shape.width)
        self.head = nn.Linear(shape.width, shape.vocab_size, bias=False)
        self.apply(self._init)
        for name, parameter in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith(("attention.out.weight", "mlp.2.weight")):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * shape.layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """(batch, time) token ids -> (batch, time, vocab) logits; time <= context."""
        time = tokens.shape[1]
        if time > self.shape.context:
            raise ValueError(f"{time} tokens are more than the context of {self.shape.context}")
        positions = torch.arange(time, device=tokens.device)
        x = self.drop(self.tokens(tokens) + self.positions(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of every position's prediction of the next token."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
