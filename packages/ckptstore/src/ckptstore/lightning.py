"""A Lightning ``CheckpointIO`` backed by ckptstore (extra ``[lightning]``).

``Trainer(plugins=[CkptStoreIO()])`` makes every checkpoint Lightning writes -- ``ModelCheckpoint``,
``trainer.save_checkpoint``, slurmclock's ``TimeAwareCallback`` -- verified, atomic and (by default)
asynchronous, on any fsspec URL, without pickle:

- each Lightning checkpoint *path* (``ckpts/last.ckpt``) becomes a small ckptstore root: a
  directory holding ``step-NNNNNNNN/`` (payload + manifest) and the ``latest`` pointer. Lightning
  sees a path that exists (``ckpt_path="last"``, ``best_model_path`` keep working); a crash
  mid-save leaves the previous checkpoint under that path loadable;
- ``save_checkpoint`` snapshots the tensors and returns; the write, checksums and commit run in
  the background (``blocking=True`` for synchronous saves). ``wait()`` is the durability barrier,
  ``saves_completed()`` reports how long each save took until durable (slurmclock's callback feeds
  those into its time budget);
- ``load_checkpoint`` verifies every byte it reads and falls back to an older step under the same
  path if the newest is corrupt; a plain ``torch.save`` ``.ckpt`` file is read with
  ``weights_only=True``. Anything that is not tensors or plain data (e.g. an arbitrary object in
  ``hyper_parameters``) is refused at save time with the path to the value.

Lightning calls ``save_checkpoint`` on global rank 0 only (DDP), so the stores here never take
part in ``torch.distributed`` collectives (``distributed=False``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from .errors import CheckpointError
from .foreign import foreign_kind
from .manifest import SaveStats
from .storage import IOOptions
from .store import CheckpointStore

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "ckptstore.lightning needs Lightning >= 2.2: pip install 'ckptstore[lightning]'"
    ) from e

__all__ = ["CkptStoreIO"]

_Path = str | os.PathLike[str]


class CkptStoreIO(CheckpointIO):
    """Lightning checkpoints through :class:`ckptstore.CheckpointStore`.

    ``blocking``: False (default) returns from ``save_checkpoint`` after a CPU snapshot.
    ``keep_last``: checkpoints kept under each path (1: a re-saved ``last.ckpt`` keeps only the
    newest, once it is committed). ``format``: ``"torch"`` (one file) or ``"dcp"``.
    ``storage_options``: fsspec options for every path (e.g. an S3 ``endpoint_url``).
    """

    def __init__(
        self,
        *,
        blocking: bool = False,
        keep_last: int | None = 1,
        format: str = "torch",
        storage_options: dict[str, Any] | None = None,
        io: IOOptions | None = None,
    ) -> None:
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be an integer >= 1 or None, got {keep_last!r}")
        self.blocking = blocking
        self.keep_last = keep_last
        self.format = format
        self.storage_options = storage_options
        self.io = io
        self._stores: dict[str, CheckpointStore] = {}
        self._lock = threading.Lock()

    def _store(self, path: _Path) -> CheckpointStore:
        url = os.fspath(path)
        with self._lock:
            store = self._stores.get(url)
            if store is None:
                store = CheckpointStore(
                    url,
                    format=self.format,
                    keep_last=self.keep_last,
                    storage_options=self.storage_options,
                    io=self.io,
                    distributed=False,
                )
                self._stores[url] = store
            return store

    # -- CheckpointIO -----------------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _Path, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "CkptStoreIO takes storage options once, in CkptStoreIO(storage_options=...), "
                f"not per save (got {storage_options!r})"
            )
        step = int(checkpoint.get("global_step", 0))
        metadata = {"lightning_path": os.fspath(path), "epoch": checkpoint.get("epoch")}
        store = self._store(path)
        try:
            store.save(step, checkpoint, metadata=metadata, blocking=self.blocking)
        except BaseException:
            if not store.steps():  # refused (e.g. a set in the hyper-parameters): no folder
                self._forget(os.fspath(path))  # stays behind for resume_path() to find
            raise

    def _forget(self, url: str) -> None:
        """Close the store of ``url`` now (a store that committed nothing removes the folders
        its lock created)."""
        with self._lock:
            store = self._stores.pop(url, None)
        if store is not None:
            _close(store)

    def load_checkpoint(
        self, path: _Path, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        # Nothing here unpickles, so weights_only=False asks for nothing we could give.
        store = self._store(path)
        url = os.fspath(path)
        step = "latest" if store.steps() else url  # a store root, else a plain torch.save file
        if step == url and os.path.isdir(url) and not foreign_kind(url)[0]:
            raise CheckpointError(
                f"{url} holds no checkpoint (a folder that a save never committed to, e.g. one "
                "killed or refused): remove it, or start without ckpt_path"
            )
        _, values = store.read(step)
        return _own_small(values if map_location is None else _to(values, map_location))

    def remove_checkpoint(self, path: _Path) -> None:
        """Remove the checkpoints under ``path`` (after any save in flight there committed),
        manifest first; files the store did not write stay, and so does a path that is no store."""
        url = os.fspath(path)
        store = self._store(url)
        store.wait()
        loc = store.primary
        committed = store.steps()
        for step, step_dir in loc.step_dirs().items():
            if step in committed:
                loc.remove_checkpoint(step_dir)
        if committed:
            pointer = loc.storage.join(loc.root, "latest")
            if loc.storage.exists(pointer):
                loc.storage.delete(pointer)
        with self._lock:
            self._stores.pop(url, None)
        store.close()  # releases the store's writer lock file in that folder
        if committed and not loc.storage.list_dir(loc.root):
            loc.storage.rmdir(loc.root)

    def teardown(self) -> None:
        """Wait for every save in flight (re-raising a failure) and close the stores."""
        with self._lock:
            stores, self._stores = list(self._stores.values()), {}
        errors = [e for e in map(_close, stores) if e is not None]
        if errors:
            raise errors[0]

    # -- for time-aware callbacks -------------------------------------------------------------

    def wait(self) -> None:
        """Block until every checkpoint saved so far is durable; re-raise a background failure."""
        with self._lock:
            stores = list(self._stores.values())
        for store in stores:
            store.wait()

    def saves_completed(self) -> list[SaveStats]:
        """Saves committed since the last call, with ``total_s`` = until durable."""
        with self._lock:
            stores = list(self._stores.values())
        done: list[SaveStats] = []
        for store in stores:
            done.extend(store.saves_completed())
        return sorted(done, key=lambda s: s.durable_at)

    def exists(self, path: _Path) -> bool:
        """True when ``path`` holds a committed checkpoint (a store root written here)."""
        try:
            return bool(self._store(path).steps())
        except (CheckpointError, OSError):
            return False


def _close(store: CheckpointStore) -> BaseException | None:
    """Close one store; its failure is returned so the other stores still get closed."""
    try:
        store.close()
    except BaseException as e:
        return e
    return None


_SMALL = 1 << 20


def _own_small(value: Any) -> Any:
    """Small tensors get storage of their own. Loaded tensors are views into one buffer, and
    ``torch.set_rng_state`` / ``Generator.set_state`` crash (SIGSEGV, torch 2.13) on a view with a
    storage offset -- RNG and dataloader-sampler states in the checkpoint are such views."""
    if isinstance(value, torch.Tensor):
        return value.clone() if value.nbytes < _SMALL else value
    if isinstance(value, dict):
        return type(value)((k, _own_small(v)) for k, v in value.items())
    if isinstance(value, list):
        return [_own_small(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_own_small(v) for v in value)
    return value


def _to(value: Any, device: Any) -> Any:
    """Move every tensor of a nested checkpoint dict (``map_location`` as Lightning passes it)."""
    move: Callable[[torch.Tensor], torch.Tensor]
    if callable(device) and not isinstance(device, (str, torch.device)):
        return value  # a storage-remapping function: tensors are on the CPU already
    if isinstance(device, dict):
        return value
    move = lambda t: t.to(device)  # noqa: E731
    if isinstance(value, torch.Tensor):
        return move(value)
    if isinstance(value, dict):
        return type(value)((k, _to(v, device)) for k, v in value.items())
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    return value
