"""Communication accounting: the bytes a worker contributes to a collective."""

from typing import Any

import jax
import numpy as np

from diloco_jax.compression import Compression, parse_compression, tree_payload_bytes
from diloco_jax.outer import widen


def payload_bytes(tree: Any) -> int:
    """Bytes of one worker's payload: sum of size x itemsize over the leaves of `tree`.

    `tree` may hold arrays or `jax.ShapeDtypeStruct`s (e.g. from `jax.eval_shape`).
    """
    return int(
        sum(
            np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize
            for x in jax.tree.leaves(tree)
        )
    )


def round_bytes(params: Any, compression: "str | Compression | None" = None) -> int:
    """Bytes one worker sends in one DiLoCo round's outer-gradient exchange.

    The per-worker operand of the round's collectives, for `params` (arrays or
    `jax.ShapeDtypeStruct`s, the caller's dtypes):

    * no compression (None / "none"): the deltas in their delta dtype (float32, or float64
      params' float64), the all-reduce operand: |θ| x itemsize;
    * a lossy kind: every leaf's payload, the all_gather operand: integer codes, float32
      scales, int32 indices / packed masks, block padding included
      (`compression.tree_payload_bytes`).

    Not included: the 4-byte all-reduce of the round's mean loss, and the 1 / M of the
    gathered result a worker receives back from each peer. With k workers on a device the
    device's all_gather operand is k times this (an exact all-reduce stays |θ| x itemsize,
    as the device sums its workers first).
    """
    c = parse_compression(compression)
    deltas = jax.eval_shape(widen, params)
    if c.kind == "none":
        return payload_bytes(deltas)
    return tree_payload_bytes(deltas, c)
