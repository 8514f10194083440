"""ParquetSource: files, directories, globs, lists, fsspec URLs; content fingerprint; bad input."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from parquetlm import EmptyDatasetError, ParquetSource, SourceError


def test_directory_glob_file_and_list_read_the_same_texts(corpus: tuple[Path, list[str]]) -> None:
    root, texts = corpus
    files = [root / "part-0.parquet", root / "part-1.parquet"]
    for spec in (root, str(root / "*.parquet"), files, [str(files[0]), root / "part-1.parquet"]):
        src = ParquetSource(spec)  # type: ignore[arg-type]
        assert list(src.iter_texts()) == texts
        assert src.num_rows == len(texts) and len(src.files) == 2
    assert list(ParquetSource(files[1]).iter_texts()) == texts[250:]
    # Row groups are the units of work, in dataset order.
    units = ParquetSource(root).units
    assert [u.num_rows for u in units] == [50] * 5 + [40] * 3 + [30]
    assert [u.index for u in units] == list(range(9))
    # Streaming: one row group at a time, never a whole file (memory bounded by a row group).
    assert [len(a) for a in ParquetSource(root).iter_arrays()] == [50] * 5 + [40] * 3 + [30]


def test_directory_skips_hidden_entries(corpus: tuple[Path, list[str]], tools: Any) -> None:
    root, texts = corpus
    tools.write_parquet(root / ".parquetlm-cache" / "junk.parquet", ["no"])
    tools.write_parquet(root / "_tmp" / "junk.parquet", ["no"])
    assert list(ParquetSource(root).iter_texts()) == texts


def test_nulls_are_skipped_and_counted(tmp_path: Path, tools: Any) -> None:
    path = tools.write_parquet(
        tmp_path / "n.parquet", ["a", None, "b", None, "", "c"], row_group_size=2
    )
    src = ParquetSource(path)
    assert list(src.iter_texts()) == ["a", "b", "", "c"]
    assert src.null_rows == 2 and src.num_rows == 6


def test_large_string_column_and_other_column_name(tmp_path: Path) -> None:
    table = pa.table({"body": pa.array(["x", "yz"], type=pa.large_string())})
    pq.write_table(table, tmp_path / "l.parquet")
    assert list(ParquetSource(tmp_path / "l.parquet", column="body").iter_texts()) == ["x", "yz"]


@pytest.mark.parametrize("values", [pa.string(), pa.large_string()])
@pytest.mark.parametrize("index", [pa.int8(), pa.int32()])
def test_dictionary_string_columns_are_text(
    tmp_path: Path, values: pa.DataType, index: pa.DataType
) -> None:
    """What pandas writes for a ``category`` column (Arrow dictionary<int, string>), nulls and
    repeated values included, over several row groups."""
    texts = ["red", None, "green", "red", "blue", None, "green"] * 5
    dictionary = pa.array(texts, type=values).dictionary_encode()
    dictionary = dictionary.cast(pa.dictionary(index, values))
    pq.write_table(pa.table({"text": dictionary}), tmp_path / "c.parquet", row_group_size=4)
    assert pa.types.is_dictionary(pq.read_schema(tmp_path / "c.parquet").field("text").type)
    src = ParquetSource(tmp_path / "c.parquet")
    assert list(src.iter_texts()) == [t for t in texts if t is not None]
    assert src.null_rows == 10
    assert all(not pa.types.is_dictionary(a.type) for a in src.iter_arrays())


def test_a_dictionary_of_numbers_is_not_text(tmp_path: Path) -> None:
    col = pa.array([1, 2, 1]).dictionary_encode()
    pq.write_table(pa.table({"text": col, "other": ["a", "b", "c"]}), tmp_path / "n.parquet")
    with pytest.raises(SourceError, match=r"not string.*columns here: other"):
        ParquetSource(tmp_path / "n.parquet")


def test_fingerprint_follows_content_not_paths(corpus: tuple[Path, list[str]], tools: Any) -> None:
    root, texts = corpus
    fp = ParquetSource(root).fingerprint()
    moved = root.parent / "moved"
    shutil.copytree(root, moved)
    assert ParquetSource(moved).fingerprint() == fp
    assert ParquetSource(moved).fingerprint(full=True) == ParquetSource(root).fingerprint(full=True)
    # One changed character in one document changes it.
    edited = list(texts[250:])
    edited[7] = edited[7] + "!"
    tools.write_parquet(moved / "part-1.parquet", edited, row_group_size=40)
    assert ParquetSource(moved).fingerprint() != fp
    # Order of files is part of the content (it is the token order).
    files = sorted(root.glob("*.parquet"))
    assert ParquetSource(files[::-1]).fingerprint() != ParquetSource(files).fingerprint()


def test_fsspec_urls(corpus: tuple[Path, list[str]]) -> None:
    fsspec = pytest.importorskip("fsspec", reason="fsspec URLs need the [fsspec] extra")
    root, texts = corpus
    assert list(ParquetSource(f"file://{root}").iter_texts()) == texts
    mem = fsspec.filesystem("memory")
    for p in sorted(root.glob("*.parquet")):
        mem.pipe(f"/plm-test/{p.name}", p.read_bytes())
    try:
        src = ParquetSource("memory://plm-test/")
        assert list(src.iter_texts()) == texts
        assert src.files == [
            "memory:///plm-test/part-0.parquet",
            "memory:///plm-test/part-1.parquet",
        ]
        assert list(ParquetSource("memory://plm-test/*-1.parquet").iter_texts()) == texts[250:]
        assert src.fingerprint() == ParquetSource(root).fingerprint()
        with pytest.raises(SourceError, match="no such file"):
            ParquetSource("memory://plm-test/nope.parquet")
    finally:
        mem.rm("/plm-test", recursive=True)


# -- bad input -----------------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"no such file: .*nope\.parquet"):
        ParquetSource(tmp_path / "nope.parquet")


def test_not_a_parquet_file(tmp_path: Path) -> None:
    (tmp_path / "x.parquet").write_text("id,text\n1,hello\n")
    with pytest.raises(SourceError, match=r"x\.parquet is not a parquet file"):
        ParquetSource(tmp_path / "x.parquet")


def test_missing_column_lists_the_columns(corpus: tuple[Path, list[str]]) -> None:
    with pytest.raises(SourceError, match=r"no column 'content'; its columns are: text, id"):
        ParquetSource(corpus[0], column="content")


def test_non_string_column(corpus: tuple[Path, list[str]]) -> None:
    with pytest.raises(
        SourceError, match=r"'id' .* has type int64, not string.*columns here: text"
    ):
        ParquetSource(corpus[0], column="id")


def test_empty_inputs(tmp_path: Path, tools: Any) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(EmptyDatasetError, match="no \\*.parquet files under directory"):
        ParquetSource(tmp_path / "empty")
    with pytest.raises(SourceError, match="no files match"):
        ParquetSource(str(tmp_path / "empty" / "*.parquet"))
    with pytest.raises(EmptyDatasetError, match="0 rows"):
        ParquetSource(tools.write_parquet(tmp_path / "zero.parquet", []))
    with pytest.raises(EmptyDatasetError, match="no paths"):
        ParquetSource([])
    assert issubclass(EmptyDatasetError, ValueError)


def test_a_name_with_glob_characters_and_a_fifo(
    corpus: tuple[Path, list[str]], tmp_path: Path
) -> None:
    """Probes: an existing data[1].parquet was taken for a pattern ('no files match'); a FIFO
    given as the data blocked the command forever."""
    import os

    root, texts = corpus
    named = tmp_path / "data[1].parquet"
    shutil.copy(root / "part-0.parquet", named)
    assert ParquetSource(str(named)).files == [str(named)]
    assert ParquetSource(str(tmp_path / "data*.parquet")).files == [str(named)]  # a pattern
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(SourceError, match="'.*fifo' is not a regular file: give a parquet file"):
        ParquetSource(str(tmp_path / "fifo"))
