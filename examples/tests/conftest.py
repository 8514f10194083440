"""The session's job timelines (``slurmclock requeue`` in examples/slurm/requeue-on-75.sh marks
one) go to its temp folder, never to the user's ~/.cache/slurmclock."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _timelines_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    # Session-wide and first: the SLURM cluster copies the environment when it starts.
    where = tmp_path_factory.mktemp("timelines")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURMCLOCK_DIR", str(where))
        yield where
