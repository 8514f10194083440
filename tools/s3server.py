"""A real S3 endpoint for tests: ``moto_server`` on 127.0.0.1, started and stopped by PID.

Standard library only. Tests of several packages and the e2e suite load this file by path (no
package imports another)::

    import importlib.util, pathlib
    spec = importlib.util.spec_from_file_location("s3server", ROOT / "tools/s3server.py")
    s3server = importlib.util.module_from_spec(spec); spec.loader.exec_module(s3server)

    if (why := s3server.unavailable_reason()) is not None:
        pytest.skip(why)                      # unless PYRECOVER_REQUIRE_S3=1: then fail
    with s3server.MotoServer() as server:     # moto_server -H 127.0.0.1 -p <free port>
        server.make_bucket("ckpt")
        fs = s3fs.S3FileSystem(**server.storage_options())
        subprocess.run([...], env={**os.environ, **server.env()})   # AWS_* for child processes

What it offers:

- ``unavailable_reason()``: None when ``moto_server`` can be started, else one line saying why and
  how to fix it (``pip install 'moto[server]'``).
- ``MotoServer(port=None, proxy=False)``: a context manager. ``endpoint_url``, ``storage_options()``
  (for s3fs / fsspec), ``env()`` (``AWS_ENDPOINT_URL``, keys, region), ``make_bucket(name)``,
  ``stop()`` (by PID; idempotent; also on ``__exit__`` and at interpreter exit).
- The server dies with the process that started it (Linux), even if that one crashes. (Strictly:
  with the thread that called ``start()``; start it from a thread that lives as long as you need
  it, e.g. the main thread, as a pytest session fixture does.)
- Outages that keep moto's in-memory data, for "the server died during an upload" tests:
  ``pause()`` / ``resume()`` send SIGSTOP / SIGCONT to the server: connections hang (clients see
  timeouts), nothing is lost. With ``proxy=True`` the endpoint is a small TCP proxy in this process:
  ``disconnect()`` closes the listening socket and resets every open connection (clients see
  "connection refused"/"reset"), ``reconnect()`` listens again on the same port.

Run ``python tools/s3server.py`` to start one in the foreground and print its endpoint.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO

ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"
_INSTALL_HINT = "install it with: pip install 'moto[server]'"
_RST = b"\x01\x00\x00\x00\x00\x00\x00\x00"  # SO_LINGER on, 0 s: close() sends RST


def moto_server_path() -> str | None:
    """The ``moto_server`` next to the running interpreter (a venv), else the one on PATH."""
    local = Path(sys.executable).parent / "moto_server"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which("moto_server")


def unavailable_reason() -> str | None:
    """None when a moto_server can be started here, else a one-line reason with the fix."""
    if moto_server_path() is None:
        return f"moto_server not found next to {sys.executable} nor on PATH; {_INSTALL_HINT}"
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
    except OSError as e:
        return f"cannot bind a TCP port on 127.0.0.1 ({e}); moto_server needs the loopback"
    return None


def _die_with_parent() -> None:
    """Linux: the server gets SIGTERM when the process that started it dies, even by a crash
    (segfault, SIGKILL) that skips every cleanup; elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listen(port: int, on_client: Callable[[socket.socket], None]) -> socket.socket:
    """A socket listening on 127.0.0.1:``port``; a daemon thread accepts each connection and
    gives it to ``on_client`` until the socket is closed (:func:`unlisten`). SO_REUSEADDR: a
    proxy that stopped listens on its port again at once."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(64)
    threading.Thread(target=_accept, args=(s, on_client), daemon=True).start()
    return s


def _accept(listener: socket.socket, on_client: Callable[[socket.socket], None]) -> None:
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return  # closed
        on_client(client)


def unlisten(listener: socket.socket | None) -> None:
    """Close a socket :func:`listen` made (None: nothing): new connections are refused."""
    if listener is not None:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()


def reset(conn: socket.socket) -> None:
    """Close ``conn`` with RST (SO_LINGER on, 0 s), as a dead server looks to the client."""
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RST)
    with contextlib.suppress(OSError):
        conn.close()


class MotoServer:
    """``moto_server`` as a subprocess on 127.0.0.1 with a free port; see the module docstring."""

    def __init__(
        self, *, port: int | None = None, proxy: bool = False, start_timeout: float = 60.0
    ) -> None:
        if start_timeout <= 0:
            raise ValueError(f"start_timeout must be > 0 seconds, got {start_timeout}")
        self.port = port or free_port()
        self.start_timeout = start_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._proxy: _TcpProxy | None = _TcpProxy(self.port) if proxy else None
        self._log: IO[bytes] | None = None
        self._paused = False

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> MotoServer:
        if self._proc is not None:
            return self
        exe = moto_server_path()
        if exe is None:
            raise RuntimeError(f"moto_server not found; {_INSTALL_HINT}")
        # The log has no name (unlinked at once): nothing is left behind even when the caller
        # is SIGKILLed. moto keeps large objects in temp files; TMPDIR stays the caller's.
        self._log = tempfile.TemporaryFile(prefix="moto_server-", suffix=".log")  # noqa: SIM115
        self._proc = subprocess.Popen(
            [exe, "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log.fileno(),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C in the terminal is for the test runner, not moto
            preexec_fn=_die_with_parent,
        )
        atexit.register(self.stop)
        try:
            self._wait_until_up()
        except BaseException:
            self.stop()
            raise
        if self._proxy is not None:
            self._proxy.start()
        return self

    def _wait_until_up(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        url = f"http://127.0.0.1:{self.port}/moto-api/"
        while True:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"moto_server exited with code {self._proc.returncode} before answering: "
                    f"{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    r.read()
                return
            except urllib.error.HTTPError:
                return  # any HTTP answer means it is serving
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"moto_server did not answer on port {self.port} within "
                    f"{self.start_timeout:.0f} s: {self.log_tail()}"
                )
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop the server (by its PID) and the proxy. Safe to call twice."""
        if self._proxy is not None:
            self._proxy.stop()
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            if self._paused:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self._paused = False
        log, self._log = self._log, None
        if log is not None:
            log.close()

    def __enter__(self) -> MotoServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def log_tail(self, chars: int = 2000) -> str:
        if self._log is None:
            return "(no log)"
        fd = self._log.fileno()
        # pread: the server shares this file's offset, which a seek here would move.
        size = os.fstat(fd).st_size
        data = os.pread(fd, 4 * chars, max(0, size - 4 * chars))
        return data.decode(errors="replace")[-chars:].strip() or "(empty log)"

    # -- client configuration ---------------------------------------------------------------
    @property
    def endpoint_url(self) -> str:
        port = self._proxy.port if self._proxy is not None else self.port
        return f"http://127.0.0.1:{port}"

    def storage_options(self) -> dict[str, object]:
        """Keyword arguments for ``s3fs.S3FileSystem`` / fsspec ``storage_options``."""
        return {
            "endpoint_url": self.endpoint_url,
            "key": ACCESS_KEY,
            "secret": SECRET_KEY,
            "anon": False,
            "client_kwargs": {"region_name": REGION},
        }

    def env(self) -> dict[str, str]:
        """Environment for child processes (boto3/s3fs read these)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
        }

    def make_bucket(self, name: str) -> None:
        """Create a bucket with a plain HTTP PUT (moto does not check signatures)."""
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", name):
            raise ValueError(
                f"bucket name {name!r} is not valid for S3: "
                "use 3-63 lowercase letters, digits, '.' and '-'"
            )
        # The Authorization header lets moto route the request to S3 (it does not check it).
        auth = f"AWS4-HMAC-SHA256 Credential={ACCESS_KEY}/20240101/{REGION}/s3/aws4_request"
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/{name}",
            method="PUT",
            data=b"",
            headers={"Authorization": f"{auth}, SignedHeaders=host, Signature=0"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                r.read()
        except urllib.error.HTTPError as e:
            if e.code != 409:  # 409: already exists, which is what the caller wants
                raise RuntimeError(f"could not create bucket {name!r}: HTTP {e.code}") from e

    # -- outages ----------------------------------------------------------------------------
    def pause(self) -> None:
        """SIGSTOP the server: requests hang until resume(); moto's data is kept."""
        if self._proc is None:
            raise RuntimeError("pause(): the server is not running; call start() first")
        os.kill(self._proc.pid, signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        if self._proc is None:
            raise RuntimeError("resume(): the server is not running; call start() first")
        os.kill(self._proc.pid, signal.SIGCONT)
        self._paused = False

    def disconnect(self) -> None:
        """Proxy mode: refuse new connections and reset open ones; data is kept."""
        if self._proxy is None:
            raise RuntimeError("disconnect() needs MotoServer(proxy=True); or use pause()")
        self._proxy.stop()

    def reconnect(self) -> None:
        if self._proxy is None:
            raise RuntimeError("reconnect() needs MotoServer(proxy=True); or use resume()")
        self._proxy.start()


class _TcpProxy:
    """127.0.0.1:<own port> -> 127.0.0.1:<target>, one thread pair per connection."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()

    def start(self) -> None:
        if self._listener is None:
            self._listener = listen(self.port, self._connect)

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        unlisten(listener)
        with self._lock:
            conns, self._conns = self._conns, set()
        for c in conns:
            reset(c)

    def _connect(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=30)
            upstream.settimeout(None)
        except OSError:
            client.close()
            return
        with self._lock:
            self._conns.update((client, upstream))
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 20):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._conns.discard(src)


if __name__ == "__main__":
    why = unavailable_reason()
    if why is not None:
        print(why, file=sys.stderr)
        sys.exit(1)
    with MotoServer() as server:
        print(f"moto_server pid {server.pid} at {server.endpoint_url} (Ctrl-C stops it)")
        for k, v in server.env().items():
            print(f"export {k}={v}")
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
