"""A batch job's body for chaos/test_files.py: put one fault at the job's timeline and at ddpkit's
fault file, then become the real ``slurmclock supervise`` around a stand-in trainer.

    python chaos/files_job.py FAULT_NAME
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from files_faults import FAULTS, STEP  # noqa: E402

from slurmclock.timeline import JobTimeline  # noqa: E402

GOOD_EVENT = b'{"event": "checkpoint", "time": 1.0, "restart": 0, "step": 0}\n'


def main(name: str) -> None:
    (fault,) = [f for f in FAULTS if f.name == name]
    timeline = JobTimeline()
    assert timeline.path is not None, "run inside a SLURM job"
    timeline.path.parent.mkdir(parents=True, exist_ok=True)
    fault.apply(timeline.path, GOOD_EVENT)
    fault_file = timeline.path.with_name(f"{timeline.path.stem}.faults.jsonl")
    lines = timeline.path.with_name(f"{timeline.path.stem}.lines")
    if fault.lines is None:
        fault.apply(fault_file)
        lines.write_bytes(b"")
    else:
        fault_file.write_bytes(b"")  # the step appends the lines while the supervisor watches
        lines.write_bytes(b"".join(line + b"\n" for line in fault.lines))
    os.environ["DDPKIT_FAULT_FILE"] = str(fault_file)
    py = sys.executable
    argv = [py, "-m", "slurmclock", "supervise", "--", py, "-c", STEP, str(lines)]
    sys.stdout.flush()
    os.execv(py, argv)


if __name__ == "__main__":
    main(sys.argv[1])
