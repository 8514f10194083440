"""The ``ddpkit`` command: ``info``, ``check`` and ``hostlist`` (see ``EPILOG`` for examples)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
from collections.abc import Sequence
from typing import NoReturn, TextIO

from ddpkit.dist import init
from ddpkit.env import detect
from ddpkit.errors import DistConfigError, InitInterrupted, PeerError
from ddpkit.hostlist import expand_hostlist, first_host

DESCRIPTION = "See what each task of a job detects, and smoke-test its process group."
EPILOG = """examples:
  srun -n 4 ddpkit info            one line per task: launcher, rank, master, ...
  srun -n 4 ddpkit check           join, all-reduce, any_rank; exit 0 when all agree
  ddpkit hostlist 'gpu[001-004]'   one host per line, like `scontrol show hostnames`

exit codes: 0 ok, 1 a collective failed or gave a wrong answer, 2 bad usage or bad
variables, 128+N stopped by signal N while waiting for the other ranks (143: SIGTERM),
141 quietly when the reader of stdout left early (| head -1), as SIGPIPE gives."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not the usage block and then this
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(
        prog="ddpkit",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_Parser
    )
    p_info = sub.add_parser("info", help="print what detect() sees in this process")
    p_info.add_argument("--json", action="store_true", help="one JSON object")
    p_check = sub.add_parser("check", help="join the group and verify an all-reduce")
    p_check.add_argument("--timeout", type=float, default=None, help="seconds (default 180)")
    p_check.add_argument("--backend", default="auto", help="auto, gloo, nccl, ...")
    p_check.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ...")
    p_check.add_argument("--json", action="store_true", help="one JSON line per rank")
    p_host = sub.add_parser("hostlist", help="expand a SLURM node list")
    p_host.add_argument("nodelist", help="e.g. 'gpu[001-004,007],cpu3'")
    p_host.add_argument("--first", action="store_true", help="only the first host")
    args = parser.parse_args(argv)
    try:
        if args.command == "info":
            return _info(args.json)
        if args.command == "check":
            return _check(args.timeout, args.backend, args.device, args.json)
        code = _hostlist(args.nodelist, args.first)
        sys.stdout.flush()  # a closed pipe shows here, not as a message at interpreter exit
        return code
    except (DistConfigError, ValueError) as e:
        _line(f"ddpkit: error: {e}", sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left early (`| head -1`): quiet, as SIGPIPE would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush
        return 141
    except PeerError as e:
        _line(f"ddpkit: {e}", sys.stderr)
        return 1
    except InitInterrupted as e:
        _line(f"ddpkit: {e}", sys.stderr)
        return 128 + e.signum if e.signum else 1


def _info(as_json: bool) -> int:
    info = detect()
    fields = dataclasses.asdict(info)
    fields["host"] = socket.gethostname()
    if as_json:
        _line(json.dumps(fields, sort_keys=True))
    else:
        _line(" ".join(f"{k}={v}" for k, v in fields.items()))
    return 0


def _check(timeout: float | None, backend: str, device: str | None, as_json: bool) -> int:
    with init(backend=backend, timeout=timeout, device=device) as dist:
        n = dist.world_size
        total = dist.all_reduce(dist.rank + 1, op="sum")
        last_wants_stop = dist.any_rank(dist.rank == n - 1)
        hosts = dist.all_gather_object(socket.gethostname())
        ok = total == n * (n + 1) // 2 and last_wants_stop and len(hosts) == n
        line = {
            "rank": dist.rank,
            "world_size": n,
            "local_rank": dist.local_rank,
            "launcher": dist.info.launcher,
            "backend": dist.backend,
            "device": str(dist.device),
            "sum": total,
            "any_rank": last_wants_stop,
            "hosts": sorted(set(hosts)),
            "master": f"{dist.info.master_addr}:{dist.info.master_port}",
            "ok": ok,
        }
        if as_json:
            _line(json.dumps(line, sort_keys=True))
        else:
            dist.print(
                f"ddpkit check: {'ok' if ok else 'WRONG'}: {n} rank(s) via {dist.info.launcher}, "
                f"backend {dist.backend}, sum of 1..{n} = {total}, hosts {line['hosts']}"
            )
        all_ok = dist.all_ranks(ok)
    return 0 if all_ok else 1


def _line(text: str, stream: TextIO | None = None) -> None:
    """``text`` and its newline in one write: every rank of a launch shares the launcher's
    stdout and stderr, and ``print``'s separate write of the newline (unbuffered, as under
    PYTHONUNBUFFERED) lets another rank's line in between: two JSON objects, or two ranks'
    errors, on one line."""
    out = sys.stdout if stream is None else stream
    out.write(text + "\n")
    out.flush()


def _hostlist(nodelist: str, first: bool) -> int:
    if not nodelist.strip():
        _line(
            "ddpkit: error: empty node list: pass one, e.g. 'gpu[001-004]' or "
            '"$SLURM_JOB_NODELIST" (is the variable set in this shell?)',
            sys.stderr,
        )
        return 2
    hosts = [first_host(nodelist)] if first else expand_hostlist(nodelist)
    sys.stdout.write("".join(f"{h}\n" for h in hosts))
    return 0
