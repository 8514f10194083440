"""Test helpers: tools loaded by path, deterministic training states, bitwise comparison, and
corruption the way disks and networks do it. Imported by the tests as ``ckpt_helpers``."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import fsspec
import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
TESTS = Path(__file__).resolve().parent


def load_tool(name: str) -> ModuleType:
    """tools/<name>.py by file path (tools are not a package; no package imports another)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


s3server = load_tool("s3server")
STORAGES = ["local", "file", "memory", pytest.param("s3", marks=pytest.mark.s3), "plugin"]


# ---------------------------------------------------------------------------- states --
class TinyNet(torch.nn.Module):
    """Small, but with the parts that make checkpoints tricky: tied weights, a buffer."""

    def __init__(self, vocab: int = 32, width: int = 16) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.body = torch.nn.Linear(width, width)
        self.norm = torch.nn.BatchNorm1d(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.relu(self.body(self.emb(x)))))


def make_state(seed: int, *, big: int = 0) -> dict[str, Any]:
    """A training state after ``seed % 3 + 1`` optimizer steps, fully determined by ``seed``.
    ``big`` adds a tensor of that many floats (to span several I/O pieces)."""
    torch.manual_seed(seed)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # same float results in every process, whatever its thread count
    try:
        for _ in range(seed % 3 + 1):
            x = torch.randint(0, 32, (8,))
            loss = model(x).logsumexp(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    finally:
        torch.set_num_threads(threads)
    state: dict[str, Any] = {
        "model": model,
        "optim": opt,
        "sched": sched,
        "step": seed,
        "rng": {"torch": torch.get_rng_state(), "py": (3, tuple(range(5)), None), "seed": seed},
        "extra": {"lr": [0.1, float("inf")], 7: "int key", "bytes": b"\x00\x01"},
        "buf": torch.arange(10, dtype=torch.float64) * seed,
    }
    if big:
        g = torch.Generator().manual_seed(seed)
        state["big"] = torch.randn(big, generator=g)
    return state


def blank_state(*, big: int = 0) -> dict[str, Any]:
    """Same structure as make_state, different values: what a resuming job constructs."""
    torch.manual_seed(12345)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    state: dict[str, Any] = {
        "model": model,
        "optim": opt,
        "sched": sched,
        "step": -1,
        "rng": None,
        "extra": None,
        "buf": torch.zeros(10, dtype=torch.float64),
    }
    if big:
        state["big"] = torch.zeros(big)
    return state


def flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """Everything in a state, as comparable leaves (objects through their state_dict)."""
    if hasattr(value, "state_dict") and not isinstance(value, torch.Tensor):
        value = value.state_dict()
    out: dict[str, Any] = {}
    if isinstance(value, dict):
        for k, v in value.items():
            out.update(flat(v, f"{prefix}/{k!r}"))
    elif isinstance(value, (list, tuple)):
        out[prefix + "#type"] = type(value).__name__
        for i, v in enumerate(value):
            out.update(flat(v, f"{prefix}/{i}"))
    else:
        out[prefix] = value
    return out


def assert_same_state(a: dict[str, Any], b: dict[str, Any], keys: Any = None) -> None:
    """Bitwise equality of two states (NaN equals NaN; dtypes must match)."""
    for key in keys or a.keys():
        fa, fb = flat(a[key], key), flat(b[key], key)
        assert fa.keys() == fb.keys(), f"{key}: different structure"
        for k, va in fa.items():
            vb = fb[k]
            if isinstance(va, torch.Tensor):
                assert isinstance(vb, torch.Tensor), k
                assert va.dtype == vb.dtype and va.shape == vb.shape, k
                assert torch.equal(_bits(va), _bits(vb)), k
            elif isinstance(va, float) and va != va:
                assert isinstance(vb, float) and vb != vb, k
            else:
                assert va == vb and type(va) is type(vb), f"{k}: {va!r} != {vb!r}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().reshape(-1)
    return t if t.dtype == torch.bool else t.view(torch.uint8)


def corrupt(url: str, options: dict[str, Any], how: str) -> str:
    """Damage the (first) payload file of the checkpoint directory ``url``; return its name.
    (Not DCP's ``.metadata``: ckptstore's reader never needs it; ``verify`` checks it.)"""
    fs, path = fs_for(url, options)
    names = sorted(
        name
        for p in fs.ls(path, detail=False)
        if (name := p.rsplit("/", 1)[-1]) != "manifest.json" and not name.startswith(".")
    )
    name = names[0]
    f = f"{path.rstrip('/')}/{name}"
    data = bytearray(fs.cat_file(f))
    if how == "flip":
        data[len(data) // 2] ^= 0x10
    elif how == "truncate":
        data = data[: len(data) - 100]
    elif how == "delete":
        fs.rm_file(f)
        return name
    else:
        raise ValueError(how)
    fs.pipe_file(f, bytes(data))
    return name


def fs_for(url: str, options: dict[str, Any]) -> tuple[Any, str]:
    if url.startswith("folder://"):  # FolderStorage's URLs are local folders
        url = "file://" + url.removeprefix("folder://")
    fs, path = fsspec.core.url_to_fs(url, **options)
    return fs, path


BIG_DIST = 3_000_000  # 12 MB: holds a whole 4 MiB checksum chunk of its own


# ------------------------------------------------------------------------ processes --
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_envs(n: int) -> list[dict[str, str]]:
    """The environment torchrun gives each of ``n`` local ranks (a fresh port)."""
    port = str(free_port())
    return [
        {
            "RANK": str(r),
            "WORLD_SIZE": str(n),
            "LOCAL_RANK": str(r),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
        }
        for r in range(n)
    ]


def communicate_all(procs: list[subprocess.Popen[str]], timeout: float = 300) -> list[str]:
    """Every process's output; none is left running, whatever happens."""
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outputs


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``ckptstore ARGV`` in this process: (exit code, stdout, stderr)."""
    from ckptstore.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    """The one line of ``err`` (asserted: one line, no traceback)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]
