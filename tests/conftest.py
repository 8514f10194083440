"""Shared by the repository's own tests: the bench scripts, loaded by path (``bench/`` is not a
package, and the importlib import mode puts no test folder on ``sys.path``)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load_bench(name: str) -> ModuleType:
    """``bench/NAME.py`` as module ``NAME``, with ``bench/`` on the path while it imports (the
    scripts import each other by name)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


@pytest.fixture(scope="session")
def load_bench() -> Callable[[str], ModuleType]:
    return _load_bench
