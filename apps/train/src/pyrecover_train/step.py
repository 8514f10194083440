"""One optimizer step, the validation loss, and what turns running out of memory into one line."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

import ddpkit
from parquetlm import PackedLoader

from .config import TrainConfig
from .precision import Precision
from .state import TrainState


class OutOfMemory(RuntimeError):
    """A step or an evaluation ran out of memory: the message says what to lower."""


class Stepper:
    """Forward, backward and the optimizer step over ``--grad-accum`` micro-batches."""

    def __init__(
        self,
        cfg: TrainConfig,
        state: TrainState,
        train_model: nn.Module,
        precision: Precision,
        *,
        before_update: Callable[[], None] = lambda: None,
    ) -> None:
        self.cfg, self.state, self.train_model, self.precision = cfg, state, train_model, precision
        # Before the optimizer changes the state: an overlapped async save's snapshot is
        # taken beside this step's forward and backward, and waited for here.
        self.before_update = before_update
        self.device = next(state.model.parameters()).device
        self.grad_norm: torch.Tensor | None = None  # of the last step, when clipping
        # What reduces the gradients: FSDP shards in place (the bare module is the FSDP root,
        # also under torch.compile); DDP wraps (and torch.compile forwards its no_sync).
        self._sharded = ddpkit.is_sharded(state.model)
        self._reducer = state.model if self._sharded else train_model

    def train_step(self) -> torch.Tensor:
        """One optimizer step; returns the mean loss (on device, not synchronised: reading it
        every step would stall a GPU)."""
        cfg, model, s = self.cfg, self.train_model, self.state
        total = torch.zeros((), device=self.device)
        for micro in range(cfg.grad_accum):
            x, y = self._batch(s.loader)
            last = micro == cfg.grad_accum - 1
            # DDP / FSDP: reduce gradients only on the last micro-batch.
            sync = contextlib.nullcontext() if last else ddpkit.no_sync(self._reducer)
            with sync:
                with self.precision.autocast(self.device):
                    logits = model(x)
                loss = lm_loss(logits, y) / cfg.grad_accum
                (s.scaler.scale(loss) if s.scaler is not None else loss).backward()
            total += loss.detach()
        self.before_update()
        if s.scaler is not None:
            s.scaler.unscale_(s.optimizer)
        if cfg.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(s.model.parameters(), cfg.grad_clip)
            self.grad_norm = ddpkit.full_value(norm)  # FSDP: a DTensor, the same on every rank
        if s.scaler is not None:
            s.scaler.step(s.optimizer)
            s.scaler.update()
        else:
            s.optimizer.step()
        s.scheduler.step()
        s.optimizer.zero_grad(set_to_none=True)
        return total

    def _batch(self, loader: PackedLoader) -> tuple[torch.Tensor, torch.Tensor]:
        batch = torch.from_numpy(loader.next_batch())
        if self.device.type == "cuda":
            batch = batch.pin_memory().to(self.device, non_blocking=True)
        return batch[:, :-1], batch[:, 1:]

    @torch.no_grad()
    def validation_loss(self, loader: PackedLoader) -> torch.Tensor:
        """This rank's mean loss over the first ``--eval-batches`` held-out batches (float64)."""
        self.train_model.eval()
        total, n = torch.zeros((), device=self.device, dtype=torch.float64), 0
        for batch_np in loader.eval_batches(self.cfg.eval_batches):
            batch = torch.from_numpy(batch_np).to(self.device)
            with self.precision.autocast(self.device):
                logits = self.state.model(batch[:, :-1])
            total += lm_loss(logits, batch[:, 1:]).double()
            n += 1
        if self._sharded:
            # FSDP's root stays gathered after a forward that no backward follows: shard it
            # again, or the optimizer and the checkpoint would see whole tensors.
            self.state.model.reshard()  # type: ignore[operator]
        self.train_model.train()
        return total / max(n, 1)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # Cross-entropy in fp32 at least: bf16 logits lose the small probabilities.
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@contextlib.contextmanager
def memory_guard(cfg: TrainConfig, where: str) -> Iterator[None]:
    """Out of memory where it happens -> :class:`OutOfMemory` saying what to lower (the CLI
    prints its one line; the traceback goes to train.log)."""
    try:
        yield
    except (MemoryError, RuntimeError) as e:
        if not _out_of_memory(e):
            raise
        raise OutOfMemory(
            f"out of memory in {where} (--batch-size {cfg.batch_size} x "
            f"--sequence-length {cfg.sequence_length}, --model-size {cfg.model_size}): lower "
            "--batch-size (--grad-accum N keeps the tokens per step) or --sequence-length, or "
            "pick a smaller --model-size"
        ) from e


def _out_of_memory(e: BaseException) -> bool:
    if isinstance(e, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(e)
    return "out of memory" in text or "can't allocate memory" in text
