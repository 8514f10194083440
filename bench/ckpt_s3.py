"""ckptstore on S3 (a real moto_server on 127.0.0.1), side by side with the usual ways.

The same GPT-2-shaped model + AdamW state as bench/ckpt.py, about ``--gb`` GB (default 0.5:
moto is slow, and DCP's reader slower), is saved and restored by every candidate, interleaved,
several times; medians are reported as MB/s and as ratios against DCP's fsspec writer/reader:

- save: ckptstore ('torch' and 'dcp' formats: parallel multipart upload, checksummed),
  DCP's FsspecWriter, and s3fs ``put`` of an already serialized torch.save file (its defaults);
- restore: ckptstore's verified load into the model and optimizer (one streaming GET per file),
  DCP's FsspecReader (then load_state_dict), and s3fs ``get`` of the torch.save file (defaults).

    python bench/ckpt_s3.py            # needs moto[server] and s3fs
    python bench/ckpt_s3.py --gb 0.05  # quick check
Writes bench/results/ckpt_s3.json and ckpt_s3.png.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import shutil
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch

warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from ckpt import build_state  # noqa: E402
from common import RESULTS, bar_chart, interleaved, median, print_table, write_results  # noqa: E402

from ckptstore import CheckpointStore  # noqa: E402

MB = 1e6


def load_s3server() -> Any:
    spec = importlib.util.spec_from_file_location("s3server", HERE.parent / "tools/s3server.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=0.5, help="state size in GB (default 0.5)")
    ap.add_argument("--repeats", type=int, default=2, help="measured rounds (after 1 warmup)")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = ap.parse_args()
    if args.gb <= 0 or args.repeats < 1:
        ap.error("--gb must be > 0 and --repeats >= 1")
    s3server = load_s3server()
    why = s3server.unavailable_reason()
    if why:
        sys.exit(f"bench/ckpt_s3.py: {why}")
    try:
        import s3fs
    except ImportError:
        sys.exit("bench/ckpt_s3.py: needs s3fs: pip install 'ckptstore[s3]'")
    scratch = tempfile.mkdtemp(prefix="bench-ckpt-s3-")
    try:
        with s3server.MotoServer() as server:
            server.make_bucket("bench")
            run(args, server, s3fs, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run(args: argparse.Namespace, server: Any, s3fs: Any, scratch: str) -> None:
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    opts = server.storage_options()
    fs = s3fs.S3FileSystem(**opts)
    model, opt, nbytes = build_state(args.gb)
    state = {"model": model, "optim": opt, "step": 0}
    print(f"state: {nbytes / 1e9:.2f} GB; moto_server pid {server.pid} at {server.endpoint_url}")

    def sd() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def wipe() -> None:
        """Remove what the last round wrote; the stores keep their writer locks (a store
        copes with a removed lock, but each removal is a warning)."""
        fs.invalidate_cache()
        for p in fs.find("bench"):
            if not p.endswith("/writer.lock"):
                fs.rm_file(p)
        gc.collect()

    local_pt = os.path.join(scratch, "model.pt")
    with open(local_pt, "wb") as f:
        torch.save(sd(), f)
    tag = uuid.uuid4().hex[:6]
    stores = {
        fmt: CheckpointStore(
            f"s3://bench/cs-{fmt}-{tag}", format=fmt, storage_options=opts, distributed=False
        )
        for fmt in ("torch", "dcp")
    }
    for store in stores.values():
        store.acquire()  # the writer lock exists from the start, and wipe() keeps it
    counter = [0]

    def cs_save(fmt: str) -> Any:
        def go() -> None:
            counter[0] += 1
            stores[fmt].save(counter[0], state)

        return go

    def dcp_writer() -> None:
        url = f"s3://bench/dcp-{uuid.uuid4().hex[:6]}"
        dcp_save(sd(), storage_writer=FsspecWriter(url, **opts))

    def s3fs_put() -> None:
        fs.put(local_pt, f"bench/put-{uuid.uuid4().hex}")

    saves = interleaved(
        {
            "DCP FsspecWriter": dcp_writer,
            "s3fs put (serialized file)": s3fs_put,
            "ckptstore torch": cs_save("torch"),
            "ckptstore dcp": cs_save("dcp"),
        },
        repeats=args.repeats,
        warmup=1,
        between=wipe,
    )
    base = median(saves["DCP FsspecWriter"])
    print_table(
        f"Save {nbytes / 1e9:.2f} GB to moto_server S3 (median of {args.repeats})",
        ["candidate", "seconds", "MB/s", "x DCP FsspecWriter"],
        [(k, median(v), nbytes / median(v) / MB, base / median(v)) for k, v in saves.items()],
    )

    # ---- restores: write each once, then read interleaved ---------------------------------
    wipe()
    dcp_url = f"s3://bench/dcp-restore-{tag}"
    dcp_save(sd(), storage_writer=FsspecWriter(dcp_url, **opts))
    fs.put(local_pt, "bench/restore.pt")
    last = {}
    for fmt, store in stores.items():
        counter[0] += 1
        store.save(counter[0], state)
        last[fmt] = counter[0]
    model2, opt2, _ = build_state(args.gb)
    state2 = {"model": model2, "optim": opt2, "step": None}

    def dcp_restore() -> None:
        target = {"model": model2.state_dict(), "optim": opt2.state_dict()}
        dcp_load(target, storage_reader=FsspecReader(dcp_url, **opts))
        model2.load_state_dict(target["model"])
        opt2.load_state_dict(target["optim"])

    def s3fs_get() -> None:
        out = os.path.join(scratch, "got.pt")
        fs.get("bench/restore.pt", out)
        os.unlink(out)

    def cs_load(fmt: str) -> Any:
        def go() -> None:
            stores[fmt].load(state2, step=last[fmt])

        return go

    loads = interleaved(
        {
            "DCP FsspecReader": dcp_restore,
            "s3fs get (file, defaults)": s3fs_get,
            "ckptstore torch (verified)": cs_load("torch"),
            "ckptstore dcp (verified)": cs_load("dcp"),
        },
        repeats=args.repeats,
        warmup=1,
        between=gc.collect,
    )
    lbase = median(loads["DCP FsspecReader"])
    print_table(
        f"Restore {nbytes / 1e9:.2f} GB from moto_server S3 (median of {args.repeats})",
        ["candidate", "seconds", "MB/s", "x DCP FsspecReader"],
        [(k, median(v), nbytes / median(v) / MB, lbase / median(v)) for k, v in loads.items()],
    )
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True)
    )
    for s in stores.values():
        s.close()
    out = Path(args.out) if args.out else RESULTS
    summary = {
        "save_vs_dcp_fsspec_writer": base / median(saves["ckptstore torch"]),
        "dcp_format_save_vs_dcp_fsspec_writer": base / median(saves["ckptstore dcp"]),
        "restore_vs_dcp_fsspec_reader": lbase / median(loads["ckptstore torch (verified)"]),
        "dcp_format_restore_vs_dcp_fsspec_reader": lbase
        / median(loads["ckptstore dcp (verified)"]),
    }
    write_results(
        "ckpt_s3",
        {
            "gb": nbytes / 1e9,
            "bytes": nbytes,
            "repeats": args.repeats,
            "save_seconds": saves,
            "restore_seconds": loads,
            "summary": summary,
        },
        out,
    )
    labels = [f"save: {k}" for k in saves] + [f"restore: {k}" for k in loads]
    values = [nbytes / median(v) / MB for v in saves.values()]
    values += [nbytes / median(v) / MB for v in loads.values()]
    bar_chart(
        out / "ckpt_s3.png",
        labels,
        values,
        title=f"{nbytes / 1e9:.2f} GB state, moto S3",
        ylabel="MB/s (higher is better)",
    )
    for k, v in summary.items():
        print(f"  {k}: {v:.3g}")
    t0 = time.perf_counter()
    wipe()
    print(f"(cleanup {time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
