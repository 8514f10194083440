"""Import of checkpoints written by the real Lightning Trainer and the real Hugging Face
Trainer (small models, a few CPU steps), bitwise against the files they wrote. Needs lightning
and transformers: the integrations session installs them."""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_helpers import assert_same_state

from ckptstore import CheckpointStore, import_checkpoint
from ckptstore.cli import main

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def read_back(root: Path, step: int) -> dict[str, Any]:
    with CheckpointStore(str(root)) as store:
        assert store.verify(step).ok
        _, values = store.read(step)
    return values


def lightning_ckpt(tmp_path: Path) -> Path:
    L = pytest.importorskip("lightning", reason="needs lightning (the integrations session)")

    class Net(L.LightningModule):
        def __init__(self, lr: float = 0.05) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(8, 3))
    trainer = L.Trainer(
        max_steps=3,
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    logging.getLogger("lightning").setLevel(logging.ERROR)
    trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=4))
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    return path


def test_a_lightning_ckpt_comes_in(tmp_path: Path, capsys: Any) -> None:
    src = lightning_ckpt(tmp_path)
    expected = torch.load(src, weights_only=True)
    assert main(["import", str(src), str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "imported lightning checkpoint" in out and "as step 3" in out, out
    values = read_back(tmp_path / "c", 3)
    assert values["step"] == 3
    assert_same_state({"model": expected["state_dict"]}, values, keys=["model"])
    assert_same_state({"optim": expected["optimizer_states"][0]}, values, keys=["optim"])
    assert values["scheduler"] == expected["lr_schedulers"][0]
    assert values["lightning"]["hyper_parameters"] == {"lr": 0.05}
    assert values["lightning"]["epoch"] == expected["epoch"]


def hf_checkpoint(tmp_path: Path) -> Path:
    transformers = pytest.importorskip("transformers", reason="needs transformers")

    os.environ.setdefault("WANDB_DISABLED", "true")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=8, vocab_size=32, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(cfg)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            x = (torch.arange(8) + i) % 32
            return {"input_ids": x, "labels": x}

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        save_steps=3,
        per_device_train_batch_size=2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=100,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.Trainer(model=model, args=args, train_dataset=Tokens()).train()
    return tmp_path / "out" / "checkpoint-3"


def test_a_hugging_face_trainer_checkpoint_comes_in(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    src = hf_checkpoint(tmp_path)
    report = import_checkpoint(str(src), str(tmp_path / "c"))
    f = report.foreign
    assert f.kind == "hf-trainer" and report.manifest.step == 3
    assert {"model", "optim", "scheduler", "rng", "trainer_state", "step"} <= set(f.took)
    assert "training_args.bin" in f.left and "never unpickled" in f.left["training_args.bin"]
    assert f.missing == {} and "not exact" not in report.summary()  # a complete checkpoint
    values = read_back(tmp_path / "c", 3)
    assert_same_state({"model": load_file(src / "model.safetensors")}, values, keys=["model"])
    optim = torch.load(src / "optimizer.pt", weights_only=True)
    assert_same_state({"optim": optim}, values, keys=["optim"])
    assert values["trainer_state"]["global_step"] == 3
    assert torch.equal(
        values["rng"]["cpu"], torch.load(src / "rng_state.pth", weights_only=False)["cpu"]
    )
    # the weights go into a fresh model of the same config, bitwise
    import transformers

    fresh = transformers.GPT2LMHeadModel(transformers.GPT2Config(**values["config"]))
    missing, unexpected = fresh.load_state_dict(values["model"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to wte
    assert torch.equal(fresh.transformer.wte.weight, values["model"]["transformer.wte.weight"])
    assert report.summary().startswith(f"imported hf-trainer checkpoint {src} as step 3")


def test_a_hugging_face_checkpoint_without_its_state_says_the_resume_is_not_exact(
    tmp_path: Path, capsys: Any
) -> None:
    """An HF folder without trainer_state.json and rng_state.pth imported as "verified", not a
    word about what a resume from it would lack."""
    src = hf_checkpoint(tmp_path)
    (src / "trainer_state.json").unlink()
    (src / "rng_state.pth").unlink()
    capsys.readouterr()  # what the Trainer printed
    assert main(["import", str(src), str(tmp_path / "c"), "--step", "3", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert set(row["missing"]) == {"rng_state.pth", "trainer_state.json"}, row
    report = import_checkpoint(str(src), str(tmp_path / "d"), step=3)
    line = report.summary()
    assert "not a complete hf-trainer checkpoint, a resume from it is not exact: no " in line
    assert "trainer_state.json (no step, epoch or progress)" in line
    assert "rng_state.pth (the random streams (dropout, data order) start anew)" in line


def test_a_weights_only_lightning_ckpt_says_the_optimizer_starts_fresh(tmp_path: Path) -> None:
    src = lightning_ckpt(tmp_path)
    ckpt = torch.load(src, weights_only=True)
    del ckpt["optimizer_states"], ckpt["lr_schedulers"]  # what save_weights_only=True writes
    torch.save(ckpt, tmp_path / "weights.ckpt")
    report = import_checkpoint(str(tmp_path / "weights.ckpt"), str(tmp_path / "c"))
    assert report.foreign.missing == {
        "optimizer_states": "the optimizer starts without its moments"
    }
    assert "a resume from it is not exact: no optimizer_states" in report.summary()
