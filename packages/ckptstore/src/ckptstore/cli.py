"""``ckptstore`` command line: list, verify, inspect, prune, export, import, lock.

Exit codes: 0 fine, 1 corrupt / untrusted / nothing found / failed, 2 usage error (one line on
stderr), 141 quietly when the reader of stdout left early (``| head -1``), as SIGPIPE gives. URL
is an experiment folder (``/ckpt/run1``, ``s3://bucket/run``), one step folder of it, or a root
holding experiment folders (``list`` then lists the experiments).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import orjson

from .errors import CheckpointError, CheckpointWarning, NoCheckpointError, StoreConfigError
from .foreign import foreign_kind
from .formats import available_formats
from .layout import Location, StepSpec, split_step_url
from .manifest import Manifest
from .plugins import PluginError
from .storage import parse_storage_options


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def _common(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "url", type=_url, help="experiment folder, step folder or root (path or fsspec URL)"
    )
    sp.add_argument("--experiment", help="experiment sub-directory under the root")
    sp.add_argument(
        "--storage-options",
        type=_json_dict,
        default=None,
        help='fsspec options as JSON, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'',
    )


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ckptstore", description="Inspect and manage ckptstore checkpoints.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    sp = _command(sub, "list", "committed checkpoints by step; broken ones; or the experiments")
    sp.add_argument("--json", action="store_true", help="one JSON object per line")
    sp = _command(sub, "verify", "re-read files against the manifest; exit 1 if anything is bad")
    sp.add_argument("--step", default=None, help="N, latest (default) or all")
    sp.add_argument("--json", action="store_true")
    sp = _command(sub, "inspect", "manifest, files, tensor shapes and dtypes")
    sp.add_argument("--step", default=None, help="N or latest (default)")
    sp.add_argument("--json", action="store_true")
    sp = _command(sub, "prune", "delete old checkpoints (never the newest verified one)")
    sp.add_argument("--keep-last", type=_positive, required=True, metavar="K")
    sp.add_argument("--keep-every", type=_positive, default=None, metavar="N")
    sp.add_argument("--dry-run", action="store_true", help="say what would go; delete nothing")
    sp = _command(sub, "export", "the whole state (or --key entries) as torch.save or safetensors")
    sp.add_argument("--step", default=None, help="N or latest (default)")
    sp.add_argument(
        "--out",
        required=True,
        help="output file (written atomically; through a link, the file it names), or a FIFO, a "
        "character device or - (standard output), written into",
    )
    sp.add_argument(
        "--key", action="append", default=None, help="an entry to export (repeat; default: all)"
    )
    sp.add_argument(
        "--format",
        choices=("torch", "safetensors"),
        default=None,
        help="torch.save or safetensors (default: from the --out suffix, else torch)",
    )
    _import_command(sub)
    sp = _command(sub, "lock", "who writes this experiment (the one-writer lock)")
    sp.add_argument("--break", dest="break_", action="store_true", help="remove the lock")
    return p


def _import_command(sub: Any) -> None:
    sp = sub.add_parser(
        "import",
        help="a torch.save, DCP, safetensors, Lightning or Hugging Face Trainer checkpoint as a "
        "verified ckptstore checkpoint",
    )
    sp.add_argument("source", help="the foreign checkpoint: a file or folder (path or fsspec URL)")
    sp.add_argument("url", help="the experiment folder to import into (path or fsspec URL)")
    sp.add_argument("--experiment", help="experiment sub-directory under URL")
    sp.add_argument("--step", type=_step_number, default=None, help="step to save it as")
    sp.add_argument(
        "--format",
        choices=available_formats(),
        default="torch",
        help="the checkpoint format to write it in: one of the registry's (default torch)",
    )
    sp.add_argument("--overwrite", action="store_true", help="replace that step if it exists")
    sp.add_argument(
        "--rewind",
        action="store_true",
        help="import below the experiment's latest step (it becomes the latest: a resume goes "
        "back to it)",
    )
    sp.add_argument(
        "--into-run",
        action="store_true",
        help="import into an experiment that holds a run's checkpoints (the import becomes its "
        "newest: the run's next resume loads it)",
    )
    sp.add_argument(
        "--storage-options", type=_json_dict, default=None, help="fsspec options of URL"
    )
    sp.add_argument(
        "--source-storage-options", type=_json_dict, default=None, help="fsspec options of SOURCE"
    )
    sp.add_argument("--json", action="store_true", help="the report as one JSON object")


def _command(sub: Any, name: str, help: str) -> argparse.ArgumentParser:
    sp: argparse.ArgumentParser = sub.add_parser(name, help=help)
    _common(sp)
    return sp


def _url(text: str) -> str:
    if not text.strip():  # '' would be this folder, or / on some stores: never what was meant
        raise argparse.ArgumentTypeError("the URL is empty: give a folder or fsspec URL")
    return text


def _json_dict(text: str) -> dict[str, Any]:
    try:
        return parse_storage_options(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _step_number(text: str) -> int:
    from .layout import check_step

    try:
        return check_step(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step number (0, 1, 2, ...)") from None


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _step(args: argparse.Namespace, url_step: int | None) -> int | str:
    """The step a command means: --step, else the step folder the URL names, else latest."""
    if args.step is None:
        return "latest" if url_step is None else url_step
    try:
        spec = StepSpec.parse(args.step)
    except ValueError as e:
        raise _UsageError(f"--step: {e}") from None
    if spec.path is not None:
        raise _UsageError(f"--step must be a step number or 'latest', got {args.step!r}")
    return "latest" if spec.step is None else spec.step


def _open(args: argparse.Namespace, **kw: Any) -> tuple[Any, int | None]:
    """The store, and the step the URL itself names (URL = .../step-00001234)."""
    from .store import CheckpointStore

    url, step = split_step_url(args.url)
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


def _table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def _nothing(store: Any) -> NoCheckpointError:
    """No checkpoint here: say whether the folder exists or holds experiments instead."""
    local = store.local_path or ""
    if os.path.isfile(local):  # a torch.save, safetensors or Lightning file: say how to import
        kind, foreign = foreign_kind(store.url, store._storage_options)
        if kind:
            return NoCheckpointError(foreign)
    if os.path.exists(local) and not os.path.isdir(local):  # a file, a FIFO (never read), a device
        return NoCheckpointError(f"{store.url} is a file, not a folder of checkpoints")
    exps = store.experiments()
    if exps:
        more = f" and {len(exps) - 10} more" if len(exps) > 10 else ""
        return NoCheckpointError(
            f"no checkpoints directly in {store.url}: it holds experiments "
            f"{', '.join(exps[:10])}{more}; name one, e.g. {store.url.rstrip('/')}/{exps[0]}"
        )
    if not store.primary.storage.exists(store.primary.root):
        return NoCheckpointError(f"{store.url} does not exist: no checkpoints there")
    _, foreign = foreign_kind(store.url, store._storage_options)
    return NoCheckpointError(foreign or f"no checkpoints in {store.url}")


def _or_nothing(store: Any, step: int | str, fn: Callable[[int | str], Any]) -> Any:
    """``fn(step)``; for "latest" with nothing there, say where the checkpoints may be."""
    try:
        return fn(step)
    except NoCheckpointError:
        if step != "latest":
            raise
        raise _nothing(store) from None


# -- list ------------------------------------------------------------------------------------
def cmd_list(args: argparse.Namespace) -> int:
    store, _ = _open(args)
    scan = store.scan()
    if not scan.checkpoints and not scan.broken and not scan.newer:
        return _list_experiments(store, args.json)
    (_list_json if args.json else _list_table)(scan)
    for line in scan.problems():
        print(f"ckptstore: cannot be trusted: {line}", file=sys.stderr)
    _explain_pointer(scan, args.url)
    return 1 if scan.problems() else 0


def _dangling(scan: Any) -> bool:
    """`latest` names a step folder that is gone (removed by hand, say), and a committed
    checkpoint is left for "latest" to fall back to: harmless, and repairable."""
    gone = scan.pointer not in {*scan.checkpoints, *scan.broken, *scan.incomplete, *scan.newer}
    return (
        bool(scan.pointer_problem) and scan.pointer is not None and gone and scan.head is not None
    )


def _explain_pointer(scan: Any, url: str) -> None:
    """One line on stderr when `latest` dangles: what "latest" means meanwhile, how to mend it."""
    if _dangling(scan):
        print(
            f"ckptstore: note: latest names step {scan.pointer}, whose folder is gone: every "
            f'load and resume of "latest" takes step {scan.head}, the newest committed '
            f"checkpoint; `ckptstore prune {url} --keep-last K` (or the next save) rewrites the "
            "pointer",
            file=sys.stderr,
        )


def _list_json(scan: Any) -> None:
    for step in sorted({*scan.checkpoints, *scan.broken, *scan.newer}):
        m: Manifest | None = scan.checkpoints.get(step)
        if m is None:
            why = scan.broken.get(step) or scan.newer[step]
            row: dict[str, Any] = {"step": step, "ok": False, "problem": why}
        else:
            row = {"step": step, "ok": True, "url": m.url, "format": m.format, "time": m.time}
            row |= {"bytes": m.bytes, "world_size": m.world_size, "metadata": m.metadata}
        sys.stdout.write(orjson.dumps({**row, "latest": step == _latest(scan)}).decode() + "\n")


def _latest(scan: Any) -> int | None:
    """What load("latest") takes (the newest commit), or the step a bad pointer names (a
    broken one: the table says so), or the newest one a newer ckptstore wrote."""
    if scan.newer_latest_step is not None:
        return int(scan.newer_latest_step)
    return scan.pointer if scan.pointer_problem and scan.pointer is not None else scan.head


def _list_table(scan: Any) -> None:
    rows = [("step", "time", "format", "size", "world", "metadata")]
    for step in sorted({*scan.checkpoints, *scan.broken, *scan.newer}):
        mark = " (latest)" if step == _latest(scan) else ""
        m: Manifest | None = scan.checkpoints.get(step)
        if step in scan.newer:
            rows.append((f"{step}{mark}", "NEWER", "-", "-", "-", "needs a newer ckptstore"))
            continue
        if m is None:
            rows.append((f"{step}{mark}", "BROKEN", "-", "-", "-", scan.broken[step][:80]))
            continue
        meta = orjson.dumps(m.metadata).decode()
        meta = meta if len(meta) <= 60 else meta[:57] + "..."
        rows.append(
            (f"{step}{mark}", _when(m.time), m.format, _human(m.bytes), str(m.world_size), meta)
        )
    _table(rows)


def _list_experiments(store: Any, as_json: bool) -> int:
    names = store.experiments()
    if not names:
        raise _nothing(store)
    rows = [("experiment", "latest", "step folders", "url")]
    for name in names:
        loc = Location(store.primary.storage, store.primary.path(name))
        latest, _ = loc.read_pointer()
        row = (name, "-" if latest is None else str(latest), str(len(loc.step_dirs())), loc.url)
        if as_json:
            keys = ("experiment", "latest", "step_folders", "url")
            sys.stdout.write(orjson.dumps(dict(zip(keys, row, strict=True))).decode() + "\n")
        rows.append(row)
    if not as_json:
        print(f"no checkpoints directly in {store.url}; it holds {len(names)} experiment(s):")
        _table(rows)
    return 0


# -- verify ----------------------------------------------------------------------------------
def cmd_verify(args: argparse.Namespace) -> int:
    store, url_step = _open(args)
    if args.step != "all":
        return _verify_one(store, _step(args, url_step), args.json)
    scan = store.scan()
    steps = sorted({*scan.checkpoints, *scan.broken, *scan.newer})
    if not steps:
        raise _nothing(store)
    bad = sum(_report(store.verify(s), args.json) for s in steps)
    for s in scan.incomplete:
        print(f"INCOMPLETE step {s}: no manifest.json: an interrupted save, not a checkpoint")
    if scan.pointer_problem:
        print(f"BAD {scan.pointer_problem}")
    _explain_pointer(scan, args.url)
    return 1 if bad or scan.pointer_problem else 0


def _verify_one(store: Any, step: int | str, as_json: bool) -> int:
    code = _report(_or_nothing(store, step, store.verify), as_json)
    if step == "latest":
        _explain_pointer(store.scan(), store.url)
    return code


def _report(report: Any, as_json: bool) -> int:
    if as_json:
        out = orjson.dumps(report, option=orjson.OPT_SERIALIZE_DATACLASS).decode()
        sys.stdout.write(out + "\n")
        return 0 if report.ok else 1
    print(report.summary())
    for f in report.files:
        why = "" if f.ok else f": {f.problem}"
        print(f"  {'ok ' if f.ok else 'BAD'} {f.path} ({f.size} bytes){why}")
    return 0 if report.ok else 1


# -- inspect, prune, export ------------------------------------------------------------------
def cmd_inspect(args: argparse.Namespace) -> int:
    store, url_step = _open(args)
    step = _step(args, url_step)
    info = _or_nothing(store, step, store.inspect)
    if step == "latest":
        _explain_pointer(store.scan(), args.url)
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
    with store:
        if not store.scan().checkpoints:
            raise _nothing(store)
        done = store.pruning(dry_run=args.dry_run)
        _repair_pointer(store, dry_run=args.dry_run)
    verb, keep = ("would delete", "would keep") if args.dry_run else ("deleted", "kept")
    listed = f": steps {', '.join(map(str, done.deleted))}" if done.deleted else ""
    print(f"{verb} {len(done.deleted)} checkpoint(s){listed}")
    print(f"{keep} {len(done.kept)}:")
    for step, why in done.kept.items():
        print(f"  step {step}: {why}")
    return 0


def _repair_pointer(store: Any, *, dry_run: bool) -> None:
    """A `latest` whose step folder is gone names the newest committed checkpoint again (what
    "latest" meant meanwhile). Prune is a writer: it holds the experiment's lock here."""
    scan = store.scan()
    if not _dangling(scan):
        return
    if dry_run:
        print(
            f"would rewrite latest (it names step {scan.pointer}, whose folder is gone) to "
            f"step {scan.head}, the newest committed checkpoint"
        )
        return
    store.primary.write_pointer(scan.head)
    print(
        f"rewrote latest: it named step {scan.pointer}, whose folder is gone; it names step "
        f"{scan.head} now, the newest committed checkpoint"
    )


def cmd_export(args: argparse.Namespace) -> int:
    from .exporting import check_out, export_checkpoint, export_format

    try:
        export_format(args.out, args.format)
    except ValueError as e:
        raise _UsageError(str(e)) from None
    try:
        target = check_out(args.out)
    except ValueError as e:
        raise _UsageError(f"--out {e}") from None
    store, url_step = _open(args)
    step = _step(args, url_step)
    keys = list(_or_nothing(store, step, store.inspect)["types"])
    store.close()
    missing = [k for k in args.key or () if k not in keys]
    if missing:
        raise _UsageError(
            f"checkpoint has no entry {', '.join(map(repr, missing))}; choose with --key from: "
            f"{', '.join(keys)}"
        )
    report = export_checkpoint(
        split_step_url(args.url)[0],
        args.out,
        step=step,
        keys=args.key,
        format=args.format,
        experiment=args.experiment,
        storage_options=args.storage_options,
    )
    print(report.summary(), file=sys.stderr if target.stdout else sys.stdout)
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from .importing import import_checkpoint

    report = import_checkpoint(
        args.source,
        args.url,
        step=args.step,
        experiment=args.experiment,
        format=args.format,
        storage_options=args.storage_options,
        source_storage_options=args.source_storage_options,
        overwrite=args.overwrite,
        rewind=args.rewind,
        into_run=args.into_run,
    )
    if args.json:
        f = report.foreign
        row = {"source": f.source, "kind": f.kind, "step": report.manifest.step, "url": report.url}
        row |= {"took": f.took, "left": f.left, "missing": f.missing}
        row |= {"bytes": report.manifest.bytes}
        sys.stdout.write(orjson.dumps(row).decode() + "\n")
    else:
        print(report.summary())
    return 0


# -- lock ------------------------------------------------------------------------------------
def cmd_lock(args: argparse.Namespace) -> int:
    from .lock import break_lock, holder_alive, read_lock, takeover_reason, whoami

    loc = Location.open(split_step_url(args.url)[0], args.experiment, args.storage_options)
    _lockable(loc)
    if args.break_:
        removed = break_lock(loc.storage, loc.root)
        print(f"removed the writer lock of {loc.url}" if removed else f"{loc.url}: not locked")
        return 0
    try:
        current = read_lock(loc.storage, loc.root)
    except IsADirectoryError:
        raise NoCheckpointError(
            f"{loc.url}: its writer.lock is a folder, not a lock file; if no run writes it, "
            "remove that folder"
        ) from None
    if current is None:
        print(f"{loc.url}: not locked (no run writes it)")
        return 0
    holder, now = current[0], time.time()
    reason = takeover_reason(holder, whoami(now, holder.lease_s), now, holder_alive)
    state = f"stale: a new writer takes it over ({reason})" if reason else "held by a live writer"
    print(f"{loc.url}: written by {holder.describe(now)}; lease {holder.lease_s:.0f} s; {state}")
    return 0


def _lockable(loc: Location) -> None:
    """An experiment folder, or one line saying what ``loc`` is instead ("not locked" of a
    typo would read as "free to start")."""
    if not loc.storage.exists(loc.root):
        raise NoCheckpointError(f"{loc.url} does not exist: no experiment there, nothing to lock")
    if os.path.isfile(loc.storage.local_path(loc.root) or ""):
        raise NoCheckpointError(f"{loc.url} is a file, not an experiment folder")
    exps = [] if loc.step_dirs() else loc.experiments()
    if exps:  # a root: the experiments below it hold the locks
        raise NoCheckpointError(
            f"{loc.url} holds experiments, not a writer lock: name one, e.g. "
            f"ckptstore lock {loc.url.rstrip('/')}/{exps[0]}"
        )


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "list": cmd_list,
    "verify": cmd_verify,
    "inspect": cmd_inspect,
    "prune": cmd_prune,
    "export": cmd_export,
    "import": cmd_import,
    "lock": cmd_lock,
}


def main(argv: Sequence[str] | None = None) -> int:
    with warnings.catch_warnings():
        # A skipped checkpoint is one line already (the ckptstore logger, on stderr): no second
        # copy in Python's warning format. Any other warning: one line, without a source line.
        warnings.simplefilter("ignore", CheckpointWarning)
        warnings.showwarning = lambda msg, *_, **__: print(
            f"ckptstore: warning: {msg}", file=sys.stderr
        )
        try:
            return _main(argv)
        except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback per thread
            print("ckptstore: interrupted", file=sys.stderr)
            return 130


def _main(argv: Sequence[str] | None) -> int:
    try:
        args = _parser().parse_args(argv)
        from .store import check_plugins

        check_plugins()  # a broken plugin: one line before any work
        code = _COMMANDS[args.cmd](args)
        sys.stdout.flush()  # a closed pipe shows here, not as a message at interpreter exit
        return code
    except _UsageError as e:
        print(f"ckptstore: error: {e} (see ckptstore --help)", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left early (`| head -1`): quiet, as SIGPIPE would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush
        return 141
    except ValueError as e:  # bad option values found by the store's validation
        print(f"ckptstore: error: {e}", file=sys.stderr)
        return 2
    except (PluginError, StoreConfigError) as e:  # a setting: a retry cannot help
        print(f"ckptstore: error: {e}", file=sys.stderr)
        return 2
    except (CheckpointError, OSError) as e:
        print(f"ckptstore: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
