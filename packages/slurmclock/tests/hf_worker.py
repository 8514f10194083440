"""Run by test_hf.py in a process of its own (an abandon ends the process):

    hf_worker.py OUTPUT_DIR

A stop for time on test_hf's fake clock (one fake second per step): the final save at step 9,
two more steps planned, and the Trainer's save of that extra checkpoint stalls (after its
folder exists, before trainer_state.json) while time passes. The watchdog abandons it when the
exit must begin: exit 75, checkpoint-9 stands.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from transformers import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from test_hf import stop_for_time, train  # noqa: E402  - the same model, data, arguments

CLOCK = [0.0]
save = Trainer._save_checkpoint


def stalls_in_the_extra_save(self: Trainer, *args: Any, **kw: Any) -> Any:
    if self.state.global_step > 9:  # the file system stalls while time passes
        (Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}").mkdir()
        CLOCK[0] += 5.0
        time.sleep(600)
    return save(self, *args, **kw)


def main() -> int:
    Trainer._save_checkpoint = stalls_in_the_extra_save  # type: ignore[method-assign]
    train(Path(sys.argv[1]), timer=stop_for_time(CLOCK), clock=CLOCK)
    print("not abandoned", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
