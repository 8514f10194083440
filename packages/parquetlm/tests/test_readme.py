"""The README's usage examples run as written (all ```python blocks, in order, one namespace)."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 4
    monkeypatch.delenv("PARQUETLM_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)
    # The example's mkdtemp() lands in tmp_path. (Not all of tempfile: worker processes put
    # sockets there, and a socket's path must stay short.)
    mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: mkdtemp(*a, **{**k, "dir": tmp_path}))
    namespace: dict[str, object] = {"__name__": "readme"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md block {i}", "exec"), namespace)
    assert (Path(str(namespace["data"])) / ".parquetlm-cache").is_dir()
    assert namespace["batches"].step == 5  # type: ignore[attr-defined]
