"""Parquet text to tokens to packed, sharded, exactly resumable language-model batches.

The core imports neither torch nor tokenizers; ``parquetlm.torch`` is the PyTorch adapter.
"""

from .cache import TokenCache
from .cachedir import default_cache_dir
from .errors import (
    CacheError,
    CacheRebuiltWarning,
    EmptyDatasetError,
    LoaderError,
    MissingExtraError,
    NullRowsWarning,
    ParquetLMError,
    SourceError,
    TokenizerError,
)
from .loader import LoaderConfig, PackedLoader
from .perm import FeistelPermutation
from .source import ParquetSource
from .tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    TokenizerSpec,
    gpt2_tokenizer,
    load_tokenizer,
    parse_tokenizer_spec,
    register_tokenizer,
    train_tokenizer,
)

__version__ = "0.1.0"

__all__ = [
    "ByteTokenizer",
    "CacheError",
    "CacheRebuiltWarning",
    "EmptyDatasetError",
    "FeistelPermutation",
    "HFTokenizer",
    "LoaderConfig",
    "LoaderError",
    "MissingExtraError",
    "NullRowsWarning",
    "PackedLoader",
    "ParquetLMError",
    "ParquetSource",
    "SourceError",
    "TokenCache",
    "Tokenizer",
    "TokenizerError",
    "TokenizerSpec",
    "__version__",
    "default_cache_dir",
    "gpt2_tokenizer",
    "load_tokenizer",
    "parse_tokenizer_spec",
    "register_tokenizer",
    "train_tokenizer",
]
