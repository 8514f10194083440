"""Broken plugins fail at the start, in one line: a format or storage plugin (an entry point of
an installed distribution) that fails to import, is not a class of its registry's protocol, or
whose name collides with a built-in's or another plugin's. Real distributions on sys.path (what
``pip install`` leaves), the real ``ckptstore`` CLI in a subprocess: exit 2, one line naming the
entry point and its distribution, before any work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointStore

MODULES = {
    "ckpt_boom": "raise RuntimeError('the plugin is broken at import')\n",
    "ckpt_notclass": "Thing = 42\n",
    "ckpt_lacking": "class Half:\n    def stage(self, enc, ctx):\n        return None\n",
    "ckpt_fine": (
        "class Store:\n    @classmethod\n    def from_url(cls, url, options):\n"
        "        raise ValueError('unused')\n"
    ),
}

# (case, [(distribution, group, name, target)], what the one line must say)
CASES = [
    (
        "import fails",
        [("boom-plugin", "ckptstore.storage", "boom", "ckpt_boom:Store")],
        ["'boom'", "boom-plugin 1.0", "fails to import", "RuntimeError"],
    ),
    (
        "not a class",
        [("odd-plugin", "ckptstore.formats", "odd", "ckpt_notclass:Thing")],
        ["'odd'", "odd-plugin 1.0", "is not a class"],
    ),
    (
        "wrong protocol",
        [("half-plugin", "ckptstore.formats", "half", "ckpt_lacking:Half")],
        ["'half'", "half-plugin 1.0", "lacks writes_on, persist, load, describe"],
    ),
    (
        "named like a built-in",
        [("shadow-plugin", "ckptstore.storage", "s3", "ckpt_fine:Store")],
        ["'s3'", "shadow-plugin 1.0", "collides with ckptstore's own storage"],
    ),
    (
        "two plugins, one name",
        [
            ("twin-a", "ckptstore.storage", "twin", "ckpt_fine:Store"),
            ("twin-b", "ckptstore.storage", "twin", "ckpt_fine:Store"),
        ],
        ["'twin'", "twin-a 1.0", "twin-b 1.0", "collides with each other"],
    ),
]


def install(site: Path, dist: str, group: str, name: str, target: str) -> None:
    """A distribution ``dist`` 1.0 declaring ``name = target`` in ``group``, as pip leaves it."""
    info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n{name} = {target}\n")


def site_with(tmp_path: Path, plugins: list[tuple[str, str, str, str]]) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    for module, text in MODULES.items():
        (site / f"{module}.py").write_text(text)
    for plugin in plugins:
        install(site, *plugin)
    return site


def run(argv: list[str], site: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path, check=False
    )


@pytest.mark.parametrize(("case", "plugins", "said"), CASES, ids=[c[0] for c in CASES])
def test_a_broken_plugin_is_one_line_and_exit_2_at_start(
    case: str, plugins: list[tuple[str, str, str, str]], said: list[str], tmp_path: Path
) -> None:
    site = site_with(tmp_path, plugins)
    (tmp_path / "ckpt").mkdir()
    r = run([sys.executable, "-m", "ckptstore.cli", "list", str(tmp_path / "ckpt")], site, tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for words in said:
        assert words in lines[0], (words, lines[0])
    assert r.stdout == ""  # nothing was done


def test_a_good_plugin_passes_the_check(tmp_path: Path) -> None:
    site = site_with(tmp_path, [("good-plugin", "ckptstore.storage", "good", "ckpt_fine:Store")])
    with CheckpointStore(str(tmp_path / "ckpt")) as store:
        store.save(1, {"w": torch.ones(2)})
    r = run([sys.executable, "-m", "ckptstore.cli", "list", str(tmp_path / "ckpt")], site, tmp_path)
    assert r.returncode == 0, r.stderr
