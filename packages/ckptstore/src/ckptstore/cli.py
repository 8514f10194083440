"""``ckptstore`` command line: list, verify, inspect, prune, export.

Exit codes: 0 fine, 1 corrupt / nothing found / failed, 2 usage error (one line on stderr).
URL is a checkpoint root (``/ckpt``, ``s3://bucket/run``) or one step directory of it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import orjson

from .errors import CheckpointError, NoCheckpointError
from .manifest import parse_step_dir


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ckptstore", description="Inspect and manage ckptstore checkpoints.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("url", help="checkpoint root or step directory (path or fsspec URL)")
        sp.add_argument("--experiment", help="experiment sub-directory under the root")
        sp.add_argument(
            "--storage-options",
            type=_json_dict,
            default=None,
            help='fsspec options as JSON, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'',
        )

    sp = sub.add_parser("list", help="committed checkpoints, by step")
    common(sp)
    sp.add_argument("--json", action="store_true", help="one JSON object per line")
    sp = sub.add_parser("verify", help="re-read files against the manifest; exit 1 if corrupt")
    common(sp)
    sp.add_argument("--step", default=None, help="N, latest (default) or all")
    sp.add_argument("--json", action="store_true")
    sp = sub.add_parser("inspect", help="manifest, files, tensor shapes and dtypes")
    common(sp)
    sp.add_argument("--step", default=None, help="N or latest (default)")
    sp.add_argument("--json", action="store_true")
    sp = sub.add_parser("prune", help="delete old checkpoints (never the newest verified one)")
    common(sp)
    sp.add_argument("--keep-last", type=_positive, required=True, metavar="K")
    sp.add_argument("--keep-every", type=_positive, default=None, metavar="N")
    sp.add_argument("--dry-run", action="store_true", help="say what would go; delete nothing")
    sp = sub.add_parser("export", help="plain torch.save file of one state entry")
    common(sp)
    sp.add_argument("--step", required=True, help="N or latest")
    sp.add_argument("--out", required=True, help="output file (written atomically)")
    sp.add_argument("--key", default=None, help="state entry to export (default: model)")
    return p


def _json_dict(text: str) -> dict[str, Any]:
    try:
        v = orjson.loads(text)
    except orjson.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return v


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _step_arg(text: str | None) -> int | str:
    if text is None or text == "latest":
        return "latest"
    if text.isdigit():
        return int(text)
    raise _UsageError(f"--step must be a step number or 'latest', got {text!r}")


def _open(args: argparse.Namespace, **kw: Any) -> tuple[Any, int | None]:
    """The store, and the step the URL itself names (URL = .../step-00001234)."""
    from .store import CheckpointStore

    url = args.url.rstrip("/")
    step = parse_step_dir(url.rsplit("/", 1)[-1]) if "/" in url else None
    if step is not None:
        url = url.rsplit("/", 1)[0] or "/"
    store = CheckpointStore(
        url,
        experiment=args.experiment,
        storage_options=args.storage_options,
        distributed=False,
        **kw,
    )
    return store, step


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n} B"


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).isoformat(timespec="seconds")


def cmd_list(args: argparse.Namespace) -> int:
    store, _ = _open(args)
    infos = store.list()
    if args.json:
        for i in infos:
            sys.stdout.write(orjson.dumps(i, option=orjson.OPT_SERIALIZE_DATACLASS).decode() + "\n")
        return 0
    if not infos:
        print(f"no checkpoints in {store.url}")
        return 0
    head = store.latest_step()
    rows = [("step", "time", "format", "size", "world", "metadata")]
    for i in infos:
        meta = orjson.dumps(i.metadata).decode()
        rows.append(
            (
                f"{i.step}{' (latest)' if i.step == head else ''}",
                _when(i.time),
                i.format,
                _human(i.bytes),
                str(i.world_size),
                meta if len(meta) <= 60 else meta[:57] + "...",
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    store, url_step = _open(args)
    if args.step == "all":
        steps: list[int | str] = list(store.steps())
        if not steps:
            raise NoCheckpointError(f"no checkpoints in {store.url}")
    else:
        steps = [url_step if url_step is not None and args.step is None else _step_arg(args.step)]
    bad = 0
    for s in steps:
        report = store.verify(s)
        if args.json:
            sys.stdout.write(orjson.dumps(report, option=orjson.OPT_SERIALIZE_DATACLASS).decode())
            sys.stdout.write("\n")
        else:
            print(report.summary())
            for f in report.files:
                why = "" if f.ok else f": {f.problem}"
                print(f"  {'ok ' if f.ok else 'BAD'} {f.path} ({f.size} bytes){why}")
        bad += not report.ok
    return 1 if bad else 0


def cmd_inspect(args: argparse.Namespace) -> int:
    store, url_step = _open(args)
    step = url_step if url_step is not None and args.step is None else _step_arg(args.step)
    info = store.inspect(step)
    if args.json:
        sys.stdout.write(orjson.dumps(info, option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    print(f"{info['url']}")
    print(
        f"  step {info['step']}, format {info['format']}, world size {info['world_size']}, "
        f"saved {_when(info['time'])}, {_human(info['bytes'])}"
    )
    print(f"  versions: {orjson.dumps(info['versions']).decode()}")
    if info["metadata"]:
        print(f"  metadata: {orjson.dumps(info['metadata']).decode()}")
    print(f"  entries: {orjson.dumps(info['types']).decode()}")
    print("  files:")
    for f in info["files"]:
        chunks = len(f["crc32"]["values"])
        print(f"    {f['path']}  {f['size']} bytes  rank {f['rank']}  {chunks} crc32 chunks")
    print(f"  tensors ({len(info['tensors'])}):")
    for t in info["tensors"]:
        print(f"    {t['key']}  {t['dtype']}  {list(t['shape'])}  {t['nbytes']} bytes")
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    store, _ = _open(args, keep_last=args.keep_last, keep_every=args.keep_every)
    gone = store.prune(dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    print(
        f"{verb} {len(gone)} checkpoint(s){': steps ' + ', '.join(map(str, gone)) if gone else ''}"
    )
    print(f"kept: steps {', '.join(map(str, store.steps())) if not args.dry_run else '(dry run)'}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    store, url_step = _open(args)
    step = url_step if url_step is not None and args.step is None else _step_arg(args.step)
    keys = list(store.inspect(step)["types"])
    key = args.key or "model"
    if key not in keys:
        raise _UsageError(
            f"checkpoint has no entry {key!r}; choose one with --key from: {', '.join(keys)}"
        )
    manifest, values = store.read(step, keys=[key])
    value = _clone(values[key])  # torch.save writes a view's whole storage: the read buffer
    out = os.path.abspath(args.out)
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(value, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    print(f"exported {key!r} of step {manifest.step} to {out} (torch.load(..., weights_only=True))")
    return 0


def _clone(v: Any) -> Any:
    import torch

    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, dict):
        out = type(v)((k, _clone(x)) for k, x in v.items())
        if hasattr(v, "_metadata"):
            out._metadata = v._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(v, (list, tuple)):
        return type(v)(_clone(x) for x in v)
    return v


_COMMANDS = {
    "list": cmd_list,
    "verify": cmd_verify,
    "inspect": cmd_inspect,
    "prune": cmd_prune,
    "export": cmd_export,
}


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        return _COMMANDS[args.cmd](args)
    except _UsageError as e:
        print(f"ckptstore: error: {e} (see ckptstore --help)", file=sys.stderr)
        return 2
    except ValueError as e:  # bad option values found by the store's validation
        print(f"ckptstore: error: {e}", file=sys.stderr)
        return 2
    except (CheckpointError, OSError) as e:
        print(f"ckptstore: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
