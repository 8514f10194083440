"""The environment variables the sbatch script and the supervisor export, read by the package
that owns each (DESIGN.md, "Contracts"): the real ``submit-training-simple.sh`` and the real
``slurmclock supervise``, with a training step that reports what slurmclock and ddpkit read."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import slurmclock
from slurmclock.supervisor import Supervisor

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "apps" / "train" / "slurm" / "submit-training-simple.sh"

# srun: drop its options, run the task (one task: the probe).
FAKE_SRUN = """#!/bin/bash
while [ $# -gt 0 ] && [[ $1 == --* ]]; do shift; done
exec "$@"
"""

PROBE = f"""#!{sys.executable}
import json, os
from pathlib import Path
import slurmclock
from ddpkit import WatchdogOptions

settings = WatchdogOptions().settings(os.environ, 2.0)
said = {{
    "lead": slurmclock.signal_lead_from_env(),
    "timeline_dir": str(slurmclock.timeline_dir()),
    "timeline": str(slurmclock.JobTimeline().path),
    "fault_file": settings.fault_file if settings is not None else None,
    "leader": slurmclock.is_leader(),
}}
(Path(os.environ["FAKE_DIR"]) / "probe.json").write_text(json.dumps(said))
"""


def test_what_the_script_exports_the_packages_read(job: Any) -> None:
    srun = job.dir / "bin" / "srun"
    srun.write_text(FAKE_SRUN)
    srun.chmod(0o755)
    probe = job.dir / "probe.py"
    probe.write_text(PROBE)
    probe.chmod(0o755)
    env = {**job.env, "TRAIN_CMD": str(probe)}
    out = subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    said = json.loads((job.dir / "probe.json").read_text())
    # PYRECOVER_SIGNAL_LEAD: the script's own #SBATCH --signal lead, in slurmclock's reading.
    lead = re.search(r"^#SBATCH --signal=B:USR2@([0-9]+)$", SCRIPT.read_text(), re.MULTILINE)
    assert lead is not None and said["lead"] == float(lead.group(1)), said
    # SLURMCLOCK_DIR: where the supervisor and the trainer write the one timeline.
    assert said["timeline_dir"] == str(job.dir) and said["timeline"] == str(job.timeline)
    # DDPKIT_FAULT_FILE: set by slurmclock's supervisor, taken by ddpkit's watchdog.
    assert said["fault_file"] == str(Supervisor(env=job.env).fault_file), said
    assert said["leader"] is True
    assert "training finished" in out.stdout, out.stdout
    events = [json.loads(line)["event"] for line in job.timeline.read_text().splitlines()]
    assert events == ["start", "exited"] and set(events) <= set(slurmclock.EVENTS)
