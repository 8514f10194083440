"""The Llama-style model: shapes, GQA, a forward/backward, seeded init, presets, FLOPs."""

from __future__ import annotations

import pytest
import torch

from pyrecover_train.model import GPT, ModelConfig, apply_rope, build_model, preset_config
from pyrecover_train.sizes import SIZES


def small(**kw: int) -> ModelConfig:
    base = {
        "dim": 64,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "ffn_dim": 96,
        "vocab_size": 100,
        "max_seq_len": 16,
    }
    base.update(kw)
    return ModelConfig(**base)


def test_forward_backward_shapes() -> None:
    cfg = small()
    model = build_model(cfg, seed=0)
    x = torch.randint(0, cfg.vocab_size, (3, 16))
    logits = model(x)
    assert logits.shape == (3, 16, cfg.vocab_size)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), x.reshape(-1))
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    # Untrained model: loss near ln(vocab).
    assert abs(loss.item() - torch.log(torch.tensor(100.0)).item()) < 0.5


def test_gqa_projections_are_smaller() -> None:
    model = build_model(small(n_heads=8, n_kv_heads=2), seed=0)
    attn = model.layers[0].attn
    assert attn.wq.weight.shape == (64, 64)
    assert attn.wk.weight.shape == (16, 64) and attn.wv.weight.shape == (16, 64)


def test_causal() -> None:
    model = build_model(small(), seed=0)
    x = torch.randint(0, 100, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 100
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.equal(a[0, :10], b[0, :10])
    assert not torch.equal(a[0, 10:], b[0, 10:])


def test_seeded_init_is_reproducible_and_seed_dependent() -> None:
    a, b, c = (build_model(small(), seed=s) for s in (1, 1, 2))
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(p, q), n
        if p.ndim == 2:
            assert not torch.equal(p, r), n


def test_state_dict_holds_weights_only() -> None:
    keys = set(build_model(small(), seed=0).state_dict())
    assert not any(k in ("cos", "sin") for k in keys)
    assert "tok_embeddings.weight" in keys and "output.weight" in keys


def test_rope_rotates_pairs_and_keeps_norm() -> None:
    x = torch.randn(1, 2, 5, 8)
    from pyrecover_train.model import rope_tables

    cos, sin = rope_tables(8, 5, 10000.0)
    y = apply_rope(x, cos, sin)
    assert torch.allclose(x[..., 0, :], y[..., 0, :])  # position 0: no rotation
    assert torch.allclose(x.norm(dim=-1), y.norm(dim=-1), atol=1e-5)


def test_too_long_input_is_refused() -> None:
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        build_model(small(), seed=0)(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"dim": 60, "n_heads": 8}, "not divisible by n_heads"),
        ({"n_heads": 4, "n_kv_heads": 3}, "not a multiple of n_kv_heads"),
        ({"n_layers": 0}, "n_layers must be positive"),
        ({"dim": 12, "n_heads": 4, "n_kv_heads": 4}, "must be even for RoPE"),
    ],
)
def test_bad_shapes(kw: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        small(**kw)


def test_8b_preset_is_the_originals_llama3_shape() -> None:
    cfg = preset_config("8b", vocab_size=50000, max_seq_len=2048)
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim) == (
        4096,
        32,
        32,
        8,
        14336,
    )
    assert cfg.vocab_size == 128256 and cfg.rope_theta == 500000.0
    # Llama-3-8B has 8.03B parameters.
    assert 8.0e9 < cfg.num_params() < 8.1e9


def test_1b_preset_and_flops() -> None:
    cfg = preset_config("1b", vocab_size=8192, max_seq_len=2048)
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads) == (2048, 16, 32, 8)
    n = cfg.num_params(embedding=False)
    assert cfg.flops_per_token(2048) == 6 * n + 12 * 16 * 2048 * 2048


def test_tokenizer_vocab_rounds_up_and_too_big_vocab_is_refused() -> None:
    assert preset_config("tiny", vocab_size=257, max_seq_len=8).vocab_size == 320
    with pytest.raises(ValueError, match="use a smaller tokenizer"):
        preset_config("8b", vocab_size=200_000, max_seq_len=8)


def test_num_params_matches_the_module() -> None:
    for name in ("tiny", "small"):
        cfg = preset_config(name, vocab_size=1000, max_seq_len=8)
        model = GPT(cfg)
        assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    assert {"tiny", "small", "125m", "350m", "1b", "8b"} <= set(SIZES)


def test_differences_name_the_fields() -> None:
    a = small()
    b = small(dim=128, n_layers=3)
    diffs = a.differences(b.to_dict())
    assert any(d.startswith("dim: 128 in the checkpoint != 64") for d in diffs)
    assert any(d.startswith("n_layers") for d in diffs)
    assert a.differences(small(max_seq_len=64)) == []  # sequence length does not change weights


def test_fp64_model_runs() -> None:
    model = build_model(small(), seed=0).to(torch.float64)
    out = model(torch.randint(0, 100, (1, 8)))
    assert out.dtype == torch.float64


@pytest.mark.parametrize("size", sorted(SIZES))
def test_every_size_in_the_table_builds_and_parses(size: str) -> None:
    """A new size is one entry in sizes.SIZES: its shape builds, its defaults validate, and
    --help describes it (nothing else to edit)."""
    from pyrecover_train.config import build_parser, config_from_args

    cfg = preset_config(size, vocab_size=256, max_seq_len=64)
    assert cfg.num_params() > 0
    train = config_from_args(["--model-size", size])
    assert train.sequence_length == SIZES[size].defaults.sequence_length
    assert size in build_parser().format_help()
