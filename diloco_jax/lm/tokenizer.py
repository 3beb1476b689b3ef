"""Tokenizers for the LM experiments: UTF-8 bytes, or byte-level BPE trained on the train split.

  spec = parse_spec("bpe:4096")                 # TokenizerSpec(kind="bpe", vocab_size=4096)
  tok = get_tokenizer("bpe:4096", train_docs)   # trains once, then loads from the disk cache
  token_docs = tok.encode_documents(docs)       # [(name, int32 ids)]: concat_documents() them
  tok.token_bytes[i]                            # the UTF-8 bytes token i stands for

"bytes" (the default) is the identity on data.py's documents: token i is byte i (vocab 256)
and byte 0 (NUL) separates documents, so nothing changes against a run without a tokenizer.

"bpe:VOCAB" is byte-level BPE (GPT-2's scheme) trained with Hugging Face `tokenizers` on the
run's train documents: id 0 is the end-of-document token (the separator, in place of byte 0),
ids 1-256 the 256 byte symbols, so every UTF-8 text encodes, and the rest learned merges, VOCAB
in all (hence VOCAB >= 257). Training is deterministic (the merges follow counts, ties broken
by the pair), so one train split and vocabulary always give the same file. It is cached as
CACHE/tokenizers/bpe{VOCAB}-{sha256 of the train split}.json, CACHE being $DILOCO_JAX_CACHE,
else $XDG_CACHE_HOME/diloco-jax, else ~/.cache/diloco-jax; a later run on the same split loads
it instead of training. Documents that are not valid UTF-8 have their bad bytes replaced by
U+FFFD before BPE (stdlib, text: and hf: sources give valid UTF-8).

`token_bytes` maps the BPE stream back to the byte path's stream exactly (the separator to
byte 0), which is how eval turns loss per token into bits per byte.
"""

import dataclasses
import functools
import hashlib
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from diloco_jax.lm import data as data_lib

BYTES = "bytes"
BPE = "bpe"
BYTE_VOCAB = data_lib.VOCAB_SIZE
MIN_BPE_VOCAB = BYTE_VOCAB + 1  # the 256 byte symbols and the end-of-document token
MAX_BPE_VOCAB = 2**20
END_OF_DOCUMENT = "<|endoftext|>"
CACHE_ENV = "DILOCO_JAX_CACHE"


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """A parsed --tokenizer value: kind "bytes" (vocab 256) or "bpe" (vocab_size tokens)."""

    kind: str
    vocab_size: int


def parse_spec(spec: str) -> TokenizerSpec:
    """ "bytes" or "bpe:VOCAB" (MIN_BPE_VOCAB <= VOCAB <= MAX_BPE_VOCAB) as a TokenizerSpec;
    ValueError (one line, saying what is expected) for anything else."""
    expected = f"'bytes' or 'bpe:VOCAB' with {MIN_BPE_VOCAB} <= VOCAB <= {MAX_BPE_VOCAB:,}"
    if not isinstance(spec, str):
        raise ValueError(f"tokenizer must be {expected}, got {spec!r}")
    if spec == BYTES:
        return TokenizerSpec(BYTES, BYTE_VOCAB)
    kind, sep, vocab = spec.partition(":")
    # isdecimal, not int(): int() also takes "+300", " 300" and "3_00".
    if kind != BPE or not sep or not vocab.isascii() or not vocab.isdecimal():
        raise ValueError(f"tokenizer must be {expected}, got {spec!r}")
    size = int(vocab)
    if not MIN_BPE_VOCAB <= size <= MAX_BPE_VOCAB:
        raise ValueError(
            f"tokenizer {spec!r}: a byte-level BPE vocabulary holds the 256 bytes and the "
            f"end-of-document token, so it needs {MIN_BPE_VOCAB} <= VOCAB <= {MAX_BPE_VOCAB:,}"
        )
    return TokenizerSpec(BPE, size)


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """A trained tokenizer: documents to ids, ids back to bytes.

    Attributes:
      spec: what was asked for.
      token_bytes: the bytes each id stands for, [vocab_size] (the separator: b"\\x00").
      info: JSON-able description for config.json: spec, kind, vocab_size, and for BPE the
        sha256 of the tokenizer file, its path, the train split's sha256 and bytes, and the
        `tokenizers` version.
      hf: the Hugging Face `tokenizers.Tokenizer` (None for bytes).
    """

    spec: TokenizerSpec
    token_bytes: tuple[bytes, ...]
    info: dict[str, Any]
    hf: Any = None

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @functools.cached_property
    def byte_lengths(self) -> np.ndarray:
        """int64 [vocab_size]: len(token_bytes[i])."""
        return np.array([len(b) for b in self.token_bytes], dtype=np.int64)

    def encode_documents(self, documents: Sequence[data_lib.Document]) -> list[data_lib.Document]:
        """[(name, token ids)] for [(name, uint8 bytes)]: the documents themselves for bytes,
        int32 ids in [1, vocab_size) for BPE (0, the separator, is never produced)."""
        if self.hf is None:
            return list(documents)
        texts = [_text(data) for _, data in documents]
        encodings = self.hf.encode_batch_fast(texts)
        return [
            (name, np.asarray(e.ids, dtype=np.int32))
            for (name, _), e in zip(documents, encodings, strict=True)
        ]

    def to_bytes(self, ids: Sequence[int] | np.ndarray) -> bytes:
        """The bytes a 1-D sequence of ids stands for (the separator as byte 0)."""
        ids = np.asarray(ids)
        if ids.ndim != 1:
            raise ValueError(f"ids must be 1-D, got shape {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(
                f"ids must be in [0, {self.vocab_size}), got [{ids.min()}, {ids.max()}]"
            )
        return b"".join(self.token_bytes[i] for i in ids.tolist())

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text for a 1-D sequence of ids; invalid UTF-8 (a cut token stream) becomes U+FFFD."""
        return self.to_bytes(ids).decode("utf-8", errors="replace")


def _text(data: np.ndarray) -> str:
    return np.ascontiguousarray(data, dtype=np.uint8).tobytes().decode("utf-8", errors="replace")


def byte_tokenizer() -> Tokenizer:
    """The byte path: token i is byte i."""
    spec = TokenizerSpec(BYTES, BYTE_VOCAB)
    info = {"spec": BYTES, "kind": BYTES, "vocab_size": BYTE_VOCAB}
    return Tokenizer(spec, tuple(bytes([i]) for i in range(BYTE_VOCAB)), info)


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the printable character standing for each byte
    (printable Latin-1 bytes stand for themselves, the other 68 for chr(256 + k))."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in chars]
    chars.update({b: chr(256 + k) for k, b in enumerate(others)})
    return {c: b for b, c in chars.items()}


def _hf_token_bytes(hf: Any) -> tuple[bytes, ...]:
    """The bytes of every id of a byte-level BPE tokenizer; id 0 (end of document) is b"\\0"."""
    alphabet = _unicode_to_byte()
    out = [bytes([data_lib.DOC_SEPARATOR])]
    for i in range(1, hf.get_vocab_size()):
        out.append(bytes(alphabet[c] for c in hf.id_to_token(i)))
    return tuple(out)


def train_bpe(documents: Sequence[data_lib.Document], vocab_size: int) -> str:
    """Trains byte-level BPE with `vocab_size` tokens on the documents' text; returns the
    tokenizer's JSON (Hugging Face format). ValueError when the text yields fewer merges than
    the vocabulary needs."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_DOCUMENT],  # first, so it gets id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator((_text(data) for _, data in documents), trainer=trainer)
    got = hf.get_vocab_size()
    if got != vocab_size:
        num_bytes = sum(int(d.size) for _, d in documents)
        raise ValueError(
            f"the train split ({num_bytes:,} bytes) has only enough distinct pairs for {got:,} "
            f"BPE tokens, fewer than the {vocab_size:,} asked for: use a smaller vocabulary or "
            "more data"
        )
    return hf.to_str()


def cache_root() -> Path:
    """$DILOCO_JAX_CACHE, else $XDG_CACHE_HOME/diloco-jax, else ~/.cache/diloco-jax."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "diloco-jax"


def cache_path(vocab_size: int, train_sha256: str, root: Path | None = None) -> Path:
    """Where the BPE tokenizer of this train split and vocabulary is cached."""
    folder = (cache_root() if root is None else root) / "tokenizers"
    return folder / f"bpe{vocab_size}-{train_sha256}.json"


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(
        "w", encoding="utf-8", dir=path.parent, delete=False, suffix=".tmp"
    ) as f:
        f.write(text)
    os.replace(f.name, path)


def _load_hf(text: str) -> Any:
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_str(text)
    # Text that happens to contain "<|endoftext|>" is encoded as text, never as id 0, so the
    # separator only ever comes from concat_documents and every document round-trips.
    hf.encode_special_tokens = True
    if hf.token_to_id(END_OF_DOCUMENT) != 0:
        raise ValueError(f"not a diloco-jax BPE tokenizer: {END_OF_DOCUMENT} is not id 0")
    return hf


def get_tokenizer(
    spec: str, train_documents: Sequence[data_lib.Document], cache: Path | None = None
) -> Tokenizer:
    """The tokenizer `spec` of these train documents: bytes, or BPE loaded from the cache
    (`cache_root()` unless `cache` is given) or trained there on a miss. A cache that can't be
    written only costs a warning (the run still gets its tokenizer); an unreadable cached file
    is retrained. ValueError for a bad spec or a corpus too small for the vocabulary."""
    parsed = parse_spec(spec)
    if parsed.kind == BYTES:
        return byte_tokenizer()
    import tokenizers

    train_sha = data_lib.checksum(train_documents)
    path = cache_path(parsed.vocab_size, train_sha, cache)
    text, hf = None, None
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
            hf = _load_hf(text)
        except Exception:  # a damaged file (tokenizers raises plain Exception): retrain
            text, hf = None, None
    if hf is None:
        text = train_bpe(train_documents, parsed.vocab_size)
        hf = _load_hf(text)
        try:
            _write_atomic(path, text)
        except OSError as e:
            print(f"warning: could not cache the tokenizer at {path}: {e}", file=sys.stderr)
    info = {
        "spec": spec,
        "kind": BPE,
        "vocab_size": parsed.vocab_size,
        "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "path": str(path),
        "train_sha256": train_sha,
        "train_bytes": int(sum(d.size for _, d in train_documents)),
        "tokenizers_version": tokenizers.__version__,
    }
    return Tokenizer(parsed, _hf_token_bytes(hf), info, hf)
