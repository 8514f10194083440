"""ckptstore.lightning.CkptStoreIO inside the real Lightning Trainer (extra [lightning]).

Lightning's own ModelCheckpoint writes through the plugin (async by default); resuming from
``ckpt_path="last"`` gives weights bitwise equal to a run that never stopped; a corrupt newest
checkpoint falls back to the previous one; top-k removal, refusal of pickled objects, S3.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning", reason="needs the [lightning] extra")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402

from ckptstore import CheckpointError, CheckpointWarning  # noqa: E402
from ckptstore.lightning import CkptStoreIO  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


class Net(L.LightningModule):
    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.9)}


def loader() -> torch.utils.data.DataLoader:
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), 8)


QUIET: dict[str, Any] = {"enable_progress_bar": False, "enable_model_summary": False}


def fit(
    dirpath: str,
    epochs: int,
    io: CkptStoreIO,
    ckpt_path: str | None = None,
    **ckpt: Any,
) -> tuple[Net, ModelCheckpoint]:
    L.seed_everything(0, verbose=False)
    mc = ModelCheckpoint(dirpath=dirpath, save_last=True, **ckpt)
    trainer = L.Trainer(
        max_epochs=epochs,
        callbacks=[mc],
        plugins=[io],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return model, mc


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("storage", ["local", "memory"], indirect=True)
def test_resume_from_last_is_bitwise(storage: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    url, options = storage
    straight, _ = fit(str(tmp_path / "straight"), 4, CkptStoreIO())
    fit(url, 2, CkptStoreIO(storage_options=options))
    io = CkptStoreIO(storage_options=options)
    assert io.exists(f"{url}/last.ckpt")
    resumed, _ = fit(url, 4, io, ckpt_path=f"{url}/last.ckpt")
    assert same_weights(resumed, straight)


def test_saves_are_verified_atomic_and_report_durable_times(tmp_path: Path) -> None:
    io = CkptStoreIO()  # async
    _, mc = fit(str(tmp_path), 2, io, every_n_train_steps=2, save_top_k=-1)
    last = tmp_path / "last.ckpt"
    assert last.is_dir() and (last / "latest").read_text().strip() == "step-00000008"
    assert sorted(p.name for p in last.iterdir()) == ["latest", "step-00000008"]  # keep_last=1
    manifest = last / "step-00000008" / "manifest.json"
    assert b'"lightning_path"' in manifest.read_bytes()
    # Lightning's ``ckpt_path="last"`` finds the directory like it would a file.
    assert Path(mc.last_model_path) == last


def test_corrupt_newest_falls_back(tmp_path: Path) -> None:
    io = CkptStoreIO(keep_last=2, blocking=True)
    path = str(tmp_path / "run.ckpt")
    model = nn.Linear(2, 2)
    for step in (1, 2):
        with torch.no_grad():
            model.weight.fill_(step)
        io.save_checkpoint({"global_step": step, "state_dict": model.state_dict()}, path)
    payload = next((tmp_path / "run.ckpt" / "step-00000002").glob("state.*"))
    data = bytearray(payload.read_bytes())
    data[-1] ^= 0xFF
    payload.write_bytes(bytes(data))
    with pytest.warns(CheckpointWarning, match="trying step 1"):
        ckpt = CkptStoreIO().load_checkpoint(path)
    assert ckpt["global_step"] == 1 and torch.all(ckpt["state_dict"]["weight"] == 1)
    # RNG-like small tensors own their memory (Generator.set_state crashes on a view).
    rng = torch.get_rng_state()
    io.save_checkpoint({"global_step": 3, "rng": rng}, path)
    io.wait()
    loaded = CkptStoreIO().load_checkpoint(path)["rng"]
    torch.set_rng_state(loaded)
    assert torch.equal(torch.get_rng_state(), rng)


def test_remove_checkpoint_top_k_and_foreign_files(tmp_path: Path) -> None:
    io = CkptStoreIO()
    fit(str(tmp_path), 3, io, every_n_train_steps=4, save_top_k=1, monitor="train_loss")
    ckpts = sorted(p.name for p in tmp_path.iterdir())
    assert len(ckpts) == 2 and "last.ckpt" in ckpts  # the best and last; the rest removed
    keep = tmp_path / "keep.ckpt"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    io.remove_checkpoint(keep)  # not a store: nothing happens to it
    assert (keep / "notes.txt").read_text() == "mine"


def test_refuses_objects_that_need_pickle(tmp_path: Path) -> None:
    class Opaque:
        pass

    io = CkptStoreIO()
    ckpt = {"global_step": 1, "hyper_parameters": {"lr": 0.1, "extra": Opaque()}}
    with pytest.raises(CheckpointError, match=r"\['hyper_parameters'\]\['extra'\]"):
        io.save_checkpoint(ckpt, str(tmp_path / "x.ckpt"))
    assert not io.exists(tmp_path / "x.ckpt")
    with pytest.raises(TypeError, match="storage options once"):
        CkptStoreIO().save_checkpoint({}, str(tmp_path / "x"), storage_options={"a": 1})
    with pytest.raises(ValueError, match="keep_last must be"):
        CkptStoreIO(keep_last=0)


class WithASet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters({"tags": {"a", "b"}})  # a set: not JSON, refused at save


def test_a_refused_save_leaves_no_folder_for_a_resume_to_find(tmp_path: Path) -> None:
    """A refused save left an empty `timeaware.ckpt/`: Lightning's exists() (what slurmclock's
    resume_path() asks) said yes, and every later run that resumed from it failed."""
    from lightning.fabric.utilities.cloud_io import get_filesystem

    path = tmp_path / "ckpts" / "timeaware.ckpt"
    trainer = L.Trainer(
        max_steps=1, plugins=[CkptStoreIO()], logger=False, enable_checkpointing=False, **QUIET
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(WithASet(), loader())
    with pytest.raises(CheckpointError, match=r"\['hyper_parameters'\]\['tags'\]"):
        trainer.save_checkpoint(path)
    assert not get_filesystem(str(path)).exists(str(path))
    assert not (tmp_path / "ckpts").exists()  # its parent, made by the same save, too


def test_a_folder_without_a_checkpoint_is_one_line_when_loaded(tmp_path: Path) -> None:
    """What an older ckptstore left behind (or a save killed before its commit)."""
    empty = tmp_path / "timeaware.ckpt"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="holds no checkpoint .* remove it, or start"):
        CkptStoreIO().load_checkpoint(empty)


@pytest.mark.s3
@pytest.mark.parametrize("storage", ["s3"], indirect=True)
def test_s3(
    storage: tuple[str, dict[str, Any]], moto: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, options = storage
    for key, value in moto.env().items():  # Lightning's own fsspec calls (exists, ls) need them
        monkeypatch.setenv(key, value)
    straight, _ = fit(str(tmp_path / "straight"), 2, CkptStoreIO())
    fit(url, 1, CkptStoreIO(storage_options=options))
    resumed, _ = fit(url, 2, CkptStoreIO(storage_options=options), ckpt_path=f"{url}/last.ckpt")
    assert same_weights(resumed, straight)
