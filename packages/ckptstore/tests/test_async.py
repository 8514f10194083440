"""Async saves: one in flight, errors never swallowed, latest moves only after durability."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointError, CheckpointStore, register_format
from ckptstore.formats import SaveContext
from ckptstore.formats.torchfile import TorchFormat

EVENTS: list[str] = []
GATE = threading.Event()


class GatedFormat(TorchFormat):
    """The 'torch' format, but persist() waits for GATE and logs what happens when."""

    name = "gated"

    def persist(self, staged: Any, ctx: SaveContext) -> None:
        EVENTS.append(f"persist-start {ctx.step}")
        assert GATE.wait(60)
        super().persist(staged, ctx)
        EVENTS.append(f"persist-end {ctx.step}")


class BrokenFormat(TorchFormat):
    name = "broken"

    def persist(self, staged: Any, ctx: SaveContext) -> None:
        if ctx.step == 2:
            raise OSError(5, "Input/output error (injected)")
        super().persist(staged, ctx)


register_format("gated", GatedFormat, clobber=True)
register_format("broken", BrokenFormat, clobber=True)


def test_one_save_in_flight_and_latest_moves_after_durability(tmp_path: Path) -> None:
    EVENTS.clear()
    GATE.clear()
    store = CheckpointStore(str(tmp_path), format="gated")
    store.save(1, {"w": torch.ones(3)}, blocking=False)
    assert store.latest_step() is None  # not durable yet: not a checkpoint, no pointer
    assert not (tmp_path / "latest").exists()
    second = threading.Thread(target=lambda: store.save(2, {"w": torch.full((3,), 2.0)}))
    second.start()
    second.join(0.5)
    assert second.is_alive()  # waits for save 1: never two in flight
    assert EVENTS == ["persist-start 1"]
    GATE.set()
    second.join(60)
    assert EVENTS == ["persist-start 1", "persist-end 1", "persist-start 2", "persist-end 2"]
    assert store.latest_step() == 2
    store.close()


def test_background_error_surfaces_at_the_next_call(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), format="broken")
    store.save(1, {"w": torch.ones(3)}, blocking=False).result()
    handle = store.save(2, {"w": torch.ones(3)}, blocking=False)
    with pytest.raises(CheckpointError, match="injected"):
        store.save(3, {"w": torch.ones(3)})  # the next call re-raises the background failure
    assert [c.step for c in store.list()] == [1]
    assert (tmp_path / "latest").read_text().strip() == "step-00000001"
    with pytest.raises(CheckpointError, match="injected"):
        handle.result()
    store.save(3, {"w": torch.ones(3)})  # delivered once; the store keeps working
    assert store.latest_step() == 3
    store.close()


def test_error_surfaces_at_wait_and_close(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), format="broken")
    store.save(2, {"w": torch.ones(3)}, blocking=False)
    with pytest.raises(CheckpointError, match="injected"):
        store.wait()
    store.save(2, {"w": torch.ones(3)}, blocking=False)
    with pytest.raises(CheckpointError, match="injected"):
        store.close()
    with pytest.raises(CheckpointError, match="closed"):
        store.save(4, {})


def test_snapshot_buffers_are_reused(tmp_path: Path) -> None:
    w = torch.randn(1000, 100)
    with CheckpointStore(str(tmp_path)) as store:
        store.save(1, {"w": w}, blocking=False).result()
        arena = store._arena._buf
        assert arena is not None
        ptr = arena.data_ptr()
        for step in (2, 3):
            w.add_(1)
            store.save(step, {"w": w}, blocking=False).result()
            assert store._arena._buf is not None and store._arena._buf.data_ptr() == ptr
        loaded = {"w": torch.zeros_like(w)}
        store.load(loaded)
        assert torch.equal(loaded["w"], w)


def test_saves_completed_drains_stats(tmp_path: Path) -> None:
    with CheckpointStore(str(tmp_path)) as store:
        for step in range(3):
            store.save(step, {"w": torch.ones(10)}, blocking=step % 2 == 0)
        store.wait()
        stats = store.saves_completed()
        assert [s.step for s in stats] == [0, 1, 2]
        for s in stats:
            d = s.to_dict()
            assert set(d) >= {"step", "bytes", "blocking_s", "total_s", "durable_at", "url"}
            assert s.total_s >= s.blocking_s >= 0 and s.bytes > 0 and s.target == "primary"
        assert store.saves_completed() == []


def test_saves_completed_says_which_saves_ran_in_the_background(tmp_path: Path) -> None:
    """A time budget keeps async saves (slower: the caller went on meanwhile) apart from
    blocking ones; the stats say which was which."""
    with CheckpointStore(str(tmp_path)) as store:
        store.save(1, {"w": torch.ones(10)})
        store.save(2, {"w": torch.ones(10)}, blocking=False)
        store.wait()
        assert [(s.step, s.background) for s in store.saves_completed()] == [(1, False), (2, True)]


def test_a_script_that_ends_right_after_an_async_save_still_commits(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = (
        "import sys, torch\n"
        "from ckptstore import CheckpointStore\n"
        "s = CheckpointStore(sys.argv[1])\n"
        "s.save(1, {'w': torch.arange(3_000_000, dtype=torch.float32)}, blocking=False)\n"
    )  # no wait(), no close(): the interpreter must still finish the save
    r = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    with CheckpointStore(str(tmp_path)) as store:
        assert store.verify(1).ok
        loaded = {"w": torch.zeros(3_000_000)}
        store.load(loaded)
        assert torch.equal(loaded["w"], torch.arange(3_000_000, dtype=torch.float32))


def test_reserve_prepares_the_snapshot_buffer(tmp_path: Path) -> None:
    state = {"w": torch.randn(1000, 300), "opt": {"m": torch.randn(300)}}
    with CheckpointStore(str(tmp_path)) as store:
        store.reserve(state)
        store.save(1, state, blocking=False).result()
        buf = store._arena._buf
        assert buf is not None and buf.numel() >= 1000 * 300 * 4
        ptr = buf.data_ptr()
        store.save(2, state, blocking=False).result()  # the reserved buffer is the one used
        assert store._arena._buf is not None and store._arena._buf.data_ptr() == ptr
        loaded = {"w": torch.zeros(1000, 300), "opt": None}
        store.load(loaded)
        assert torch.equal(loaded["w"], state["w"]) and torch.equal(
            loaded["opt"]["m"], state["opt"]["m"]
        )


# -- what a save holds when the state changes right after it returns ----------------------------

STAGE_GATE = threading.Event()


class GatedStageFormat(TorchFormat):
    """The 'torch' format whose background snapshot waits for STAGE_GATE: the copy of an
    overlapped save is still to be made when save() returns."""

    name = "gated-stage"

    def stage(self, enc: Any, ctx: SaveContext) -> Any:
        if ctx.background:
            assert STAGE_GATE.wait(60)
        return super().stage(enc, ctx)


register_format("gated-stage", GatedStageFormat, clobber=True)


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(8, 64)).square().mean().backward()
    opt.step()
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 64)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("overlap", [False, True])
def test_an_async_save_holds_its_steps_state_when_training_goes_on_at_once(
    tmp_path: Path, overlap: bool
) -> None:
    """The weights and the optimizer change right after save() returns (overlapped: right
    after staged()), while the write is held back: the checkpoint has the old values, bitwise."""
    EVENTS.clear()
    GATE.clear()
    model, opt = _model_and_optimizer()
    saved_model = {k: t.clone() for k, t in model.state_dict().items()}
    saved_moments = [s["exp_avg"].clone() for s in opt.state.values()]
    store = CheckpointStore(str(tmp_path), format="gated")
    handle = store.save(1, {"model": model, "optim": opt}, blocking=False, overlap=overlap)
    handle.staged()
    _step(model, opt)  # the next forward, backward and optimizer step
    with torch.no_grad():
        model[0].weight.add_(1.0)
    GATE.set()
    handle.result()
    _, got = store.read(1)
    store.close()
    assert all(torch.equal(got["model"][k], t) for k, t in saved_model.items())
    moments = [s["exp_avg"] for s in got["optim"]["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(moments, saved_moments, strict=True))
    assert [s["step"] for s in got["optim"]["state"].values()] == [torch.tensor(1.0)] * 4


def test_an_overlapped_save_returns_before_its_snapshot_and_staged_waits_for_it(
    tmp_path: Path,
) -> None:
    """save(overlap=True) returns while its copy is held back; staged() returns only once the
    copy is made; the checkpoint is the state at save()."""
    STAGE_GATE.clear()
    w = torch.arange(1000, dtype=torch.float32)
    store = CheckpointStore(str(tmp_path), format="gated-stage")
    handle = store.save(1, {"w": w}, blocking=False, overlap=True)
    assert not handle.done()  # returned with the copy still to make
    waiting = threading.Thread(target=store.staged)
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive()  # staged() waits for the copy
    STAGE_GATE.set()
    waiting.join(60)
    assert not waiting.is_alive()
    w.add_(1.0)  # allowed now
    handle.result()
    assert torch.equal(store.read(1)[1]["w"], torch.arange(1000, dtype=torch.float32))
    store.close()


def test_a_change_before_staged_fails_the_save_and_writes_nothing(tmp_path: Path) -> None:
    """The contract broken: the optimizer steps while the snapshot is still being taken. The
    save fails (the error names what changed and what to call) instead of writing a mixture;
    the store goes on."""
    STAGE_GATE.clear()
    model, opt = _model_and_optimizer()
    store = CheckpointStore(str(tmp_path), format="gated-stage")
    handle = store.save(1, {"model": model, "optim": opt}, blocking=False, overlap=True)
    _step(model, opt)  # without staged()
    STAGE_GATE.set()
    store.staged()  # returns: a failed snapshot is never waited for forever
    with pytest.raises(CheckpointError, match=r"changed while its snapshot was taken.*staged\(\)"):
        handle.result()
    assert store.latest_step() is None and not list(tmp_path.glob("step-*/manifest.json"))
    store.save(2, {"model": model, "optim": opt})  # delivered once; the store goes on
    assert store.latest_step() == 2
    store.close()


def test_staged_is_immediate_without_an_overlapped_save(tmp_path: Path) -> None:
    with CheckpointStore(str(tmp_path)) as store:
        store.staged()  # nothing in flight
        store.save(1, {"w": torch.ones(3)}, blocking=False).staged()
        store.staged()
