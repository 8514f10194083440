"""unwrap / clean_state_dict on real wrappers (DataParallel, torch.compile's OptimizedModule)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from ddpkit import clean_state_dict, unwrap


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(3, 4)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 2)


PLAIN = sorted(Net().state_dict())


def test_unwrap_strips_every_wrapper_in_any_order() -> None:
    net = Net()
    assert unwrap(net) is net
    assert unwrap(nn.DataParallel(net)) is net
    compiled = torch.compile(net)  # lazy: nothing compiles until the first call
    assert type(compiled).__name__ == "OptimizedModule"
    assert unwrap(compiled) is net
    assert unwrap(nn.DataParallel(torch.compile(nn.DataParallel(net)))) is net


def test_clean_state_dict_of_wrapped_models() -> None:
    net = Net()
    for wrapped in (
        nn.DataParallel(net),
        torch.compile(net),
        torch.compile(nn.DataParallel(net)),
        nn.DataParallel(torch.compile(net)),
    ):
        raw = wrapped.state_dict()
        assert sorted(raw) != PLAIN  # the wrapper really added prefixes
        clean = clean_state_dict(raw)
        assert sorted(clean) == PLAIN
        assert all(clean[k] is raw[k2] for k, k2 in zip(clean, raw, strict=True))  # no copies
        Net().load_state_dict(clean)  # strict load into an unwrapped model works


def test_compiled_submodule_and_metadata() -> None:
    net = Net()
    net.enc = torch.compile(net.enc)  # type: ignore[assignment]
    raw = net.state_dict()
    assert "enc._orig_mod.weight" in raw
    clean = clean_state_dict(raw)
    assert sorted(clean) == PLAIN
    meta = clean._metadata  # type: ignore[attr-defined]
    assert "enc" in meta and "norm" in meta and "" in meta
    assert not any("_orig_mod" in k for k in meta)


def test_a_submodule_called_module_survives() -> None:
    sd = OrderedDict([("module.weight", torch.zeros(1)), ("other.weight", torch.zeros(1))])
    assert list(clean_state_dict(sd)) == ["module.weight", "other.weight"]


def test_collisions_are_refused() -> None:
    sd = {"a._orig_mod.w": torch.zeros(1), "a.w": torch.zeros(1)}
    with pytest.raises(ValueError, match="both clean to 'a.w'"):
        clean_state_dict(sd)


def test_plain_dicts_and_empty() -> None:
    assert clean_state_dict({}) == {}
    assert list(clean_state_dict({"module.module.x": 1})) == ["x"]
