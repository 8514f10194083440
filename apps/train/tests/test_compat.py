"""Drop-in for the original PyRecover's users (issue 14): its other flags do what they did (or
what is said), and its torch.save checkpoints can be imported or resumed from in one command."""

from __future__ import annotations

import csv
import functools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from train_helpers import events, final_state, tiny_flags

import ckptstore
from pyrecover_train.cli import main
from pyrecover_train.model import build_model, preset_config
from pyrecover_train.state import tensors_equal


def test_loss_csv_has_every_step_and_grows_on_resume(
    corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    argv = tiny_flags(corpus, cache_dir, ckpt, "--log-loss-to-csv", "--logging-frequency", "3")
    assert main([*argv, "--training-steps", "4", "--checkpoint-frequency", "2"]) == 0
    resume = [*argv, "--training-steps", "7", "--resume-from-checkpoint", "latest"]
    assert main(resume) == 0
    with open(ckpt / "default-exp" / "default-exp_loss_log.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["Step", "Loss"]  # the original's header, written once
    assert [int(r[0]) for r in rows[1:]] == list(range(1, 8))  # every step, not every 3rd
    logged = {e["step"]: e["loss"] for e in events(ckpt) if e["event"] == "step"}
    each = [float(r[1]) for r in rows[1:]]
    assert logged[3] == pytest.approx(sum(each[:3]) / 3)  # a progress line: the window's mean
    assert logged[4] == pytest.approx(each[3])  # a window of one step (the last): that loss


def test_profile_writes_a_trace_of_the_chosen_steps(
    corpus: Path, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    argv = tiny_flags(corpus, cache_dir, ckpt, "--training-steps", "4", "--profile")
    assert main([*argv, "--profile-step-start", "2", "--profile-step-end", "3"]) == 0
    trace = ckpt / "default-exp" / "profile-steps2-3-rank0.json"
    assert f"--profile: steps 2-3 traced to {trace}" in capsys.readouterr().out
    names = {e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]}
    assert any("aten::" in n for n in names)  # the ops of the profiled steps


def test_switches_whose_job_is_always_done_say_so(
    corpus: Path, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = tiny_flags(corpus, cache_dir, tmp_path / "ckpt", "--training-steps", "1")
    extra = ["--timeaware-checkpointing", "--verify-checkpoints", "--use_flash_attention"]
    assert main([*argv, *extra]) == 0
    notes = (
        "--timeaware-checkpointing: always on here",
        "--verify-checkpoints: always on here",
        "--use-flash-attention: the attention is torch SDPA",
    )
    out = capsys.readouterr().out
    assert [note for note in notes if note not in out] == []


def test_default_times_are_the_budgets_first_estimates() -> None:
    """The original's --default-iter-time / --default-ckpt-time: the time budget's guesses of a
    step and a save until one is measured (durations: 2m = 120 s)."""
    import slurmclock
    from pyrecover_train import build
    from pyrecover_train.config import config_from_args

    model = torch.nn.Linear(4, 4)
    flag = slurmclock.AnyFlag(slurmclock.StopSignals(("USR2",)))
    argv = ["--default-ckpt-time", "2m", "--default-iter-time", "1.5"]
    given = build.budget(config_from_args(argv), model, flag)
    assert given.config.initial_save_estimate == 120.0
    assert given.config.initial_step_estimate == 1.5
    guessed = build.budget(config_from_args([]), model, flag)
    assert guessed.config.initial_save_estimate == pytest.approx(1.0 + 3 * 20 * 4 / 200e6)
    assert guessed.config.initial_step_estimate == 0.0  # the first step is measured first


def test_tokenizer_name_or_path_takes_a_model_folder(
    corpus: Path, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The original's --tokenizer-name-or-path took a folder (a Hugging Face model's): its
    tokenizer.json is used; a Hub id, which would need a download, is one line."""
    from parquetlm import ParquetSource, train_tokenizer

    tok = train_tokenizer(ParquetSource(str(corpus)), vocab_size=300, cache_dir=tmp_path / "t")
    folder = tmp_path / "my-model"
    folder.mkdir()
    shutil.copy(next((tmp_path / "t").rglob("*.json")), folder / "tokenizer.json")
    argv = tiny_flags(corpus, cache_dir, tmp_path / "ckpt", "--training-steps", "1")
    argv = [*argv[: argv.index("--tokenizer")], *argv[argv.index("--tokenizer") + 2 :]]
    assert main([*argv, "--tokenizer-name-or-path", str(folder)]) == 0
    assert f"tokenizer {folder}" in capsys.readouterr().out
    assert tok.vocab_size <= 300
    ckpt = tmp_path / "hub"
    hub = [*tiny_flags(corpus, cache_dir, ckpt), "--tokenizer-name-or-path", "org/some-model"]
    assert main(hub) == 2
    err = capsys.readouterr().err.strip()
    assert "download its tokenizer.json and give its path" in err and len(err.splitlines()) == 1
    assert not ckpt.exists()


def test_keep_every_keeps_the_multiples(corpus: Path, cache_dir: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    argv = tiny_flags(corpus, cache_dir, ckpt, "--training-steps", "9", "--checkpoint-frequency")
    assert main([*argv, "1", "--keep-last", "1", "--keep-every", "4"]) == 0
    store = ckptstore.CheckpointStore(str(ckpt), experiment="default-exp")
    try:
        assert [i.step for i in store.list()] == [4, 8, 9]
    finally:
        store.close()


# -- the original's checkpoints ------------------------------------------------------------------

ORIGINAL_ORDER = (  # the original's module names, in its parameter order, per layer
    ("attention.wq", "attn.wq"),
    ("attention.wk", "attn.wk"),
    ("attention.wv", "attn.wv"),
    ("attention.wo", "attn.wo"),
    ("feed_forward.w1", "ffn.w1"),
    ("feed_forward.w2", "ffn.w2"),
    ("feed_forward.w3", "ffn.w3"),
    ("attention_norm", "attn_norm"),
    ("ffn_norm", "ffn_norm"),
)


def original_checkpoint(path: Path, vocab: int, step: int) -> dict[str, torch.Tensor]:
    """A file as the original PyRecover's save_ckpt_vanilla wrote it: torch.save of epoch, step,
    model (its names, bf16, "_orig_mod." from torch.compile), AdamW over its parameter order
    (one step taken, so there are moments), its LambdaLR (a functools.partial lambda). Returns
    the weights by this model's names, as fp32."""
    ours = build_model(preset_config("tiny", vocab_size=vocab, max_seq_len=32), seed=7)
    ours.to(torch.bfloat16)
    named = dict(ours.named_parameters())
    names = ["tok_embeddings"]
    for i in range(ours.cfg.n_layers):
        names += [f"layers.{i}.{old}" for old, _ in ORIGINAL_ORDER]
    names += ["norm", "output"]
    mine = {f"layers.{i}.{o}": f"layers.{i}.{n}" for i in range(9) for o, n in ORIGINAL_ORDER}
    params = [named[f"{mine.get(n, n)}.weight"] for n in names]
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lambda w, s: 1.0, 10))
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    sched.step()
    model = {f"_orig_mod.{n}.weight": p.detach() for n, p in zip(names, params, strict=True)}
    state = {"epoch": 1, "step": step, "model": model, "optimizer": optimizer.state_dict()}
    torch.save({**state, "lr_scheduler": sched.state_dict()}, path)
    ours_by_name = zip((f"{mine.get(n, n)}.weight" for n in names), params, strict=True)
    return {n: p.detach().float() for n, p in ours_by_name}


@pytest.fixture
def original(tmp_path: Path, corpus: Path, cache_dir: Path) -> tuple[Path, Any, list[str]]:
    """(the file, its weights by our names, flags whose model fits it)."""
    from parquetlm import ParquetSource, load_tokenizer

    vocab = load_tokenizer("byte", ParquetSource(str(corpus))).vocab_size
    path = tmp_path / "ckpt_7.pt"
    return path, original_checkpoint(path, vocab, 7), tiny_flags(corpus, cache_dir, tmp_path)


def test_import_checkpoint_then_resume(
    original: tuple[Path, Any, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, weights, flags = original
    assert main(["import-checkpoint", str(path), *flags, "--experiment_name", "imp"]) == 0
    out = capsys.readouterr().out
    line = f"imported the torch.save checkpoint {path} at step 7: took the weights (39 tensors), "
    assert f"{line}the AdamW moments and step 7; not taken: the data position" in out
    assert "the RNG states (re-seeded" in out and out.rstrip().count("unused: epoch\n") == 1
    assert "imported: step 7/400 into" in out
    manifest, state = final_state(tmp_path, "imp")
    assert manifest.step == 7 and state["step"] == 7
    assert tensors_equal(state["model"], weights) == []  # every weight, mapped by name
    raw = torch.load(path, weights_only=True)
    first_moment = raw["optimizer"]["state"][1]["exp_avg"].float()  # layers.0 attention.wq
    # AdamW's state index of a weight: its place among the matrices (the first group), in the
    # model's parameter order.
    model = build_model(preset_config("tiny", vocab_size=300, max_seq_len=32), seed=0)
    matrices = [n for n, p in model.named_parameters() if p.ndim >= 2]
    index = matrices.index("layers.0.attn.wq.weight")
    assert torch.equal(state["optim"]["state"][index]["exp_avg"], first_moment)
    resume = [*flags, "--experiment_name", "imp", "--training-steps", "9"]
    assert main([*resume, "--resume-from-checkpoint", "latest"]) == 0
    assert final_state(tmp_path, "imp")[0].step == 9


def test_resume_from_an_original_file_directly(
    original: tuple[Path, Any, list[str]], tmp_path: Path
) -> None:
    path, _, flags = original
    argv = [*flags, "--experiment_name", "direct", "--training-steps", "9"]
    assert main([*argv, "--resume-from-checkpoint", str(path)]) == 0
    resume = next(e for e in events(tmp_path, "direct") if e["event"] == "resume")
    assert resume["step"] == 7 and f"torch.save checkpoint {path}" in resume["reason"]
    assert final_state(tmp_path, "direct")[0].step == 9


def test_an_original_file_of_another_shape_is_one_line(
    original: tuple[Path, Any, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _, flags = original
    argv = [*flags, "--experiment_name", "small", "--model-size", "small"]
    assert main([*argv, "--resume-from-checkpoint", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "its weights do not fit --model-size small" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "small").exists()
