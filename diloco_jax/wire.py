"""Bytes on the wire and on disk for the elastic runtime (`diloco_jax.elastic`): messages and
pytrees as msgpack (Flax's serialization), and files written whole or not at all.

A message is a dict of str keys and msgpack values (numbers, strings, lists, dicts, None,
NumPy arrays). A pytree travels as its leaves (NumPy arrays) in the order of
`jax.tree.leaves`; the receiver rebuilds it on a tree of the same structure it already has
(the task's params, the optimizer's state), so no structure is ever trusted from the wire.
A file (`write_file`) is a CRC-32 of its body then the body, written to a temporary name,
flushed to disk and renamed: a reader sees the old file or the new one, and `read_file`
refuses a torn or edited one.
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


def tree_like(like: Any, arrays: list[Any], what: str) -> Any:
    """`like`'s structure with `arrays` as its leaves; ValueError naming `what` unless they
    match its leaves in number, shape and dtype."""
    expected = jax.tree.leaves(like)
    if len(arrays) != len(expected):
        raise ValueError(f"{what}: {len(arrays)} leaves, expected {len(expected)}")
    out = []
    for i, (x, e) in enumerate(zip(arrays, expected, strict=True)):
        x = np.asarray(x)
        dtype = e.dtype if hasattr(e, "dtype") else np.result_type(e)  # a jax.Array's own
        if x.shape != np.shape(e) or x.dtype != dtype:
            raise ValueError(
                f"{what}: leaf {i} is {x.dtype}{list(x.shape)}, expected {dtype}{list(np.shape(e))}"
            )
        out.append(x)
    return jax.tree.unflatten(jax.tree.structure(like), out)


_HEADER = struct.Struct("<I")


def write_file(path: Path, message: dict[str, Any]) -> None:
    """Writes `message` to `path` whole or not at all (temporary file, fsync, rename, fsync
    of the folder), prefixed by the CRC-32 of its body."""
    body = pack(message)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(_HEADER.pack(zlib.crc32(body)) + body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def read_file(path: Path) -> dict[str, Any]:
    """The message `write_file` wrote; ValueError naming the file if it is short, its
    checksum does not match, or it holds no message."""
    data = Path(path).read_bytes()
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
