"""The model sizes, in one table: each size's shape and the training defaults that suit it.

A new size is one entry in :data:`SIZES`: ``--model-size`` accepts it, ``--help`` lists it and
its defaults, and :func:`pyrecover_train.model.preset_config` builds its shape. No torch here:
the command line reads this table before anything heavy is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class Shape:
    """The model's shape (:class:`pyrecover_train.model.ModelConfig` without the sequence
    length, which is ``--sequence-length``)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int | None = None  # None: the tokenizer's, rounded up to a multiple of 64
    rope_theta: float = 10000.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Defaults:
    """The flags whose best value depends on the size; a flag given on the command line wins.
    Every field here is a :class:`~pyrecover_train.config.TrainConfig` field of the same name."""

    sequence_length: int
    batch_size: int
    learning_rate: float
    training_steps: int
    model_dtype: str
    tokenizer: str
    warmup_steps: int
    eval_every: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSize:
    shape: Shape
    defaults: Defaults


# The original PyRecover's defaults, for its model sizes (125m and up).
ORIGINAL = Defaults(
    sequence_length=2048,
    batch_size=1,
    learning_rate=1e-5,
    training_steps=1000,
    model_dtype="bf16",
    tokenizer="bpe:8192",
    warmup_steps=100,
    eval_every=0,
)

# tiny and small are sized for a CPU: a no-argument run trains in about a minute on 2 cores.
SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(
        shape=Shape(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384),
        defaults=Defaults(
            sequence_length=128,
            batch_size=8,
            learning_rate=3e-3,
            training_steps=400,
            model_dtype="fp32",
            tokenizer="bpe:4096",
            warmup_steps=40,
            eval_every=100,
        ),
    ),
    "small": ModelSize(
        shape=Shape(dim=384, n_layers=6, n_heads=6, n_kv_heads=2, ffn_dim=1024),
        defaults=Defaults(
            sequence_length=256,
            batch_size=16,
            learning_rate=1e-3,
            training_steps=2000,
            model_dtype="fp32",
            tokenizer="bpe:4096",
            warmup_steps=100,
            eval_every=200,
        ),
    ),
    "125m": ModelSize(
        shape=Shape(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048),
        defaults=ORIGINAL,
    ),
    "350m": ModelSize(
        shape=Shape(dim=1024, n_layers=24, n_heads=16, n_kv_heads=4, ffn_dim=2816),
        defaults=ORIGINAL,
    ),
    # Llama-3.2-1B's shape (embeddings untied here, so 1.5B parameters).
    "1b": ModelSize(
        shape=Shape(
            dim=2048,
            n_layers=16,
            n_heads=32,
            n_kv_heads=8,
            ffn_dim=8192,
            vocab_size=128256,
            rope_theta=500000.0,
        ),
        defaults=ORIGINAL,
    ),
    # The original PyRecover's Llama-3-8B shape.
    "8b": ModelSize(
        shape=Shape(
            dim=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=8,
            ffn_dim=14336,
            vocab_size=128256,
            rope_theta=500000.0,
        ),
        defaults=ORIGINAL,
    ),
}
DEFAULT_SIZE = "tiny"  # what a run with no arguments trains
PRESET_FLAGS = tuple(f.name for f in fields(Defaults))  # the flags whose default is the size's


def preset_defaults(size: str) -> dict[str, Any]:
    """The size's defaults as ``{field: value}`` (empty for an unknown size)."""
    entry = SIZES.get(size)
    return {} if entry is None else {n: getattr(entry.defaults, n) for n in PRESET_FLAGS}


def describe_preset(name: str) -> str:
    """How the default of ``name`` follows the size, for ``--help``: the sizes in table order,
    neighbours with the same value merged (``tiny/small fp32, 125m and up bf16``)."""
    runs: list[tuple[list[str], object]] = []
    for size, entry in SIZES.items():
        value = getattr(entry.defaults, name)
        if runs and runs[-1][1] == value:
            runs[-1][0].append(size)
        else:
            runs.append(([size], value))
    parts = []
    for i, (sizes, value) in enumerate(runs):
        if len(sizes) == 1:
            where = sizes[0]
        elif i == len(runs) - 1:
            where = f"{sizes[0]} and up"
        else:
            where = "/".join(sizes)
        parts.append(f"{where} {value:g}" if isinstance(value, float) else f"{where} {value}")
    return "preset: " + ", ".join(parts)
