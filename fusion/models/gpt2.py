"""GPT-2, written from scratch in the style of nanoGPT.

The model is a decoder-only transformer (Radford et al., 2019, "Language Models are
Unsupervised Multitask Learners") with learned position embeddings, pre-LayerNorm blocks
and an output head tied to the token embedding. ``forward`` maps token ids to logits and
nothing else: the loss lives in :mod:`fusion.losses`, so the traced graph has one input and
one output and can be split into pipeline stages.

``forward`` is written to be captured by :func:`torch.fx.symbolic_trace`: it never branches
on a tensor shape or value. Python-level branches only read configuration (``self.training``
and the dropout probability), which fx bakes into the graph at trace time.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
from torch import nn
from torch.nn import functional as F

from fusion.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["GPT2", "GPT2Config", "PRESETS"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPT2Config:
    """Shape and regularisation of a GPT-2 model."""

    vocab_size: int
    """Number of distinct token ids; ids must lie in ``[0, vocab_size)``."""

    block_size: int
    """Longest sequence the model accepts (the number of learned position embeddings)."""

    n_layer: int
    """Number of transformer blocks."""

    n_head: int
    """Number of attention heads per block; must divide ``n_embd``."""

    n_embd: int
    """Width of the residual stream."""

    dropout: float = 0.0
    """Dropout probability on embeddings, attention weights and residual branches."""

    bias: bool = True
    """Whether Linear and LayerNorm layers have biases (GPT-2 does)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"GPT2Config.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ConfigError(
                f"GPT2Config.n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                "choose n_embd as a multiple of n_head"
            )
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, int | float):
            raise ConfigError(f"GPT2Config.dropout must be a float, got {self.dropout!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"GPT2Config.dropout must be in [0, 1), got {self.dropout}")
        if not isinstance(self.bias, bool):
            raise ConfigError(f"GPT2Config.bias must be a bool, got {self.bias!r}")


PRESETS: dict[str, dict[str, int]] = {
    # Test sizes: byte-level vocabulary, milliseconds per step on a CPU.
    "tiny": dict(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=32),
    "mini": dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128),
    # The four released GPT-2 sizes (124M, 350M, 774M, 1558M parameters).
    "small": dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "medium": dict(vocab_size=50257, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "large": dict(vocab_size=50257, block_size=1024, n_layer=36, n_head=20, n_embd=1280),
    "xl": dict(vocab_size=50257, block_size=1024, n_layer=48, n_head=25, n_embd=1600),
}
"""Named configurations, as keyword arguments of :class:`GPT2Config`."""


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t attends to positions <= t."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.head_dim = config.n_embd // config.n_head
        self.dropout = config.dropout
        # Query, key and value projections for all heads in one matmul.
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over the sequence.

        Args:
            x: residual stream, shape (B, T, C).

        Returns:
            The attention output projected back to the residual stream, shape (B, T, C).
        """
        b = x.size(0)
        t = x.size(1)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        q = q.view(b, t, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(b, t, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(b, t, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        # A branch on configuration, not on a tensor: fx records the value at trace time.
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(b, t, self.n_embd)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))  # (B, T, C)


class MLP(nn.Module):
    """Position-wise feed-forward network with a 4x hidden expansion."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to each position; (B, T, C) -> (B, T, C)."""
        x = self.gelu(self.c_fc(x))  # (B, T, 4C)
        return self.dropout(self.c_proj(x))  # (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: attention then MLP, each on a residual branch."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Update the residual stream; (B, T, C) -> (B, T, C)."""
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class GPT2(nn.Module):
    """GPT-2 language model: token ids (B, T) to next-token logits (B, T, vocab_size).

    Sequences longer than ``config.block_size`` fail in the position-embedding lookup; the
    forward pass does not check the length so that it stays traceable.
    """

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying (Press & Wolf, 2017): the input embedding and the output head share
        # one Parameter, so it is counted, stored and updated once.
        self.transformer.wte.weight = self.lm_head.weight

        self.apply(self._init_weights)
        # GPT-2 scales the init of each residual projection by 1/sqrt(2 * n_layer) because
        # every block adds two branches to the residual stream (Radford et al., 2019, sec 2.3).
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=residual_std)
        logger.debug("built GPT2 with %d parameters from %s", self.num_parameters(), config)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        """Number of parameter elements, counting the tied embedding/head weight once."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Compute next-token logits.

        Args:
            idx: token ids, int64 of shape (B, T) with T <= ``config.block_size``.

        Returns:
            Logits of shape (B, T, vocab_size); position t predicts token t + 1.
        """
        t = idx.size(1)
        pos = torch.arange(t, device=idx.device)  # (T,)
        tok_emb = self.transformer.wte(idx)  # (B, T, C)
        pos_emb = self.transformer.wpe(pos)  # (T, C)
        x = self.transformer.drop(tok_emb + pos_emb)  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)  # (B, T, C)
        x = self.transformer.ln_f(x)  # (B, T, C)
        return self.lm_head(x)  # (B, T, vocab_size)
