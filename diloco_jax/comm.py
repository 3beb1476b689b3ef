"""Communication accounting: the bytes a worker contributes to a round's exchange
(`round_bytes`, history's "bytes_communicated") and the bytes it sends on the wire
(`round_wire_bytes`, history's "wire_bytes")."""

from typing import Any

import jax
import numpy as np

from diloco_jax.compression import Compression, parse_compression, tree_payload_bytes
from diloco_jax.exchange import shard_groups, wire_bytes
from diloco_jax.faults import NormSoftmax, Weights
from diloco_jax.hlo import ring_wire_bytes
from diloco_jax.outer import widen
from diloco_jax.schedule import Streaming, synced_indices

LOSS_BYTES = 4  # the round's (or step's) mean loss: one float32 all-reduced over the workers


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


def round_bytes(
    params: Any, compression: "str | Compression | None" = None, frozen: tuple[int, ...] = ()
) -> int:
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
    deltas = [
        x for i, x in enumerate(jax.tree.leaves(jax.eval_shape(widen, params))) if i not in frozen
    ]
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
    frozen: tuple[int, ...] = (),
    specs: "tuple | None" = None,
) -> float:
    """Bytes each worker sends on the wire in one DiLoCo round, under ring algorithms over
    the M workers, for every collective the round runs, as if every worker had its own link
    (whatever the device layout): the sum of what each part of the method contributes. Per
    sync of the schedule (one, or one per fragment: `schedule.synced_groups`), the exchange's
    bytes (`exchange.wire_bytes`; `weighted`: the round carries fault weights) and the
    weights part's own (`Weights.sync_wire_bytes`: EDiT's softmax, `softmax`, all-reduces
    the smallest delta norm); plus the all-reduce of the round's mean loss, 2(M-1)/M x 4.
    0 when M = 1. `fragments` is Streaming's P or pytree (None: one sync); `frozen` leaves
    (`diloco_jax.trainable`) send nothing. `specs`: each leaf's PartitionSpec, `params` being
    one device's shards of them: a compressed exchange then runs once per group of leaves
    split over the same axes (`exchange.shard_groups`), what that device sends."""
    if num_workers <= 1:
        return 0.0
    c = parse_compression(compression)
    streaming = None if fragments is None else Streaming(fragments)
    weights = Weights(weighting=NormSoftmax() if softmax else "uniform")
    total = ring_wire_bytes("all-reduce", LOSS_BYTES, num_workers)
    wide = jax.eval_shape(widen, params)
    leaves = jax.tree.leaves(wide)
    for indices in synced_indices(wide, streaming, frozen):
        groups = [list(indices)]
        if specs is not None and c.kind != "none":
            groups = [
                [indices[j] for j in positions]
                for _, positions in shard_groups([specs[i] for i in indices])
            ]
        for group in groups:
            total += wire_bytes(c, [leaves[i] for i in group], num_workers, weighted)
        total += weights.sync_wire_bytes(num_workers)
    return total


def sync_step_wire_bytes(params: Any, num_workers: int) -> float:
    """Bytes each worker sends on the wire in one data-parallel step: the all-reduce of the
    gradients (the params' dtypes) and of the step's mean loss, 2(M-1)/M x (|θ| + 4)."""
    return ring_wire_bytes("all-reduce", payload_bytes(params), num_workers) + ring_wire_bytes(
        "all-reduce", LOSS_BYTES, num_workers
    )
