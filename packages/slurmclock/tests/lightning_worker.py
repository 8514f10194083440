"""Run by test_lightning.py in a process of its own (an abandon ends the process):

    lightning_worker.py ROOT

A stop for time on test_lightning's fake clock (one fake second per step): the final save at
step 9, two more steps planned and saved -- by a CheckpointIO that stalls in that extra save while
time passes. The watchdog abandons it when the exit must begin: exit 75, the final save stands.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.plugins.io import TorchCheckpointIO

sys.path.insert(0, str(Path(__file__).parent))
from test_lightning import fit, stop_for_time  # noqa: E402  - the same model, data, trainer


class StallsInTheExtraSave(TorchCheckpointIO):
    def __init__(self, clock: list[float]) -> None:
        super().__init__()
        self.clock, self.saves = clock, 0

    def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
        self.saves += 1
        if self.saves == 2:  # the extra save: the file system stalls while time passes
            self.clock[0] += 5.0
            time.sleep(600)
        super().save_checkpoint(checkpoint, path, storage_options)


def main() -> int:
    root, clock = Path(sys.argv[1]), [0.0]
    timer = stop_for_time(root, clock)
    fit(root, timer=timer, clock=clock, plugins=[StallsInTheExtraSave(clock)])
    print("not abandoned", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
