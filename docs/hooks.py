"""MkDocs hooks: the site is built from the repository as it is.

The READMEs stay where they are (a package's README is what PyPI and GitHub show); this hook adds
them, DESIGN.md and every other tracked file a page may link to (scripts, results, images) to the
site under their repository paths, so a relative link between them resolves on the site as it
does on GitHub, and ``mkdocs build --strict`` fails on a link that does not. Two places differ:
the root README is the site's ``index.md``, and ``docs/`` is the site's root; a relative link
is written for GitHub (from the file where it stands, in the repository) and rewritten here to
where its target is on the site, before mkdocs checks it.

The files come from ``git ls-files``: the site is built from a git clone (CI clones) with git on
PATH. Without either the build stops with one line saying so, rather than publish a site with
the READMEs missing.
"""

from __future__ import annotations

import ast
import posixpath
import re
import subprocess
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files, InclusionLevel

ROOT = Path(__file__).resolve().parent.parent
# Markdown files that are pages of the site; other .md files in the repository are not.
TOP_PAGES = {"README.md": "index.md", "DESIGN.md": "DESIGN.md", "CHANGELOG.md": "CHANGELOG.md"}
DOCS = "docs/"
# An inline Markdown link's target: a relative path (no scheme, not an anchor alone), anchor kept.
_LINK = re.compile(r"(\]\()([^)\s#:]+)(#[^)\s]*)?(\))")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
# Test data and binaries no page links to.
SKIP_SUFFIXES = (".pt", ".bin", ".ckpt", ".safetensors", ".parquet", ".pyc")


def _tracked() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        raise PluginError(
            f"docs/hooks.py: `git ls-files` failed in {ROOT} ({str(detail).strip()}): the site is "
            "built from a git clone of the repository, with git on PATH"
        ) from None
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


def _site(repo_path: str) -> str:
    """Where a repository file is on the site."""
    if repo_path.startswith(DOCS):
        return repo_path[len(DOCS) :]
    return TOP_PAGES.get(repo_path, repo_path)


def _repo(page_src: str, abs_src: str) -> str:
    """Where a page of the site is in the repository."""
    path = Path(abs_src).resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else page_src


def _rewrite(markdown: str, repo_path: str) -> str:
    here_repo, here_site = posixpath.dirname(repo_path), posixpath.dirname(_site(repo_path))

    def link(m: re.Match[str]) -> str:
        target = posixpath.normpath(posixpath.join(here_repo, m.group(2)))
        if target.startswith(".."):
            return m.group(0)  # outside the repository: mkdocs says so
        moved = posixpath.relpath(_site(target), here_site or ".")
        return f"{m.group(1)}{moved}{m.group(3) or ''}{m.group(4)}"

    parts, last = [], 0
    for fence in _FENCE.finditer(markdown):  # code blocks are left as they are
        parts += [_LINK.sub(link, markdown[last : fence.start()]), fence.group(0)]
        last = fence.end()
    return "".join([*parts, _LINK.sub(link, markdown[last:])])


# ``<!-- modules: PACKAGE -->`` on a page: a table of the package's modules and their purpose.
_MODULES = re.compile(r"^<!-- modules: ([a-z_]+) -->$", re.MULTILINE)


def _purpose(path: Path) -> str:
    """The first sentence of a module's docstring, on one line."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    first = " ".join(doc.split("\n\n", 1)[0].split())
    end = re.search(r"(?<=[a-z)`])\. ", first)
    text = first[: end.start() + 1] if end else first
    return text.replace("|", "\\|") or "-"


def _module_table(package: str) -> str:
    """Every module of ``package`` (sub-packages' too) with its one-line purpose, from the
    source, so the table cannot fall behind the code."""
    src = ROOT / "packages" / package / "src" / package
    if not src.is_dir():
        raise PluginError(f"docs/hooks.py: <!-- modules: {package} -->: no folder {src}")
    rows = ["| module | what it is for |", "|---|---|"]
    for path in sorted(src.rglob("*.py")):
        parts = path.relative_to(src.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        rows.append(f"| `{'.'.join(parts)}` | {_purpose(path)} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    markdown = _MODULES.sub(lambda m: _module_table(m.group(1)), markdown)
    return _rewrite(markdown, _repo(page.file.src_uri, page.file.abs_src_path))
