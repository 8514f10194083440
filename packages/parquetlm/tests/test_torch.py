"""The PyTorch adapter keeps the exact state with and without DataLoader workers; ranks under a
real gloo process group read disjoint shards that cover the epoch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the adapter needs the [torch] extra")

from parquetlm import PackedLoader  # noqa: E402
from parquetlm.torch import PackedDataset, TorchLoader  # noqa: E402

TOKENS = np.arange(20_001, dtype=np.uint32)


def make(**kw: object) -> PackedLoader:
    return PackedLoader(TOKENS, seq_len=16, batch_size=3, seed=2, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("workers", [0, 2])
def test_adapter_yields_the_loader_stream_and_resumes_exactly(workers: int) -> None:
    reference = [torch.from_numpy(b) for b in make(world_size=2, rank=1).take(30)]
    first = TorchLoader(make(world_size=2, rank=1), num_workers=workers, pin_memory=False)
    got = list(first.take(12))
    assert first.step == 12 and first.position == 12 * 6
    state = json.loads(json.dumps(first.state_dict()))
    # Resume with the other worker count, on a fresh adapter: the stream goes on exactly.
    second = TorchLoader(make(world_size=2, rank=1), num_workers=2 - workers)
    second.load_state_dict(state)
    got += list(second.take(18))
    assert len(got) == 30
    for a, b in zip(got, reference, strict=True):
        assert a.dtype == torch.int64 and torch.equal(a, b)


def test_load_state_dict_while_iterating_restarts_from_the_new_position() -> None:
    adapter = TorchLoader(make(), num_workers=2)
    it = iter(adapter)
    for _ in range(5):
        next(it)
    state = adapter.state_dict()
    for _ in range(5):
        next(it)
    adapter.load_state_dict(state)
    expect = make()
    expect.load_state_dict(state)
    assert torch.equal(next(it), torch.from_numpy(expect.next_batch()))
    assert adapter.position == expect.position


def test_dataset_alone_with_a_plain_dataloader() -> None:
    from torch.utils.data import DataLoader

    loader = make()
    batches = DataLoader(PackedDataset(loader), batch_size=None, num_workers=2)
    it = iter(batches)
    got = [next(it) for _ in range(6)]
    del it
    assert [p for p, _ in got] == [i * 3 for i in range(6)]
    assert all(torch.equal(b, torch.from_numpy(loader.batch_at(p))) for p, b in got)


GLOO = """
import json, sys
import numpy as np
import torch.distributed as dist
from parquetlm import ByteTokenizer, PackedLoader, ParquetSource, TokenCache
rank, world, data, cache_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", rank=rank, world_size=world)
# Every rank builds the cache at once (one node): the lock makes them share one build.
cache = TokenCache.build(ParquetSource(data), ByteTokenizer(), cache_dir, workers=1)
loader = PackedLoader(cache, seq_len=32, batch_size=4, rank=rank, world_size=world, seed=9)
n, mine = loader.windows_per_epoch, []
for _ in range(-(-n // loader.global_batch)):
    positions = loader.position + rank * 4 + np.arange(4)
    windows = loader.windows_at(positions)
    batch = loader.next_batch()
    for row, w in zip(batch, windows):  # the rows really are those windows' tokens
        assert (row == cache.tokens[w * 32 : w * 32 + 33]).all()
    mine += [(int(p), int(w)) for p, w in zip(positions, windows) if p < n]  # epoch 0 only
got = [None] * world
dist.all_gather_object(got, {"windows": mine, "n": n, "path": str(cache.path)})
if rank == 0:
    print(json.dumps(got))
dist.destroy_process_group()
"""


def test_ranks_under_gloo_read_disjoint_shards_covering_the_epoch(
    corpus: tuple[Path, list[str]], tmp_path: Path
) -> None:
    root, _ = corpus
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(GLOO))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    world = 3
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(world), str(root), str(tmp_path / "c")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    outs = []
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    per_rank = json.loads(outs[0][0].strip().splitlines()[-1])
    assert len({r["path"] for r in per_rank}) == 1  # one shared cache
    n = per_rank[0]["n"]
    shards = [[w for _, w in r["windows"]] for r in per_rank]
    assert all(shards)
    everything = [w for shard in shards for w in shard]
    assert sorted(everything) == list(range(n))  # disjoint, and together the whole epoch
    positions = sorted(p for r in per_rank for p, _ in r["windows"])
    assert positions == list(range(n))


def test_sized_loader_tells_its_length_and_resumes_exactly() -> None:
    from parquetlm.torch import SizedLoader

    reference = [torch.from_numpy(b) for b in make().take(8)]
    first = SizedLoader(TorchLoader(make()), 5)
    assert len(first) == 5
    it = iter(first)
    got = [next(it) for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))
    again = SizedLoader(TorchLoader(make()), 5)
    again.load_state_dict(state)
    it2 = iter(again)
    got += [next(it2) for _ in range(5)]  # past the length: still the one endless stream
    for a, b in zip(got, reference, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="batches per epoch"):
        SizedLoader(TorchLoader(make()), 0)
