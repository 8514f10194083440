"""Where parquetlm keeps what it derives from a dataset (token caches, trained tokenizers)."""

from __future__ import annotations

import os
from pathlib import Path

from .source import ParquetSource, _is_url

CACHE_ENV = "PARQUETLM_CACHE"
CACHE_DIRNAME = ".parquetlm-cache"


def default_cache_dir(source: ParquetSource) -> Path:
    """``$PARQUETLM_CACHE`` if set; else ``.parquetlm-cache/`` in the dataset's directory when it
    is local and writable; else ``$XDG_CACHE_HOME/parquetlm`` (``~/.cache/parquetlm``)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    if not any(_is_url(f) for f in source.files):
        parents = [
            os.path.dirname(os.path.abspath(f.removeprefix("file://"))) for f in source.files
        ]
        candidate = Path(os.path.commonpath(parents)) / CACHE_DIRNAME
        try:
            candidate.mkdir(exist_ok=True)
            if os.access(candidate, os.W_OK | os.X_OK):
                return candidate
        except OSError:
            pass  # read-only dataset directory: fall back to the user cache
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(home) / "parquetlm"
