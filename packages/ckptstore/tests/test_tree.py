"""State trees: exact round trips through JSON + tensors, and refusals that say what to do."""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from ckpt_helpers import FORMATS, assert_same_state
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore import CheckpointError, CheckpointStore
from ckptstore.tree import decode, encode_state, tensor_keys, tensor_paths

leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.sampled_from([torch.float32, torch.bfloat16, torch.int8]),
)
keys = st.one_of(st.text(max_size=6), st.integers(-5, 5), st.just("$t"))
trees = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
    ),
    max_leaves=20,
)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(v, b[k]) for k, v in a.items())
    return bool(a == b)


@settings(max_examples=150, deadline=None)
@given(trees)
def test_plain_values_round_trip_exactly_through_json(value: Any) -> None:
    enc = encode_state({"v": value})
    tree = orjson.loads(orjson.dumps(enc.tree))  # what the manifest/header really stores
    assert same(decode(tree["v"], enc.tensors), value)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.float8_e4m3fn,
    ],
)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_dtype_and_odd_layouts_round_trip_bitwise(
    tmp_path: Path, dtype: torch.dtype, fmt: str
) -> None:
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(6, 5, generator=g) * 3).to(dtype)
    state = {
        "t": {
            "plain": base,
            "transposed": base.t(),  # not contiguous
            "slice": base[1:4, ::2],  # a view with an offset and strides
            "scalar": base[0, 0].clone(),
            "empty": base[:0],
        }
    }
    with CheckpointStore(str(tmp_path), format=fmt) as store:
        store.save(1, state)
        _, values = store.read(1)
    got = values["t"]
    for k, v in state["t"].items():
        assert got[k].dtype == dtype and got[k].shape == v.shape, k
        assert torch.equal(
            got[k].contiguous().view(-1).view(torch.uint8) if dtype != torch.bool else got[k],
            v.contiguous().view(-1).view(torch.uint8) if dtype != torch.bool else v,
        ), k


def test_tied_and_shared_tensors_are_stored_once() -> None:
    w = torch.randn(4, 4)
    enc = encode_state({"a": {"w": w, "w2": w, "view": w[1]}, "b": [w]})
    assert list(enc.tensors) == ["a.w", "a.view"]
    assert enc.specs["a.w"].group == "a"
    assert tensor_keys(enc.tree["b"]) == ["a.w"]
    assert enc.paths == {
        ("a", "w"): "a.w",
        ("a", "w2"): "a.w",
        ("a", "view"): "a.view",
        ("b", 0): "a.w",
    }


def test_module_state_dict_metadata_survives() -> None:
    bn = torch.nn.BatchNorm1d(3)
    enc = encode_state({"m": bn})
    sd = decode(orjson.loads(orjson.dumps(enc.tree))["m"], enc.tensors)
    assert isinstance(sd, OrderedDict)
    assert sd._metadata == bn.state_dict()._metadata  # type: ignore[attr-defined]


def test_keys_are_dotted_paths_and_unique() -> None:
    enc = encode_state(
        {"m": {"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}, 3: [torch.ones(2)]}}
    )
    assert list(enc.tensors) == ["m.a.b", "m.a.b~2", "m.3.0"]  # DCP's names, made unique
    paths = tensor_paths(orjson.loads(orjson.dumps(enc.tree)))
    assert paths == {"m.a.b": ("m", "a.b"), "m.a.b~2": ("m", "a", "b"), "m.3.0": ("m", 3, 0)}


def test_arbitrary_objects_are_refused_with_the_path() -> None:
    class Opaque:
        pass

    with pytest.raises(
        CheckpointError, match=r"state\['x'\]\['deep'\]\[1\].*Opaque.*never pickles"
    ):
        encode_state({"x": {"deep": [1, Opaque()]}})
    with pytest.raises(CheckpointError, match="to_dense"):
        encode_state({"s": torch.eye(3).to_sparse()})
    with pytest.raises(TypeError, match="non-empty strings"):
        encode_state({1: 2})  # type: ignore[dict-item]


def test_objects_with_state_dict_are_called() -> None:
    class Counter:
        def __init__(self) -> None:
            self.n = 3

        def state_dict(self) -> dict[str, int]:
            return {"n": self.n}

        def load_state_dict(self, sd: dict[str, int]) -> None:
            self.n = sd["n"]

    enc = encode_state({"c": Counter()})
    assert enc.tree["c"] == {"n": 3} and enc.types["c"].endswith("Counter")


def test_numpy_values_round_trip(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")  # numpy is optional for torch; only then can users have it
    rng = np.random.RandomState(3)
    state = {"np_rng": rng.get_state(), "arr": {"a": np.arange(6, dtype=np.int32).reshape(2, 3)}}
    with CheckpointStore(str(tmp_path)) as store:
        store.save(1, state)
        loaded: dict[str, Any] = {"np_rng": None, "arr": None}
        store.load(loaded)
    r2 = np.random.RandomState()
    r2.set_state(loaded["np_rng"])
    assert r2.randint(0, 10**9) == np.random.RandomState(3).randint(0, 10**9)
    assert (loaded["arr"]["a"] == state["arr"]["a"]).all()
    assert_same_state(
        {"x": torch.from_numpy(state["arr"]["a"])}, {"x": torch.from_numpy(loaded["arr"]["a"])}
    )
