"""init() in this process: a single process (no group), a real one-rank gloo group, and the
errors that must come before any network wait."""

from __future__ import annotations

import os
import re
import socket
import sys
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as tdist

import ddpkit
from ddpkit import Dist, DistConfigError, PeerError, init
from ddpkit.cli import main


@pytest.fixture(autouse=True)
def _no_leftover_group() -> Any:
    yield
    assert not tdist.is_initialized(), "a test left a process group behind"


def test_single_process_has_no_group_and_local_answers() -> None:
    with init(env={}) as dist:
        assert isinstance(dist, Dist)
        assert not tdist.is_initialized()
        assert (dist.rank, dist.world_size, dist.local_rank, dist.is_main) == (0, 1, 0, True)
        assert not dist.distributed and dist.backend is None
        assert dist.device == torch.device("cpu")
        assert dist.info.launcher == "single"
        dist.barrier()
        assert dist.all_reduce(2.5) == 2.5
        assert dist.all_reduce(3, "sum") == 3 and isinstance(dist.all_reduce(3, "sum"), int)
        assert dist.all_reduce(3) == 3.0 and isinstance(dist.all_reduce(3), float)
        t = torch.ones(2)
        assert dist.all_reduce(t, "max") is t
        assert dist.all_reduce({"loss": 1.5, "n": 2}) == {"loss": 1.5, "n": 2.0}
        assert dist.all_reduce({}) == {}
        assert dist.any_rank(True) is True and dist.any_rank(False) is False
        assert dist.all_ranks(True) is True
        assert dist.agree(3, True, 0) == (3, 1, 0)
        assert dist.all_gather_object({"a": 1}) == [{"a": 1}]
        assert dist.broadcast_object("x") == "x"
        assert list(dist.even([1, 2, 3])) == [1, 2, 3]
        model = torch.nn.Linear(2, 2)
        assert ddpkit.wrap_ddp(model, dist) is model
        with dist.join(model):
            pass


def test_one_rank_group_through_the_same_api(launch: Any) -> None:
    """distributed=True with a world of one: a real gloo group, destroyed on exit."""
    saved = os.environ.get("MASTER_PORT")
    with init(env=launch.one_rank_env(launch.free_port()), distributed=True, timeout=20) as dist:
        assert tdist.is_initialized() and dist.distributed and dist.backend == "gloo"
        assert dist.all_reduce(2.5) == 2.5
        assert dist.all_reduce(torch.tensor([4.0]), "sum").item() == 4.0
        assert dist.any_rank(True) and not dist.any_rank(False)
        assert dist.agree(4, 0, 20, op="min") == (4, 0, 20)  # one word through gloo
        assert dist.agree(62) == (62,)
        assert dist.broadcast_object([1, 2]) == [1, 2]
        assert dist.all_gather_object("me") == ["me"]
        dist.barrier()
    assert not tdist.is_initialized()
    assert os.environ.get("MASTER_PORT") == saved


def test_teardown_on_exception_and_the_exception_propagates(launch: Any) -> None:
    env = launch.one_rank_env(launch.free_port())
    with pytest.raises(ZeroDivisionError), init(env=env, distributed=True, timeout=20):
        assert tdist.is_initialized()
        _ = 1 / 0
    assert not tdist.is_initialized()


def test_close_is_idempotent_and_an_existing_group_is_adopted_not_destroyed(launch: Any) -> None:
    outer = init(env=launch.one_rank_env(launch.free_port()), distributed=True, timeout=20)
    try:
        with init(env=launch.one_rank_env(launch.free_port())) as inner:
            assert inner.distributed and inner.backend == "gloo"
            assert inner.all_reduce(1.0, "sum") == 1.0
        assert tdist.is_initialized(), "an adopted group must outlive the inner init()"
    finally:
        outer.close()
        outer.close()
    assert not tdist.is_initialized()


def test_distributed_true_without_a_launcher() -> None:
    with pytest.raises(DistConfigError, match=r"^--distributed needs a launcher: .*mpirun -n N"):
        init(env={}, distributed=True)
    sbatch_shell = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}
    with pytest.raises(DistConfigError, match="--distributed needs a launcher"):
        init(env=sbatch_shell, distributed=True)


def test_distributed_false_with_several_processes(launch: Any) -> None:
    env = launch.one_rank_env(1234, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    with pytest.raises(DistConfigError, match="distributed=False, but torchrun started 2"):
        init(env=env, distributed=False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backend": "nccl"}, "backend='nccl' needs a CUDA device"),
        ({"backend": "carrier-pigeon"}, "backend='carrier-pigeon' is unknown"),
        ({"timeout": 0}, "timeout=0 must be a positive number"),
        ({"timeout": -1.0}, "timeout=-1.0 must be a positive number"),
        ({"timeout": float("inf")}, "must be a positive number"),
        ({"timeout": "soon"}, "must be seconds"),
        ({"rendezvous_timeout": timedelta(0)}, "rendezvous_timeout="),
        ({"device": "cuda"}, "CUDA is not available"),
        ({"device": "gpu:7"}, "is not a torch device"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], message: str, launch: Any) -> None:
    if "CUDA is not available" in message and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    env = launch.one_rank_env(1234, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    with pytest.raises(DistConfigError) as e:
        init(env=env, **kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_timeout_from_environment(launch: Any) -> None:
    with pytest.raises(DistConfigError, match="PYRECOVER_DIST_TIMEOUT='abc' must be a positive"):
        init(env={"PYRECOVER_DIST_TIMEOUT": "abc"})
    with pytest.raises(DistConfigError, match="PYRECOVER_DIST_TIMEOUT='-3'"):
        init(env={"PYRECOVER_DIST_TIMEOUT": "-3"})
    assert init(env={"PYRECOVER_DIST_TIMEOUT": "42"}).timeout_s == 42.0
    assert init(env={"PYRECOVER_DIST_TIMEOUT": "42"}, timeout=7).timeout_s == 7.0  # argument wins
    assert init(env={}).timeout_s == ddpkit.DEFAULT_TIMEOUT_S
    assert 60 <= ddpkit.DEFAULT_TIMEOUT_S <= 300  # well under a typical SLURM kill grace + margin


def test_watchdog_settings_are_checked_on_one_process_too() -> None:
    """DDPKIT_WATCHDOG=banana was accepted by a single process (issue 30): said at once, not
    first on the many-rank launch it was meant for."""
    with pytest.raises(DistConfigError) as e:
        init(env={"DDPKIT_WATCHDOG": "banana"})
    assert (
        str(e.value)
        == "DDPKIT_WATCHDOG='banana' must be 1 (on, the default) or 0 (off); fix or unset it"
    )
    with pytest.raises(DistConfigError, match="DDPKIT_FROZEN_AFTER='soon' must be a positive"):
        init(env={"DDPKIT_FROZEN_AFTER": "soon"})
    assert init(env={"DDPKIT_WATCHDOG": "0", "DDPKIT_FROZEN_AFTER": "soon"}).world_size == 1
    assert init(env={"DDPKIT_WATCHDOG": "off"}, watchdog=False).world_size == 1


def test_unresolvable_master_fails_before_any_wait() -> None:
    env = {
        "SLURM_JOB_ID": "99",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_NODELIST": "no-such-host-ddpkit.invalid",
    }
    t0 = time.monotonic()
    with pytest.raises(DistConfigError, match="does not resolve.*export MASTER_ADDR"):
        init(env=env, timeout=600)
    # A bound against hanging for the 600 s timeout, not a speed test.
    assert time.monotonic() - t0 < 60


def test_bad_variables_fail_before_any_wait(launch: Any) -> None:
    with pytest.raises(DistConfigError, match="RANK=3 must be < WORLD_SIZE=2"):
        env = launch.one_rank_env(1234, RANK="3", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
        init(env=env, timeout=600)


def test_port_in_use_is_named(launch: Any) -> None:
    """Rank 0 cannot listen on MASTER_PORT: a PeerError naming the address, at once."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = launch.one_rank_env(port, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
        with pytest.raises(PeerError) as e:
            init(env=env, timeout=5, rendezvous_timeout=5)
    msg = str(e.value)
    assert f"could not rendezvous at 127.0.0.1:{port}" in msg
    assert "export another MASTER_PORT" in msg
    assert os.environ.get("MASTER_PORT") != str(port)  # restored


def test_missing_rank_zero_times_out_with_a_clear_error(launch: Any) -> None:
    env = launch.one_rank_env(
        launch.free_port(), RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2"
    )
    with pytest.raises(PeerError, match=r"\[rank 1/2\] could not rendezvous .* within 2 s"):
        init(env=env, timeout=2, rendezvous_timeout=2)


def test_reduce_argument_errors() -> None:
    with init(env={}) as dist:
        with pytest.raises(ValueError, match="op='avg' is unknown"):
            dist.all_reduce(1.0, "avg")  # type: ignore[call-overload]
        with pytest.raises(TypeError, match="would truncate"):
            dist.all_reduce(torch.tensor([1, 2]), "mean")
        with pytest.raises(TypeError, match="needs numbers"):
            dist.all_reduce({"a": "x"})  # type: ignore[dict-item]
        with pytest.raises(TypeError, match="not str"):
            dist.all_reduce("1.0")  # type: ignore[call-overload]
        with pytest.raises(ValueError, match="src=1 is not a rank"):
            dist.broadcast_object(1, src=1)
        with pytest.raises(ValueError, match="agree\\(\\) takes 1 to 63 values, got 0"):
            dist.agree()
        with pytest.raises(ValueError, match=r"with 3 value\(s\) each must be in 0..20, got 21;"):
            dist.agree(1, 21, 0)
        with pytest.raises(ValueError, match="got -1; use all_reduce for other numbers"):
            dist.agree(-1)
        with pytest.raises(ValueError, match="got 1.5"):
            dist.agree(1, 1.5)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="op='sum' is unknown; use 'max' or 'min'"):
            dist.agree(1, op="sum")  # type: ignore[arg-type]


def test_print_only_on_rank_zero(capsys: pytest.CaptureFixture[str]) -> None:
    with init(env={}) as dist:
        dist.print("hello", 1)
        dist.print("everyone", all_ranks=True)
    assert capsys.readouterr().out == "hello 1\n[rank 0] everyone\n"
    other = Dist(
        ddpkit.DistInfo(
            launcher="torchrun", rank=1, world_size=2, local_world_size=2, local_rank=1
        ),
        torch.device("cpu"),
        backend=None,
        timeout_s=1,
        owned=False,
    )
    other.print("hidden")
    assert capsys.readouterr().out == ""


class _Writes:
    """An unbuffered stdout (PYTHONUNBUFFERED): every write reaches the launcher on its own."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_a_printed_line_is_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks share the launcher's stdout: a line written in parts can take in another rank's
    line (mpirun's merged output had two JSON objects on one line)."""
    out = _Writes()
    monkeypatch.setattr(sys, "stdout", out)
    with init(env={}) as dist:
        dist.print("everyone", 1, all_ranks=True)
        dist.print("a", "b", sep="-", end="!\n")
    assert main(["info", "--json"]) == 0
    assert out.writes[:2] == ["[rank 0] everyone 1\n", "a-b!\n"]
    assert len(out.writes) == 3 and out.writes[2].endswith("}\n"), out.writes


def test_an_error_line_is_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank of `mpirun -x RANK=0 ...` refuses at once on the launcher's merged stderr: a
    line and its newline written apart let the other rank's line in between (two errors on one
    line, seen in CI)."""
    err = _Writes()
    monkeypatch.setattr(sys, "stderr", err)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["info"]) == 2
    assert main(["hostlist", " "]) == 2
    assert len(err.writes) == 2, err.writes
    assert all(w.startswith("ddpkit: error: ") and w.count("\n") == 1 for w in err.writes)
    assert all(w.endswith("\n") for w in err.writes), err.writes


@pytest.mark.parametrize(
    ("launcher", "local_rank", "local_world", "count", "expected"),
    [
        ("torchrun", 3, 4, 4, 3),  # one GPU per local rank
        ("srun", 2, 4, 8, 2),
        ("srun", 3, 4, 1, 0),  # srun --gpus-per-task=1: each task sees only its own GPU
        ("torchrun", 0, 1, 1, 0),
        ("torchrun", 1, 2, 1, "LOCAL_RANK=1 but only 1 GPU(s)"),  # torchrun does not split GPUs
        ("srun", 4, 8, 2, "SLURM_LOCALID=4 but only 2 GPU(s)"),
    ],
)
def test_gpu_choice_per_local_rank(
    launcher: str, local_rank: int, local_world: int, count: int, expected: int | str
) -> None:
    from ddpkit.dist import _cuda_index

    info = ddpkit.DistInfo(
        launcher=launcher,  # type: ignore[arg-type]
        rank=local_rank,
        world_size=local_world,
        local_rank=local_rank,
        local_world_size=local_world,
    )
    if isinstance(expected, int):
        assert _cuda_index(info, count) == expected
    else:
        with pytest.raises(DistConfigError, match=re.escape(expected)):
            _cuda_index(info, count)


def test_agree_encoding_round_trips_every_small_value() -> None:
    """The one-word encoding: OR of one-hot fields gives the element-wise max and min."""
    from itertools import product

    from ddpkit import agreement

    for n in (1, 2, 3, 9, 63):
        width = agreement.field_width(n)
        assert width * n <= 63
        for a, b in product(range(width), [0, width - 1, width // 2]):
            mine, theirs = [a] * n, [b] * n
            theirs[-1] = (a + 1) % width
            word = agreement.pack(mine, width) | agreement.pack(theirs, width)
            assert 0 <= word < 2**63
            assert agreement.unpack(word, n, width, "max") == tuple(map(max, mine, theirs))
            assert agreement.unpack(word, n, width, "min") == tuple(map(min, mine, theirs))


def test_peer_failures_are_told_from_programming_errors() -> None:
    from ddpkit import is_peer_failure

    gloo = "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:4421: Connection reset by peer"
    assert is_peer_failure(RuntimeError(gloo))
    assert is_peer_failure(RuntimeError("NCCL communicator was aborted on rank 0"))
    assert is_peer_failure(PeerError("[rank 0/2 on n1] all_reduce failed"))
    assert not is_peer_failure(RuntimeError("expected scalar type Float but found Half"))
    assert not is_peer_failure(ValueError("timeout must be positive"))  # not a backend error
