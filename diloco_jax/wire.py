"""Bytes on the wire and on disk for the elastic runtime (`diloco_jax.elastic`): messages as
msgpack (Flax's serialization), leaves as their raw bytes, and files written whole or not at
all.

A message is a dict of str keys and msgpack values (numbers, strings, lists, dicts, None,
NumPy arrays, bytes). A pytree travels as its leaves in the order of `jax.tree.leaves`,
each as its raw bytes (`raw`: no encoding, no copy) or a NumPy array; the receiver rebuilds
it on a tree of the same structure it already has (the task's params, the optimizer's
state), so no structure, dtype or shape is ever trusted from the wire.

A file (`write_file`) is MAGIC, a CRC-32 of the rest, the length of a msgpack header, the
header (the message with each array replaced by its dtype, shape and place), then the arrays'
raw bytes. It is written to a temporary name, flushed to disk and renamed: a reader sees the
old file or the new one, and `read_file` refuses a torn or edited one. Files of the earlier
format (CRC-32, then the whole message as msgpack) are still read.
"""

import os
import struct
import zlib
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import serialization


def pack(message: dict[str, Any]) -> bytes:
    """A message dict as msgpack bytes (NumPy arrays kept with their dtype and shape)."""
    return serialization.msgpack_serialize(message)


def unpack(data: bytes) -> dict[str, Any]:
    """`pack`'s inverse. Raises ValueError on bytes that are not a packed dict."""
    try:
        message = serialization.msgpack_restore(data)
    except Exception as error:  # msgpack's own errors differ by version
        raise ValueError(f"not a packed message: {error}") from error
    if not isinstance(message, dict):
        raise ValueError(f"not a packed message: a {type(message).__name__}")
    return message


def leaves(tree: Any) -> list[np.ndarray]:
    """The tree's leaves as host NumPy arrays, in `jax.tree.leaves` order."""
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def raw(x: Any) -> memoryview:
    """A leaf's raw bytes (C order), without a copy where it is already contiguous."""
    # As uint8: a buffer of an ml_dtypes dtype (bfloat16, float8) can't be viewed directly.
    return memoryview(np.ascontiguousarray(x).reshape(-1).view(np.uint8))


def checksum(tree: Any) -> int:
    """CRC-32 of `tree`'s leaves' raw bytes in order: two trees of the same leaves agree
    where every byte does."""
    crc = 0
    for x in leaves(tree):
        crc = zlib.crc32(raw(x), crc)
    return crc


def tree_like(like: Any, arrays: list[Any], what: str) -> Any:
    """`like`'s structure with `arrays` as its leaves (arrays, or `raw` bytes read as the
    like leaf's dtype and shape, without a copy); ValueError naming `what` unless they match
    its leaves in number, shape and dtype (in bytes: in length)."""
    expected = jax.tree.leaves(like)
    if len(arrays) != len(expected):
        raise ValueError(f"{what}: {len(arrays)} leaves, expected {len(expected)}")
    out = []
    for i, (x, e) in enumerate(zip(arrays, expected, strict=True)):
        dtype = e.dtype if hasattr(e, "dtype") else np.result_type(e)  # a jax.Array's own
        if isinstance(x, bytes | bytearray | memoryview):
            size = int(np.prod(np.shape(e))) * np.dtype(dtype).itemsize
            if len(x) != size:
                raise ValueError(f"{what}: leaf {i} is {len(x)} bytes, expected {size} "
                                 f"({dtype}{list(np.shape(e))})")  # fmt: skip
            x = np.frombuffer(x, dtype).reshape(np.shape(e))
        x = np.asarray(x)
        if x.shape != np.shape(e) or x.dtype != dtype:
            raise ValueError(
                f"{what}: leaf {i} is {x.dtype}{list(x.shape)}, expected {dtype}{list(np.shape(e))}"
            )
        out.append(x)
    return jax.tree.unflatten(jax.tree.structure(like), out)


_HEADER = struct.Struct("<I")  # the earlier format: its CRC-32
MAGIC = b"DJW2"
_PREFIX = struct.Struct("<4sIQ")  # MAGIC, the CRC-32 of what follows, the header's length
_ARRAY = "__array__"


def _split(value: Any, blobs: list[memoryview], offset: list[int]) -> Any:
    """`value` with each array replaced by {_ARRAY: [offset, dtype, shape]}, its bytes in
    `blobs` (`offset[0]`: where the next one starts)."""
    if isinstance(value, dict):
        return {k: _split(v, blobs, offset) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_split(v, blobs, offset) for v in value]
    if isinstance(value, np.ndarray | np.generic) and value.dtype != object:
        blob = raw(value)
        blobs.append(blob)
        offset[0] += len(blob)
        return {_ARRAY: [offset[0] - len(blob), _dtype_name(value.dtype), list(np.shape(value))]}
    return value


def _dtype_name(dtype: np.dtype) -> str:
    """A name np.dtype reads back: NumPy's own with its byte order ("<f4"), or an ml_dtypes
    type's name ("bfloat16", whose .str says only "<V2"). Object and string arrays have no
    raw bytes to keep."""
    if dtype.kind in "OUS":
        raise ValueError(f"an array of dtype {dtype} can't be written as raw bytes")
    return dtype.name if dtype.kind == "V" else dtype.str


def _joined(value: Any, data: memoryview) -> Any:
    if isinstance(value, dict):
        if _ARRAY in value:
            start, dtype, shape = value[_ARRAY]
            count = int(np.prod(shape))
            return np.frombuffer(data, np.dtype(dtype), count, start).reshape(shape)
        return {k: _joined(v, data) for k, v in value.items()}
    if isinstance(value, list):
        return [_joined(v, data) for v in value]
    return value


def write_file(path: Path, message: dict[str, Any], recycle: Path | None = None) -> None:
    """Writes `message` to `path` whole or not at all (temporary file, fsync, rename, fsync
    of the folder): its arrays as their raw bytes, the rest as a msgpack header, the whole
    behind a CRC-32.

    recycle: a file of the same folder that this write retires (an older checkpoint that
    would be deleted after it), or None. It becomes the temporary file and is overwritten in
    place, so the kernel writes into the pages it already holds for it instead of finding
    new ones (for a checkpoint of θ's size each sync, most of the write's cost)."""
    blobs: list[memoryview] = []
    header = pack(_split(message, blobs, [0]))
    crc = zlib.crc32(header)
    for blob in blobs:
        crc = zlib.crc32(blob, crc)
    tmp = path.with_name(f".{path.name}.tmp")
    mode = "wb"
    if recycle is not None and recycle != path and recycle.exists():
        os.replace(recycle, tmp)
        mode = "r+b"
    with open(tmp, mode) as f:
        f.write(_PREFIX.pack(MAGIC, crc, len(header)))
        f.write(header)
        for blob in blobs:
            f.write(blob)
        f.truncate()  # a recycled file may have been longer
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def write_kept(path: Path, message: dict[str, Any], pattern: str, keep: int) -> None:
    """Writes `message` at `path` (`write_file`) among the files of its folder that match
    `pattern`, of which the `keep` >= 1 last by name stay: the oldest one retired is recycled
    for the write, the others retired are deleted after it."""
    retired = [p for p in sorted(path.parent.glob(pattern)) if p != path]
    retired = retired[: max(len(retired) - (keep - 1), 0)]
    write_file(path, message, recycle=retired[0] if retired else None)
    for old in retired[1:]:
        old.unlink(missing_ok=True)


def read_file(path: Path) -> dict[str, Any]:
    """The message `write_file` wrote; ValueError naming the file if it is short, its
    checksum does not match, or it holds no message."""
    data = Path(path).read_bytes()
    if data[: len(MAGIC)] == MAGIC:
        return _read_arrays_file(path, data)
    if len(data) < _HEADER.size:
        raise ValueError(f"{path}: {len(data)} bytes, too short for a checkpoint")
    (crc,) = _HEADER.unpack_from(data)
    body = data[_HEADER.size :]
    if zlib.crc32(body) != crc:
        raise ValueError(f"{path}: checksum mismatch (torn or edited file)")
    try:
        return unpack(body)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from error


def _read_arrays_file(path: Path, data: bytes) -> dict[str, Any]:
    if len(data) < _PREFIX.size:
        raise ValueError(f"{path}: {len(data)} bytes, too short for a checkpoint")
    _, crc, size = _PREFIX.unpack_from(data)
    rest = memoryview(data)[_PREFIX.size :]
    if zlib.crc32(rest) != crc or size > len(rest):
        raise ValueError(f"{path}: checksum mismatch (torn or edited file)")
    try:
        header = unpack(rest[:size])
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from error
    return _joined(header, rest[size:])
