"""The original PyRecover's checkpoints (one ``torch.save`` file, ``ckpt_N.pt``), imported.

The original saved ``{"epoch", "step", "model", "optimizer", "lr_scheduler"}`` with
``torch.save``: the weights under its own module names (``layers.N.attention.wq.weight``,
``layers.N.feed_forward.w1.weight``, ``layers.N.attention_norm.weight``, ...; with ``module.`` /
``_orig_mod.`` prefixes when it ran under DDP / torch.compile) and the AdamW state indexed by
parameter order. The file is read with ``weights_only=True`` (no code is ever unpickled), the
names are mapped to this model's, and the AdamW moments follow their weights by name. What the
file does not hold is not carried over, and the run says so: the data position (the original's
loader is another), the RNG states, and the LR schedule's own state (this run's flags apply).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from .config import UsageError
from .state import TrainState

log = logging.getLogger("pyrecover_train")

_PREFIXES = ("module.", "_orig_mod.")
_RENAMES = (
    (".attention.", ".attn."),
    (".feed_forward.", ".ffn."),
    (".attention_norm.", ".attn_norm."),
)
_TORCH_SAVE_MAGIC = (b"PK\x03\x04", b"\x80")  # zip container (torch >= 1.6), legacy pickle


def our_name(name: str) -> str:
    """The original's parameter name -> this model's."""
    while name.startswith(_PREFIXES):
        name = name.split(".", 1)[1]
    for old, new in _RENAMES:
        name = name.replace(old, new)
    return name


@dataclass(slots=True)
class OriginalCheckpoint:
    path: str
    step: int
    weights: dict[str, torch.Tensor]  # by this model's names
    moments: dict[str, dict[str, Any]] | None  # AdamW state by this model's names

    @property
    def vocab_size(self) -> int:
        emb = self.weights.get("tok_embeddings.weight")
        if emb is None:
            raise UsageError(f"{self._flag}: no tok_embeddings.weight in its model weights")
        return int(emb.shape[0])

    @property
    def _flag(self) -> str:
        return f"--resume-from-checkpoint {self.path}"

    @classmethod
    def read_if_file(cls, target: str | None) -> OriginalCheckpoint | None:
        """The checkpoint when ``target`` is a local file (a folder or a step is ours)."""
        if target is None or "://" in target:
            return None
        path = os.path.expanduser(target)
        return cls.read(path) if os.path.isfile(path) else None

    @classmethod
    def read(cls, path: str) -> OriginalCheckpoint:
        flag = f"--resume-from-checkpoint {path}"
        with open(path, "rb") as f:
            head = f.read(4)
        if not head.startswith(_TORCH_SAVE_MAGIC):
            raise UsageError(
                f"{flag}: a file, but not a torch.save checkpoint: give 'latest', a step number, "
                "a checkpoint folder, or an original PyRecover .pt file"
            )
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # UnpicklingError, RuntimeError, EOFError, ...
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UsageError(
                f"{flag}: not loadable with weights_only=True ({first}): pyrecover-train never "
                "unpickles code from a checkpoint; re-save it as plain tensors"
            ) from None
        model = obj.get("model") if isinstance(obj, dict) else None
        step = obj.get("step") if isinstance(obj, dict) else None
        if not isinstance(model, dict) or not isinstance(step, int) or step < 0:
            found = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise UsageError(
                f"{flag}: not an original PyRecover checkpoint (expected a dict with 'model', "
                f"'optimizer' and 'step'; found {found})"
            )
        names = list(model)
        weights = {our_name(n): t for n, t in model.items()}
        return cls(path, step, weights, _moments(obj.get("optimizer"), names))

    def apply(self, state: TrainState, model_size: str) -> None:
        """Weights, AdamW moments and the step into ``state`` (in place)."""
        self._check_shapes(state.model.state_dict(), model_size)
        state.model.load_state_dict(self.weights)  # copied, cast to this model's dtype
        if self.moments is not None:
            state.optimizer.load_state_dict(self._optimizer_state(state))
        state.scheduler.last_epoch = self.step  # this run's schedule, at the imported step
        state.step = self.step
        carried = "weights, AdamW moments" if self.moments is not None else "weights"
        log.info(
            "imported the original PyRecover checkpoint %s at step %d: %s and the step "
            "carried over; not in the file, so not carried over: the data position (the data "
            "starts from its beginning), the RNG states (re-seeded from --seed and the step), "
            "the LR schedule's state (this run's flags, at step %d)",
            self.path,
            self.step,
            carried,
            self.step,
        )

    def _check_shapes(self, mine: dict[str, torch.Tensor], model_size: str) -> None:
        problems = [f"{k} missing" for k in mine if k not in self.weights]
        problems += [f"{k} unexpected" for k in self.weights if k not in mine]
        problems += [
            f"{k} is {list(t.shape)} there, {list(mine[k].shape)} here"
            for k, t in self.weights.items()
            if k in mine and t.shape != mine[k].shape
        ]
        if problems:
            more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
            raise UsageError(
                f"{self._flag}: its weights do not fit --model-size {model_size} "
                f"({'; '.join(problems[:3])}{more}): pass the --model-size it was trained with "
                "(the original PyRecover trained the 8b shape)"
            )

    def _optimizer_state(self, state: TrainState) -> dict[str, Any]:
        """This optimizer's state dict with the imported moments at this model's indices."""
        assert self.moments is not None
        names = {id(p): n for n, p in state.model.named_parameters()}
        order = [names[id(p)] for g in state.optimizer.param_groups for p in g["params"]]
        mine = state.optimizer.state_dict()
        moments = {i: self.moments[n] for i, n in enumerate(order) if n in self.moments}
        return {"state": moments, "param_groups": mine["param_groups"]}


def _moments(optimizer: Any, names: list[str]) -> dict[str, dict[str, Any]] | None:
    """AdamW state by this model's names: the original's optimizer held the parameters in the
    order of its model's weights (one group), which is the order of ``names``."""
    if not isinstance(optimizer, dict) or not isinstance(optimizer.get("state"), dict):
        return None
    indices = [i for g in optimizer.get("param_groups", []) for i in g.get("params", [])]
    if len(indices) != len(names):
        log.warning(
            "the original checkpoint's optimizer covers %d parameters, its weights %d: the AdamW "
            "moments are not carried over",
            len(indices),
            len(names),
        )
        return None
    by_index = dict(zip(indices, names, strict=True))
    return {our_name(by_index[i]): s for i, s in optimizer["state"].items() if i in by_index}
