"""A Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention, SDPA.

The model is deliberately plain (no fused kernels of its own) so that it runs the same on CPU and
CUDA, compiles with ``torch.compile``, and gives bitwise-repeatable results on CPU.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import ddpkit

from .sizes import SIZES


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelConfig:
    """The shape of the model. Two checkpoints are compatible when their configs are equal."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model {name} must be positive, got {getattr(self, name)}")
        if self.max_seq_len <= 0:
            raise ValueError(f"sequence length must be positive, got {self.max_seq_len}")
        if self.dim % self.n_heads:
            raise ValueError(
                f"model dim {self.dim} is not divisible by n_heads {self.n_heads}: "
                "pick a dim that is a multiple of the head count"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}: "
                "grouped-query attention shares each kv head among a whole number of heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"head dim {self.head_dim} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def differences(self, other: ModelConfig | dict[str, Any]) -> list[str]:
        """Fields that differ, as ``name: mine != theirs`` (empty when compatible).

        ``max_seq_len`` is left out: RoPE tables are rebuilt, weights do not depend on it.
        """
        theirs = other if isinstance(other, dict) else other.to_dict()
        out = []
        for f in fields(self):
            if f.name == "max_seq_len":
                continue
            mine = getattr(self, f.name)
            if f.name in theirs and theirs[f.name] != mine:
                out.append(f"{f.name}: {theirs[f.name]} in the checkpoint != {mine} here")
        return out

    def num_params(self, *, embedding: bool = True) -> int:
        attn = self.dim * self.dim * 2 + 2 * self.dim * self.n_kv_heads * self.head_dim
        mlp = 3 * self.dim * self.ffn_dim
        per_layer = attn + mlp + 2 * self.dim
        body = self.n_layers * per_layer + self.dim + self.vocab_size * self.dim  # norm + lm head
        return body + (self.vocab_size * self.dim if embedding else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), the PaLM appendix-B count.

        6 per weight of every matmul (the input embedding is a lookup, not a matmul) plus the
        attention scores and values: 12 * layers * dim * seq_len (causal masking not discounted,
        as in PaLM and nanoGPT, so figures compare across codebases).
        """
        return 6.0 * self.num_params(embedding=False) + 12.0 * self.n_layers * self.dim * seq_len


def preset_config(
    name: str, *, vocab_size: int, max_seq_len: int, exact_vocab: int | None = None
) -> ModelConfig:
    """The shape of model size ``name`` (:data:`~pyrecover_train.sizes.SIZES`), with the
    tokenizer's vocabulary where the preset has none of its own.

    ``exact_vocab``: the vocabulary of weights being imported (it wins over the preset's; the
    tokenizer must fit in it).
    """
    if name not in SIZES:
        raise ValueError(f"unknown model size {name!r}: pick one of {', '.join(SIZES)}")
    spec = asdict(SIZES[name].shape)
    preset_vocab = spec.pop("vocab_size")
    if exact_vocab is not None:
        if vocab_size > exact_vocab:
            raise ValueError(
                f"the tokenizer has {vocab_size} ids but the imported weights have a vocabulary "
                f"of {exact_vocab}: pass the tokenizer the checkpoint was trained with"
            )
        vocab = exact_vocab
    elif preset_vocab is None:
        vocab = -(-vocab_size // 64) * 64  # a multiple of 64 keeps the lm-head matmul efficient
    elif vocab_size > preset_vocab:
        raise ValueError(
            f"the tokenizer has {vocab_size} ids but model size {name!r} has a vocabulary of "
            f"{preset_vocab}: use a smaller tokenizer or another --model-size"
        )
    else:
        vocab = preset_vocab
    return ModelConfig(vocab_size=vocab, max_seq_len=max_seq_len, **spec)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the autocast dtype: the mean of squares underflows in bf16.
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (seq_len, head_dim / 2), computed in float64 on CPU whatever the default
    device: the same bits everywhere."""
    cpu = torch.device("cpu")
    steps = torch.arange(0, head_dim, 2, dtype=torch.float64, device=cpu)
    inv_freq = 1.0 / (theta ** (steps / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64, device=cpu), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]); x is (batch, heads, seq, head_dim)."""
    t = x.shape[-2]
    c, s = cos[:t].to(x.dtype), sin[:t].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv_heads != self.n_heads:
            # Expanding kv heads explicitly works on every backend and torch version (SDPA's
            # enable_gqa is not supported by all kernels). expand + reshape, not
            # repeat_interleave: the same values, but its backward is a sum over the copies
            # (deterministic and fast everywhere), not an index_add (atomics on CUDA, a slower
            # sorted kernel in deterministic mode).
            k, v = self._expand_kv(k), self._expand_kv(v)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))

    def _expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        """(b, kv heads, t, d) -> (b, heads, t, d), each kv head repeated for its group."""
        b, kv, n, d = t.shape
        rep = self.n_heads // kv
        return t[:, :, None].expand(b, kv, rep, n, d).reshape(b, kv * rep, n, d)


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class GPT(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Not persistent: derived from the config, so checkpoints hold weights only.
        half = (cfg.max_seq_len, cfg.head_dim // 2)
        self.register_buffer("cos", torch.empty(half), persistent=False)
        self.register_buffer("sin", torch.empty(half), persistent=False)
        if not self.cos.is_meta:  # on meta: filled by init_rope() once it has memory
            self.init_rope()

    def init_weights(self, seed: int) -> None:
        """Seeded init, independent of the global RNG: same seed, same weights on any device and
        any sharding (each whole tensor is drawn on CPU, in parameter order; a sharded
        parameter keeps its own part of it)."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.ndim == 1:
                    p.fill_(1.0)  # norm weights
                    continue
                std = residual_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
                # Drawn on CPU so the weights do not depend on the device's RNG implementation.
                whole = torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
                ddpkit.copy_whole_(p, whole)

    def init_rope(self) -> None:
        """The RoPE tables (derived, never saved), computed on CPU: the same bits on any device,
        in the buffers' dtype (a model stored in bf16 keeps them in bf16, as ``.to()`` casts)."""
        cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta)
        with torch.no_grad():
            self.cos.copy_(cos)
            self.sin.copy_(sin)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.cfg.max_seq_len:
            raise ValueError(
                f"input of length {tokens.shape[1]} exceeds max_seq_len {self.cfg.max_seq_len}"
            )
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.cos, self.sin)
        return self.output(self.norm(h))


def empty_model(cfg: ModelConfig) -> GPT:
    """The model's structure on the meta device: no memory, nothing initialised. Cast it, shard
    it, then :func:`materialise` it: only what each rank keeps is ever allocated."""
    with torch.device("meta"), _NoInit():
        return GPT(cfg)


class _NoInit(TorchFunctionMode):
    """The modules' default initialisers (``torch.nn.init``) skipped: a meta tensor has nothing
    to initialise, and some of them (``normal_``) run on meta through a Python reference that
    imports torch's compiler stack (seconds of every start-up)."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else (kwargs or {})["tensor"]  # the tensor, as it was
        return func(*args, **(kwargs or {}))


def materialise(model: GPT, device: torch.device | str, *, seed: int | None) -> None:
    """Memory on ``device`` for an :func:`empty_model` (each rank its own shards, when sharded),
    then the RoPE tables; ``seed``: the weights as :func:`build_model` initialises them. None:
    the weights are left unset, for a checkpoint to fill (a resume initialises nothing only to
    overwrite it)."""
    model.to_empty(device=device)
    model.init_rope()
    if seed is not None:
        model.init_weights(seed)


def build_model(cfg: ModelConfig, *, seed: int, device: torch.device | str = "cpu") -> GPT:
    """A freshly initialised model on ``device`` (weights in fp32)."""
    model = empty_model(cfg)
    materialise(model, device, seed=seed)
    return model
