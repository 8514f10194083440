"""The watchdog's sockets: each rank's beacon (a listening TCP port) and the links watchers hold
to it. A process that dies closes them (the kernel does it); one that is stopped keeps them, and
its kernel still accepts new connections for it. That is what tells dead from frozen."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from collections.abc import Mapping
from typing import Any

CONNECT_S = 2.0  # a beacon connect / probe that takes longer: nothing answers there


def identity(pid: int) -> dict[str, Any]:
    """What tells a process apart on this machine, beyond a pid that may be reused or belong to
    another pid namespace (a container): its pid namespace and its start time (Linux)."""
    found: dict[str, Any] = {"pid": pid}
    with contextlib.suppress(OSError, ValueError, IndexError):
        found["pidns"] = os.stat(f"/proc/{pid}/ns/pid").st_ino
        with open(f"/proc/{pid}/stat", "rb") as f:
            # Field 22 (start time in clock ticks), counted after the ")" that ends field 2.
            found["start"] = int(f.read().rsplit(b")", 1)[1].split()[19])
    return found


def facing_address(master_addr: str, master_port: int) -> tuple[int, str]:
    """(family, this host's address on the route to rank 0): what the other ranks can reach."""
    infos = socket.getaddrinfo(master_addr, master_port, type=socket.SOCK_DGRAM)
    family, _, _, _, target = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(target)  # UDP: picks the route, sends nothing
        return family, str(probe.getsockname()[0])


class Beacon:
    """This rank's listening socket. Watchers connect to it; it sends them L, E or F lines."""

    def __init__(self, master_addr: str, master_port: int) -> None:
        self.family, self.addr = facing_address(master_addr, master_port)
        self.sock = socket.socket(self.family, socket.SOCK_STREAM)
        self.sock.bind(("::" if self.family == socket.AF_INET6 else "0.0.0.0", 0))
        self.sock.listen(128)
        self.sock.setblocking(False)
        self.port = int(self.sock.getsockname()[1])
        self.conns: list[socket.socket] = []
        # Held from accept() to the listing of its connection: a fork waits for it (see
        # watchdog's fork handlers), or the child would copy a connection it cannot close.
        self.accepting = threading.Lock()

    def record(self) -> str:
        """What the rendezvous publishes for this rank."""
        record = {"host": socket.gethostname(), "addr": self.addr, "port": self.port}
        return json.dumps({**record, **identity(os.getpid())})

    def accept(self) -> None:
        with self.accepting:
            while True:
                try:
                    conn, _ = self.sock.accept()
                except (BlockingIOError, InterruptedError):
                    return
                except OSError:
                    return
                conn.setblocking(False)
                self.conns.append(conn)

    def drain(self, readable: list[Any]) -> None:
        """Drop the watchers' connections that closed (they send nothing else)."""
        for conn in [c for c in self.conns if c in readable]:
            try:
                if conn.recv(4096):
                    continue
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                pass
            conn.close()
            self.conns.remove(conn)

    def send(self, line: str) -> None:
        data = line.encode()
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.settimeout(1.0)
                conn.sendall(data)
                conn.setblocking(False)

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        self.conns.clear()
        self.sock.close()


class Link:
    """A connection to a watched rank's beacon: its lines, and whether it closed."""

    def __init__(self, rank: int, record: Mapping[str, Any]) -> None:
        self.rank = rank
        self.host = str(record.get("host", "?"))
        self.addr = (str(record["addr"]), int(record["port"]))
        self.identity = {k: record[k] for k in ("pid", "pidns", "start") if k in record}
        self.sock: socket.socket | None = None
        self.closed = False  # EOF (or reset) without a goodbye
        self.lines: list[str] = []
        self._buf = b""

    def connect(self) -> Link:
        self.sock = socket.create_connection(self.addr, timeout=CONNECT_S)
        self.sock.setblocking(False)
        return self

    def read(self) -> None:
        """Collect complete lines; note EOF or a reset as ``closed``."""
        if self.sock is None or self.closed:
            return
        while True:
            try:
                chunk = self.sock.recv(4096)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                chunk = b""
            if not chunk:
                self.closed = True
                return
            self._buf += chunk
            *done, self._buf = self._buf.split(b"\n")
            self.lines.extend(d.decode(errors="replace") for d in done)

    def probe(self) -> bool:
        """True when a fresh connection to the beacon is accepted: the process is still there
        (stopped or not) and its node answers; False when refused or unanswered."""
        try:
            with socket.create_connection(self.addr, timeout=CONNECT_S):
                return True
        except OSError:
            return False

    def same_process_here(self) -> bool:
        """True when the watched rank is another process on this machine, in this pid namespace,
        with the very pid and start time it published (so a signal reaches it and only it)."""
        pid = int(self.identity.get("pid", 0))
        if (
            self.host != socket.gethostname()
            or "start" not in self.identity
            or pid in (0, os.getpid())
        ):
            return False
        if self.identity.get("pidns") != identity(os.getpid()).get("pidns"):
            return False  # another container: that pid is not this process's
        return identity(pid) == self.identity

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
