import subprocess
import sys
from pathlib import Path

import parquetlm


def test_version() -> None:
    assert parquetlm.__version__ == "0.1.0"


def test_the_core_imports_neither_torch_nor_tokenizers(tmp_path: Path) -> None:
    """Source, byte tokenizer, cache and loader work with torch and tokenizers absent."""
    script = (
        "import sys, pyarrow as pa, pyarrow.parquet as pq\n"
        "from parquetlm import ByteTokenizer, PackedLoader, ParquetSource, TokenCache\n"
        "path = sys.argv[1] + '/t.parquet'\n"
        "pq.write_table(pa.table({'text': ['hello world'] * 50}), path)\n"
        "cache = TokenCache.build(ParquetSource(path), ByteTokenizer(), sys.argv[1] + '/c')\n"
        "PackedLoader(cache, seq_len=8, batch_size=2).next_batch()\n"
        "print(sorted(m for m in ('torch', 'tokenizers') if m in sys.modules))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
