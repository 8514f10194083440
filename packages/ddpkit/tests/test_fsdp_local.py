"""shard_model in one process (a private one-rank group from Dist.mesh), its argument checks,
and no_sync for every kind of model. The 2-rank runs are in test_multiprocess.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as tdist
from torch import nn

import ddpkit
from ddpkit import DistConfigError, ShardOptions, init, no_sync, shard_model


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = torch.relu(layer(h))
        return self.out(h)


def test_one_process_gets_a_private_group_for_fsdp_and_close_ends_it() -> None:
    with init(env={}) as dist:
        assert not dist.distributed
        torch.manual_seed(0)
        model = shard_model(Net(), dist, blocks="layers", dtype=torch.bfloat16)
        assert tdist.is_initialized() and tdist.get_world_size() == 1
        assert dist.mesh.size() == 1 and dist.mesh is dist.mesh
        assert ddpkit.is_sharded(model) and ddpkit.is_sharded(model.layers[0])
        assert model.layers[0].weight.dtype == torch.bfloat16
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        before = model.out.weight.full_tensor().clone()
        model(torch.randn(3, 4, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
        assert not torch.equal(before, model.out.weight.full_tensor())
        # The helpers stay one-rank no-ops: the private group is for the mesh only.
        assert dist.backend is None and dist.agree(3, 1) == (3, 1)
    assert not tdist.is_initialized()


@pytest.mark.parametrize("how", ["name", "callable", "modulelist", "list"])
def test_blocks_can_be_given_four_ways(how: str) -> None:
    with init(env={}) as dist:
        model = Net()
        blocks: Any = {
            "name": "layers",
            "callable": lambda m: list(m.layers),
            "modulelist": model.layers,
            "list": list(model.layers),
        }[how]
        shard_model(model, dist, blocks=blocks)
        assert all(ddpkit.is_sharded(m) for m in model.layers)
        assert not ddpkit.is_sharded(model.inp)


@pytest.mark.parametrize(
    ("blocks", "message"),
    [
        ("stack", "Net has no attribute 'stack'; name the ModuleList"),
        ("layers.0.weight", "is a Parameter, not a module"),
        ([], "blocks gave nothing"),
        ([nn.Linear(2, 2)], "blocks gave Linear that is not a submodule"),
        (lambda m: [m], "blocks gave Net that is not a submodule"),
    ],
)
def test_bad_blocks_are_refused_before_sharding(blocks: Any, message: str) -> None:
    with init(env={}) as dist:
        model = Net()
        with pytest.raises(DistConfigError) as e:
            shard_model(model, dist, blocks=blocks)
        assert message in str(e.value) and "\n" not in str(e.value)
        assert not ddpkit.is_sharded(model)
    assert not tdist.is_initialized()


def test_the_same_block_twice_is_refused() -> None:
    with init(env={}) as dist:
        model = Net()
        with pytest.raises(DistConfigError, match="the same module twice"):
            shard_model(model, dist, blocks=[model.layers[0], model.layers[0]])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": torch.int8}, "dtype=torch.int8 must be a floating torch dtype"),
        ({"param_dtype": "bf16"}, "param_dtype='bf16' must be a floating torch dtype"),
        ({"reshard_after_forward": 2}, "reshard_after_forward=2 must be True or False"),
    ],
)
def test_bad_options(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(DistConfigError, match=message):
        ShardOptions(**kwargs)


def test_no_sync_for_plain_and_ddp_models(launch: Any) -> None:
    plain = Net()
    with no_sync(plain):  # one process: nothing to skip
        plain(torch.randn(2, 4)).sum().backward()
    env = launch.one_rank_env(launch.free_port())
    with init(env=env, distributed=True, timeout=20) as dist:
        ddp = nn.parallel.DistributedDataParallel(Net())
        assert ddp.require_backward_grad_sync
        with no_sync(ddp):
            assert not ddp.require_backward_grad_sync
        assert ddp.require_backward_grad_sync
        model = shard_model(Net(), dist, blocks="layers")
        with no_sync(model):  # gradients wait, unsharded, for the last micro-batch
            model(torch.randn(2, 4)).sum().backward()
        assert model.layers[0].weight.grad is None
        model(torch.randn(2, 4)).sum().backward()
        assert model.layers[0].weight.grad is not None
        del ddp, model


def test_full_value_passes_plain_tensors_through() -> None:
    t = torch.ones(2)
    assert ddpkit.full_value(t) is t


class Dropped(nn.Module):
    """Net with dropout in each block: the recomputation must replay the same masks."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.GELU()) for _ in range(3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    torch.manual_seed(5)  # the same dropout masks for both models
    model(torch.randn(4, 8)).pow(2).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_checkpoint_activations_without_sharding_keeps_names_and_bits() -> None:
    torch.manual_seed(0)
    plain = Dropped()
    checkpointed = Dropped()
    checkpointed.load_state_dict(plain.state_dict())
    units = ddpkit.checkpoint_activations(checkpointed, blocks="layers")
    assert units == list(checkpointed.layers)
    assert list(checkpointed.state_dict()) == list(plain.state_dict())  # no wrapper prefix
    calls: list[int] = []
    checkpointed.layers[1][0].register_forward_hook(lambda *_: calls.append(1))
    want, got = _grads(plain), _grads(checkpointed)
    assert len(calls) == 2  # forward, and again in backward: the activations were recomputed
    assert set(want) == set(got) and len(want) == 6
    assert all(torch.equal(want[n], got[n]) for n in want)


def test_checkpoint_activations_refuses_what_shard_model_refuses() -> None:
    with pytest.raises(DistConfigError, match="blocks gave Dropped that is not a submodule"):
        ddpkit.checkpoint_activations(Dropped(), blocks=lambda m: [m])
