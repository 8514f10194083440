"""Run a command whose stdout is a pipe that nobody reads any more (standard library only).

``CMD | head -1`` closes the pipe after one line; when exactly depends on timing, so a test of
"the command ends quietly when its reader leaves" would be flaky. Here the read end is closed
before the command starts, so its first write (or flush) fails with EPIPE every time::

    python tools/closedpipe.py ckptstore verify DIR --step all; echo $?    # 141, nothing said

The command's stderr passes through; the exit status is the command's (128+N when signal N
ended it, as a shell reports it). Tests run it with ``subprocess.run([sys.executable,
"tools/closedpipe.py", *argv], capture_output=True)`` and check both.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence


def run(argv: Sequence[str]) -> int:
    """Run ``argv`` with stdout a pipe whose read end is already closed; its exit status."""
    if not argv:
        raise ValueError("closedpipe needs a command: python tools/closedpipe.py CMD [ARGS...]")
    read, write = os.pipe()
    os.close(read)
    try:
        code = subprocess.call(list(argv), stdout=write)
    finally:
        os.close(write)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    try:
        sys.exit(run(sys.argv[1:]))
    except (ValueError, OSError) as e:
        print(f"closedpipe: {e}", file=sys.stderr)
        sys.exit(2)
