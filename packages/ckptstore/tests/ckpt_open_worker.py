"""Reads a ckptstore checkpoint with standard tools only, or (``save-dcp``) writes one from a
rank of a gloo job. Run by tests/test_open_formats.py.

    python ckpt_open_worker.py read-safetensors FILE EXPECTED
    python ckpt_open_worker.py read-dcp STEP_DIR EXPECTED        # under RANK/WORLD_SIZE: gloo
    python ckpt_open_worker.py save-dcp ROOT                     # under RANK/WORLD_SIZE: gloo
    python ckpt_open_worker.py exec FILE                         # run FILE (a README snippet)

The readers first make ``ckptstore`` unimportable (a finder ahead of all others refuses the
name), so a read that needed it would fail: the proof that a user who uninstalled
ckptstore still reads its checkpoints. ``EXPECTED`` is a plain ``torch.save`` file of the state
as nested dicts (what ``CheckpointStore.read()`` returned when it was written).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from typing import Any


class _Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, *args: Any, **kwargs: Any) -> None:
        if name == "ckptstore" or name.startswith("ckptstore."):
            raise ImportError(f"{name} is not installed here (the test removed it)")
        return


def block_ckptstore() -> None:
    # A finder first in line, not a shorter sys.path: installed as a wheel (nox, CI), ckptstore
    # shares site-packages with the readers' own packages (safetensors, numpy), and dropping that
    # folder would take them too.
    for name in [m for m in sys.modules if m == "ckptstore" or m.startswith("ckptstore.")]:
        del sys.modules[name]
    sys.meta_path.insert(0, _Refuse())
    try:
        importlib.util.find_spec("ckptstore")
    except ImportError:
        return
    raise SystemExit("could not make ckptstore unimportable")


def flat_tensors(node: Any, prefix: str = "") -> dict[str, Any]:
    """Tensors of a nested state under DCP's dotted names."""
    import torch

    if isinstance(node, torch.Tensor):
        return {prefix: node}
    out: dict[str, Any] = {}
    items = (
        node.items()
        if isinstance(node, dict)
        else enumerate(node)
        if isinstance(node, list)
        else ()
    )
    for k, v in items:
        out.update(flat_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def blank(node: Any) -> Any:
    """The same structure with zeroed tensors and placeholder values (what a user's fresh
    objects hold before dcp.load fills them)."""
    import torch

    if isinstance(node, torch.Tensor):
        return torch.zeros_like(node)
    if isinstance(node, dict):
        return {k: blank(v) for k, v in node.items()}
    if isinstance(node, list):
        return [blank(v) for v in node]
    return None


def read_safetensors(path: str, expected_path: str) -> None:
    import json

    import torch
    from ckpt_helpers import assert_same_state  # beside this script; it imports no ckptstore
    from safetensors import safe_open
    from safetensors.torch import load_file

    expected = torch.load(expected_path, weights_only=True)
    got = load_file(path)
    with safe_open(path, framework="pt") as f:
        meta = json.loads(f.metadata()["ckptstore"])
    for name, real in meta["dtypes"].items():  # dtypes safetensors cannot name: raw bytes
        got[name] = got[name].view(getattr(torch, real["dtype"])).view(real["shape"])
    assert_same_state({"all": flat_tensors(expected)}, {"all": got})
    assert meta["tree"]["step"] == expected["step"], meta["tree"]["step"]
    print(f"OK {len(got)} tensors")


def read_dcp(step_dir: str, expected_path: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from ckpt_helpers import assert_same_state  # beside this script; it imports no ckptstore

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    try:
        expected = torch.load(expected_path, weights_only=True)
        state = blank(expected)
        dcp.load(state, storage_reader=dcp.FileSystemReader(step_dir))
        assert_same_state(expected, state)
    finally:
        if world > 1:
            dist.destroy_process_group()
    print(f"OK rank {os.environ.get('RANK', '0')} of {world}")


def save_dcp(root: str) -> None:
    import torch
    import torch.distributed as dist

    from ckptstore import CheckpointStore

    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)  # the same state on every rank, as under DDP
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5))
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(3, 6)).sum().backward()
        opt.step()
        state = {"model": model, "optim": opt, "step": 11}
        with CheckpointStore(root, format="dcp") as store:
            store.save(11, state)
            _, values = store.read(11)  # every rank reads: a load is collective
            if dist.get_rank() == 0:
                torch.save(values, os.path.join(root, "expected.pt"))
    finally:
        dist.destroy_process_group()


def main() -> None:
    mode, *args = sys.argv[1:]
    if mode == "save-dcp":
        save_dcp(*args)
        return
    block_ckptstore()
    if mode == "exec":
        with open(args[0]) as f:
            exec(compile(f.read(), args[0], "exec"), {"__name__": "__snippet__"})
        print("OK snippet")
        return
    {"read-safetensors": read_safetensors, "read-dcp": read_dcp}[mode](*args)


if __name__ == "__main__":
    main()
