"""``parquetlm`` command line: tokenize, train-tokenizer, stats, verify.

Bad input (a missing file, a wrong column, a corrupt tokenizer...) prints one line and exits 2; a
reader of stdout that left early (``| head -1``) ends it quietly with 141, as SIGPIPE gives.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

from . import __version__
from .cache import TokenCache
from .errors import ParquetLMError
from .loader import PackedLoader
from .source import ParquetSource
from .tokenizer import DEFAULT_VOCAB_SIZE, load_tokenizer, train_tokenizer


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not the usage block and then this
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="parquetlm",
        description="Parquet text -> tokens -> packed, sharded, resumable batches.",
    )
    p.add_argument("--version", action="version", version=f"parquetlm {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    def source_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("src", nargs="+", help="parquet file(s), directory, glob or fsspec URL")
        sp.add_argument("--column", default="text", help="text column (default: text)")
        sp.add_argument(
            "--storage-options",
            type=_json_object,
            default=None,
            metavar="JSON",
            help="fsspec options for URLs, e.g. '{\"anon\": true}'",
        )

    tok = sub.add_parser("tokenize", help="build (or reuse) the token cache of a dataset")
    source_args(tok)
    tok.add_argument("--tokenizer", default="byte", help="byte | gpt2 | bpe[:VOCAB] | FILE.json")
    tok.add_argument("--cache-dir", default=None, help="default: .parquetlm-cache next to the data")
    tok.add_argument("--workers", type=_positive, default=None, help="processes (default: CPUs)")
    tok.add_argument(
        "--verify",
        action="store_true",
        help="check every byte of an existing cache now; rebuild it if it is damaged",
    )
    tok.add_argument("--json", action="store_true", help="print the result as JSON")

    train = sub.add_parser("train-tokenizer", help="train a byte-level BPE on a dataset")
    source_args(train)
    train.add_argument("--vocab-size", type=_positive, default=DEFAULT_VOCAB_SIZE)
    train.add_argument("--out", required=True, help="where to write tokenizer.json")

    stats = sub.add_parser("stats", help="rows, bytes, tokens and windows of a dataset")
    source_args(stats)
    stats.add_argument("--tokenizer", default="byte", help="byte | gpt2 | bpe[:VOCAB] | FILE.json")
    stats.add_argument("--seq-len", type=_positive, default=1024)
    stats.add_argument("--val-fraction", type=float, default=0.0)
    stats.add_argument("--cache-dir", default=None)
    stats.add_argument("--workers", type=_positive, default=None)
    stats.add_argument("--json", action="store_true", help="print the result as JSON")

    verify = sub.add_parser(
        "verify", help="check token caches against the checksums written when they were built"
    )
    verify.add_argument("cache", nargs="+", help="a cache folder (tokens-KEY/, as tokenize prints)")
    return p


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _source(args: argparse.Namespace) -> ParquetSource:
    return ParquetSource(args.src, column=args.column, storage_options=args.storage_options)


def _cache(args: argparse.Namespace, source: ParquetSource) -> TokenCache:
    tokenizer = load_tokenizer(args.tokenizer, source)
    verify = bool(getattr(args, "verify", False))
    return TokenCache.build(source, tokenizer, args.cache_dir, workers=args.workers, verify=verify)


def _print(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
        return
    width = max(len(k) for k in result)
    for k, v in result.items():
        shown = f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else v
        print(f"{k.ljust(width)}  {shown}")


def cmd_tokenize(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    source = _source(args)
    cache = _cache(args, source)
    _print(
        {
            "cache": str(cache.path),
            "tokens": cache.num_tokens,
            "docs": cache.num_docs,
            "dtype": cache.dtype.name,
            "vocab_size": cache.vocab_size,
            "null_rows_skipped": cache.null_rows,
            "seconds": round(time.perf_counter() - t0, 3),
        },
        args.json,
    )


def cmd_train_tokenizer(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    tok = train_tokenizer(_source(args), vocab_size=args.vocab_size, path=args.out)
    print(f"wrote {args.out}: vocab_size {tok.vocab_size} in {time.perf_counter() - t0:.1f} s")


def cmd_stats(args: argparse.Namespace) -> None:
    source = _source(args)
    cache = _cache(args, source)
    loader = PackedLoader(cache, seq_len=args.seq_len, batch_size=1, val_fraction=args.val_fraction)
    result: dict[str, Any] = {
        "files": len(source.files),
        "rows": source.num_rows,
        "null_rows": cache.null_rows,
        "text_bytes": int(cache.meta["text_bytes"]),
        "tokenizer": args.tokenizer,
        "tokens": cache.num_tokens,
        "docs": cache.num_docs,
        "bytes_per_token": round(int(cache.meta["text_bytes"]) / cache.num_tokens, 3),
        "seq_len": args.seq_len,
        "windows_per_epoch": loader.windows_per_epoch,
    }
    if loader.val_windows:
        result["val_windows"] = loader.val_windows
    result["cache"] = str(cache.path)
    _print(result, args.json)


def cmd_verify(args: argparse.Namespace) -> None:
    for path in args.cache:
        cache = TokenCache.open(path)
        cache.verify()
        print(f"ok {cache.path}: {cache.num_tokens:,} tokens, {cache.num_docs:,} docs")


COMMANDS = {
    "tokenize": cmd_tokenize,
    "train-tokenizer": cmd_train_tokenizer,
    "stats": cmd_stats,
    "verify": cmd_verify,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    with warnings.catch_warnings():  # the library's warnings, for a user: one line each
        warnings.showwarning = lambda msg, *_, **__: print(
            f"parquetlm: warning: {msg}", file=sys.stderr
        )
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        COMMANDS[args.command](args)
        sys.stdout.flush()  # a closed pipe shows here, not as a message at interpreter exit
    except ParquetLMError as e:
        print(f"parquetlm: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left early (`| head -1`): quiet, as SIGPIPE would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush
        return 141
    except OSError as e:  # the machine's, not the input's: a full disk, a lost mount
        print(f"parquetlm: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("parquetlm: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
