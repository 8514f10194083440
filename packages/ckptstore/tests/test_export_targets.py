"""Where ``ckptstore export --out`` writes (issue 30): a device, a FIFO or standard output is
written into and never replaced; a symbolic link is followed (the link stays, the file it
names gets the export); a block device or a socket is refused; and the format and the file's
suffix must agree. (As root, ``--out /dev/null`` replaced the machine's /dev/null with a regular
file, and ``--out /dev/stdout`` replaced that link and printed nothing.)"""

from __future__ import annotations

import io
import os
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from ckpt_helpers import one_line, run_cli

from ckptstore import CheckpointStore

STATE = {"w": torch.arange(6.0), "step": 3}


@pytest.fixture
def exp(tmp_path: Path) -> Path:
    with CheckpointStore(str(tmp_path / "exp")) as store:
        store.save(3, STATE)
    return tmp_path / "exp"


def exported(data: bytes) -> None:
    got = torch.load(io.BytesIO(data), weights_only=True)
    assert torch.equal(got["w"], STATE["w"]) and got["step"] == 3


def test_a_link_to_a_device_is_written_into_and_stays_a_link(
    exp: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Safe to run on any machine: with the old code the link was replaced, not /dev/null."""
    link = tmp_path / "null"
    link.symlink_to("/dev/null")
    code, out, _ = run_cli(capsys, "export", str(exp), "--out", str(link))
    assert code == 0 and "exported step, w of step 3" in out, out
    assert link.is_symlink() and os.readlink(link) == "/dev/null"
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root (CI runs as root)")
def test_a_device_node_is_written_into_and_a_block_device_refused(
    exp: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    null, block = tmp_path / "null", tmp_path / "disk"
    os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # a /dev/null of our own
    os.mknod(block, stat.S_IFBLK | 0o600, os.makedev(7, 0))  # a loop device's node
    assert run_cli(capsys, "export", str(exp), "--out", str(null))[0] == 0
    assert stat.S_ISCHR(null.stat().st_mode)  # still the device
    code, _, err = run_cli(capsys, "export", str(exp), "--out", str(block))
    assert code == 2 and f"--out {block} is a block device: export writes a file" in one_line(err)
    assert stat.S_ISBLK(block.stat().st_mode)


def test_a_socket_is_refused(exp: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        code, _, err = run_cli(capsys, "export", str(exp), "--out", str(path))
    assert code == 2 and "is a socket: export writes a file, a FIFO" in one_line(err)
    assert stat.S_ISSOCK(path.stat().st_mode)


def test_a_fifo_is_written_into(
    exp: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    code, _, _ = run_cli(capsys, "export", str(exp), "--out", str(fifo))
    reader.join(60)
    assert code == 0 and stat.S_ISFIFO(fifo.stat().st_mode)
    exported(got[0])


@pytest.mark.parametrize("out", ["-", "/dev/stdout"])
def test_standard_output_gets_the_export_and_stderr_the_summary(
    exp: Path, tmp_path: Path, out: str
) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "ckptstore", "export", str(exp), "--out", out],
        capture_output=True,
        timeout=120,
        cwd=tmp_path,  # where a file named "-" went before
    )
    assert r.returncode == 0, r.stderr
    exported(r.stdout)
    assert r.stderr.decode().startswith("exported step, w of step 3 to /dev/stdout")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]


def test_a_link_to_a_file_is_followed_and_stays_a_link(
    exp: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Writing through a link is what `cp`, `>` and `torch.save` do: the file it names gets
    the export (written beside it and renamed over it, as any export), the link stays."""
    real, link = tmp_path / "real.pt", tmp_path / "link.pt"
    real.write_text("old")
    link.symlink_to("real.pt")
    code, out, _ = run_cli(capsys, "export", str(exp), "--out", str(link))
    assert code == 0 and f"to {real} (" in out, out
    assert link.is_symlink() and os.readlink(link) == "real.pt"
    exported(real.read_bytes())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp", "link.pt", "real.pt"]


@pytest.mark.parametrize(
    ("fmt", "out", "said"),
    [
        ("torch", "x.safetensors", "--format torch writes a torch.save file, but --out"),
        ("safetensors", "x.pt", "--format safetensors writes a safetensors file, but --out"),
    ],
)
def test_a_format_the_file_name_contradicts_is_refused(
    exp: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str, out: str, said: str
) -> None:
    """`--format torch --out x.safetensors` wrote a pickle under a .safetensors name."""
    target = tmp_path / out
    code, _, err = run_cli(capsys, "export", str(exp), "--format", fmt, "--out", str(target))
    line = one_line(err)
    assert code == 2 and said in line and "or leave --format out" in line, line
    assert not target.exists()
