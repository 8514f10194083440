"""A fault proxy for tests: an HTTP/1.1 proxy on 127.0.0.1 in front of a real endpoint (the
moto_server of ``tools/s3server.py``), switchable at run time between the ways a store fails.

Standard library only; load it by path, as ``tools/s3server.py`` (whose socket helpers it
shares, loaded by path from beside this file)::

    with s3server.MotoServer() as server, FaultProxy(server.port) as proxy:
        server.make_bucket("ckpt")
        env = {**server.env(), "AWS_ENDPOINT_URL": proxy.endpoint_url}
        proxy.set("503", retry_after=2)       # every request from now on: 503 SlowDown
        ...
        proxy.set("pass")                     # the store answers again

Modes (``MODES``), applied to each request as it arrives (keep-alive connections included):

- ``pass``: forwarded to the endpoint, the answer relayed.
- ``refuse``: the listening socket is closed (new connections: ECONNREFUSED) and open ones are
  reset; the same port listens again when the mode changes.
- ``reset``: the connection is reset (RST) when a request arrives.
- ``500``, ``502``: that status with an S3 error body (``InternalError``, ``BadGateway``).
- ``503``: ``SlowDown`` with ``Retry-After: <retry_after>``.
- ``403``: ``AccessDenied``; ``nosuchbucket``: 404 ``NoSuchBucket`` (a deleted bucket).
- ``hang``: the request is read and never answered; the connection stays open and silent for
  good (a stalled gateway: the client must drop it), also after the mode changes.
- ``trickle``: forwarded, and the answer relayed at ``rate`` bytes per second.

``requests`` counts the requests seen per mode; ``python tools/faultproxy.py TARGET_PORT``
runs one in the foreground (a mode per line on stdin).
"""

from __future__ import annotations

import contextlib
import importlib.util
import socket
import sys
import threading
from collections import Counter
from pathlib import Path
from types import ModuleType

MODES = ("pass", "refuse", "reset", "500", "502", "503", "403", "nosuchbucket", "hang", "trickle")
_ERRORS = {
    "500": (500, "Internal Server Error", "InternalError", "We encountered an internal error."),
    "502": (502, "Bad Gateway", "BadGateway", "The gateway got no answer."),
    "503": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "403": (403, "Forbidden", "AccessDenied", "Access Denied"),
    "nosuchbucket": (404, "Not Found", "NoSuchBucket", "The specified bucket does not exist"),
}
_MAX_HEAD = 64 * 1024


def _s3server() -> ModuleType:
    """``tools/s3server.py`` (the tools are files, not a package): the one loaded, else loaded
    from beside this file."""
    loaded = sys.modules.get("s3server")
    if loaded is not None:
        return loaded
    path = Path(__file__).with_name("s3server.py")
    spec = importlib.util.spec_from_file_location("s3server", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_sockets = _s3server()  # listen, unlisten, reset, free_port: shared with its TCP proxy


class FaultProxy:
    """127.0.0.1:<port> -> 127.0.0.1:<target_port>; see the module docstring."""

    def __init__(self, target_port: int, *, port: int | None = None) -> None:
        self.target_port = target_port
        self.port = port or _sockets.free_port()
        self.mode = "pass"
        self.retry_after = 1
        self.rate = 64  # bytes per second in trickle mode
        self.requests: Counter[str] = Counter()
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> FaultProxy:
        self._stopped.clear()
        self._listen()
        return self

    def stop(self) -> None:
        """Close everything (hung connections too); idempotent."""
        self._stopped.set()
        self._unlisten()
        self._reset_all()

    def set(self, mode: str, *, retry_after: int | None = None, rate: int | None = None) -> None:
        """Switch to ``mode`` for every request from now on."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; one of {', '.join(MODES)}")
        if retry_after is not None:
            self.retry_after = retry_after
        if rate is not None:
            self.rate = rate
        previous, self.mode = self.mode, mode
        if mode == "refuse":
            self._unlisten()
            self._reset_all()
        elif previous == "refuse":
            self._listen()

    # -- sockets ----------------------------------------------------------------------------
    def _listen(self) -> None:
        if self._listener is None and self.mode != "refuse":
            self._listener = _sockets.listen(self.port, self._on_client)

    def _unlisten(self) -> None:
        listener, self._listener = self._listener, None
        _sockets.unlisten(listener)

    def _reset_all(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, set()
        for c in conns:
            _sockets.reset(c)

    def _on_client(self, client: socket.socket) -> None:
        with self._lock:
            self._conns.add(client)
        threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    # -- one client connection: request by request ------------------------------------------
    def _serve(self, client: socket.socket) -> None:
        reader = _Reader(client)
        upstream: socket.socket | None = None
        up_reader: _Reader | None = None
        try:
            while not self._stopped.is_set():
                request = _read_message(reader, client=client)
                if request is None:
                    return
                mode = self.mode
                self.requests[mode] += 1
                if mode in ("reset", "refuse"):
                    _sockets.reset(client)
                    return
                if mode == "hang":
                    self._stopped.wait()  # silent for good
                    return
                if mode in _ERRORS:
                    client.sendall(self._error(mode, request))
                    continue
                if upstream is None or up_reader is None:
                    upstream = socket.create_connection(("127.0.0.1", self.target_port), 30)
                    upstream.settimeout(None)
                    up_reader = _Reader(upstream)
                upstream.sendall(request)
                head_only = request.split(b" ", 1)[0].upper() == b"HEAD"
                answer = _read_message(up_reader, head_only=head_only)
                if answer is None:
                    return
                self._send(client, answer, trickle=mode == "trickle")
        except OSError:
            return
        finally:
            with self._lock:
                self._conns.discard(client)
            for s in (client, upstream):
                if s is not None:
                    with contextlib.suppress(OSError):
                        s.close()

    def _error(self, mode: str, request: bytes) -> bytes:
        status, reason, code, message = _ERRORS[mode]
        body = b"" if request.split(b" ", 1)[0].upper() == b"HEAD" else _xml(code, message)
        extra = f"Retry-After: {self.retry_after}\r\n" if mode == "503" else ""
        head = (
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n"
        )
        return head.encode() + body

    def _send(self, client: socket.socket, data: bytes, *, trickle: bool) -> None:
        if not trickle:
            client.sendall(data)
            return
        step = max(1, self.rate // 4)
        for i in range(0, len(data), step):
            if self._stopped.wait(step / self.rate):
                return
            client.sendall(data[i : i + step])


def _xml(code: str, message: str) -> bytes:
    return (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
        f"<Message>{message}</Message><RequestId>faultproxy</RequestId></Error>"
    ).encode()


class _Reader:
    """Buffered reads from a socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, bytearray()

    def _more(self) -> bool:
        data = self.sock.recv(1 << 20)
        self.buf += data
        return bool(data)

    def until(self, marker: bytes, limit: int = _MAX_HEAD) -> bytes | None:
        while (i := self.buf.find(marker)) < 0:
            if len(self.buf) > limit or not self._more():
                return None
        out = bytes(self.buf[: i + len(marker)])
        del self.buf[: i + len(marker)]
        return out

    def exactly(self, n: int) -> bytes | None:
        while len(self.buf) < n:
            if not self._more():
                return None
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def rest(self) -> bytes:
        while self._more():
            pass
        out = bytes(self.buf)
        self.buf.clear()
        return out


def _read_message(
    r: _Reader, *, client: socket.socket | None = None, head_only: bool = False
) -> bytes | None:
    """One HTTP message (head and body) as bytes; None when the peer closed first. A client's
    ``Expect: 100-continue`` is answered here (the header is dropped before forwarding)."""
    head = r.until(b"\r\n\r\n")
    if head is None:
        return None
    lines = head.split(b"\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in lines[1:])}
    if client is not None and headers.get(b"expect", b"").lower() == b"100-continue":
        client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        head = b"\r\n".join(ln for ln in lines if not ln.lower().startswith(b"expect:"))
    if head_only or _no_body(lines[0]):
        return head
    if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
        body = _chunked(r)
        return None if body is None else head + body
    if (length := headers.get(b"content-length")) is not None:
        body = r.exactly(int(length))
        return None if body is None else head + body
    if client is None and lines[0].startswith(b"HTTP/"):  # a response without length
        return head + r.rest()
    return head


def _no_body(first_line: bytes) -> bool:
    parts = first_line.split(b" ")
    return first_line.startswith(b"HTTP/") and len(parts) > 1 and parts[1] in (b"204", b"304")


def _chunked(r: _Reader) -> bytes | None:
    out = bytearray()
    while True:
        size_line = r.until(b"\r\n")
        if size_line is None:
            return None
        out += size_line
        size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while (trailer := r.until(b"\r\n")) not in (None, b"\r\n"):
                out += trailer
            if trailer is None:
                return None
            out += b"\r\n"
            return bytes(out)
        data = r.exactly(size + 2)
        if data is None:
            return None
        out += data


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python tools/faultproxy.py TARGET_PORT  (modes on stdin)", file=sys.stderr)
        return 2
    with FaultProxy(int(argv[0])) as proxy:
        print(f"faultproxy: {proxy.endpoint_url} -> 127.0.0.1:{argv[0]}", flush=True)
        for line in sys.stdin:
            if line.strip() in MODES:
                proxy.set(line.strip())
            else:
                print(f"faultproxy: unknown mode; one of {', '.join(MODES)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
