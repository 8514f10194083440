"""Dataset -> tokenizer -> token cache -> train/val loaders (parquetlm), rank-0 first."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parquetlm import (
    PackedLoader,
    ParquetLMError,
    ParquetSource,
    TokenCache,
    Tokenizer,
    TokenizerError,
    TokenizerSpec,
    load_tokenizer,
    parse_tokenizer_spec,
)

from .config import TrainConfig, UsageError
from .corpus import default_cache_dir, prepare_shakespeare


@dataclass(slots=True)
class Data:
    source: ParquetSource
    tokenizer: Tokenizer
    cache: TokenCache
    train: PackedLoader
    val: PackedLoader | None
    dataset: str  # what was read, for logs and metadata

    def describe(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "files": len(self.source.files),
            "tokenizer": getattr(self.tokenizer, "name", type(self.tokenizer).__name__),
            "tokenizer_fingerprint": self.tokenizer.fingerprint(),
            "vocab_size": self.tokenizer.vocab_size,
            "tokens": self.cache.num_tokens,
            "docs": self.cache.num_docs,
            "train_windows": self.train.windows_per_epoch,
            "val_windows": 0 if self.val is None else self.val.windows_per_epoch,
            "cache": str(self.cache.path),
        }


def cache_root(cfg: TrainConfig) -> Path:
    return Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()


def prepare(cfg: TrainConfig) -> tuple[ParquetSource, Tokenizer, TokenCache, str]:
    """Build (or reuse) the corpus, tokenizer and token cache. Call on one rank per node first:
    the caches are shared files and building them twice is wasted time."""
    root = cache_root(cfg)
    try:
        dataset = cfg.dataset or str(prepare_shakespeare(root))
        source = ParquetSource(dataset, column=cfg.text_column)
        tokenizer = _tokenizer(cfg.tokenizer, source, root)
        cache = TokenCache.build(source, tokenizer, root / "tokens")
    except ParquetLMError as e:
        raise UsageError(f"--dataset/--tokenizer: {e}") from None
    except OSError as e:  # the corpus or a trained tokenizer written into the cache folder
        raise UsageError(_cache_problem(e, root)) from None
    return source, tokenizer, cache, dataset


def _cache_problem(e: OSError, root: Path) -> str:
    """One line for a file of the cache that cannot be written (a read-only or full disk) or
    a dataset that cannot be read."""
    where, why = e.filename or root, e.strerror or str(e)
    if Path(where).resolve().is_relative_to(root.resolve()):
        return (
            f"--cache-dir {root}: cannot write {where}: {why}; point --cache-dir (or "
            "PYRECOVER_CACHE) at a folder you can write with room to spare (a read-only cache "
            "serves once it holds what the run needs)"
        )
    return f"--dataset/--tokenizer: cannot read {where}: {why}"


def _tokenizer(spec: str, source: ParquetSource, root: Path) -> Tokenizer:
    # Trained tokenizers (bpe:N) go to our cache dir, not next to a possibly read-only dataset.
    return load_tokenizer(tokenizer_spec(spec), source, cache_dir=root / "tokenizers")


def tokenizer_spec(spec: str) -> TokenizerSpec:
    """``--tokenizer`` parsed by parquetlm (a folder means its ``tokenizer.json``); bad input is
    one line (:class:`UsageError`)."""
    try:
        return parse_tokenizer_spec(_tokenizer_file(spec))
    except TokenizerError as e:
        raise UsageError(f"--tokenizer {spec}: {e}") from None


def _tokenizer_file(spec: str) -> str:
    """A folder holding ``tokenizer.json`` (what the original's --tokenizer-name-or-path took, a
    Hugging Face model folder) means that file; a missing file is one clear line."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise UsageError(
                f"--tokenizer {spec}: the folder has no tokenizer.json (give the file, or "
                "byte|gpt2|bpe:N)"
            )
        return str(path / "tokenizer.json")
    looks_like_path = spec.endswith(".json") or "/" in spec
    if looks_like_path and not path.is_file():
        raise UsageError(
            f"--tokenizer {spec}: no such file or folder (pyrecover-train reads tokenizers from "
            "disk: for a Hugging Face Hub model, download its tokenizer.json and give its path; "
            "or use byte|gpt2|bpe:N)"
        )
    return str(path) if path.is_file() else spec


def loaders(
    cfg: TrainConfig, cache: TokenCache, *, rank: int, world_size: int
) -> tuple[PackedLoader, PackedLoader | None]:
    """Train loader (state checkpointed) and the held-out val loader (read from the start at
    every evaluation, so it has no state to save)."""
    common: dict[str, Any] = {
        "seq_len": cfg.sequence_length,
        "batch_size": cfg.batch_size,
        "seed": cfg.seed,
        "rank": rank,
        "world_size": world_size,
        "val_fraction": cfg.val_fraction,
    }
    try:
        train = PackedLoader(cache, split="train", **common)
        val = PackedLoader(cache, split="val", **common) if cfg.val_fraction > 0 else None
    except ParquetLMError as e:
        raise UsageError(f"data: {e}") from None
    return train, val
