"""Python half of bench/gpu.sh: data, bounded training runs, the deterministic resume check,
checkpoint timing from GPU memory, summaries.

    python bench/gpu.py corpus PATH [--docs N]            a generated parquet corpus
    python bench/gpu.py train METRICS --steps N --log L -- ARGS
                                                          pyrecover-train ARGS, SIGKILLed once
                                                          step N is logged (no final save)
    python bench/gpu.py mfu METRICS.jsonl OUT.json ...    MFU, tokens/s and start-up of a run
    python bench/gpu.py resume-check OUT.json --work D --steps N --every E --kills K -- ARGS
                                                          a straight run vs the same run
                                                          SIGKILLed K times and resumed: bitwise?
    python bench/gpu.py fits --model-size 8b --bytes-per-param 16 OUT.json
                                                          would the preset train on this GPU?
    python bench/gpu.py ckpt OUT.json [--model-size 1b] [--repeats 2] [--dir D] [--device cuda]
    python bench/gpu.py summary DIR                       DIR/*.json -> DIR/gpu.json + a table

Start-up: a run's ``start`` event carries the process start (or, on SLURM, the allocation start
when the trainer records it); the first ``step`` event's time minus it is the time from launch to
the first finished step (imports, data, model, compile, resume, the step itself).

The checkpoint timing builds the trainer's model (``--model-size``) and fused AdamW state on the
device, then measures side by side, interleaved, ``--repeats`` rounds after a warm-up async save
(its blocking time, which includes allocating the pinned snapshot buffer, is reported apart):
torch.save of the state dicts + fsync (the baseline), ckptstore sync save (durable), ckptstore
async save (how long the caller is blocked -- until save() returns and the GPU's snapshot
copies are done -- and until durable), then cold loads (page cache evicted): torch.load +
load_state_dict vs ckptstore's verified load.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table  # noqa: E402


def corpus(path: str, docs: int) -> None:
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    rnd = random.Random(0)
    words = ["the", "king", "queen", "night", "day", "sword", "crown", "heart", "love", "death"]
    texts = [
        " ".join(rnd.choice(words) for _ in range(rnd.randint(200, 2000))) + "."
        for _ in range(docs)
    ]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": texts}), path)
    print(f"wrote {path}: {docs} documents")


# -- bounded runs -----------------------------------------------------------------------------


def _events(metrics: Path, start: int = 0) -> list[dict[str, Any]]:
    """The metrics file's events after line ``start`` (a line being written is skipped)."""
    if not metrics.exists():
        return []
    return [e for e in map(_parse, metrics.read_bytes().splitlines()[start:]) if e is not None]


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        return dict(json.loads(line))
    except ValueError:
        return None


def _last_step(metrics: Path, start: int = 0) -> int:
    steps = [e["step"] for e in _events(metrics, start) if e.get("event") == "step"]
    return max(steps, default=0)


def _line_count(path: Path) -> int:
    return len(path.read_bytes().splitlines()) if path.exists() else 0


def run_until(
    args: list[str],
    metrics: Path,
    log: Path,
    *,
    step: int | None,
    timeout: float,
    delay: float = 0.0,
) -> tuple[int, int]:
    """``python -m pyrecover_train ARGS``, SIGKILLed ``delay`` seconds after this run logged a
    step >= ``step`` (None: runs to its end). Returns (exit status: 0 when the step was reached
    or the run finished, 124 past ``timeout``, else the run's; the last step this run logged)."""
    start = _line_count(metrics)
    with log.open("a") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pyrecover_train", *args], stdout=out, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None:
                if step is not None and _last_step(metrics, start) >= step:
                    time.sleep(delay)  # somewhere in the next step, or in a save
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
                    return 0, _last_step(metrics, start)
                if time.monotonic() > deadline:
                    return 124, _last_step(metrics, start)
                time.sleep(0.01)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return proc.returncode, _last_step(metrics, start)


def train(args: list[str], metrics: str, log: str, steps: int, timeout: float) -> int:
    rc, last = run_until(args, Path(metrics), Path(log), step=steps, timeout=timeout)
    if rc:
        print(f"pyrecover-train exit {rc} at step {last} (see {log})")
    return rc


# -- the deterministic resume check ------------------------------------------------------------


def _final(root: Path) -> tuple[Any, dict[str, Any]]:
    from ckptstore import CheckpointStore

    with CheckpointStore(str(root), experiment="check") as store:
        return store.read("latest")


def compare_states(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Which tensors of two checkpoints differ, and by how much (model weights)."""
    import torch

    from pyrecover_train.state import tensors_equal

    keys = ("model", "optim", "sched", "data", "rng", "step")
    differ = {k: tensors_equal(a[k], b[k]) for k in keys}
    model = a["model"]
    diffs = [
        float((model[n].double() - b["model"][n].double()).abs().max())
        for n in model
        if isinstance(model[n], torch.Tensor) and model[n].shape == b["model"][n].shape
    ]
    return {
        "bitwise": not any(differ.values()),
        "model_tensors": len(model),
        "model_tensors_differing": len(differ["model"]),
        "differing": {k: v[:10] for k, v in differ.items() if v},
        "model_max_abs_diff": max(diffs, default=0.0),
    }


def resume_check(
    out: str, work: str, args: list[str], steps: int, every: int, kills: int, timeout: float
) -> int:
    """A straight run of ``steps`` steps vs the same run SIGKILLed ``kills`` times at random
    moments (mid-step or mid-save) and resumed from its latest checkpoint: compared bitwise."""
    root = Path(work)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    common = [*args, "--training-steps", str(steps), "--checkpoint-frequency", str(every)]
    common += ["--experiment-name", "check", "--keep-last", "2", "--log-every", "1"]
    rnd = random.Random(0)
    straight, killed = root / "straight", root / "killed"
    t0 = time.perf_counter()
    for name in ("straight", "killed"):  # the metrics go to the log folder: kept with the runs
        (root / name).mkdir()
    rc, _ = run_until(
        [*common, "--checkpoint-dir", str(straight)],
        straight / "check" / "metrics.jsonl",
        root / "straight.log",
        step=None,
        timeout=timeout,
    )
    if rc:
        return _failed(out, f"the straight run exited {rc}", root / "straight.log")
    resume = [*common, "--checkpoint-dir", str(killed), "--resume-from-checkpoint", "latest"]
    metrics, log = killed / "check" / "metrics.jsonl", root / "killed.log"
    kill_steps = []
    for k in range(kills):
        at = _last_step(metrics) + rnd.randint(every + 1, 2 * every)
        if at > steps - 2:
            return _failed(out, f"--steps {steps} leaves no room for kill {k + 1} at {at}", log)
        delay = rnd.uniform(0.0, _step_seconds(metrics))
        rc, last = run_until(resume, metrics, log, step=at, timeout=timeout, delay=delay)
        if rc or last >= steps:
            return _failed(out, f"killed run {k + 1} exited {rc} at step {last}", log)
        kill_steps.append(last)
    rc, _ = run_until(resume, metrics, log, step=None, timeout=timeout)
    if rc:
        return _failed(out, f"the resumed run exited {rc}", log)
    (_, want), (manifest, got) = _final(straight), _final(killed)
    result = {
        "args": args,
        "steps": steps,
        "checkpoint_every": every,
        "killed_at_steps": kill_steps,
        "resumed_to": manifest.step,
        **compare_states(want, got),
        "seconds": time.perf_counter() - t0,
    }
    Path(out).write_text(json.dumps(result, indent=2))
    verdict = "BITWISE EQUAL" if result["bitwise"] else "DIFFERENT"
    print(
        f"resume check {Path(out).stem}: straight vs killed after steps {kill_steps} + "
        f"resumed: {verdict} ({result['model_tensors_differing']}/{result['model_tensors']} "
        f"weight tensors differ, max abs diff {result['model_max_abs_diff']:.3g})"
    )
    shutil.rmtree(root, ignore_errors=True)
    return 0


def _step_seconds(metrics: Path) -> float:
    """The last logged step time (0.05 s before any): the kill lands within the next step."""
    times = [e["step_time_s"] for e in _events(metrics) if e.get("event") == "step"]
    return float(times[-1]) if times else 0.05


def _failed(out: str, why: str, log: Path) -> int:
    tail = log.read_text(errors="replace").splitlines()[-20:] if log.exists() else []
    Path(out).write_text(json.dumps({"failed": why, "log_tail": tail}, indent=2))
    print(f"resume check failed: {why}; last lines of {log}:\n" + "\n".join(tail[-5:]))
    return 1


# -- measurements ------------------------------------------------------------------------------


def _max_memory_mib(smi_csv: str | None) -> float | None:
    """Highest ``memory.used`` in an ``nvidia-smi --query-gpu=memory.used --format=csv`` log."""
    if not smi_csv or not Path(smi_csv).exists():
        return None
    used = []
    for line in Path(smi_csv).read_text().splitlines():
        for cell in line.split(","):
            cell = cell.strip()
            if cell.endswith("MiB") and cell[:-3].strip().isdigit():
                used.append(float(cell[:-3]))
                break
    return max(used) if used else None


def mfu(
    metrics: str, out: str, skip: int, label: str, extra: dict[str, Any], smi: str | None = None
) -> int:
    """Medians over the step events after step ``skip`` (compilation and warm-up excluded)."""
    events = [json.loads(line) for line in Path(metrics).read_text().splitlines() if line.strip()]
    steps = [e for e in events if e.get("event") == "step" and e.get("step", 0) > skip]
    if not steps:
        print(f"{metrics}: no step events after step {skip}: did the run fail? see its log")
        return 1
    mfus = [e["mfu"] for e in steps if e.get("mfu") is not None]
    start: dict[str, Any] = next((e for e in events if e.get("event") == "start"), {})
    first = next(e for e in events if e.get("event") == "step")
    began = start.get("allocation_start") or start.get("process_start")
    data = {
        "label": label,
        "steps_used": [e["step"] for e in steps],
        "mfu_median": statistics.median(mfus) if mfus else None,
        "tokens_per_s_per_gpu_median": statistics.median(e["tokens_per_s_per_rank"] for e in steps),
        "step_time_s_median": statistics.median(e["step_time_s"] for e in steps),
        "params": start.get("params"),
        "model": start.get("model"),
        "device": start.get("device"),
        "gpu_memory_used_max_mib": _max_memory_mib(smi),
        # Start-up: launch (allocation) -> the start event (set-up done) -> the first step done.
        "startup_setup_s": None if began is None else start["time"] - began,
        "startup_to_first_step_s": None if began is None else first["time"] - began,
        # ... and as the trainer measured it, in parts (its `startup` event)
        "startup_parts": next((e for e in events if e.get("event") == "startup"), None),
        **extra,
    }
    Path(out).write_text(json.dumps(data, indent=2))
    m = data["mfu_median"]
    print(
        f"{label}: {data['tokens_per_s_per_gpu_median']:,.0f} tokens/s per GPU, "
        f"MFU {'n/a (no GPU peak known)' if m is None else f'{m * 100:.1f}%'}"
    )
    return 0


_STORED = {16: "fp32 weights, grads, AdamW moments", 8: "bf16 weights, grads, AdamW moments"}


def _preset_params(size: str) -> int:
    from pyrecover_train.model import preset_config

    return preset_config(size, vocab_size=50304, max_seq_len=2048).num_params()


def fits(size: str, out: str, bytes_per_param: int = 16) -> int:
    """Exit 0 when the preset's weights + grads + AdamW state (fp32: 16 bytes a parameter; bf16
    weights: 8) take less than 85% of the device memory (the rest for activations), else 1."""
    import torch

    params = _preset_params(size)
    need = params * bytes_per_param
    if torch.cuda.is_available():
        total = torch.cuda.mem_get_info()[1]
        where = torch.cuda.get_device_name(0)
    else:
        total, where = 0, "no GPU"
    ok = need < 0.85 * total
    stored = _STORED.get(bytes_per_param, "weights, grads, AdamW moments")
    why = (
        f"{size}: {params / 1e9:.2f}B parameters x {bytes_per_param} bytes ({stored}) "
        f"= {need / 2**30:.0f} GiB {'<' if ok else '>='} 85% of {total / 2**30:.0f} GiB on {where}"
    )
    data = {"model_size": size, "bytes_per_param": bytes_per_param, "fits": ok, "why": why}
    Path(out).write_text(json.dumps(data, indent=2))
    print(("fits: " if ok else "does not fit, skipped: ") + why)
    return 0 if ok else 1


# -- checkpoints from GPU memory ---------------------------------------------------------------


def _state(size: str, device: str) -> tuple[Any, Any, int]:
    import torch

    from pyrecover_train.build import decay_params
    from pyrecover_train.model import build_model, preset_config

    cfg = preset_config(size, vocab_size=50304, max_seq_len=2048)
    model = build_model(cfg, seed=0, device=device)
    fused = device.startswith("cuda")
    groups = [{"params": decay_params(model, d)} for d in (True, False)]  # the trainer's order
    opt = torch.optim.AdamW(groups, lr=1e-4, fused=fused)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()  # creates the moments
    opt.zero_grad(set_to_none=True)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
    return model, opt, nbytes


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _drop_cache(root: str) -> None:
    """Evict the files under ``root`` from the page cache (clean pages; no root needed)."""
    for d, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def ckpt(out: str, size: str, repeats: int, scratch_parent: str | None, device: str) -> int:
    import torch

    from ckptstore import CheckpointStore

    model, opt, nbytes = _state(size, device)
    gb = nbytes / 1e9
    print(f"state: {size} model + AdamW moments, {gb:.2f} GB on {device}")
    scratch = tempfile.mkdtemp(prefix="gpu-ckpt-", dir=scratch_parent)
    try:
        store = CheckpointStore(os.path.join(scratch, "store"), keep_last=1)
        state = {"model": model, "optim": opt, "step": 0}
        plain = os.path.join(scratch, "plain.pt")
        samples: dict[str, list[float]] = {}
        step = 0

        def record(name: str, seconds: float) -> None:
            samples.setdefault(name, []).append(seconds)

        # Warm-up: the first async save allocates and touches the pinned snapshot buffer once
        # per run (reported apart); the rounds after it are what every later save costs.
        t0 = time.perf_counter()
        store.save(0, state, blocking=False)
        _sync(device)
        first_async_block = time.perf_counter() - t0
        store.wait()
        for _ in range(repeats):
            # torch.save + fsync of the state dicts, as a training script would save them; its
            # cold load; then the file goes (the disk may hold only two copies of the state).
            t0 = time.perf_counter()
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, plain)
            fd = os.open(plain, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            record("torch.save+fsync", time.perf_counter() - t0)
            _drop_cache(scratch)
            t0 = time.perf_counter()
            loaded = torch.load(plain, map_location=device, weights_only=True)
            model.load_state_dict(loaded["model"])
            opt.load_state_dict(loaded["optim"])
            del loaded
            _sync(device)
            record("torch.load+load_state_dict (cold)", time.perf_counter() - t0)
            os.remove(plain)
            gc.collect()

            step += 1
            _sync(device)
            t0 = time.perf_counter()
            store.save(step, {**state, "step": step}, blocking=True)
            record("ckptstore sync", time.perf_counter() - t0)

            step += 1
            _sync(device)
            t0 = time.perf_counter()
            handle = store.save(step, {**state, "step": step}, blocking=False)
            returned = time.perf_counter() - t0
            # On CUDA save() returns once the device-to-host copies are queued; the training
            # stream runs them before the next step's kernels, so the step really waits until
            # they are done: that (returned + synchronize) is the honest blocking time.
            _sync(device)
            blocked = time.perf_counter() - t0
            store.wait()
            total = time.perf_counter() - t0
            record("ckptstore async: save() returns", returned)
            record("ckptstore async: blocking", blocked)
            record("ckptstore async: until durable", total)
            del handle

            _drop_cache(scratch)
            t0 = time.perf_counter()
            store.load(state)  # the latest: the async save just made durable
            _sync(device)
            record("ckptstore verified load (cold)", time.perf_counter() - t0)
        store.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in samples.items()}
    base_save, base_load = med["torch.save+fsync"], med["torch.load+load_state_dict (cold)"]
    ratios = {
        "sync_save_speedup_vs_torch_save": base_save / med["ckptstore sync"],
        "async_blocking_share_of_torch_save": med["ckptstore async: blocking"] / base_save,
        "verified_load_speed_vs_torch_load": base_load / med["ckptstore verified load (cold)"],
    }
    rows = [[k, f"{v:.2f}", f"{gb / v:.2f}"] for k, v in med.items()]
    print_table(
        f"checkpoint from {device} memory: {gb:.1f} GB, median of {repeats} interleaved rounds",
        ["candidate", "seconds", "GB/s"],
        rows,
    )
    print_table("ratios", ["figure", "value"], [[k, f"{v:.3f}"] for k, v in ratios.items()])
    data = {
        "model_size": size,
        "device": device,
        "state_gb": gb,
        "repeats": repeats,
        "median_s": med,
        "ratios": ratios,
        "first_async_blocking_s": first_async_block,
        "samples_s": samples,
    }
    Path(out).write_text(json.dumps(data, indent=2))
    return 0


# -- a resume's model: initialised then overwritten, or materialised from the checkpoint ------


def build_resume(out: str, size: str, device: str, repeats: int, scratch_parent: str | None) -> int:
    """What building the model costs on a resume, side by side, interleaved: as before (the
    model made on the device with torch's default init, then pyrecover-train's seeded init, then
    the checkpoint loaded over it) vs now (made on the meta device, given memory, filled by the
    checkpoint's load alone). Both then load the same checkpoint (model + AdamW, in place, the
    page cache warm for both); the model built, the optimizer, the load, and their sum."""
    import torch

    from ckptstore import CheckpointStore
    from pyrecover_train.model import GPT, empty_model, materialise, preset_config

    cfg = preset_config(size, vocab_size=50304, max_seq_len=2048)
    model, opt, nbytes = _state(size, device)
    scratch = tempfile.mkdtemp(prefix="gpu-build-", dir=scratch_parent)
    samples: dict[str, list[float]] = {}
    try:
        with CheckpointStore(os.path.join(scratch, "store")) as store:
            store.save(1, {"model": model, "optim": opt})
            del model, opt
            gc.collect()

            def initialised() -> Any:
                with torch.device(device):
                    m = GPT(cfg)
                m.init_weights(0)
                return m

            def from_meta() -> Any:
                m = empty_model(cfg)
                materialise(m, device, seed=None)
                return m

            for _ in range(repeats + 1):  # the first round warms up (page cache, allocator)
                for name, build in (
                    ("initialised, then loaded", initialised),
                    ("meta, materialised by the load", from_meta),
                ):
                    timed = _resume_once(build, store, device)
                    for part, seconds in timed.items():
                        samples.setdefault(f"{name}: {part}", []).append(seconds)
                    gc.collect()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    med = {k: statistics.median(v[1:] or v) for k, v in samples.items()}
    old, new = med["initialised, then loaded: total"], med["meta, materialised by the load: total"]
    rows = [[k, f"{v:.2f}"] for k, v in med.items()]
    print_table(
        f"a resume's model build + load, {size} ({nbytes / 1e9:.1f} GB with AdamW) on {device}, "
        f"median of {repeats}",
        ["candidate: part", "seconds"],
        rows,
    )
    print(
        f"meta-device build + load: {old / new:.2f}x as fast as init + load ({old:.2f} s -> "
        f"{new:.2f} s)"
    )
    data = {
        "model_size": size,
        "device": device,
        "state_gb": nbytes / 1e9,
        "repeats": repeats,
        "median_s": med,
        "speedup_meta_vs_init": old / new,
        "samples_s": samples,
    }
    Path(out).write_text(json.dumps(data, indent=2))
    return 0


def _resume_once(build: Any, store: Any, device: str) -> dict[str, float]:
    """One resume's model part: build, optimizer, load (in place, as pyrecover-train does)."""
    import torch

    from pyrecover_train.build import decay_params

    _sync(device)
    t0 = time.perf_counter()
    model = build()
    _sync(device)
    t1 = time.perf_counter()
    groups = [{"params": decay_params(model, d)} for d in (True, False)]
    opt = torch.optim.AdamW(groups, lr=1e-4, fused=device.startswith("cuda"))
    t2 = time.perf_counter()
    store.load({"model": model, "optim": opt}, 1)
    _sync(device)
    t3 = time.perf_counter()
    del model, opt
    return {"build": t1 - t0, "optimizer": t2 - t1, "load": t3 - t2, "total": t3 - t0}


# -- summary -----------------------------------------------------------------------------------


def summary(folder: str) -> int:
    root = Path(folder)
    parts = {
        p.stem: json.loads(p.read_text()) for p in sorted(root.glob("*.json")) if p.stem != "gpu"
    }
    rows: list[list[object]] = []
    for name, d in parts.items():
        if "mfu_median" in d:
            m = d["mfu_median"]
            up = d.get("startup_to_first_step_s")
            rows.append(
                [
                    d.get("label", name),
                    f"{d['tokens_per_s_per_gpu_median']:,.0f} tok/s/GPU",
                    ("n/a" if m is None else f"MFU {m * 100:.1f}%")
                    + ("" if up is None else f", first step {up:.0f} s after launch"),
                ]
            )
        elif "bitwise" in d:
            rows.append(
                [
                    f"resume check {name}",
                    f"killed after steps {d['killed_at_steps']}, resumed to {d['resumed_to']}",
                    "bitwise equal"
                    if d["bitwise"]
                    else f"DIFFERENT: {d['model_tensors_differing']}/{d['model_tensors']} "
                    f"weights, max {d['model_max_abs_diff']:.2g}",
                ]
            )
        elif "failed" in d:
            rows.append([name, "failed", d["failed"]])
        elif "ratios" in d:
            med = d["median_s"]
            rows.append(
                [
                    f"checkpoint {d['model_size']} ({d['state_gb']:.1f} GB)",
                    f"torch.save {med['torch.save+fsync']:.1f} s, sync {med['ckptstore sync']:.1f}"
                    f" s, async blocks {med['ckptstore async: blocking']:.2f} s",
                    f"async blocking {d['ratios']['async_blocking_share_of_torch_save'] * 100:.1f}%"
                    " of torch.save",
                ]
            )
            rows.append(
                [
                    "load (cold)",
                    f"torch.load {med['torch.load+load_state_dict (cold)']:.1f} s, ckptstore "
                    f"{med['ckptstore verified load (cold)']:.1f} s",
                    f"{d['ratios']['verified_load_speed_vs_torch_load']:.2f}x torch.load",
                ]
            )
        elif "fits" in d:
            rows.append([f"{d['model_size']} fits?", "yes" if d["fits"] else "no", d["why"]])
    figures = _figures(parts)
    rows += [[k, "side by side, same run", f"{v:.3f}"] for k, v in figures.items()]
    print_table("GPU results", ["what", "measured", "figure"], rows)
    payload = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        "figures": figures,
        **parts,
    }
    (root / "gpu.json").write_text(json.dumps(payload, indent=2, default=str))
    print(f"wrote {root / 'gpu.json'}")
    return 0


# Ratios of tokens/s per GPU, measured in the same gpu.sh run with the same shapes.
RATIOS = {
    "deterministic_tokens_per_s_vs_default": ("det-on", "det-off"),
    "fsdp_world1_tokens_per_s_vs_ddp": ("mfu-fsdp", "mfu-ddp"),
}


def _figures(parts: dict[str, Any]) -> dict[str, float]:
    out = {}
    for figure, (num, den) in RATIOS.items():
        a = next((d for k, d in parts.items() if k.startswith(num) and "mfu_median" in d), None)
        b = next((d for k, d in parts.items() if k.startswith(den) and "mfu_median" in d), None)
        if a and b:
            out[figure] = a["tokens_per_s_per_gpu_median"] / b["tokens_per_s_per_gpu_median"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/gpu.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("corpus")
    c.add_argument("path")
    c.add_argument("--docs", type=int, default=4000)
    m = sub.add_parser("mfu")
    m.add_argument("metrics")
    m.add_argument("out")
    m.add_argument("--skip", type=int, default=10, help="ignore steps up to this one (compile)")
    m.add_argument("--label", default="pyrecover-train")
    m.add_argument("--extra", default="{}", help="JSON object merged into the result")
    m.add_argument("--smi", default=None, help="nvidia-smi memory log of the run")
    f = sub.add_parser("fits")
    f.add_argument("--model-size", default="8b")
    f.add_argument("--bytes-per-param", type=int, default=16, help="16: fp32, 8: bf16 weights")
    f.add_argument("out")
    t = sub.add_parser("train", help="pyrecover-train ARGS, SIGKILLed once step N is logged")
    t.add_argument("metrics")
    t.add_argument("--steps", type=int, required=True)
    t.add_argument("--log", required=True)
    t.add_argument("--timeout", type=float, default=600)
    r = sub.add_parser("resume-check", help="straight vs SIGKILLed + resumed, bitwise?")
    r.add_argument("out")
    r.add_argument("--work", required=True, help="scratch folder (removed after)")
    r.add_argument("--steps", type=int, default=30)
    r.add_argument("--every", type=int, default=5)
    r.add_argument("--kills", type=int, default=2)
    r.add_argument("--timeout", type=float, default=600, help="per run")
    k = sub.add_parser("ckpt")
    k.add_argument("out")
    k.add_argument("--model-size", default="1b")
    k.add_argument("--repeats", type=int, default=2)
    k.add_argument("--dir", default=None, help="scratch directory on the disk to measure")
    k.add_argument("--device", default="cuda")
    b = sub.add_parser("build", help="a resume's model: init + load vs meta + load")
    b.add_argument("out")
    b.add_argument("--model-size", default="350m")
    b.add_argument("--device", default="cpu")
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--dir", default=None, help="scratch directory on the disk to measure")
    s = sub.add_parser("summary")
    s.add_argument("folder")
    argv = sys.argv[1:] if argv is None else list(argv)
    # train / resume-check: pyrecover-train's own flags follow a "--".
    cut = argv.index("--") if "--" in argv else len(argv)
    args, rest = ap.parse_args(argv[:cut]), argv[cut + 1 :]
    if args.cmd == "corpus":
        corpus(args.path, args.docs)
        return 0
    if args.cmd == "mfu":
        return mfu(args.metrics, args.out, args.skip, args.label, json.loads(args.extra), args.smi)
    if args.cmd == "fits":
        return fits(args.model_size, args.out, args.bytes_per_param)
    if args.cmd == "train":
        return train(rest, args.metrics, args.log, args.steps, args.timeout)
    if args.cmd == "resume-check":
        return resume_check(
            args.out, args.work, rest, args.steps, args.every, args.kills, args.timeout
        )
    if args.cmd == "ckpt":
        if args.repeats < 1:
            ap.error("--repeats must be >= 1")
        return ckpt(args.out, args.model_size, args.repeats, args.dir, args.device)
    if args.cmd == "build":
        return build_resume(args.out, args.model_size, args.device, args.repeats, args.dir)
    return summary(args.folder)


if __name__ == "__main__":
    sys.exit(main())
