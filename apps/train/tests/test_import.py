"""pyrecover-train starts from other tools' checkpoints (issue 22): a plain torch.save file, a
dcp.save folder (1 process, 2 gloo ranks), a safetensors file, a Lightning .ckpt and a Hugging
Face Trainer checkpoint-N folder, each written here as those tools write them. ckptstore reads
them; the run takes the weights bitwise, the AdamW moments and the step where present, and says
in one line what it took and what not. Bad sources (one line, exit 2, nothing written):
test_inputs.py; the original PyRecover's files: test_compat.py."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from train_foreign_worker import source_state
from train_helpers import events, final_state, tiny_flags

from pyrecover_train.cli import main
from pyrecover_train.state import tensors_equal

STEP = 5  # the step the sources recorded
WORKER = Path(__file__).with_name("train_foreign_worker.py")


@pytest.fixture(scope="module")
def vocab(corpus: Path) -> int:
    from parquetlm import ParquetSource, load_tokenizer

    return int(load_tokenizer("byte", ParquetSource(str(corpus))).vocab_size)


@pytest.fixture(scope="module")
def source(vocab: int) -> dict[str, Any]:
    return source_state(vocab, STEP)


@dataclass(frozen=True)
class Sources:
    """Writes the sources into a test's folder; the flags of a tiny run with checkpoints there."""

    folder: Path
    state: dict[str, Any]
    vocab: int
    corpus: Path
    cache_dir: Path

    def write(self, kind: str, **kw: Any) -> Path:
        return KINDS[kind][0](self.folder, self.state, self.vocab, **kw)

    def flags(self, *extra: str) -> list[str]:
        return tiny_flags(self.corpus, self.cache_dir, self.folder / "ckpt", *extra)

    def final(self, experiment: str) -> tuple[Any, dict[str, Any]]:
        return final_state(self.folder / "ckpt", experiment)


@pytest.fixture
def sources(
    tmp_path: Path, source: dict[str, Any], vocab: int, corpus: Path, cache_dir: Path
) -> Sources:
    return Sources(tmp_path, source, vocab, corpus, cache_dir)


# -- the sources, as each tool writes them -------------------------------------------------------
def torch_save(out: Path, src: dict[str, Any], vocab: int) -> Path:
    """A training loop's torch.save under DDP + torch.compile: prefixed names."""
    model = {f"module._orig_mod.{k}": v for k, v in src["model"].items()}
    torch.save({**src, "model": model, "epoch": 1}, out / "ckpt_5.pt")
    return out / "ckpt_5.pt"


def dcp_folder(out: Path, src: dict[str, Any], vocab: int, ranks: int = 1) -> Path:
    """Plain dcp.save, in a process of its own (or each rank of torchrun, gloo)."""
    cmd = [sys.executable, str(WORKER), "dcp", str(out / "dcp"), str(vocab), str(STEP)]
    if ranks > 1:
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    tmp = out / "tmp"  # torchrun leaves a torchelastic_* folder in its temp folder
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return out / "dcp"


def safetensors_file(out: Path, src: dict[str, Any], vocab: int) -> Path:
    from safetensors.torch import save_file

    save_file(src["model"], out / "model.safetensors")
    return out / "model.safetensors"


def lightning_ckpt(out: Path, src: dict[str, Any], vocab: int) -> Path:
    """What Lightning's Trainer.save_checkpoint writes for a LightningModule holding the GPT as
    ``self.model`` (its entries, the module's names under ``model.``)."""
    ckpt = {
        "epoch": 0,
        "global_step": STEP,
        "pytorch-lightning_version": "2.4.0",
        "state_dict": {f"model.{k}": v for k, v in src["model"].items()},
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 1}}}},
        "callbacks": {},
        "optimizer_states": [src["optimizer"]],
        "lr_schedulers": [{"last_epoch": STEP, "base_lrs": [1e-3, 1e-3]}],
        "hparams_name": "kwargs",
        "hyper_parameters": {"lr": 1e-3},
    }
    torch.save(ckpt, out / "epoch=0-step=5.ckpt")
    return out / "epoch=0-step=5.ckpt"


class TrainingArguments:  # pickled into training_args.bin, as the Trainer does
    output_dir = "out"


def hf_folder(out: Path, src: dict[str, Any], vocab: int) -> Path:
    """A Hugging Face Trainer checkpoint-N folder: its file names and contents."""
    from safetensors.torch import save_file

    folder = out / f"checkpoint-{STEP}"
    folder.mkdir()
    save_file(src["model"], folder / "model.safetensors")
    torch.save(src["optimizer"], folder / "optimizer.pt")
    torch.save({"last_epoch": STEP, "base_lrs": [1e-3, 1e-3]}, folder / "scheduler.pt")
    rng = {"python": random.getstate(), "numpy": np.random.get_state()}
    torch.save({**rng, "cpu": torch.get_rng_state()}, folder / "rng_state.pth")
    state = {"global_step": STEP, "epoch": 0.5, "log_history": [{"loss": 5.0, "step": STEP}]}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    torch.save(TrainingArguments(), folder / "training_args.bin")
    return folder


Writer = Callable[..., Path]  # (folder, source state, vocab) -> the source's path
KINDS: dict[str, tuple[Writer, str, bool, str]] = {  # writer, label, has optimizer + step, unused
    "torch.save": (torch_save, "torch.save", True, "epoch"),
    "dcp": (dcp_folder, "dcp.save", True, ""),
    "safetensors": (safetensors_file, "safetensors", False, ""),
    "lightning": (lightning_ckpt, "Lightning", True, "lightning"),
    "hf-trainer": (hf_folder, "Hugging Face Trainer", True, "trainer_state, training_args.bin"),
}


def the_line(out: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.startswith("imported the ")]
    assert len(lines) == 1, out
    return lines[0]


def expected_line(label: str, path: Path, full: bool, unused: str) -> str:
    step = STEP if full else 0
    took = f"the weights (39 tensors), the AdamW moments and step {STEP}"
    left = (
        ""
        if full
        else (
            "the optimizer state (a safetensors file holds weights only: AdamW starts fresh), "
            "a step (none recorded: training starts at step 0), "
        )
    )
    return (
        f"imported the {label} checkpoint {path} at step {step}: took "
        f"{took if full else 'the weights (39 tensors)'}; not taken: {left}the data position "
        "(the data starts from its beginning), the RNG states (re-seeded from --seed and the "
        f"step), the LR schedule's state (this run's flags, at step {step})"
        + (f"; unused: {unused}" if unused else "")
    )


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_run_starts_from_another_tools_checkpoint(
    kind: str, sources: Sources, capsys: pytest.CaptureFixture[str]
) -> None:
    _, label, full, unused = KINDS[kind]
    path, source = sources.write(kind), sources.state
    step = STEP if full else 0
    line = expected_line(label, path, full, unused)
    # import-checkpoint: what the run starts from, saved as it is (no step taken)
    assert main(["import-checkpoint", str(path), *sources.flags("--experiment_name", "imp")]) == 0
    assert the_line(capsys.readouterr().out) == line
    manifest, state = sources.final("imp")
    assert manifest.step == step and state["step"] == step
    assert tensors_equal(state["model"], source["model"]) == []  # every weight, bitwise
    if full:  # the AdamW moments at the same indices (the trainer's layout), bitwise
        assert tensors_equal(state["optim"]["state"], source["optimizer"]["state"]) == []
    else:
        assert state["optim"]["state"] == {}  # AdamW starts fresh
    # a short training straight from the source: the same run as from the imported checkpoint
    flags = sources.flags("--training-steps", str(step + 2))
    assert main([*flags, "--experiment_name", "run", "--resume-from-checkpoint", str(path)]) == 0
    assert the_line(capsys.readouterr().out) == line
    resume = next(e for e in events(sources.folder / "ckpt", "run") if e["event"] == "resume")
    assert resume["step"] == step and f"{label} checkpoint {path}" in resume["reason"]
    assert main([*flags, "--experiment_name", "imp", "--resume-from-checkpoint", "latest"]) == 0
    direct, imported = (sources.final(e)[1] for e in ("run", "imp"))
    assert direct["step"] == step + 2
    for key in ("model", "optim", "rng", "step"):
        assert tensors_equal(direct[key], imported[key]) == [], key


@pytest.mark.slow
def test_a_dcp_folder_of_two_ranks(sources: Sources, capsys: pytest.CaptureFixture[str]) -> None:
    path = sources.write("dcp", ranks=2)
    assert len(list(path.glob("*.distcp"))) == 2  # both ranks wrote
    assert main(["import-checkpoint", str(path), *sources.flags("--experiment_name", "imp")]) == 0
    assert "took the weights (39 tensors), the AdamW moments and step 5" in capsys.readouterr().out
    _, state = sources.final("imp")
    assert tensors_equal(state["model"], sources.state["model"]) == []
    assert tensors_equal(state["optim"]["state"], sources.state["optimizer"]["state"]) == []


def test_an_experiment_with_checkpoints_is_not_mixed_with_an_import(
    sources: Sources, capsys: pytest.CaptureFixture[str]
) -> None:
    """One line, exit 2, nothing written (the other bad sources: test_inputs.py)."""
    flags = sources.flags("--training-steps", "1")
    assert main(flags) == 0
    exp = sources.folder / "ckpt" / "default-exp"
    before = sorted(p.name for p in exp.iterdir())
    capsys.readouterr()
    path = sources.write("safetensors")
    assert main([*flags, "--resume-from-checkpoint", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "already holds checkpoints (latest step 1): start from" in err and "\n" not in err
    assert sorted(p.name for p in exp.iterdir()) == before
