"""Communication accounting: the bytes a worker contributes to a round's exchange
(`round_bytes`, history's "bytes_communicated") and the bytes it sends on the wire
(`round_wire_bytes`, history's "wire_bytes")."""

from typing import Any

import jax
import numpy as np

from diloco_jax.compression import (
    Compression,
    block_row_bytes,
    parse_compression,
    to_blocks,
    tree_payload_bytes,
)
from diloco_jax.hlo import ring_wire_bytes
from diloco_jax.outer import widen
from diloco_jax.schedule import fragment_of

LOSS_BYTES = 4  # the round's (or step's) mean loss: one float32 all-reduced over the workers
WEIGHT_BYTES = 4  # a worker's float32 weight at a sync, under fault options


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
      scales, int32 indices / packed masks, block padding included; SparseLoCo's per-block
      offsets, packed 2-bit codes and float32 levels (`compression.tree_payload_bytes`).

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


def round_wire_bytes(
    params: Any,
    compression: "str | Compression | None",
    num_workers: int,
    *,
    fragments: Any = None,
    weighted: bool = False,
    softmax: bool = False,
) -> float:
    """Bytes each worker sends on the wire in one DiLoCo round, under ring algorithms over
    the M workers, for every collective the round runs, as if every worker had its own link
    (whatever the device layout). Per sync (one, or one per fragment) of B delta bytes:

    * exact: one all-reduce of the deltas, 2(M-1)/M x B (fault options add the float32
      weight to it);
    * two-stage (dense codecs): an all-to-all of the worker's block rows, the rows padded to
      a multiple of M blocks (NB' blocks of R bytes: codes + float32 scale), then an
      all-gather of its reduced chunk of NB'/M rows: (M-1)/M x NB' R + (M-1) x NB' R / M =
      2(M-1)/M x NB' R;
    * gather (sparse codecs, or `exchange="gather"`): an all-gather of the payload P,
      (M-1) x P;
    fault options add an all-gather of the float32 weight to the lossy ones, (M-1) x 4, and
    EDiT's softmax weighting (`softmax`) an all-reduce of the smallest delta norm,
    2(M-1)/M x 4. Plus the all-reduce of the round's mean loss, 2(M-1)/M x 4. 0 when M = 1."""
    if num_workers <= 1:
        return 0.0
    m = num_workers
    c = parse_compression(compression)
    exchange = c.resolved_exchange
    leaves = jax.tree.leaves(jax.eval_shape(widen, params))
    frags = (0,) * len(leaves) if fragments is None else fragment_of(params, fragments)
    total = ring_wire_bytes("all-reduce", LOSS_BYTES, m)
    for p in range(max(frags) + 1):
        synced = [x for x, f in zip(leaves, frags, strict=True) if f == p]
        if exchange == "exact":
            extra = WEIGHT_BYTES if weighted else 0
            total += ring_wire_bytes("all-reduce", payload_bytes(synced) + extra, m)
            continue
        if exchange == "two_stage":
            blocks = jax.eval_shape(lambda xs: to_blocks(xs, c.block_size), synced).shape[0]
            rows = -(-blocks // m) * m * block_row_bytes(c)
            total += ring_wire_bytes("all-to-all", rows, m) + ring_wire_bytes(
                "all-gather", rows / m, m
            )
        else:
            total += ring_wire_bytes("all-gather", tree_payload_bytes(synced, c), m)
        if weighted:
            total += ring_wire_bytes("all-gather", WEIGHT_BYTES, m)
    if softmax:
        total += (max(frags) + 1) * ring_wire_bytes("all-reduce", WEIGHT_BYTES, m)
    return total


def sync_step_wire_bytes(params: Any, num_workers: int) -> float:
    """Bytes each worker sends on the wire in one data-parallel step: the all-reduce of the
    gradients (the params' dtypes) and of the step's mean loss, 2(M-1)/M x (|θ| + 4)."""
    return ring_wire_bytes("all-reduce", payload_bytes(params), num_workers) + ring_wire_bytes(
        "all-reduce", LOSS_BYTES, num_workers
    )
