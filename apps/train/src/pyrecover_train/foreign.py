"""Checkpoints of other tools as a run's start: ``--resume-from-checkpoint SOURCE`` (or
``import-checkpoint SOURCE``) where SOURCE is a plain ``torch.save`` file (the original
PyRecover's ``ckpt_N.pt`` too), a ``dcp.save`` folder (written by 1 or N ranks), a safetensors
file, a Lightning ``.ckpt`` or a Hugging Face Trainer ``checkpoint-N`` folder.

ckptstore reads them (``ckptstore.read_foreign``: the one reader of those formats; nothing is
unpickled beyond plain data); this module maps what it read onto the GPT:

- the weights by this model's names: the prefixes wrappers add (``module.`` DDP, ``_orig_mod.``
  torch.compile, ``model.`` a Lightning module's attribute) dropped, the original PyRecover's
  module names renamed (``attention`` -> ``attn``, ``feed_forward`` -> ``ffn``, ...);
- the AdamW moments, when the source's optimizer is laid out as this trainer's (its two groups)
  or as one group over the weights in the order the source lists them (the original's);
- the step the source recorded.

What the source does not hold, or holds in a form this model cannot take, is said in one line
and starts fresh: the optimizer (AdamW without moments), the step (0), and always the data
position, the RNG states and the LR schedule's own state (this run's flags apply).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

import ckptstore

from .config import UsageError, first_line
from .state import TrainState

log = logging.getLogger("pyrecover_train")

EMBEDDING = "tok_embeddings.weight"  # gives the vocabulary of the imported weights
_PREFIXES = ("module.", "_orig_mod.", "model.")
_RENAMES = (  # the original PyRecover's module names -> this model's
    (".attention.", ".attn."),
    (".feed_forward.", ".ffn."),
    (".attention_norm.", ".attn_norm."),
)
KIND_NAMES = {  # ckptstore's kinds, as a user knows them
    "torch.save": "torch.save",
    "dcp": "dcp.save",
    "safetensors": "safetensors",
    "lightning": "Lightning",
    "hf-trainer": "Hugging Face Trainer",
}
_TAKEN = ("model", "optim", "step")  # the entries of a source a run starts from
_SAID = ("rng", "scheduler", "sched", "data")  # not taken, and always said so by name
_MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's state of a parameter


def our_name(name: str) -> str:
    """A source's parameter name -> this model's."""
    while name.startswith(_PREFIXES):
        name = name.split(".", 1)[1]
    for old, new in _RENAMES:
        name = name.replace(old, new)
    return name


def our_names(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights by this model's names, in the source's order. A wrapper attribute of another
    name (a Lightning module's ``self.gpt``) is dropped when every name has it."""
    named = {our_name(k): v for k, v in weights.items()}
    heads = {k.split(".", 1)[0] for k in named}
    if EMBEDDING not in named and len(heads) == 1 and all("." in k for k in named):
        named = {k.split(".", 1)[1]: v for k, v in named.items()}
    return named


@dataclass(slots=True)
class ForeignCheckpoint:
    """What a run takes from another tool's checkpoint (read by ckptstore)."""

    source: str
    kind: str  # ckptstore's: torch.save, dcp, safetensors, lightning, hf-trainer
    step: int | None  # the step the source recorded, if any
    weights: dict[str, torch.Tensor]  # by this model's names, in the source's order
    optimizer: Any  # the source's optimizer state dict as read, or None
    unused: list[str] = field(default_factory=list)  # what the source holds beyond those

    @property
    def vocab_size(self) -> int | None:
        emb = self.weights.get(EMBEDDING)
        return int(emb.shape[0]) if emb is not None and emb.ndim == 2 else None

    @property
    def label(self) -> str:
        return f"{KIND_NAMES.get(self.kind, self.kind)} checkpoint {self.source}"

    @classmethod
    def find(
        cls, target: ckptstore.StepSpec | None, storage_options: dict[str, Any] | None = None
    ) -> ForeignCheckpoint | None:
        """The foreign checkpoint ``--resume-from-checkpoint`` names, or None when it names
        one of ours ('latest', a step, a ckptstore folder) or nothing that exists (said later).
        Anything else there is a UsageError (one line)."""
        if target is None or target.path is None:
            return None
        kind, why = ckptstore.foreign_kind(target.path, storage_options)
        if not kind:
            if why:  # there is something, and it is no checkpoint of any kind
                raise UsageError(f"--resume-from-checkpoint: {why}")
            return None
        return cls.read(target.path, storage_options)

    @classmethod
    def read(cls, source: str, storage_options: dict[str, Any] | None = None) -> ForeignCheckpoint:
        try:
            found = ckptstore.read_foreign(source, storage_options=storage_options)
        except ckptstore.CheckpointError as e:
            raise UsageError(f"--resume-from-checkpoint: {first_line(e)}") from None
        model = found.state.get("model")
        tensors = (
            {str(k): v for k, v in model.items() if isinstance(v, torch.Tensor)}
            if isinstance(model, Mapping)
            else {}
        )
        if not tensors:
            holds = ", ".join(map(str, found.state)) or "nothing"
            raise UsageError(
                f"--resume-from-checkpoint {source}: a {KIND_NAMES.get(found.kind, found.kind)} "
                f"checkpoint without model weights (it holds {holds}): give a file or folder "
                "holding the model's state_dict"
            )
        step = found.step if found.step is not None and found.step >= 0 else None
        unused = [k for k in found.state if k not in (*_TAKEN, *_SAID)] + list(found.left)
        return cls(source, found.kind, step, our_names(tensors), found.state.get("optim"), unused)

    def apply(self, state: TrainState, model_size: str) -> None:
        """Weights, AdamW moments (where they fit) and the step into ``state`` (in place);
        logs the one line saying what was taken and what was not."""
        self._check_shapes(state.model.state_dict(), model_size)
        state.model.load_state_dict(self.weights)  # copied, cast to this model's dtype
        moments, why_not = self._moments(state)
        if moments is not None:
            groups = state.optimizer.state_dict()["param_groups"]  # this run's hyper-parameters
            state.optimizer.load_state_dict({"state": moments, "param_groups": groups})
        step = self.step or 0
        state.scheduler.last_epoch = step  # this run's schedule, at the imported step
        state.step = step
        log.info("%s", self.summary(moments is not None, why_not, step))

    def summary(self, moments: bool, why_not: str, step: int) -> str:
        """One line: what the run took from the source, and what it did not (and why)."""
        took = [f"the weights ({len(self.weights)} tensors)"]
        took += ["the AdamW moments"] if moments else []
        took += [f"step {step}"] if self.step is not None else []
        left = [] if moments else [f"the optimizer state ({why_not}: AdamW starts fresh)"]
        if self.step is None:
            left.append("a step (none recorded: training starts at step 0)")
        left += [
            "the data position (the data starts from its beginning)",
            "the RNG states (re-seeded from --seed and the step)",
            f"the LR schedule's state (this run's flags, at step {step})",
        ]
        unused = f"; unused: {', '.join(self.unused)}" if self.unused else ""
        return (
            f"imported the {self.label} at step {step}: took {_join(took)}; not taken: "
            f"{', '.join(left)}{unused}"
        )

    def _check_shapes(self, mine: dict[str, torch.Tensor], model_size: str) -> None:
        shapes = [
            f"{k} is {list(t.shape)} there, {list(mine[k].shape)} here"
            for k, t in self.weights.items()
            if k in mine and t.shape != mine[k].shape
        ]
        missing = [k for k in mine if k not in self.weights]
        unexpected = [k for k in self.weights if k not in mine]
        kinds = [(shapes, "of another shape"), (missing, "missing"), (unexpected, "unexpected")]
        problems = [f"{len(found)} {what}, e.g. {found[0]}" for found, what in kinds if found]
        if problems:
            raise UsageError(
                f"--resume-from-checkpoint {self.source}: its weights do not fit --model-size "
                f"{model_size} ({'; '.join(problems)}): pass the --model-size it was trained with "
                "(the original PyRecover's is 8b); only this trainer's GPT model can be imported"
            )

    def _moments(self, state: TrainState) -> tuple[dict[int, Any] | None, str]:
        """The source's AdamW state at this optimizer's indices, or None and why not."""
        opt = self.optimizer
        if opt is None:
            kind = "a safetensors file holds weights only" if self.kind == "safetensors" else ""
            return None, kind or "none in the checkpoint"
        if isinstance(opt, list):
            return None, f"it holds {len(opt)} optimizers, this run has one AdamW"
        groups = opt.get("param_groups") if isinstance(opt, Mapping) else None
        saved = opt.get("state") if isinstance(opt, Mapping) else None
        if not isinstance(groups, list) or not isinstance(saved, Mapping):
            return None, "not an optimizer state_dict"
        if not saved:
            return None, "it holds no moments (it never took a step)"
        pairs = self._pairs(state, [list(g.get("params", [])) for g in groups])
        if isinstance(pairs, str):
            return None, pairs
        params = dict(state.model.named_parameters())
        moments: dict[int, Any] = {}
        for index, (source_id, name) in enumerate(pairs):
            s = saved.get(source_id)
            if not isinstance(s, Mapping) or not all(k in s for k in _MOMENTS):
                return None, f"no AdamW moments (exp_avg, exp_avg_sq) for {name}"
            shape = list(s["exp_avg"].shape)
            if shape != list(params[name].shape):
                return None, f"moments of shape {shape} for {name}, {list(params[name].shape)}"
            moments[index] = dict(s)
        return moments, ""

    def _pairs(self, state: TrainState, source: list[list[Any]]) -> list[tuple[Any, str]] | str:
        """(the source's parameter id, this model's name) in this optimizer's index order: the
        source laid out as this trainer's optimizer (group by group), or one group over the
        weights in the source's order (the original PyRecover's); else why neither."""
        names = {id(p): n for n, p in state.model.named_parameters()}
        mine = [[names[id(p)] for p in g["params"]] for g in state.optimizer.param_groups]
        if [len(g) for g in source] == [len(g) for g in mine]:
            return list(zip(_flat(source), _flat(mine), strict=True))
        order = [n for n in self.weights if n in names.values()]
        if len(source) == 1 and len(source[0]) == len(order):
            by_name = dict(zip(order, source[0], strict=True))
            return [(by_name[n], n) for n in _flat(mine)]
        sizes = "+".join(str(len(g)) for g in source)
        return (
            f"its parameter groups ({sizes} parameters) are neither this trainer's "
            f"({'+'.join(str(len(g)) for g in mine)}) nor one group over its {len(order)} weights"
        )


def _flat(groups: list[list[Any]]) -> list[Any]:
    return [x for g in groups for x in g]


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"
