"""ckptstore's checkpoints open with standard readers, without ckptstore.

Each read runs in a subprocess in which ckptstore cannot be imported (tests/ckpt_open_worker.py):
``safetensors.torch.load_file`` for the ``torch`` format, ``torch.distributed.checkpoint.load``
with ``FileSystemReader`` for the ``dcp`` format, on 1 process and on 2 gloo ranks, and for a
checkpoint that 2 ranks wrote. Everything is compared bitwise with what ckptstore's own reader
returns.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_helpers import TESTS, communicate_all, rank_envs

from ckptstore import CheckpointStore
from ckptstore.formats.torchzip import tensor_pickle

WORKER = TESTS / "ckpt_open_worker.py"


def state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    return {
        "model": model,
        "optim": opt,
        "step": 7,
        "extra": {
            "bf16": torch.arange(12, dtype=torch.bfloat16).view(3, 4),
            "i64": torch.tensor([-(2**63), 2**63 - 1]),
            "bool": torch.tensor([True, False]),
            "scalar": torch.tensor(1.5),
            "c128": torch.tensor([1 + 2j, -3j], dtype=torch.complex128),
            "big": torch.arange(300_000, dtype=torch.float32),  # page-aligned in a dcp shard
        },
    }


def save(root: Path, fmt: str) -> Path:
    """The step folder of a fresh checkpoint, and expected.pt beside it (ckptstore's read)."""
    with CheckpointStore(str(root), format=fmt) as store:
        store.save(7, state())
        _, values = store.read(7)
    torch.save(values, root / "expected.pt")
    return root / "step-00000007"


def run(mode: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), mode, *args],
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(procs: list[subprocess.Popen[str]]) -> list[str]:
    outs = communicate_all(procs)
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    return outs


def test_the_torch_format_is_a_safetensors_file(tmp_path: Path) -> None:
    step = save(tmp_path, "torch")
    (payload,) = step.glob("state.*.safetensors")
    (out,) = finish([run("read-safetensors", str(payload), str(tmp_path / "expected.pt"))])
    assert out.startswith("OK ")


def test_the_dcp_format_loads_with_dcp_on_one_process(tmp_path: Path) -> None:
    step = save(tmp_path, "dcp")
    assert (step / ".metadata").exists()
    (out,) = finish([run("read-dcp", str(step), str(tmp_path / "expected.pt"))])
    assert out.strip().endswith("OK rank 0 of 1")


@pytest.mark.slow
def test_the_dcp_format_loads_with_dcp_on_two_gloo_ranks(tmp_path: Path) -> None:
    step = save(tmp_path, "dcp")
    outs = finish(
        [run("read-dcp", str(step), str(tmp_path / "expected.pt"), env=e) for e in rank_envs(2)]
    )
    assert [o.strip().splitlines()[-1] for o in outs] == ["OK rank 0 of 2", "OK rank 1 of 2"]


@pytest.mark.slow
def test_a_dcp_checkpoint_of_two_ranks_loads_with_dcp_on_one(tmp_path: Path) -> None:
    finish([run("save-dcp", str(tmp_path), env=e) for e in rank_envs(2)])
    step = tmp_path / "step-00000011"
    assert len(list(step.glob("shard-r*.distcp"))) == 2
    (out,) = finish([run("read-dcp", str(step), str(tmp_path / "expected.pt"))])
    assert out.strip().endswith("OK rank 0 of 1")


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.uint16, torch.bool]
)
@pytest.mark.parametrize("shape", [(), (0,), (3, 4), (2, 0, 5)])
def test_a_dcp_chunk_pickles_as_torch_save_does(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    import io
    import zipfile

    buf = io.BytesIO()
    torch.save(torch.zeros(shape, dtype=dtype), buf)
    assert zipfile.ZipFile(buf).read("archive/data.pkl") == tensor_pickle(dtype, shape)


def test_tied_weights_are_stored_once_under_the_first_name(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    with CheckpointStore(str(tmp_path)) as store:
        store.save(1, {"model": model})
    (payload,) = (tmp_path / "step-00000001").glob("*.safetensors")
    assert list(load_file(payload)) == ["model.emb.weight"]


def test_the_readme_reads_both_formats_without_ckptstore(tmp_path: Path) -> None:
    """The README's example: its first part writes the checkpoints (here, with ckptstore), the
    rest runs where ckptstore cannot be imported."""
    import re
    import tempfile

    readme = (TESTS.parent / "README.md").read_text()
    (block,) = [
        b
        for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S)
        if "without ckptstore" in b
    ]
    setup, reading = block.split("# -- without ckptstore", 1)
    run_dir = tempfile.mkdtemp(dir=tmp_path)
    setup = setup.replace("tempfile.mkdtemp()", repr(run_dir))
    exec(compile(setup, "README.md setup", "exec"), {"__name__": "__readme__"})
    snippet = tmp_path / "snippet.py"
    snippet.write_text(f"import torch\nrun = {run_dir!r}\n# -- without ckptstore{reading}")
    (out,) = finish([run("exec", str(snippet))])
    assert out.strip().endswith("OK snippet")


def test_the_readers_cannot_import_ckptstore_yet_keep_their_own_packages(tmp_path: Path) -> None:
    """What makes the reads above a proof: in the worker ``import ckptstore`` fails, while the
    packages installed beside it (safetensors, numpy: one site-packages when installed as a
    wheel, as in nox and CI) still import."""
    snippet = tmp_path / "probe.py"
    snippet.write_text("import numpy, safetensors\nimport ckptstore\n")
    proc = run("exec", str(snippet))
    (out,) = communicate_all([proc])
    assert proc.returncode == 1 and "ckptstore is not installed here" in out, out[-3000:]
