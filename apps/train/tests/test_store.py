"""The app trusts its store (issue 14): one writer per experiment, refused before any work; a
requeued job takes over the lock its lost node left; a resume that finds its checkpoints only on
the mirror; the newest commit even when a kill left the `latest` pointer behind; a missing bucket
and a damaged token cache as one line that loses nothing. Real processes, a real S3 endpoint
(moto_server), files damaged on disk."""

from __future__ import annotations

import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from train_helpers import (
    assert_bitwise_equal,
    child_env,
    events,
    final_state,
    run_cli,
    running_cli,
    tiny_flags,
    wait_for_step,
)

import ckptstore
from pyrecover_train.cli import main


def flags(corpus: Path, cache: Path, ckpt: Path, *extra: str) -> list[str]:
    steps = ["--training-steps", "6", "--checkpoint-frequency", "3"]
    return tiny_flags(corpus, cache, ckpt, *steps, *extra)


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_a_second_writer_is_refused_in_one_line_before_any_work(
    corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """Two trainers on one experiment: the second exits 2 naming the first, writing nothing (no
    start in the metrics); a dry run only reads the experiment, so it runs beside the writer."""
    ckpt = tmp_path / "ckpt"
    exp = ckpt / "default-exp"
    args = tiny_flags(
        corpus, cache_dir, ckpt, "--training-steps", "100000", "--checkpoint-frequency", "0"
    )
    with running_cli(args) as first:
        wait_for_step(first, exp / "metrics.jsonl", 0, 1)
        short = [*args, "--training-steps", "2"]  # were it not refused, it would save soon
        with ThreadPoolExecutor(2) as pool:
            second, dry = pool.map(run_cli, [short, [*short, "--dry-run"]])
        assert first.poll() is None
        first.send_signal(signal.SIGINT)  # Ctrl-C: save and stop
        out, _ = first.communicate(timeout=120)
    assert second.returncode == 2, second.stdout + second.stderr
    line = one_line(second.stderr)
    assert "is being written by another run" in line and f"pid {first.pid}," in line, line
    assert second.stdout == ""  # refused before the data and the model were prepared
    assert dry.returncode == 0 and "dry run OK" in dry.stdout, dry.stdout + dry.stderr
    assert first.returncode == 75, out
    starts = [e for e in events(ckpt) if e["event"] == "start"]
    assert len(starts) == 1  # the writer's: neither the refused one nor the dry run writes here
    with ckptstore.CheckpointStore(str(ckpt), experiment="default-exp") as store:
        assert store.latest_step() == max(e["step"] for e in events(ckpt) if e["event"] == "step")
        assert store.verify("latest").ok
    assert not (exp / "writer.lock").exists()  # released at exit


def test_a_requeued_job_takes_over_the_lock_its_lost_node_left(
    corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """A node of SLURM job 777 died holding the lock (a fresh lease: it cannot be known dead).
    Another job is refused, naming it; job 777 requeued on this host takes the lock over."""
    exp = tmp_path / "ckpt" / "default-exp"
    exp.mkdir(parents=True)
    now = time.time()
    lost = ckptstore.LockInfo("0" * 32, "node-lost", 4242, now, now, 600.0, job_id="777")
    (exp / "writer.lock").write_bytes(lost.to_json())
    # A deadline of its own, so that slurmclock does not ask squeue about these job ids.
    args = [*flags(corpus, cache_dir, tmp_path / "ckpt"), "--time-limit", "1:00:00"]
    other = run_cli(args, env=child_env(SLURM_JOB_ID="778"))
    assert other.returncode == 2, other.stdout + other.stderr
    assert "host node-lost pid 4242, SLURM job 777" in one_line(other.stderr)
    assert (exp / "writer.lock").read_bytes() == lost.to_json() and not (exp / "latest").exists()
    requeued = run_cli(args, env=child_env(SLURM_JOB_ID="777"))
    assert requeued.returncode == 0, requeued.stdout + requeued.stderr
    assert "took over the writer lock" in requeued.stdout + requeued.stderr
    assert "same SLURM job 777" in requeued.stdout + requeued.stderr
    assert not (exp / "writer.lock").exists()


@pytest.fixture(scope="module")
def three_then_six(corpus: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 steps, then a resume to 6 (the LR schedule changes the same way in the runs compared)."""
    ckpt = tmp_path_factory.mktemp("three-then-six")
    for extra in (["--training-steps", "3"], ["--resume-from-checkpoint", "latest"]):
        assert main([*flags(corpus, cache_dir, ckpt), *extra]) == 0
    return ckpt


@pytest.mark.parametrize("kind", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_resume_from_the_mirror_when_the_local_checkpoints_are_gone(
    kind: str,
    three_then_six: Path,
    corpus: Path,
    cache_dir: Path,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """--resume-from-checkpoint latest --checkpoint-mirror URL with the node-local checkpoints
    gone resumes from the mirror's newest checkpoint, bitwise; the new steps come after the
    mirror's (its step 3 is never rewritten); a fresh start is refused, naming the mirror."""
    env, mirror, opts = child_env(), str(tmp_path / "mirror"), None
    if kind == "s3":
        moto = request.getfixturevalue("moto")
        env, mirror, opts = child_env(**moto.env()), "s3://ckpt/mirror", moto.storage_options()
    ckpt = tmp_path / "ckpt"
    args = [*flags(corpus, cache_dir, ckpt), "--checkpoint-mirror", mirror]
    r = run_cli([*args, "--training-steps", "3"], env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    with ckptstore.CheckpointStore(mirror, experiment="default-exp", storage_options=opts) as m:
        saved_at_3 = m.manifest(3).save_id
    shutil.rmtree(ckpt / "default-exp")  # the node-local disk is gone, its metrics with it

    fresh = run_cli(args, env=env)
    assert fresh.returncode == 2, fresh.stdout + fresh.stderr
    assert f"{mirror}/default-exp already holds checkpoints" in one_line(fresh.stderr)
    r = run_cli([*args, "--resume-from-checkpoint", "latest"], env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"resumed from step 3 ({mirror}/default-exp/step-00000003)" in r.stdout

    _, want = final_state(three_then_six)
    manifest, got = final_state(ckpt)
    assert manifest.step == 6
    assert_bitwise_equal(want, got)
    with ckptstore.CheckpointStore(mirror, experiment="default-exp", storage_options=opts) as m:
        assert m.steps() == [3, 6] and m.manifest(3).save_id == saved_at_3
        assert m.verify(6).ok


def test_resume_takes_the_newest_commit_when_a_kill_left_the_pointer_behind(
    corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """Killed between step 6's manifest (the commit) and its `latest` pointer: the next run
    resumes from 6, not 3 (the e2e crash scenario's flake)."""
    ckpt = tmp_path / "ckpt"
    assert main(flags(corpus, cache_dir, ckpt)) == 0
    (ckpt / "default-exp" / "latest").write_text("step-00000003\n")
    more = ["--training-steps", "9", "--resume-from-checkpoint", "latest"]
    assert main([*flags(corpus, cache_dir, ckpt), *more]) == 0
    assert [e["step"] for e in events(ckpt) if e["event"] == "resume"] == [6]


@pytest.mark.s3
def test_a_missing_bucket_is_one_line_and_nothing_is_created(
    moto: Any, corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    import s3fs

    args = [*flags(corpus, cache_dir, tmp_path / "unused"), "--checkpoint-url", "s3://nosuch/run"]
    r = run_cli(args, env=child_env(**moto.env()), cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    line = one_line(r.stderr)
    assert "bucket s3://nosuch does not exist: create it first" in line, line
    assert r.stdout == "" and list(tmp_path.iterdir()) == []  # no runs/ folder either
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **moto.storage_options())
    assert fs.ls("") == ["ckpt"]


def test_a_damaged_token_cache_is_one_line_and_the_checkpoints_are_untouched(
    corpus: Path, tmp_path: Path
) -> None:
    """tokens.bin overwritten in place (same size): the run stops before training on it, with
    one line naming the file and the fix; the checkpoints stay exactly as they were."""
    cache, ckpt = tmp_path / "cache", tmp_path / "ckpt"  # a private cache: others' stays whole
    assert main([*flags(corpus, cache, ckpt), "--training-steps", "3"]) == 0
    checkpoints = sorted((ckpt / "default-exp").glob("step-*/*")) + [ckpt / "default-exp/latest"]
    before = {p: p.read_bytes() for p in checkpoints}
    (tokens,) = cache.rglob("tokens.bin")
    with tokens.open("r+b") as f:
        f.seek(tokens.stat().st_size // 2)
        f.write(bytes(64))
    r = run_cli([*flags(corpus, cache, ckpt), "--resume-from-checkpoint", "latest"])
    assert r.returncode == 1, r.stdout + r.stderr
    line = one_line(r.stderr)
    assert f"{tokens} is damaged" in line and f"delete {tokens.parent} and run again" in line
    assert "the checkpoints are untouched" in line and "Traceback" not in r.stdout
    assert {p: p.read_bytes() for p in checkpoints} == before
    assert sorted((ckpt / "default-exp").glob("step-*/*")) + [ckpt / "default-exp/latest"] == (
        checkpoints
    )


def test_a_checkpoint_of_a_newer_ckptstore_is_ckptstores_one_line(
    corpus: Path, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Step 6 written by a newer ckptstore (manifest schema 99): a resume from "latest" and a
    fresh start are refused in ckptstore's own line (no prefix, no exception name), nothing
    written; the older step 3, named as that line says, still resumes."""
    import orjson

    from ckptstore.manifest import _body_checksum

    ckpt = tmp_path / "ckpt"
    assert main(flags(corpus, cache_dir, ckpt)) == 0  # steps 3 and 6
    manifest = ckpt / "default-exp" / "step-00000006" / "manifest.json"
    body = orjson.loads(manifest.read_bytes())
    body.pop("checksum")
    body["ckptstore"] = 99
    body["checksum"] = _body_checksum(body)
    manifest.write_bytes(orjson.dumps(body))
    before = sorted(p.name for p in (ckpt / "default-exp").iterdir())
    capsys.readouterr()
    for resume in (["--resume-from-checkpoint", "latest"], []):
        assert main([*flags(corpus, cache_dir, ckpt), *resume]) == 2
        line = one_line(capsys.readouterr().err)
        assert line.startswith(
            f"pyrecover-train: error: {manifest.parent} was written by a newer ckptstore "
            "(manifest schema 99"
        ), line
        assert line.endswith("step 3 is the newest this one reads: name it to load that"), line
        assert sorted(p.name for p in (ckpt / "default-exp").iterdir()) == before
    more = ["--resume-from-checkpoint", "3", "--training-steps", "5", "--checkpoint-frequency", "0"]
    assert main([*flags(corpus, cache_dir, ckpt), *more]) == 0
    assert [e["step"] for e in events(ckpt) if e["event"] == "resume"] == [3]


def test_a_broken_plugin_is_one_line_and_exit_2_before_any_training(
    corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """Issue 34: an installed storage plugin whose entry point fails to import (a real
    distribution on the path, as pip leaves it) is named with its distribution, exit 2, before
    the run writes anything -- not a traceback and exit 1 that the supervisor retries."""
    site = tmp_path / "site"
    info = site / "broken_store-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-store\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[ckptstore.storage]\nbroken = broken_store:Store\n")
    (site / "broken_store.py").write_text("raise ImportError('no module named nothing')\n")
    ckpt = tmp_path / "ckpt"
    args = tiny_flags(corpus, cache_dir, ckpt, "--training-steps", "2")
    r = run_cli(args, env=child_env(PYTHONPATH=str(site)), cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "'broken'" in lines[0] and "broken-store 1.0" in lines[0], lines[0]
    assert "fails to import" in lines[0] and not ckpt.exists()
