"""Python half of bench/gpu.sh: data, bounded training runs, their figures (MFU, start-up in
parts, the kernels each ran), the deterministic resume checks, checkpoint timing from GPU memory,
the one table.

    python bench/gpu.py corpus PATH [--docs N]            a generated parquet corpus
    python bench/gpu.py train METRICS (--steps N | --to-end) --log L -- ARGS
                                                          pyrecover-train ARGS, SIGKILLed once
                                                          step N is logged (no final save)
    python bench/gpu.py mfu METRICS.jsonl OUT.json ...    MFU, tokens/s, start-up, kernels of a run
    python bench/gpu.py startup METRICS.jsonl OUT.json    the start-up of a (resumed) run, in parts
    python bench/gpu.py same-steps OUT.json --steps 4 5 A.jsonl B.jsonl
                                                          the same losses and grad norms, bitwise?
    python bench/gpu.py resume-check OUT.json --work D --steps N --every E --kills K -- ARGS
                                                          a straight run vs the same run
                                                          SIGKILLed K times and resumed: bitwise?
    python bench/gpu.py fits --model-size 8b --bytes-per-param 8 OUT.json [--where DIR ...]
                                                          would the preset train on this GPU (and
                                                          where does its checkpoint fit)?
    python bench/gpu.py ckpt OUT.json [--model-size 1b]   async save blocking from GPU memory
    python bench/gpu.py build OUT.json [--model-size 350m] a resume's model: init + load vs meta
    python bench/gpu.py drop-cache DIR | last-step EXPDIR | note OUT.json ...
    python bench/gpu.py summary DIR                       DIR/*.json -> the one table (table.md),
                                                          DIR/gpu.json

Start-up is measured from outside too: ``train`` notes when it launched the process
(``METRICS.launch``), so the first step's event is timed from the launch as a requeue meets it,
beside the trainer's own parts (its ``startup`` event).
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
    if metrics.parent.is_dir():  # the start-up seen from outside (a run's own results folder)
        Path(f"{metrics}.launch").write_text(repr(time.time()))
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


def train(args: list[str], metrics: str, log: str, steps: int | None, timeout: float) -> int:
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
    metrics: str,
    out: str,
    skip: int,
    label: str,
    extra: dict[str, Any],
    *,
    smi: str | None = None,
    exclude: tuple[int, ...] = (),
    log: str | None = None,
    trace: str | None = None,
) -> int:
    """Medians over the step events after step ``skip`` (compilation and warm-up excluded) but
    ``exclude`` (a profiled step); the start-up; the attention kernel and determinism the log
    names; the kernels of the profiled step (``trace``: torch.profiler's chrome trace)."""
    events = _events(Path(metrics))
    steps = [e for e in _steps(events) if e["step"] > skip and e["step"] not in exclude]
    if not steps:
        print(f"{metrics}: no step events after step {skip}: did the run fail? see its log")
        return 1
    mfus = [e["mfu"] for e in steps if e.get("mfu") is not None]
    start: dict[str, Any] = next((e for e in events if e.get("event") == "start"), {})
    data = {
        "label": label,
        "steps_used": [e["step"] for e in steps],
        "mfu_median": statistics.median(mfus) if mfus else None,
        "tokens_per_s_per_gpu_median": statistics.median(e["tokens_per_s_per_rank"] for e in steps),
        "step_time_s_median": statistics.median(e["step_time_s"] for e in steps),
        "params": start.get("params"),
        "model": start.get("model"),
        "device": start.get("device"),
        "gpu": _gpu_name(),
        "gpu_memory_used_max_mib": _max_memory_mib(smi),
        "attention": _log_line(log, "attention: "),
        "determinism": _log_line(log, "deterministic "),
        "startup": _startup(events, metrics),
        "kernels": kernels(trace) if trace else None,
        **extra,
    }
    Path(out).write_text(json.dumps(data, indent=2))
    m = data["mfu_median"]
    print(
        f"{label}: {data['tokens_per_s_per_gpu_median']:,.0f} tokens/s per GPU, "
        f"MFU {'n/a (no GPU peak known)' if m is None else f'{m * 100:.1f}%'}; "
        f"attention: {data['attention']}"
    )
    return 0


def _steps(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == "step"]


def _gpu_name() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except (ImportError, RuntimeError):
        return None


def _log_line(log: str | None, prefix: str) -> str | None:
    """The rest of the first log line (after its time and level) that starts with ``prefix``."""
    if not log or not Path(log).exists():
        return None
    for line in Path(log).read_text(errors="replace").splitlines():
        at = line.find(prefix)
        if at >= 0 and (at == 0 or line[at - 1] == " "):
            return line[at + len(prefix) :].strip() if prefix.endswith(": ") else line[at:].strip()
    return None


def _startup(events: list[dict[str, Any]], metrics: str) -> dict[str, Any]:
    """The trainer's start-up parts (its ``startup`` event) and, from outside, the seconds from
    the process's launch to its first step's event."""
    own = next((e for e in events if e.get("event") == "startup"), {})
    first = next(iter(_steps(events)), None)
    launch = Path(f"{metrics}.launch")
    launched = float(launch.read_text()) if launch.exists() else None
    resumed = next((e for e in events if e.get("event") == "resume"), {})
    return {
        "seconds": own.get("seconds"),
        "parts": own.get("parts"),
        "since": own.get("since"),
        "first_step_after_launch_s": (
            first["time"] - launched if first is not None and launched is not None else None
        ),
        "resumed_from": resumed.get("reason"),
    }


# Kernel names -> what they do (first match wins; matched lower-case).
KERNEL_KINDS = (
    ("attention: flash", ("flash",)),
    ("attention: memory-efficient", ("fmha", "efficient_attention", "mem_eff")),
    ("attention: cuDNN", ("cudnn", "sdpa")),
    ("attention: math softmax", ("softmax",)),
    ("index / scatter / sort", ("index", "scatter", "radix", "sort", "embedding")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "sm90_", "sm80_")),
    ("NCCL", ("nccl",)),
    ("copy", ("memcpy", "memset", "copy")),
    ("fused elementwise (triton)", ("triton",)),
    ("reduction / elementwise", ("reduce", "elementwise", "vectorized")),
)


def kernels(trace: str, top: int = 12) -> dict[str, Any]:
    """GPU kernel time of a torch.profiler chrome trace: the top kernels and each kind's share."""
    events = json.loads(Path(trace).read_text()).get("traceEvents", [])
    by_name: dict[str, float] = {}
    for e in events:
        if e.get("cat") == "kernel" and isinstance(e.get("dur"), (int, float)):
            by_name[e["name"]] = by_name.get(e["name"], 0.0) + float(e["dur"])
    total = sum(by_name.values()) or 1.0
    kinds: dict[str, float] = {}
    for name, us in by_name.items():
        kind = next(
            (k for k, keys in KERNEL_KINDS if any(x in name.lower() for x in keys)), "other"
        )
        kinds[kind] = kinds.get(kind, 0.0) + us
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {
        "kernel_ms": total / 1e3,
        "top": [{"name": n[:120], "ms": us / 1e3, "share": us / total} for n, us in ranked],
        "kinds": {k: us / total for k, us in sorted(kinds.items(), key=lambda kv: -kv[1])},
    }


def startup(metrics: str, out: str, label: str, extra: dict[str, Any], log: str | None) -> int:
    """The start-up of one run (a requeue's resume), in the trainer's parts and from outside."""
    events = _events(Path(metrics))
    data = {"label": label, "startup": _startup(events, metrics), "gpu": _gpu_name(), **extra}
    data["attention"] = _log_line(log, "attention: ")
    Path(out).write_text(json.dumps(data, indent=2))
    up = data["startup"]
    parts = ", ".join(f"{k} {v:.1f} s" for k, v in (up["parts"] or {}).items())
    print(
        f"{label}: first step {up['seconds']} s after the process start ({parts}); "
        f"{up['first_step_after_launch_s']} s after the launch"
    )
    return 0 if up["parts"] else 1


def same_steps(out: str, steps: list[int], a: str, b: str, label: str) -> int:
    """The steps' losses and grad norms in two runs' metrics, bitwise equal? (Also the saves of
    the first: the checkpoint's size and time.)"""
    runs = [{e["step"]: e for e in _steps(_events(Path(m)))} for m in (a, b)]
    missing = [s for s in steps for r in runs if s not in r]
    if missing:
        Path(out).write_text(json.dumps({"label": label, "failed": f"steps {missing} missing"}))
        print(f"{label}: steps {sorted(set(missing))} were not logged by both runs")
        return 1
    keys = ("loss", "grad_norm")
    pairs = {s: {k: [r[s].get(k) for r in runs] for k in keys} for s in steps}
    same = all(x == y for p in pairs.values() for x, y in p.values())
    saves = [e for e in _events(Path(a)) if e.get("event") == "saved"]
    data = {"label": label, "bitwise": same, "steps": pairs, "saves": saves, "gpu": _gpu_name()}
    Path(out).write_text(json.dumps(data, indent=2))
    print(f"{label}: steps {steps}: {'BITWISE EQUAL' if same else 'DIFFERENT'} {pairs}")
    return 0


def note(out: str, label: str, *, skipped: str | None, failed: str | None, log: str | None) -> int:
    """A stage that did not run (out of time) or failed: its row in the table says so."""
    tail = (
        Path(log).read_text(errors="replace").splitlines()[-20:]
        if log and Path(log).exists()
        else []
    )
    why = {"skipped": skipped} if skipped else {"failed": failed or "?"}
    Path(out).write_text(json.dumps({"label": label, **why, "log_tail": tail}, indent=2))
    return 0


_STORED = {16: "fp32 weights, grads, AdamW moments", 8: "bf16 weights, grads, AdamW moments"}


def _preset_params(size: str) -> int:
    from pyrecover_train.model import preset_config

    return preset_config(size, vocab_size=50304, max_seq_len=2048).num_params()


def fits(
    size: str, out: str, bytes_per_param: int, ckpt_bytes_per_param: int, where: list[str]
) -> int:
    """Does the preset's weights + grads + AdamW state (fp32: 16 bytes a parameter; bf16
    weights: 8) take less than 85% of the device memory (the rest for activations)? With
    ``where``: the first of those folders with room for its checkpoint, printed last ("skip:
    ..." when it does not fit anywhere); exit 0 then, the answer is that line."""
    import torch

    params = _preset_params(size)
    need = params * bytes_per_param
    total, on = (
        (torch.cuda.mem_get_info()[1], torch.cuda.get_device_name(0))
        if (torch.cuda.is_available())
        else (0, "no GPU")
    )
    ok = need == 0 or need < 0.85 * total
    stored = _STORED.get(bytes_per_param, "weights, grads, AdamW moments")
    why = (
        f"{size}: {params / 1e9:.2f}B parameters x {bytes_per_param} bytes ({stored}) "
        f"= {need / 2**30:.0f} GiB {'<' if ok else '>='} 85% of {total / 2**30:.0f} GiB on {on}"
    )
    disk = params * ckpt_bytes_per_param * 1.15
    room = [d for d in where if Path(d).is_dir() and shutil.disk_usage(d).free > disk]
    data = {
        "model_size": size,
        "bytes_per_param": bytes_per_param,
        "fits": ok,
        "why": why,
        "checkpoint_gib": disk / 1.15 / 2**30,
        "checkpoint_dir": room[0] if room else None,
    }
    Path(out).write_text(json.dumps(data, indent=2))
    print(("fits: " if ok else "does not fit, skipped: ") + why)
    if not where:
        return 0 if ok else 1
    if not ok:
        print(f"skip: {why}")
    elif not room:
        print(f"skip: no room for a {disk / 2**30:.0f} GiB checkpoint in {' '.join(where)}")
    else:
        print(room[0])
    return 0


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


def ckpt(
    out: str, size: str, device: str, shape: tuple[int, int], scratch: str | None, call: str
) -> int:
    """An async save from GPU memory as pyrecover-train makes it, side by side with torch.save:
    one training step alone, then the same step right after an overlapped save (save() ->
    forward + backward beside the copies -> staged() -> optimizer step): the caller is blocked
    for the difference. Also ckptstore's default async save (its snapshot before save()
    returns) and the first async save of a process (the pinned buffer: reported apart)."""

    from ckptstore import CheckpointStore

    model, opt, nbytes = _state(size, device)
    step = _trainer_step(model, opt, device, shape)
    folder = tempfile.mkdtemp(prefix="gpu-ckpt-", dir=scratch)
    samples: dict[str, list[float]] = {}
    try:
        with CheckpointStore(os.path.join(folder, "store"), keep_last=1) as store:
            state = {"model": model, "optim": opt, "step": 0}
            step()
            step()  # warm: kernels, the allocator
            first = _timed(lambda: store.save(0, state, blocking=False).result(), device)
            for k in (1, 3):  # one round: two saves
                for name, seconds in _ckpt_round(store, state, step, k, device).items():
                    samples.setdefault(name, []).append(seconds)
                samples.setdefault("torch.save+fsync", []).append(
                    _timed(lambda: _torch_save(model, opt, folder), device)
                )
                gc.collect()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return _ckpt_report(out, size, device, nbytes, first, samples, call)


def _trainer_step(model: Any, opt: Any, device: str, shape: tuple[int, int]) -> Any:
    """One step as pyrecover-train takes it (bf16 autocast, the LM loss, fused AdamW), with
    its ``before_update`` hook: where an overlapped save's staged() waits."""
    import torch

    from pyrecover_train.precision import resolve_precision
    from pyrecover_train.step import lm_loss

    batch, seq = shape
    vocab = model.cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(device)
    precision = resolve_precision("bf16", torch.device(device))

    def step(before_update: Any = lambda: None) -> None:
        with precision.autocast(torch.device(device)):
            logits = model(tokens[:, :-1])
        lm_loss(logits, tokens[:, 1:]).backward()
        before_update()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)

    return step


def _ckpt_round(
    store: Any, state: dict[str, Any], step: Any, k: int, device: str
) -> dict[str, float]:
    out = {"step alone": _timed(step, device)}
    model = state["model"]
    probe = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.ndim == 1}
    t0 = time.perf_counter()
    handle = store.save(k, {**state, "step": k}, blocking=False, overlap=True)
    out["overlapped: save() returns"] = time.perf_counter() - t0
    step(handle.staged)
    out["overlapped: step with the save"] = time.perf_counter() - t0
    handle.result()
    out["overlapped: until durable"] = time.perf_counter() - t0
    out["overlapped: the checkpoint holds the state at save()"] = float(
        _holds(store, k, probe, model)
    )
    t0 = time.perf_counter()
    handle = store.save(k + 1, {**state, "step": k + 1}, blocking=False)
    _sync(device)  # its device-to-host copies, queued on the training stream
    out["snapshot at save(): blocking"] = time.perf_counter() - t0
    handle.result()
    return out


def _holds(store: Any, step: int, probe: dict[str, Any], model: Any) -> bool:
    """The saved norm weights are the values at save(), and the step after it changed them:
    the overlapped snapshot was taken before the optimizer step, on the GPU too."""
    import torch

    _, saved = store.read(step, keys=["model"])
    now = dict(model.named_parameters())
    kept = all(torch.equal(saved["model"][n], t) for n, t in probe.items())
    moved = any(not torch.equal(now[n].detach().cpu(), t) for n, t in probe.items())
    return kept and moved


def _timed(fn: Any, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _torch_save(model: Any, opt: Any, folder: str) -> None:
    import torch

    path = os.path.join(folder, "plain.pt")
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    os.remove(path)


def _ckpt_report(
    out: str,
    size: str,
    device: str,
    nbytes: int,
    first: float,
    samples: dict[str, list[float]],
    call: str,
) -> int:
    med = {k: statistics.median(v) for k, v in samples.items()}
    blocked = med["overlapped: step with the save"] - med["step alone"]
    base = med["torch.save+fsync"]
    ratios = {
        "async_blocking_share_of_torch_save": max(blocked, 0.0) / base,
        "snapshot_at_save_share_of_torch_save": med["snapshot at save(): blocking"] / base,
    }
    gb = nbytes / 1e9
    print_table(
        f"async save from {device} memory, {size}: {gb:.1f} GB "
        f"(median of {len(samples['step alone'])})",
        ["candidate", "seconds"],
        [[k, f"{v:.3f}"] for k, v in med.items()]
        + [["overlapped: the caller blocked", f"{blocked:.3f}"]],
    )
    print_table("ratios", ["figure", "value"], [[k, f"{v:.4f}"] for k, v in ratios.items()])
    data = {
        "model_size": size,
        "device": device,
        "gpu": _gpu_name(),
        "state_gb": gb,
        "median_s": med,
        "overlapped_blocked_s": blocked,
        "ratios": ratios,
        "first_async_s": first,
        "samples_s": samples,
        "call": call,
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
    from ckptstore import CheckpointStore

    model, opt, nbytes = _state(size, device)
    scratch = tempfile.mkdtemp(prefix="gpu-build-", dir=scratch_parent)
    try:
        with CheckpointStore(os.path.join(scratch, "store")) as store:
            store.save(1, {"model": model, "optim": opt})
            del model, opt
            gc.collect()
            samples = _build_rounds(size, store, device, repeats)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    med = {k: statistics.median(v[1:] or v) for k, v in samples.items()}
    old, new = med["initialised, then loaded: total"], med["meta, materialised by the load: total"]
    print_table(
        f"a resume's model build + load, {size} ({nbytes / 1e9:.1f} GB with AdamW) on {device}, "
        f"median of {repeats}",
        ["candidate: part", "seconds"],
        [[k, f"{v:.2f}"] for k, v in med.items()],
    )
    print(
        f"meta-device build + load: {old / new:.2f}x as fast as init + load ({old:.2f} s -> "
        f"{new:.2f} s)"
    )
    data = {
        "model_size": size,
        "device": device,
        "gpu": _gpu_name(),
        "machine": machine(),
        "state_gb": nbytes / 1e9,
        "repeats": repeats,
        "median_s": med,
        "speedup_meta_vs_init": old / new,
        "samples_s": samples,
    }
    Path(out).write_text(json.dumps(data, indent=2))
    return 0


def _build_rounds(size: str, store: Any, device: str, repeats: int) -> dict[str, list[float]]:
    """The two builds, interleaved; the first round warms up (page cache, allocator)."""
    import torch

    from pyrecover_train.model import GPT, empty_model, materialise, preset_config

    cfg = preset_config(size, vocab_size=50304, max_seq_len=2048)

    def initialised() -> Any:
        with torch.device(device):
            m = GPT(cfg)
        m.init_weights(0)
        return m

    def from_meta() -> Any:
        m = empty_model(cfg)
        materialise(m, device, seed=None)
        return m

    samples: dict[str, list[float]] = {}
    builds = (
        ("initialised, then loaded", initialised),
        ("meta, materialised by the load", from_meta),
    )
    for _ in range(repeats + 1):
        for name, build in builds:
            for part, seconds in _resume_once(build, store, device).items():
                samples.setdefault(f"{name}: {part}", []).append(seconds)
            gc.collect()
    return samples


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


# -- the one table ------------------------------------------------------------------------------


def summary(folder: str) -> int:
    """DIR/*.json -> one table (printed, and DIR/table.md for the README), DIR/gpu.json."""
    root = Path(folder)
    parts = {
        p.stem: json.loads(p.read_text())
        for p in sorted(root.glob("*.json"))
        if p.stem not in ("gpu", "env") and not p.stem.startswith("fits")
    }
    rows = _det_rows(parts) + _startup_rows(parts) + _big_rows(parts) + _fsdp_rows(parts)
    rows += _ckpt_rows(parts) + _resume_rows(parts) + _note_rows(parts)
    header = ["what", "measured", "target", ""]
    print_table(f"GPU results ({_gpu_of(parts)})", header, rows)
    md = ["| " + " | ".join(header) + " |", "|---|---|---|---|"]
    md += ["| " + " | ".join(str(c).replace("|", "/") for c in r) + " |" for r in rows]
    (root / "table.md").write_text("\n".join(md) + "\n")
    payload = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(), **parts}
    (root / "gpu.json").write_text(json.dumps(payload, indent=2, default=str))
    print(f"wrote {root / 'table.md'} and {root / 'gpu.json'}")
    return 0


def _gpu_of(parts: dict[str, Any]) -> str:
    names = sorted({str(d["gpu"]) for d in parts.values() if d.get("gpu")})
    return ", ".join(names) or "no GPU"


def _met(value: float | None, target: float, higher: bool) -> str:
    if value is None:
        return ""
    return "met" if (value >= target if higher else value <= target) else "**not met**"


def _run(parts: dict[str, Any], prefix: str) -> dict[str, Any] | None:
    return next((d for k, d in parts.items() if k.startswith(prefix) and "mfu_median" in d), None)


def _tps(d: dict[str, Any]) -> str:
    m = d.get("mfu_median")
    return f"{d['tokens_per_s_per_gpu_median']:,.0f} tok/s" + (
        "" if m is None else f", MFU {m:.1%}"
    )


def _same_call(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.get("call") is not None and a.get("call") == b.get("call")


def _kernel_note(d: dict[str, Any]) -> str:
    k = d.get("kernels") or {}
    kinds = ", ".join(f"{n} {v:.0%}" for n, v in list((k.get("kinds") or {}).items())[:4])
    return f"attention: {d.get('attention') or '?'}" + (f"; kernel time: {kinds}" if kinds else "")


def _size(d: dict[str, Any]) -> str:
    return str(d.get("label", "?")).split(":")[0].rsplit("-", 1)[-1]


def _det_rows(parts: dict[str, Any]) -> list[list[str]]:
    on, off = _run(parts, "det-on"), _run(parts, "det-off")
    rows = [
        [f"{_size(d)} {name}", _tps(d), "", _kernel_note(d)]
        for name, d in (("default", off), ("--deterministic", on))
        if d is not None
    ]
    if on and off:
        ratio, text = _ratio(on, off)
        rows.append([f"{_size(on)} --deterministic / default", text, ">= 0.85x"])
        rows[-1].append(_met(ratio, 0.85, True))
    return rows


def _ratio(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, str]:
    """a's tokens/s over b's, and whether they ran side by side (one call: one machine)."""
    ratio = a["tokens_per_s_per_gpu_median"] / b["tokens_per_s_per_gpu_median"]
    side = "side by side" if _same_call(a, b) else "NOT the same call"
    return ratio, f"{ratio:.2f}x ({side})"


def _startup_rows(parts: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, d in parts.items():
        up = d.get("startup") or {}
        if not name.startswith("startup") or not up.get("parts"):
            continue
        text = ", ".join(f"{k} {v:.1f}" for k, v in up["parts"].items())
        outside = up.get("first_step_after_launch_s")
        seen = "" if outside is None else f"; {outside:.1f} s from the launch"
        rows.append(
            [
                f"start-up, {d['label']}",
                f"{up['seconds']:.1f} s ({text}){seen}",
                "<= 15 s",
                _met(up["seconds"], 15.0, False),
            ]
        )
    return rows


def _big_rows(parts: dict[str, Any]) -> list[list[str]]:
    rows = []
    if (d := _run(parts, "8b-mfu")) is not None:
        m = d.get("mfu_median")
        up = (d.get("startup") or {}).get("seconds")
        rows.append(
            [
                "8b, bf16 weights + activation checkpointing, compile",
                _tps(d) + ("" if up is None else f"; resumed: first step after {up:.0f} s"),
                ">= 45% MFU",
                _met(m, 0.45, True),
            ]
        )
    if (r := parts.get("8b-det-resume")) and "bitwise" in r:
        saves = r.get("saves") or []
        ckpt = (
            ""
            if not saves
            else (f"checkpoint {saves[0]['bytes'] / 1e9:.0f} GB in {saves[0]['total_s']:.0f} s; ")
        )
        verdict = "bitwise equal" if r["bitwise"] else "DIFFERENT"
        rows.append(
            [
                f"8b --deterministic, {r['label'].split(': ', 1)[-1]}",
                f"{ckpt}steps {', '.join(map(str, r['steps']))}: {verdict}",
                "bitwise",
                "met" if r["bitwise"] else "**not met**",
            ]
        )
    return rows


def _fsdp_rows(parts: dict[str, Any]) -> list[list[str]]:
    fsdp, ddp = _run(parts, "fsdp"), _run(parts, "det-off")
    if fsdp is None:
        return []
    rows = [[f"{_size(fsdp)} FSDP2 (world size 1)", _tps(fsdp), "", ""]]
    if ddp is not None:
        rows.append([f"{_size(fsdp)} FSDP2 / DDP path", _ratio(fsdp, ddp)[1], "", ""])
    return rows


def _ckpt_rows(parts: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, d in parts.items():
        if not name.startswith("ckpt") or "ratios" not in d:
            continue
        med, share = d["median_s"], d["ratios"]["async_blocking_share_of_torch_save"]
        exact = med.get("overlapped: the checkpoint holds the state at save()") == 1.0
        rows.append(
            [
                f"async save of the {d['model_size']} state ({d['state_gb']:.0f} GB), overlapped",
                f"blocks {d['overlapped_blocked_s']:.3f} s = {share:.1%} of torch.save "
                f"({med['torch.save+fsync']:.1f} s); snapshot at save(): "
                f"{d['ratios']['snapshot_at_save_share_of_torch_save']:.1%}; the checkpoint "
                f"{'holds' if exact else 'DOES NOT hold'} the state at save()",
                "<= 5%",
                _met(share, 0.05, False),
            ]
        )
    return rows


def _resume_rows(parts: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, d in parts.items():
        if name.startswith("resume") and "bitwise" in d:
            verdict = (
                "bitwise equal"
                if d["bitwise"]
                else (f"DIFFERENT: {d['model_tensors_differing']}/{d['model_tensors']} tensors")
            )
            target = "differs (control)" if "default" in name else "bitwise"
            ok = d["bitwise"] != ("default" in name)
            rows.append(
                [
                    f"resume check {name}",
                    f"killed after {d['killed_at_steps']}: {verdict}",
                    target,
                    "met" if ok else "**not met**",
                ]
            )
    return rows


def _note_rows(parts: dict[str, Any]) -> list[list[str]]:
    return [
        [name, "skipped" if "skipped" in d else "FAILED", "", d.get("skipped") or d["failed"]]
        for name, d in parts.items()
        if "skipped" in d or "failed" in d
    ]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench/gpu.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("corpus")
    c.add_argument("path")
    c.add_argument("--docs", type=int, default=4000)
    t = sub.add_parser("train", help="pyrecover-train ARGS, SIGKILLed once step N is logged")
    t.add_argument("metrics")
    until = t.add_mutually_exclusive_group(required=True)
    until.add_argument("--steps", type=int)
    until.add_argument("--to-end", action="store_true", help="to its last step (and its save)")
    t.add_argument("--log", required=True)
    t.add_argument("--timeout", type=float, default=600)
    m = sub.add_parser("mfu")
    m.add_argument("metrics")
    m.add_argument("out")
    m.add_argument("--skip", type=int, default=10, help="ignore steps up to this one (compile)")
    m.add_argument("--exclude", type=int, action="append", default=[], help="a profiled step")
    m.add_argument("--label", default="pyrecover-train")
    m.add_argument("--extra", default="{}", help="JSON object merged into the result")
    m.add_argument("--smi", default=None, help="nvidia-smi memory log of the run")
    m.add_argument("--log", default=None, help="the run's output (the attention line)")
    m.add_argument("--trace", default=None, help="torch.profiler chrome trace of a step")
    u = sub.add_parser("startup")
    u.add_argument("metrics")
    u.add_argument("out")
    u.add_argument("--label", default="startup")
    u.add_argument("--extra", default="{}")
    u.add_argument("--log", default=None)
    q = sub.add_parser("same-steps")
    q.add_argument("out")
    q.add_argument("a")
    q.add_argument("b")
    q.add_argument("--steps", type=int, nargs="+", required=True)
    q.add_argument("--label", default="same steps")
    r = sub.add_parser("resume-check", help="straight vs SIGKILLed + resumed, bitwise?")
    r.add_argument("out")
    r.add_argument("--work", required=True, help="scratch folder (removed after)")
    r.add_argument("--steps", type=int, default=30)
    r.add_argument("--every", type=int, default=5)
    r.add_argument("--kills", type=int, default=2)
    r.add_argument("--timeout", type=float, default=600, help="per run")
    f = sub.add_parser("fits")
    f.add_argument("--model-size", default="8b")
    f.add_argument("--bytes-per-param", type=int, default=16, help="16: fp32, 8: bf16 weights")
    f.add_argument("--checkpoint-bytes-per-param", type=int, default=0)
    f.add_argument("--where", nargs="*", default=[], help="folders for its checkpoint")
    f.add_argument("out")
    _measurements(sub)
    return ap


def _measurements(sub: Any) -> None:
    """The sub-commands that measure (each a figure of the table) and the helpers."""
    k = sub.add_parser("ckpt")
    k.add_argument("out")
    k.add_argument("--model-size", default="1b")
    k.add_argument("--batch", type=int, default=8)
    k.add_argument("--seq", type=int, default=2048)
    k.add_argument("--dir", default=None, help="scratch directory on the disk to measure")
    k.add_argument("--device", default="cuda")
    k.add_argument("--call", default="")
    b = sub.add_parser("build", help="a resume's model: init + load vs meta + load")
    b.add_argument("out")
    b.add_argument("--model-size", default="350m")
    b.add_argument("--device", default="cpu")
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--dir", default=None, help="scratch directory on the disk to measure")
    d = sub.add_parser("drop-cache", help="evict a folder's files from the page cache")
    d.add_argument("folder")
    ls = sub.add_parser("last-step", help="the latest step of an experiment folder")
    ls.add_argument("folder")
    n = sub.add_parser("note", help="a row for a stage that did not run or failed")
    n.add_argument("out")
    n.add_argument("--label", required=True)
    n.add_argument("--skipped", default=None)
    n.add_argument("--failed", default=None)
    n.add_argument("--log", default=None)
    s = sub.add_parser("summary")
    s.add_argument("folder")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # train / resume-check: pyrecover-train's own flags follow a "--".
    cut = argv.index("--") if "--" in argv else len(argv)
    args, rest = _parser().parse_args(argv[:cut]), argv[cut + 1 :]
    return _dispatch(args, rest)


def _dispatch(a: argparse.Namespace, rest: list[str]) -> int:  # noqa: PLR0911 - one per command
    if a.cmd == "corpus":
        corpus(a.path, a.docs)
        return 0
    if a.cmd == "train":
        return train(rest, a.metrics, a.log, None if a.to_end else a.steps, a.timeout)
    if a.cmd == "mfu":
        opts = {"smi": a.smi, "exclude": tuple(a.exclude), "log": a.log, "trace": a.trace}
        return mfu(a.metrics, a.out, a.skip, a.label, json.loads(a.extra), **opts)
    if a.cmd == "startup":
        return startup(a.metrics, a.out, a.label, json.loads(a.extra), a.log)
    if a.cmd == "same-steps":
        return same_steps(a.out, a.steps, a.a, a.b, a.label)
    if a.cmd == "resume-check":
        return resume_check(a.out, a.work, rest, a.steps, a.every, a.kills, a.timeout)
    if a.cmd == "fits":
        return fits(a.model_size, a.out, a.bytes_per_param, a.checkpoint_bytes_per_param, a.where)
    if a.cmd == "ckpt":
        return ckpt(a.out, a.model_size, a.device, (a.batch, a.seq), a.dir, a.call)
    if a.cmd == "build":
        return build_resume(a.out, a.model_size, a.device, a.repeats, a.dir)
    if a.cmd == "drop-cache":
        _drop_cache(a.folder)
        return 0
    if a.cmd == "last-step":
        return last_step(a.folder)
    if a.cmd == "note":
        return note(a.out, a.label, skipped=a.skipped, failed=a.failed, log=a.log)
    return summary(a.folder)


def last_step(folder: str) -> int:
    from ckptstore import CheckpointStore

    where = Path(folder)
    with CheckpointStore(str(where.parent), experiment=where.name, distributed=False) as store:
        print(store.latest_step())
    return 0


if __name__ == "__main__":
    sys.exit(main())
