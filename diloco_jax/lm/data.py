"""Byte-level data for LM experiments: sources, document splits, worker shards, samplers.

Pipeline:

  source = load_source("bundled")                       # ordered (name, uint8 bytes) docs
  train_docs, val_docs = split_documents(source.documents, 0.1, seed=0)
  train_N, train_starts_D = concat_documents(train_docs)  # int32 stream + doc offsets
  val_N, _ = concat_documents(val_docs)
  starts_M, lengths_M = worker_shards(train_starts_D, len(train_N), M, "non_iid", seq_len)
  batch = sample_batch(train_N, starts_M[m], lengths_M[m], key, batch_size, seq_len)

Tokens are UTF-8 bytes (vocab 256). In the concatenated stream every document is followed
by DOC_SEPARATOR (byte 0, NUL), which does not occur in ordinary text or source code, so
the model sees an unambiguous end-of-document token.

Source specs (`load_source`):
  "bundled"  The default: 4,000,000 bytes of Python source shipped inside the package
            (`diloco_jax.lm.corpus`): what "stdlib" reads on CPython 3.11.7, cut at that
            size, so the same bytes on every Python version.
  "stdlib"  The .py files of the running interpreter's standard library
            (sysconfig stdlib path), one document per file, sorted by relative path; a
            different text on each Python version.
            Skipped, so the corpus is the same on any install of a Python version:
            site-packages/dist-packages (third-party), directories named test/tests/
            idle_test (test suites, some with deliberately odd encodings), __pycache__,
            build-generated files (config-*/ directories, _sysconfigdata_*.py), and
            anything that is not a regular file (symlinks are not followed).
  "text:PATH"  A UTF-8 file, cut into documents of about TEXT_DOCUMENT_BYTES at paragraph
            boundaries (blank lines; at line ends if a paragraph runs past 4x that size),
            so a single book still gives a validation split by document. The pieces
            concatenate back to the file exactly. Or a folder: every .txt/.md file below
            it (recursive, sorted relative paths; symbolic links are not followed, so
            nothing outside the folder is read) is one document; a folder of one file is
            cut like that file.
  "hf:NAME[:CONFIG[:SPLIT]]"  A Hugging Face `datasets` dataset (optional dependency),
            column "text", one row per document, rows in dataset order (streamed, so
            max_documents/max_bytes avoid reading everything). SPLIT defaults to "train".
            Packaged builders take a data_files path instead of CONFIG:
            "hf:text:PATH[:SPLIT]", "hf:json:PATH", "hf:csv:PATH", "hf:parquet:PATH",
            "hf:arrow:PATH" (a path containing ":" then needs an explicit SPLIT). For the
            "text" builder a row is a paragraph (sample_by="paragraph"), not a line.
All sources drop empty documents.
"""

import codecs
import dataclasses
import functools
import glob
import os
import platform
import re
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diloco_jax.lm import corpus
from diloco_jax.lm.corpus import checksum

VOCAB_SIZE = 256
DOC_SEPARATOR = 0
TEXT_DOCUMENT_BYTES = 4096
SHARD_MODES = ("iid", "non_iid")

Document = tuple[str, np.ndarray]
Batch = dict[str, Any]

_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
_TEXT_SUFFIXES = (".txt", ".md")
_HF_PACKAGED = frozenset({"text", "json", "csv", "parquet", "arrow"})
# A blank-line run (possibly with trailing spaces), the end of a paragraph.
_PARAGRAPH_END = re.compile(rb"\n(?:[ \t\r\f\v]*\n)+")
_LINE_END = re.compile(rb"\n")
_SPLIT_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")


# ---------------------------------------------------------------------------------------
# Tokenizer.


def encode(text: str) -> np.ndarray:
    """UTF-8 bytes of `text` as int32 token ids in [0, 256), shape [num_bytes].

    Raises ValueError for strings that are not valid Unicode (lone surrogates), which have
    no UTF-8 encoding.
    """
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text is not encodable as UTF-8: {e}") from None
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32)


def decode(tokens: Sequence[int] | np.ndarray | jax.Array) -> str:
    """Text for a 1-D sequence of byte ids in [0, 256); invalid UTF-8 becomes U+FFFD."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= VOCAB_SIZE):
        raise ValueError(
            f"tokens must be in [0, {VOCAB_SIZE}), got [{tokens.min()}, {tokens.max()}]"
        )
    return tokens.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------
# Sources.


@dataclasses.dataclass(frozen=True)
class Source:
    """An ordered list of documents and a JSON-able description of them.

    Attributes:
      documents: [(name, uint8 array of the document's bytes)], non-empty documents only.
      info: spec, num_documents, num_bytes, sha256 (over names and contents, in order),
        the limits used, and source-specific fields (python_version for "stdlib", corpus
        for "bundled").
    """

    documents: list[Document]
    info: dict[str, Any]


def load_source(
    spec: str, *, max_documents: int | None = None, max_bytes: int | None = None
) -> Source:
    """Loads documents from `spec` (see the module docstring for the grammar).

    Args:
      spec: "bundled", "stdlib", "text:PATH" or "hf:NAME[:CONFIG[:SPLIT]]".
      max_documents: keep only the first this-many (non-empty) documents; None = all.
      max_bytes: stop once this many bytes are collected, truncating the last document;
        None = all. Only those bytes are read: a text file's documents are cut from its
        first max_bytes bytes.

    Returns:
      Source. Raises ValueError (naming the spec) for a bad spec, a missing path, or a
      source with no documents.
    """
    if not isinstance(spec, str):
        raise ValueError(f"spec must be a str, got {type(spec).__name__}")
    for name, value in (("max_documents", max_documents), ("max_bytes", max_bytes)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    if spec == "bundled":
        docs, extra = _bundled_documents()
    elif spec == "stdlib":
        docs, extra = _stdlib_documents(max_bytes)
    elif spec.startswith("text:"):
        docs, extra = _text_documents(spec, spec[len("text:") :], max_bytes)
    elif spec.startswith("hf:"):
        docs, extra = _hf_documents(spec)
    else:
        raise ValueError(
            f"unknown data spec {spec!r}; use 'bundled', 'stdlib', 'text:PATH' or 'hf:NAME'"
        )
    documents = _take(docs, max_documents, max_bytes)
    if not documents:
        raise ValueError(f"data spec {spec!r} gave no non-empty documents")
    info = {
        "spec": spec,
        "num_documents": len(documents),
        "num_bytes": int(sum(d.size for _, d in documents)),
        "sha256": checksum(documents),
        "max_documents": max_documents,
        "max_bytes": max_bytes,
        **extra,
    }
    return Source(documents=documents, info=info)


def _take(
    docs: Iterable[tuple[str, bytes]], max_documents: int | None, max_bytes: int | None
) -> list[Document]:
    """Collects non-empty documents up to the limits; stops pulling from `docs` early."""
    out: list[Document] = []
    total = 0
    for name, data in docs:
        if not data:
            continue
        if max_bytes is not None:
            data = data[: max_bytes - total]
        out.append((name, np.frombuffer(data, dtype=np.uint8)))
        total += len(data)
        if (max_documents is not None and len(out) >= max_documents) or (
            max_bytes is not None and total >= max_bytes
        ):
            break
    return out


def _bundled_documents() -> tuple[Iterator[tuple[str, bytes]], dict[str, Any]]:
    return iter(corpus.load_documents()), {"corpus": corpus.DESCRIPTION}


def _stdlib_documents(max_bytes: int | None) -> tuple[Iterator[tuple[str, bytes]], dict[str, Any]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    names = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        # Pruning dirnames in place stops os.walk from descending into skipped folders.
        dirnames[:] = [
            d
            for d in dirnames
            if d not in _STDLIB_SKIP_DIRS and d != "__pycache__" and not d.startswith("config-")
        ]
        for filename in filenames:
            path = Path(dirpath, filename)
            if (
                filename.endswith(".py")
                and not filename.startswith("_sysconfigdata_")
                and path.is_file()
                and not path.is_symlink()
            ):
                names.append(path.relative_to(root).as_posix())
    names.sort()
    extra = {
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
    }
    return _read_within(((name, root / name) for name in names), max_bytes), extra


def _split_at(data: bytes, boundary: re.Pattern, target: int) -> list[bytes]:
    """Cuts `data` after `boundary` matches once a piece reaches `target` bytes (lossless)."""
    pieces, start = [], 0
    for m in boundary.finditer(data):
        if m.end() - start >= target:
            pieces.append(data[start : m.end()])
            start = m.end()
    pieces.append(data[start:])
    return [p for p in pieces if p]


def split_text(data: bytes, target: int = TEXT_DOCUMENT_BYTES) -> list[bytes]:
    """Splits UTF-8 text into pieces of about `target` bytes at paragraph ends.

    A piece that would still exceed 4 * target (no blank lines) is cut at line ends
    instead. b"".join(split_text(data)) == data.
    """
    if target < 1:
        raise ValueError(f"target must be >= 1, got {target}")
    pieces = []
    for piece in _split_at(data, _PARAGRAPH_END, target):
        pieces.extend(_split_at(piece, _LINE_END, target) if len(piece) > 4 * target else [piece])
    return pieces


def _read_within(
    files: Iterable[tuple[str, Path]], max_bytes: int | None, read: Any = None
) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of each file in turn, reading no more than the `max_bytes` all of them
    may keep (None: all): the last one read is cut there and nothing after it is opened."""
    read = read or _read_prefix
    left = max_bytes
    for name, path in files:
        if left is not None and left <= 0:
            return
        data = read(path, left)
        yield name, data
        if left is not None:
            left -= len(data)


def _read_prefix(path: Path, limit: int | None) -> bytes:
    """The first `limit` bytes of a file (all of it when None)."""
    with open(path, "rb") as f:
        return f.read() if limit is None else f.read(limit)


def _read_utf8(spec: str, path: Path, limit: int | None = None) -> bytes:
    """The first `limit` bytes of a UTF-8 file (all when None); a character cut at the limit
    is not an error (the cut is where the corpus ends)."""
    data = _read_prefix(path, limit)
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=limit is None)
    except UnicodeDecodeError as e:
        raise ValueError(
            f"data spec {spec!r}: {path} is not UTF-8 ({e.reason} at {e.start})"
        ) from None
    return data


def _text_documents(
    spec: str, path_str: str, max_bytes: int | None = None
) -> tuple[Iterator[tuple[str, bytes]], dict]:
    if not path_str:
        raise ValueError(f"data spec {spec!r} needs a path: 'text:PATH'")
    path = Path(path_str).expanduser()
    if path.is_file():
        return _cut_file(spec, path, path.name, max_bytes), {"path": str(path), "kind": "file"}
    if path.is_dir():
        files = _text_files(path)
        if not files:
            raise ValueError(f"data spec {spec!r}: no .txt or .md files under {path}")
        kind = {"path": str(path), "kind": "folder"}
        if len(files) == 1:  # one document has no train / eval split: cut it as a file
            return _cut_file(spec, path / files[0], files[0], max_bytes), kind
        utf8 = lambda file, limit: _read_utf8(spec, file, limit)
        return _read_within(((name, path / name) for name in files), max_bytes, utf8), kind
    raise ValueError(f"data spec {spec!r}: no such file or folder {path}")


def _text_files(folder: Path) -> list[str]:
    """The .txt / .md files below `folder` (sorted relative paths). Symbolic links are
    neither followed nor read, as in the stdlib source: what the folder holds, nothing
    outside it."""
    names = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        dirnames.sort()
        for filename in filenames:
            path = Path(dirpath, filename)
            if path.suffix.lower() in _TEXT_SUFFIXES and not path.is_symlink() and path.is_file():
                names.append(path.relative_to(folder).as_posix())
    return sorted(names)


def _cut_file(
    spec: str, path: Path, name: str, max_bytes: int | None = None
) -> Iterator[tuple[str, bytes]]:
    """A text file's documents: `split_text` pieces named NAME#i, of its first `max_bytes`
    bytes (all when None; only those are read)."""
    pieces = split_text(_read_utf8(spec, path, max_bytes))
    width = len(str(len(pieces)))
    return ((f"{name}#{i:0{width}d}", p) for i, p in enumerate(pieces))


def parse_hf_spec(spec: str) -> dict[str, Any]:
    """Parses "hf:NAME[:CONFIG[:SPLIT]]" into load_dataset arguments (see module docstring).

    For packaged builders everything after "hf:BUILDER:" is the data_files path or URL,
    except a final ":SPLIT" that is a plain identifier (letters, digits, "_", "-").
    """
    if not spec.startswith("hf:"):
        raise ValueError(f"hf data spec {spec!r} must start with 'hf:'")
    name, _, rest = spec[len("hf:") :].partition(":")
    if not name:
        raise ValueError(f"hf data spec {spec!r} needs a dataset name: 'hf:NAME[:CONFIG[:SPLIT]]'")
    if name in _HF_PACKAGED:
        data_files, split = rest, "train"
        head, sep, last = rest.rpartition(":")
        if sep and head and _SPLIT_NAME.fullmatch(last):
            data_files, split = head, last
        if not data_files:
            raise ValueError(
                f"hf data spec {spec!r}: builder {name!r} needs a path 'hf:{name}:PATH'"
            )
        return {"path": name, "name": None, "data_files": data_files, "split": split}
    fields = rest.split(":") if rest else []
    if len(fields) > 2:
        raise ValueError(f"hf data spec {spec!r} has too many fields: 'hf:NAME[:CONFIG[:SPLIT]]'")
    config = fields[0] if fields and fields[0] else None
    split = fields[1] if len(fields) > 1 and fields[1] else "train"
    return {"path": name, "name": config, "data_files": None, "split": split}


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def _hf_documents(spec: str) -> tuple[Iterator[tuple[str, bytes]], dict]:
    args = parse_hf_spec(spec)
    try:
        import datasets  # Optional dependency, imported only when an hf: spec is used.
    except ImportError:
        raise ValueError(
            f"data spec {spec!r} needs the Hugging Face `datasets` package: "
            "pip install 'diloco-jax[hf]'"
        ) from None
    kwargs: dict[str, Any] = {"split": args["split"], "streaming": True}
    if args["data_files"] is not None:
        data_files = args["data_files"]
        if "://" not in data_files:  # Local path or glob: fail fast with a clear message.
            data_files = os.path.expanduser(data_files)
            if not glob.glob(data_files):
                raise ValueError(f"data spec {spec!r}: no files match {data_files}")
        kwargs["data_files"] = data_files
    if args["path"] == "text":
        kwargs["sample_by"] = "paragraph"
    try:
        dataset = datasets.load_dataset(args["path"], args["name"], **kwargs)
    except Exception as e:  # datasets raises many types (network, missing, bad config).
        raise ValueError(f"data spec {spec!r}: {_one_line(e)}") from None
    columns = dataset.column_names
    if columns is not None and "text" not in columns:
        raise ValueError(f"data spec {spec!r}: no 'text' column (columns: {columns})")

    def rows() -> Iterator[tuple[str, bytes]]:
        prefix = f"{args['path']}:{args['split']}"
        try:
            for i, row in enumerate(dataset):
                text = row.get("text")
                if text is None:
                    continue
                yield f"{prefix}#{i}", str(text).encode("utf-8", errors="replace")
        except Exception as e:
            raise ValueError(f"data spec {spec!r}: {_one_line(e)}") from None

    return rows(), {"hf": {k: v for k, v in args.items() if v is not None}}


# ---------------------------------------------------------------------------------------
# Splits, concatenation, shards.


def split_documents(
    documents: Sequence[Document], val_fraction: float, seed: int
) -> tuple[list[Document], list[Document]]:
    """Held-out split by whole documents.

    Args:
      documents: >= 2 documents.
      val_fraction: in (0, 1); round(val_fraction * D) documents, clamped to [1, D - 1],
        go to validation.
      seed: int; the same (D, val_fraction, seed) always picks the same documents.

    Returns:
      (train_docs, val_docs), each in the original order (so contiguous ranges of the
      train list stay contiguous, e.g. a stdlib package).
    """
    num_docs = len(documents)
    if num_docs < 2:
        raise ValueError(f"documents must hold at least 2 documents to split, got {num_docs}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    num_val = min(max(round(val_fraction * num_docs), 1), num_docs - 1)
    val_idx = np.random.default_rng(seed).permutation(num_docs)[:num_val]
    is_val = np.zeros(num_docs, dtype=bool)
    is_val[val_idx] = True
    train = [d for d, v in zip(documents, is_val, strict=True) if not v]
    val = [d for d, v in zip(documents, is_val, strict=True) if v]
    return train, val


def concat_documents(documents: Sequence[Document]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenates documents into one token stream, each followed by DOC_SEPARATOR.

    Returns:
      tokens_N: int32 [N], N = sum(len(doc) + 1).
      doc_starts_D: int64 [D], offset of each document's first token; document i spans
        [doc_starts_D[i], doc_starts_D[i + 1]) including its separator (the last ends at N).
    """
    if not documents:
        raise ValueError("documents must not be empty")
    sizes = np.array([d.size + 1 for _, d in documents], dtype=np.int64)
    doc_starts_D = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    tokens_N = np.full(int(sizes.sum()), DOC_SEPARATOR, dtype=np.int32)
    for start, (_, data) in zip(doc_starts_D, documents, strict=True):
        tokens_N[start : start + data.size] = data
    return tokens_N, doc_starts_D


def worker_shards(
    doc_offsets: np.ndarray | Sequence[int],
    num_tokens: int,
    num_workers: int,
    mode: str,
    seq_len: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Token ranges [start, start + length) of the train stream for each of M workers.

    Args:
      doc_offsets: document start offsets, strictly increasing from 0, all < num_tokens
        (the doc_starts_D of concat_documents; a trailing num_tokens is also accepted).
      num_tokens: N, length of the stream, < 2**31.
      num_workers: M >= 1.
      mode: "iid": every worker gets the whole stream (and samples it with its own key).
        "non_iid": each worker gets a disjoint, contiguous run of whole documents; cuts are
        the document boundaries nearest to k * N / M, so shards are balanced by tokens up to
        document granularity, and together cover the stream.
      seq_len: L; every shard must hold at least one window of L + 1 tokens.

    Returns:
      (starts_M, lengths_M), int32.
    """
    if mode not in SHARD_MODES:
        raise ValueError(f"mode must be one of {SHARD_MODES}, got {mode!r}")
    if not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if not 0 < num_tokens < 2**31:
        raise ValueError(f"num_tokens must be in [1, 2**31), got {num_tokens}")
    offsets = np.asarray(doc_offsets, dtype=np.int64)
    if offsets.size and offsets[-1] == num_tokens:
        offsets = offsets[:-1]
    if (
        offsets.ndim != 1
        or offsets.size == 0
        or offsets[0] != 0
        or np.any(np.diff(offsets) <= 0)
        or offsets[-1] >= num_tokens
    ):
        raise ValueError("doc_offsets must be strictly increasing from 0 and below num_tokens")

    if mode == "iid":
        starts = np.zeros(num_workers, dtype=np.int64)
        lengths = np.full(num_workers, num_tokens, dtype=np.int64)
    else:
        num_docs = offsets.size
        if num_docs < num_workers:
            raise ValueError(
                f"num_workers={num_workers} non_iid shards need at least that many documents, "
                f"got {num_docs}"
            )
        bounds = np.append(offsets, num_tokens)  # [D + 1]
        cuts = [0]
        for k in range(1, num_workers):
            ideal = k * num_tokens / num_workers
            cut = int(np.argmin(np.abs(bounds[1:num_docs] - ideal))) + 1
            # Each shard keeps at least one document, on both sides of the cut.
            cut = min(max(cut, cuts[-1] + 1), num_docs - (num_workers - k))
            cuts.append(cut)
        cuts.append(num_docs)
        starts = bounds[cuts[:-1]]
        lengths = bounds[cuts[1:]] - starts
    if lengths.min() < seq_len + 1:
        raise ValueError(
            f"a {mode} shard for num_workers={num_workers} has {lengths.min()} tokens, fewer than "
            f"seq_len + 1 = {seq_len + 1}"
        )
    return starts.astype(np.int32), lengths.astype(np.int32)


# ---------------------------------------------------------------------------------------
# Samplers.


@functools.partial(jax.jit, static_argnames=("batch_size", "seq_len"))
def sample_batch(
    tokens_N: jax.Array,
    start: jax.Array,
    length: jax.Array,
    key: jax.Array,
    batch_size: int,
    seq_len: int,
) -> Batch:
    """Draws B windows of L + 1 tokens uniformly from tokens_N[start : start + length].

    Pure and jittable (batch_size, seq_len static); vmap over (start, length, key) for
    workers. Requires length >= L + 1 and start + length <= N (worker_shards ensures it).

    Args:
      tokens_N: integer token stream [N] (int32, or uint8 to save memory).
      start, length: int32 scalars, the shard.
      key: PRNG key.
      batch_size: B >= 1 (static).
      seq_len: L >= 1 (static).

    Returns:
      {"inputs": int32 [B, L], "targets": int32 [B, L]}, targets = inputs shifted by one.
    """
    # randint's maxval is exclusive: offsets in [0, length - L - 1] keep windows in range.
    maxval = jnp.maximum(length - seq_len, 1)
    offsets_B = jax.random.randint(key, (batch_size,), 0, maxval, dtype=jnp.int32)
    # An elementwise gather, not a dynamic_slice per window: with the stream split over a
    # worker's devices, XLA reads each token where it lives and all-reduces the B x (L + 1)
    # batch, where a window slice would first gather the whole stream onto every device.
    index_BxL1 = (start + offsets_B)[:, None] + jnp.arange(seq_len + 1, dtype=jnp.int32)
    windows_BxL1 = tokens_N[index_BxL1].astype(jnp.int32)
    return {"inputs": windows_BxL1[:, :-1], "targets": windows_BxL1[:, 1:]}


def batch_key(key: jax.Array, round_index: Any, worker: Any, step: Any) -> jax.Array:
    """Sampling key for (round, worker, inner step); jittable, so engines can use it in-graph."""
    return jax.random.fold_in(
        jax.random.fold_in(jax.random.fold_in(key, round_index), worker), step
    )


@functools.partial(jax.jit, static_argnames=("num_workers", "inner_steps", "batch_size", "seq_len"))
def _round_batches(
    tokens, starts, lengths, key, round_index, *, num_workers, inner_steps, batch_size, seq_len
):
    def one(worker, step):
        k = batch_key(key, round_index, worker, step)
        return sample_batch(tokens, starts[worker], lengths[worker], k, batch_size, seq_len)

    steps_H = jnp.arange(inner_steps)
    per_worker = lambda w: jax.vmap(lambda h: one(w, h))(steps_H)
    return jax.vmap(per_worker)(jnp.arange(num_workers))


def round_batches(
    tokens: np.ndarray | jax.Array,
    starts: np.ndarray,
    lengths: np.ndarray,
    key: jax.Array,
    round_index: int,
    num_workers: int,
    inner_steps: int,
    batch_size: int,
    seq_len: int,
) -> dict[str, np.ndarray]:
    """All inner-step batches of one round, on the host.

    The batch of worker m at inner step h of round r is
    sample_batch(tokens, starts[m], lengths[m], batch_key(key, r, m, h), B, L).
    Pass `tokens` as a jax.Array to avoid uploading the stream on every call.

    Returns:
      {"inputs", "targets"}: numpy int32 [M, H, B, L].
    """
    starts = np.asarray(starts)
    lengths = np.asarray(lengths)
    if starts.shape != (num_workers,) or lengths.shape != (num_workers,):
        raise ValueError(
            f"starts and lengths must have shape [num_workers={num_workers}], got "
            f"{starts.shape} and {lengths.shape}"
        )
    if inner_steps < 1 or batch_size < 1 or seq_len < 1:
        raise ValueError("inner_steps, batch_size and seq_len must be >= 1")
    if lengths.min() < seq_len + 1 or (starts + lengths.astype(np.int64)).max() > len(tokens):
        raise ValueError("every shard must lie inside tokens and hold >= seq_len + 1 tokens")
    batches = _round_batches(
        tokens,
        jnp.asarray(starts, jnp.int32),
        jnp.asarray(lengths, jnp.int32),
        key,
        jnp.asarray(round_index, jnp.int32),
        num_workers=num_workers,
        inner_steps=inner_steps,
        batch_size=batch_size,
        seq_len=seq_len,
    )
    return jax.device_get(batches)


def eval_batches(
    val_tokens: np.ndarray, num_batches: int, batch_size: int, seq_len: int
) -> dict[str, np.ndarray]:
    """Fixed validation batches: num_batches * B non-overlapping, evenly spaced windows.

    Window w (row-major over [num_batches, B]) starts at w * stride with
    stride = (N - L - 1) // (W - 1) >= L + 1, so windows span the whole stream.

    Returns:
      {"inputs", "targets"}: numpy int32 [num_batches, B, L]. ValueError if
      len(val_tokens) < num_batches * B * (L + 1).
    """
    val_tokens = np.asarray(val_tokens)
    if val_tokens.ndim != 1:
        raise ValueError(f"val_tokens must be 1-D, got shape {val_tokens.shape}")
    if num_batches < 1 or batch_size < 1 or seq_len < 1:
        raise ValueError("num_batches, batch_size and seq_len must be >= 1")
    num_windows = num_batches * batch_size
    need = num_windows * (seq_len + 1)
    if val_tokens.size < need:
        raise ValueError(
            f"val_tokens has {val_tokens.size} tokens; {num_batches} x {batch_size} windows of "
            f"seq_len + 1 = {seq_len + 1} need {need}"
        )
    stride = (val_tokens.size - seq_len - 1) // max(num_windows - 1, 1)
    starts_W = np.arange(num_windows, dtype=np.int64) * stride
    windows = val_tokens[starts_W[:, None] + np.arange(seq_len + 1)].astype(np.int32)
    windows = windows.reshape(num_batches, batch_size, seq_len + 1)
    return {"inputs": windows[..., :-1], "targets": windows[..., 1:]}
