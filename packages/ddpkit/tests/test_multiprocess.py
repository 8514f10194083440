"""Real gloo process groups on CPU: torchrun and a simulated srun step, 2 and 4 processes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow


def check_collectives(ranks: list[dict[str, Any]], launcher: str) -> None:
    n = len(ranks)
    for r, rec in enumerate(ranks):
        assert "error" not in rec, rec.get("traceback")
        info, res = rec["info"], rec["result"]
        assert info["launcher"] == launcher
        assert (info["rank"], info["world_size"], info["backend"]) == (r, n, "gloo")
        assert res["mean_float"] == pytest.approx((n - 1) / 2)
        assert res["sum_int"] == n * (n + 1) // 2
        assert res["max_int"] == 3 * (n - 1)
        assert res["min_float"] == -0.5
        assert res["mean_int"] == pytest.approx((n - 1) / 2)
        assert res["tensor_mean"] == pytest.approx([(n - 1) / 2] * 3)
        assert res["tensor_in_place"] is True
        assert res["tensor_sum_int"] == [n * (n - 1) // 2, n]
        assert res["dict_mean"] == pytest.approx({"loss": (n - 1) / 2, "tokens": 5 * (n + 1)})
        assert (res["any_last"], res["any_none"]) == (True, False)
        assert (res["all_true"], res["all_but_0"]) == (True, False)
        assert res["bcast0"] == {"step": 7, "from": 0}
        assert res["bcast_last"] == f"from {n - 1}"
        assert res["gather"] == [10 * i for i in range(n)]
        assert res["gather_uneven"] == [1000 * i for i in range(n)]
        assert res["bcast_big"] == 256_000
        assert res["bcast_none"] is None
        assert res["is_ddp"] and res["unwrap_is_model"]
        assert res["raw_keys"] == [
            "module.0.bias",
            "module.0.weight",
            "module.2.bias",
            "module.2.weight",
        ]
        assert res["clean_keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert res["even_count"] == 3, "even() must stop every rank when the shortest runs out"
        assert res["agree_max"] == [n - 1, 5, 1]
        assert res["agree_max_again"] == [3, 7, 0]
        assert res["agree_min"] == [1, 20 - (n - 1)]
        assert res["agree_one"] == [62]
        assert res["agree_many"] == [max((q + i) % 7 for q in range(n)) for i in range(9)]
        assert res["rng_keys"] == sorted(f"rank{i}" for i in range(n))
        assert res["rng_restored"] == ["restored", True]
        # Another world size: re-seeded from (seed 7, step 5, rank), pyrecover-train's formula.
        derived = (7 * 1_000_003 + 5 * 9_176 + r * 7_919) % (2**31 - 1)
        assert res["rng_other_world"] == ["reseeded", n - 1, derived]
        # After teardown: no process group, MASTER_PORT as before init.
        assert rec["initialized_after"] is False
    # DDP kept the replicas identical: after one step and after uneven steps under Join.
    for key in ("params_after_step", "params_after_join"):
        assert all(rec["result"][key] == ranks[0]["result"][key] for rec in ranks), key
    assert ranks[0]["result"]["params_after_join"] != ranks[0]["result"]["params_after_step"]


@pytest.mark.parametrize("n", [2, 4])
def test_torchrun(n: int, launch: Any, outdir: Path) -> None:
    with launch.processes([launch.torchrun_cmd(n, "collectives", outdir)]) as procs:
        (out,) = launch.wait_all(procs, timeout=240)
        assert procs[0].returncode == 0, out
    ranks = launch.read_ranks(outdir, n)
    check_collectives(ranks, "torchrun")
    assert {rec["info"]["local_world_size"] for rec in ranks} == {n}
    # torchrun sets MASTER_PORT itself; init() must leave it as it found it.
    assert all(rec["env_master_port_after"] == rec["info"]["env_master_port"] for rec in ranks)


@pytest.mark.parametrize(("n", "nodes"), [(2, 1), (4, 2)])
def test_simulated_srun(n: int, nodes: int, launch: Any, outdir: Path) -> None:
    nodelist = "localhost" if nodes == 1 else "localhost,node-[2-9]"
    cmds = launch.srun_cmds(n, "collectives", outdir, nodes=nodes, nodelist=nodelist)
    with launch.processes(cmds) as procs:
        outs = launch.wait_all(procs, timeout=240)
        assert [p.returncode for p in procs] == [0] * n, outs
    ranks = launch.read_ranks(outdir, n)
    check_collectives(ranks, "srun")
    job = cmds[0][1]["SLURM_JOB_ID"]
    for r, rec in enumerate(ranks):
        info = rec["info"]
        assert info["job_id"] == job
        # No MASTER_* given: first host of the node list, port derived from the job id.
        assert info["master_addr"] == "localhost"
        assert info["master_port"] == launch.master_port_for_job(job, 0)
        assert info["env_master_port"] == str(info["master_port"])  # set for env:// ...
        assert rec["env_master_port_after"] is None  # ... and removed again on exit
        assert (info["local_rank"], info["node_rank"]) == (r % (n // nodes), r // (n // nodes))
        assert (info["local_world_size"], info["num_nodes"]) == (n // nodes, nodes)


@pytest.mark.parametrize("victim", [1, 0])
def test_dead_peer_fails_fast_and_names_it(victim: int, launch: Any, outdir: Path) -> None:
    """A rank that dies (os._exit) makes the others raise PeerError, not hang (the diagnosis
    without the watchdog, which would end them first: test_watchdog.py)."""
    n = 3
    cmds = launch.srun_cmds(n, f"die{victim}", outdir, timeout=5, extra={"DDPKIT_WATCHDOG": "0"})
    with launch.processes(cmds) as procs:
        # A hang would show as TimeoutExpired here; 5 s timeout + diagnosis + start-up is far less.
        outs = launch.wait_all(procs, timeout=120)
    assert procs[victim].returncode == 17, outs[victim]
    survivors = [r for r in range(n) if r != victim]
    files = sorted(p.name for p in outdir.glob("rank*.json"))
    assert files == [f"rank{r}.json" for r in survivors]
    for r in survivors:
        rec = launch.json.loads((outdir / f"rank{r}.json").read_text())
        assert rec["error_type"] == "PeerError", rec
        assert f"[rank {r}/3 on " in rec["error"]
        if victim == 0:
            assert "rendezvous store is unreachable" in rec["error"]
        else:
            # The other survivor may have ended its own diagnosis (and its heartbeat) first.
            named = re.search(r"ranks? ([\d, ]+) stopped answering", rec["error"])
            assert named and "1" in named[1].split(", "), rec["error"]
        assert "Backend said:" in rec["error"]
        assert rec["initialized_after"] is False  # torn down on the way out


def test_stuck_peer_hits_the_timeout(launch: Any, outdir: Path) -> None:
    """A rank that is alive but never joins: the others time out (3 s) instead of waiting; the
    error ends rank 0's `with` block, and the watchdog ends the stuck rank too (exit 69)."""
    cmds = launch.srun_cmds(2, "hang", outdir, timeout=3)
    with launch.processes(cmds) as procs:
        out0, out1 = launch.wait_all(procs, timeout=120)
        assert procs[0].returncode == 0, out0
        assert procs[1].returncode == 69, out1
    assert "rank 0 on " in out1 and "ended with an error (PeerError: " in out1, out1
    rec = launch.json.loads((outdir / "rank0.json").read_text())
    assert rec["error_type"] == "PeerError", rec
    assert "any_rank failed" in rec["error"]
    assert "every rank still answers" in rec["error"]
    assert "timeout 3 s" in rec["error"]
    assert rec["initialized_after"] is False


def test_fsdp_two_ranks_is_deterministic_sharded_and_bf16_capable(
    launch: Any, outdir: Path
) -> None:
    """FSDP2 over gloo: each config twice per process, bitwise equal; shards are halves."""
    cmds = launch.srun_cmds(2, "fsdp", outdir, timeout=120)
    with launch.processes(cmds) as procs:
        outs = launch.wait_all(procs, timeout=400)
        assert [p.returncode for p in procs] == [0, 0], outs
    ranks = launch.read_ranks(outdir, 2)
    for rec in ranks:
        assert "error" not in rec, rec.get("traceback")
    results = [rec["result"] for rec in ranks]
    for name, got in results[0].items():
        assert got["repeat_equal"], f"{name}: two runs in one process differ"
        assert got["sharded"] and (got["local_rows"], got["full_rows"]) == (16, 32), name
        # Every rank sees the same full parameters and the same (reduced) gradient norms.
        assert got["digest"] == results[1][name]["digest"], name
        assert got["norms"] == results[1][name]["norms"], name
        assert got["losses"] != results[1][name]["losses"], f"{name}: ranks saw the same data"
    fp32 = results[0]["fp32"]
    assert fp32["param_dtype"] == fp32["moment_dtype"] == "torch.float32"
    # Recomputing activations (dropout replayed) and keeping them gathered change no bit.
    assert results[0]["checkpointed"]["digest"] == fp32["digest"]
    assert results[0]["no_reshard"]["digest"] == fp32["digest"]
    mixed, bf16 = results[0]["mixed_bf16"], results[0]["bf16_params"]
    assert mixed["param_dtype"] == mixed["moment_dtype"] == "torch.float32"  # fp32 masters
    assert bf16["param_dtype"] == bf16["moment_dtype"] == "torch.bfloat16"  # half the memory
    assert len({fp32["digest"], mixed["digest"], bf16["digest"]}) == 3


def test_exception_inside_with_tears_down_and_propagates(launch: Any, outdir: Path) -> None:
    cmds = launch.srun_cmds(2, "raise", outdir)
    with launch.processes(cmds) as procs:
        outs = launch.wait_all(procs, timeout=120)
        assert [p.returncode for p in procs] == [0, 0], outs
    for rec in launch.read_ranks(outdir, 2):
        assert rec["error_type"] == "KeyError"  # the user's exception, not swallowed or wrapped
        assert rec["initialized_after"] is False
        assert rec["env_master_port_after"] is None
