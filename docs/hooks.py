"""MkDocs hooks: the site is built from the repository as it is.

The READMEs stay where they are (a package's README is what PyPI and GitHub show); this hook adds
them, DESIGN.md and every other tracked file a page may link to (scripts, results, images) to the
site under their repository paths, so a relative link between them resolves on the site as it
does on GitHub, and ``mkdocs build --strict`` fails on a link that does not.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files, InclusionLevel

ROOT = Path(__file__).resolve().parent.parent
# Markdown files that are pages of the site; other .md files in the repository are not.
TOP_PAGES = {"README.md": "index.md", "DESIGN.md": "DESIGN.md", "CHANGELOG.md": "CHANGELOG.md"}
# Test data and binaries no page links to.
SKIP_SUFFIXES = (".pt", ".bin", ".ckpt", ".safetensors", ".parquet", ".pyc")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def _site_path(path: str) -> str | None:
    """Where a tracked file goes on the site, or None when it does not."""
    if path.startswith(("docs/", ".")) or "/tests/" in path or path.endswith(SKIP_SUFFIXES):
        return None
    if path in TOP_PAGES:
        return TOP_PAGES[path]
    if path.endswith(".md") and not path.endswith("/README.md"):
        return None
    return path


def on_files(files: Files, config: Any) -> Files:
    for path in _tracked():
        dest = _site_path(path)
        if dest is None or files.get_file_from_path(dest) is not None:
            continue
        page = dest.endswith(".md")
        file = File(
            dest,
            src_dir=None,
            dest_dir=config["site_dir"],
            use_directory_urls=config["use_directory_urls"],
            inclusion=InclusionLevel.INCLUDED if page else InclusionLevel.NOT_IN_NAV,
        )
        file.abs_src_path = str(ROOT / path)
        files.append(file)
    return files
