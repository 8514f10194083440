"""Test-only pause points for crash tests (inert unless the environment asks for them).

A crash test starts a child with ``CKPTSTORE_TEST_PAUSE_AT=<point>`` and
``CKPTSTORE_TEST_SIGNAL_DIR=<dir>``; when the child reaches that point of the commit protocol it
creates ``<dir>/<point>`` and sleeps until the test SIGKILLs it. Points, in protocol order:

``payload-partial`` (some payload bytes written), ``payload-written`` (payload durable, no
manifest), ``manifest-tmp`` (manifest written under its temp name), ``manifest-written`` (manifest
committed, pointer not moved), ``latest-tmp`` (new pointer under its temp name), ``committed``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV_PAUSE = "CKPTSTORE_TEST_PAUSE_AT"
ENV_SIGNAL_DIR = "CKPTSTORE_TEST_SIGNAL_DIR"
POINTS = (
    "payload-partial",
    "payload-written",
    "manifest-tmp",
    "manifest-written",
    "latest-tmp",
    "committed",
)


def pause_point(name: str) -> None:
    wanted = os.environ.get(ENV_PAUSE)
    if not wanted or name not in wanted.split(","):
        return
    signal_dir = os.environ.get(ENV_SIGNAL_DIR)
    if signal_dir:
        Path(signal_dir, name).touch()
    while True:  # the test kills us here
        time.sleep(3600)
