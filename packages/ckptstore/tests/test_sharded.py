"""ckptstore.sharded: FSDP2 state saved sharded with format="dcp" (no full-state gather), resumed
bitwise after a SIGKILL, and resharded 2 -> 1 -> 2 with model AND optimizer state intact.

The multi-process parts run this very file as the worker (``python test_sharded.py worker ...``)
under real gloo process groups on 127.0.0.1; torch's own ``fully_shard`` shards the model (ckptstore
does not depend on ddpkit). The single-process tests cover the wrappers' contract.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from ckpt_helpers import FORMATS
from torch import nn

from ckptstore import CheckpointStore
from ckptstore.sharded import ModelState, OptimizerState

VOCAB, WIDTH, HEADS, SEQ, BATCH = 64, 32, 4, 16, 4


# ------------------------------------------------------------------------------- model --
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        up, down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.mlp = nn.Sequential(up, nn.GELU(), down)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, WIDTH)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyLM(nn.Module):
    """A transformer in miniature: embeddings tied to the head, blocks, dropout, a final norm."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


# ------------------------------------------------------------------------------ worker --
def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _rng_of_every_rank(world: int) -> dict[str, torch.Tensor]:
    """Each rank's torch RNG under its own key: DCP would keep one copy of equal keys."""
    mine = torch.get_rng_state()
    if world == 1:
        return {"rank0": mine}
    import torch.distributed as tdist

    got = [torch.empty_like(mine) for _ in range(world)]
    tdist.all_gather(got, mine)
    return {f"rank{r}": t for r, t in enumerate(got)}


def _full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        "model": get_model_state_dict(model, options=opts),
        "optim": get_optimizer_state_dict(model, opt, options=opts),
    }


def worker(args: argparse.Namespace) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(1)
    if args.fsdp:
        import torch.distributed as tdist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # A rendezvous file, not a TCP port: a port picked free can be taken by another test's
        # process before rank 0 binds it (seen under load).
        tdist.init_process_group(
            "gloo", init_method=os.environ["INIT_METHOD"], rank=rank, world_size=world
        )
    torch.manual_seed(0)
    model = TinyLM()
    if args.fsdp:
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    torch.manual_seed(100 + rank)  # per-rank dropout streams
    out = Path(args.out)
    state: dict[str, Any] = {
        "model": ModelState(model),
        "optim": OptimizerState(model, opt),
        "rng": {},
        "step": 0,
    }
    with CheckpointStore(args.root, format="dcp") as store:
        step = 0
        if args.load is not None:
            store.load(state, args.load)
            step = int(state["step"])
            mine = state["rng"].get(f"rank{rank}")
            if mine is not None and len(state["rng"]) == world:
                torch.set_rng_state(mine.clone())
            _dump(_full_state(model, opt), out / "loaded.pt", rank)
        while step < args.steps:
            step += 1
            x, y = _batch(step, rank)
            loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step in args.save:
                state["rng"], state["step"] = _rng_of_every_rank(world), step
                store.save(step, state, blocking=not args.async_save)
                # Async: training goes on (and changes the weights) while the shard snapshots
                # are written in the background.
                _dump(_full_state(model, opt), out / f"full-step{step}.pt", rank)
            if step == args.die_at:
                os.kill(os.getpid(), signal.SIGKILL)  # no clean-up, no flush: a real crash
        _dump(_full_state(model, opt), out / "final.pt", rank)
    if args.fsdp:
        tdist.destroy_process_group()


def _dump(full: dict[str, Any], path: Path, rank: int) -> None:
    if rank == 0:
        torch.save(full, path)


# ------------------------------------------------------------------------------ driver --
def launch(
    world: int, root: Path, out: Path, *extra: str, die: bool = False
) -> list[subprocess.CompletedProcess[str]]:
    """``world`` processes of the worker (FSDP when world > 1, or with --fsdp in ``extra``)."""
    out.mkdir(parents=True, exist_ok=True)
    rendezvous = out / f"rendezvous-{os.getpid()}-{len(list(out.iterdir()))}"
    fsdp = ["--fsdp"] if world > 1 else []
    argv = [sys.executable, __file__, "worker", str(root), str(out), *fsdp, *extra]
    procs = []
    for rank in range(world):
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "TORCHELASTIC_", "MASTER_"))
            and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
        }
        env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning")
        if world > 1 or fsdp:
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(rank),
                INIT_METHOD=f"file://{rendezvous}",
            )
        procs.append(
            subprocess.Popen(
                argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    done = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=300)
            done.append(subprocess.CompletedProcess(argv, p.returncode, text, ""))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    want = -signal.SIGKILL if die else 0
    for r, c in enumerate(done):
        assert c.returncode == want, f"rank {r} exited {c.returncode}:\n{c.stdout[-4000:]}"
    return done


def load(path: Path) -> dict[str, Any]:
    return dict(torch.load(path, weights_only=True))


def assert_bitwise_equal(a: Any, b: Any, where: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} differs (max abs diff {(a - b).abs().max()})"
    elif isinstance(a, Mapping):
        assert isinstance(b, Mapping) and set(a) == set(b), f"{where}: {set(a) ^ set(b)}"
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def steps(*xs: int) -> list[str]:
    return ["--save", ",".join(map(str, xs))]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank FSDP run of 6 steps that saves at step 3 (checkpoints in OUT/ckpt)."""
    out = tmp_path_factory.mktemp("straight")
    launch(2, out / "ckpt", out, "--steps", "6", *steps(3))
    return out


@pytest.mark.slow
def test_fsdp_runs_are_deterministic_and_saving_changes_nothing(
    straight: Path, tmp_path: Path
) -> None:
    launch(2, tmp_path / "ckpt", tmp_path, "--steps", "6")  # no saves at all
    assert_bitwise_equal(load(straight / "final.pt"), load(tmp_path / "final.pt"))


@pytest.mark.slow
def test_save_is_sharded_without_a_full_gather(straight: Path) -> None:
    manifest = json.loads((straight / "ckpt" / "step-00000003" / "manifest.json").read_text())
    tensors = manifest["format_data"]["tensors"]
    # A sharded parameter and its Adam moments: one chunk per rank, each in that rank's file.
    for key in ("model.layers.0.mlp.0.weight", "optim.state.layers.0.mlp.0.weight.exp_avg"):
        chunks = tensors[key]["chunks"]
        assert [c["sizes"] for c in chunks] == [[64, 32], [64, 32]], key
        assert sorted(c["file"].split(".")[0] for c in chunks) == ["shard-r00000", "shard-r00001"]
    sizes = {f["path"].split("/")[-1].split(".")[0]: f["size"] for f in manifest["files"]}
    assert set(sizes) == {"shard-r00000", "shard-r00001", ""}  # "": DCP's .metadata
    assert 0.8 < sizes["shard-r00000"] / sizes["shard-r00001"] < 1.25, sizes  # halves, no gather


@pytest.mark.slow
def test_sigkill_after_a_save_then_resume_is_bitwise_equal(straight: Path, tmp_path: Path) -> None:
    launch(2, tmp_path / "ckpt", tmp_path, "--steps", "6", *steps(3), "--die-at", "4", die=True)
    assert not (tmp_path / "final.pt").exists()
    launch(2, tmp_path / "ckpt", tmp_path, "--steps", "6", "--load", "latest")
    assert_bitwise_equal(load(straight / "full-step3.pt"), load(tmp_path / "loaded.pt"))
    assert_bitwise_equal(load(straight / "final.pt"), load(tmp_path / "final.pt"))


@pytest.mark.slow
def test_reshard_two_to_one_to_two(straight: Path, tmp_path: Path) -> None:
    """2 FSDP ranks -> one plain process (no process group) -> 2 FSDP ranks, model and
    optimizer compared as full tensors at every hop."""
    step3 = str(straight / "ckpt" / "step-00000003")
    one = tmp_path / "one"
    launch(1, tmp_path / "ckpt", one, "--steps", "4", *steps(4), "--load", step3)
    assert_bitwise_equal(load(straight / "full-step3.pt"), load(one / "loaded.pt"))
    two = tmp_path / "two"
    launch(2, tmp_path / "ckpt", two, "--steps", "4", "--load", "4")
    assert_bitwise_equal(load(one / "full-step4.pt"), load(two / "loaded.pt"))


@pytest.mark.slow
def test_async_save_of_sharded_state_snapshots_each_ranks_shard(
    straight: Path, tmp_path: Path
) -> None:
    """Async saves of FSDP2 state (DTensors): each rank snapshots its own shard and training
    goes on while the shards are written; the checkpoints hold the state at the save, sharded
    like a blocking save's, and resume bitwise on 2 ranks and on 1."""
    launch(2, tmp_path / "ckpt", tmp_path, "--steps", "6", *steps(3, 5), "--async-save")
    assert_bitwise_equal(load(straight / "final.pt"), load(tmp_path / "final.pt"))
    manifest = json.loads((tmp_path / "ckpt" / "step-00000003" / "manifest.json").read_text())
    chunks = manifest["format_data"]["tensors"]["optim.state.layers.0.mlp.0.weight.exp_avg"]
    assert [c["sizes"] for c in chunks["chunks"]] == [[64, 32], [64, 32]]
    again = tmp_path / "again"
    launch(2, tmp_path / "ckpt", again, "--steps", "6", "--load", "3")
    assert_bitwise_equal(load(straight / "full-step3.pt"), load(again / "loaded.pt"))
    assert_bitwise_equal(load(straight / "final.pt"), load(again / "final.pt"))
    one = tmp_path / "one"
    launch(1, tmp_path / "ckpt", one, "--steps", "5", "--load", "5")
    assert_bitwise_equal(load(tmp_path / "full-step5.pt"), load(one / "loaded.pt"))


# ------------------------------------------------------------------- single process --
def trained(seed: int, steps_: int = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(steps_):
        x, y = _batch(s, 0)
        F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_in_one_process(fmt: str, tmp_path: Path) -> None:
    model, opt = trained(0)
    with CheckpointStore(str(tmp_path), format=fmt) as store:
        store.save(2, {"model": ModelState(model), "optim": OptimizerState(model, opt)})
        other, other_opt = trained(1, steps_=0)  # an optimizer that never stepped
        store.load({"model": ModelState(other), "optim": OptimizerState(other, other_opt)})
    assert_bitwise_equal(model.state_dict(), other.state_dict())
    assert_bitwise_equal(opt.state_dict(), other_opt.state_dict())


def test_saving_a_fresh_optimizer_leaves_the_parameters_alone(tmp_path: Path) -> None:
    model, opt = trained(0, steps_=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with CheckpointStore(str(tmp_path), format="dcp") as store:
        store.save(0, {"model": ModelState(model), "optim": OptimizerState(model, opt)})
    assert_bitwise_equal(before, model.state_dict())
    assert all(p.grad is None for p in model.parameters())


def test_keys_carry_no_wrapper_prefix_and_optimizer_state_is_keyed_by_name() -> None:
    model, opt = trained(0, steps_=1)
    compiled = torch.compile(model)  # lazy: nothing is compiled here
    keys = list(ModelState(compiled).state_dict())
    assert "layers.0.qkv.weight" in keys and not any("_orig_mod" in k for k in keys)
    osd = OptimizerState(compiled, opt).state_dict()
    assert "layers.1.mlp.2.bias" in osd["state"]
    assert set(osd["state"]["emb.weight"]) == {"step", "exp_avg", "exp_avg_sq"}


def test_bad_arguments_say_what_to_pass() -> None:
    model, opt = trained(0, steps_=0)
    with pytest.raises(TypeError, match="ModelState needs a torch.nn.Module, got str"):
        ModelState("model")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="needs a torch.optim.Optimizer, got dict"):
        OptimizerState(model, {})  # type: ignore[arg-type]
    stranger = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="2 parameter\\(s\\) of the optimizer are not"):
        OptimizerState(model, stranger)


# -------------------------------------------------------------------------- entry point --
def _main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("out")
    ap.add_argument("--fsdp", action="store_true")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--save", type=lambda s: {int(x) for x in s.split(",")}, default=set())
    ap.add_argument("--die-at", type=int, default=None)
    ap.add_argument("--load", default=None)
    ap.add_argument("--async-save", action="store_true")
    worker(ap.parse_args(argv))


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _main(sys.argv[2:])
    # Everything is written and the group destroyed; skip the interpreter's teardown, where
    # torch 2.13's gloo objects sometimes abort ("terminate called without an active
    # exception", exit -6) after the work is done. What this test checks is on disk by now.
    sys.stdout.flush()
    os._exit(0)
