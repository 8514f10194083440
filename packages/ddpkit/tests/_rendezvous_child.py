"""One rank that waits at the rendezvous for a peer that never comes:
``python _rendezvous_child.py RANK PORT MARKER HANDLERS``.

HANDLERS "flags" installs flag-only handlers for TERM and USR2 first (as pyrecover-train arms its
stop signals before init) and passes ``abort=`` the USR2 flag; "none" keeps Python's defaults.
The first poll of ``abort`` creates MARKER, so the test knows the wait (and its handlers) is on.
Prints one JSON line: the one-line error, the caller's flags, the handler after init.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import ddpkit


def main() -> int:
    rank, port, marker, handlers = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    flags: dict[str, bool] = {"TERM": False, "USR2": False}

    def flag_only(signum: int, frame: object) -> None:
        flags[signal.Signals(signum).name.removeprefix("SIG")] = True

    # As from a terminal: a test run started in the background of a non-interactive shell
    # (nohup ... &) passes SIGINT down ignored, and an ignored signal is left alone on purpose.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if handlers == "flags":
        signal.signal(signal.SIGTERM, flag_only)
        signal.signal(signal.SIGUSR2, flag_only)

    def abort() -> bool:
        marker.touch()
        return flags["USR2"]

    env = {
        "RANK": str(rank),
        "WORLD_SIZE": "2",
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
    }
    try:
        with ddpkit.init(env=env, timeout=300, abort=abort):
            print(json.dumps({"unexpected": "init returned"}), flush=True)
            return 3
    except ddpkit.InitInterrupted as e:
        record = {
            "error": str(e),
            "signum": e.signum,
            "flags": flags,
            "term_handler_restored": signal.getsignal(signal.SIGTERM)
            is (flag_only if handlers == "flags" else signal.SIG_DFL),
            "int_handler_restored": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        }
        print(json.dumps(record), flush=True)
        return 128 + e.signum if e.signum else 1


if __name__ == "__main__":
    sys.exit(main())
