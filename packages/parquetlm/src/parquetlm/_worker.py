"""A tokenizer worker process (started by TokenCache.build with ``python -m``).

Argv: JOB_FILE (the pickled tokenizer, source and units). Protocol on stdin/stdout: the worker
prints ``ready``, then reads a unit number (or ``stop``), tokenizes that unit into the units
directory, prints ``done``, and reads the next one.
"""

from __future__ import annotations

import os
import pickle
import sys

ERROR_MARK = "PARQUETLM-WORKER-ERROR"


def _die_with_parent() -> None:
    # A killed build must not leave workers running: ask Linux to kill us with our parent.
    try:
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> int:
    parent = os.getppid()
    _die_with_parent()
    from .cache import _encode_unit, _init_worker

    with open(argv[0], "rb") as f:
        payload, units = pickle.load(f)
    _init_worker(*pickle.loads(payload))
    print("ready", flush=True)
    try:
        for line in sys.stdin:
            if line.strip() == "stop" or os.getppid() != parent:
                break
            _encode_unit(units[int(line)])
            print("done", flush=True)
    except Exception as e:  # reported to the parent as one line, which it raises
        kind = f"{type(e).__module__}.{type(e).__name__}"
        print(f"{ERROR_MARK} {kind}: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
