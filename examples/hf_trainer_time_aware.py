"""Hugging Face ``Trainer``, time-aware: save before the deadline, resume where it stopped.

    python examples/hf_trainer_time_aware.py     # CPU, ~10 s, exit 0

Given a deadline -- ``PYRECOVER_END_TIME`` or a real SLURM job --
``slurmclock.hf.TimeAwareCallback`` stops after the optimizer step at which the next step plus a
save would no longer fit, the Trainer writes its ``checkpoint-N`` and the script exits 75; run it
again and the Trainer resumes from the newest complete checkpoint and finishes with 0:

    PYRECOVER_END_TIME=$(( $(date +%s) + 12 )) python examples/hf_trainer_time_aware.py  # 75
    python examples/hf_trainer_time_aware.py                                             # 0

On CPU the resumed run ends with weights bitwise equal to an uninterrupted one (the Trainer's own
resume restores model, optimizer, scheduler and RNG states and skips the batches already seen).
What is and is not exact in general: slurmclock's README, "Hugging Face Trainer".
"""

from __future__ import annotations

import hashlib
import os
import time

import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from slurmclock import end_process, process_start_time
from slurmclock.hf import TimeAwareCallback, checkpoint_step, last_checkpoint

STEPS = 3000
OUT_DIR = os.environ.get("EXAMPLE_CKPT_URL", "example-runs/hf")


class YourModel(nn.Module):
    """Any ``nn.Module`` whose forward returns the loss works (or a ``PreTrainedModel``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(32, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 128), nn.GELU(),
            nn.Linear(128, 1),
        )  # fmt: skip

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


def your_data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=g)
    y = torch.sin(x @ torch.randn(32, 1, generator=g))
    return [{"x": x[i], "labels": y[i]} for i in range(len(x))]


def weights_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        h.update(name.encode() + value.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> int:
    resume = last_checkpoint(OUT_DIR)  # the newest complete checkpoint-N; None on the first run
    if resume is not None and checkpoint_step(resume) >= STEPS:
        print(f"finished step {checkpoint_step(resume)}/{STEPS} (already, in {resume})")
        return 0
    torch.set_num_threads(1)
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=OUT_DIR,
        max_steps=STEPS,
        per_device_train_batch_size=64,
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        save_strategy="steps",
        save_steps=1000,  # periodic saves too; the callback times them for its budget
        save_total_limit=2,
        logging_steps=1000,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    # Fixed small margins for a tiny model on a local disk; on a cluster: measured (omit).
    timer = TimeAwareCallback(margin=3, initial_save_estimate=2)
    model = YourModel()
    trainer = Trainer(model=model, args=args, train_dataset=your_data(), callbacks=[timer])
    began = time.time()  # the deadline counts from the process's start: start-up uses it
    trainer.train(resume_from_checkpoint=resume)
    if timer.stopped_early:
        given = timer.budget.deadline()
        used = f"start-up used {began - process_start_time():.1f} s"
        if given is not None and given.end is not None:
            used += f" of {given.end - process_start_time():.1f} s"
        print(
            f"stopped at step {trainer.state.global_step}/{STEPS}; exit {timer.exit_code}; {used}"
        )
    else:
        print(f"finished step {trainer.state.global_step}/{STEPS}")
        print(f"weights {weights_digest(model)}")
    return timer.exit_code


if __name__ == "__main__":
    end_process(main())  # sys.exit without the interpreter's teardown (part of the job's exit)
