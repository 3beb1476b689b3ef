"""Communication accounting, the one module that turns what a round sends into bytes: the
bytes a worker contributes to a round's exchange (`round_bytes`, history's
"bytes_communicated") and the bytes it sends on the wire (history's "wire_bytes").

Each part reports the collectives it runs as (op, operand bytes per worker[, times])
entries: the exchange (`exchange.transfers`), the weights (`Weights.sync_transfers`), what a
part runs on its own step schedule (`Part.transfers_through`: DES-LOC's state syncs), the
model state's merge (`model_state.transfers`), the
split outer state (`outer_sharding.transfers`). `wire_bytes` prices them under ring
algorithms (`ring_wire_bytes`, the only place that formula is written), and `Bill` adds up a
run's history entries from them.
"""

from typing import Any, NamedTuple

import jax

from diloco_jax import model_state as model_state_lib
from diloco_jax import outer_sharding
from diloco_jax.compression import Compression, parse_compression, tree_payload_bytes
from diloco_jax.exchange import shard_groups, transfers
from diloco_jax.faults import NormSoftmax, Weights
from diloco_jax.outer import widen
from diloco_jax.schedule import Streaming, synced_indices
from diloco_jax.trees import payload_bytes

LOSS_BYTES = 4  # the round's (or step's) mean loss: one float32 all-reduced over the workers


def ring_wire_bytes(op: str, operand_bytes: float, n: int) -> float:
    """Bytes one of n participants sends in collective `op` with `operand_bytes` per device
    (the local shard for all-gather) under a ring algorithm; 0 when n <= 1."""
    if n <= 1:
        return 0.0
    factors = {
        "all-reduce": 2 * (n - 1) / n,
        "all-gather": n - 1,
        "all-to-all": (n - 1) / n,
        "reduce-scatter": (n - 1) / n,
        "collective-permute": 1,  # point to point: the operand, to one peer
    }
    if op not in factors:
        raise ValueError(f"no ring cost for collective {op!r}")
    return factors[op] * operand_bytes


def wire_bytes(entries: list, num_workers: int) -> float:
    """Bytes each of M workers sends for the collectives `entries`, (op, operand bytes) or
    (op, operand bytes, times) each, under ring algorithms."""
    return sum(
        (e[2] if len(e) > 2 else 1) * ring_wire_bytes(e[0], e[1], num_workers) for e in entries
    )


def round_bytes(
    params: Any,
    compression: "str | Compression | None" = None,
    frozen: tuple[int, ...] = (),
    gossip: Any = None,
) -> int:
    """Bytes one worker sends in one DiLoCo round's outer-gradient exchange.

    The per-worker operand of the round's collectives, for `params` (arrays or
    `jax.ShapeDtypeStruct`s, the caller's dtypes):

    * no compression (None / "none"): the deltas in their delta dtype (float32, or float64
      params' float64), the all-reduce operand: |θ| x itemsize;
    * a lossy kind: every leaf's payload, the all_gather operand: integer codes, float32
      scales, int32 indices / packed masks, block padding included; SparseLoCo's per-block
      offsets, packed 2-bit codes and float32 levels (`compression.tree_payload_bytes`).

    * NoLoCo (`gossip`, a `noloco.NoLoCo`): its Δ and φ in float32, once per stage of its
      group mean (`NoLoCo.transfers`).

    Not included: the 4-byte all-reduce of the round's mean loss, and the 1 / M of the
    gathered result a worker receives back from each peer. With k workers on a device the
    device's all_gather operand is k times this (an exact all-reduce stays |θ| x itemsize,
    as the device sums its workers first).
    """
    c = parse_compression(compression)
    deltas = [
        x for i, x in enumerate(jax.tree.leaves(jax.eval_shape(widen, params))) if i not in frozen
    ]
    if gossip is not None:
        return sum(e[1] * e[2] for e in gossip.transfers(deltas))
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
    gossip: Any = None,
) -> float:
    """Bytes each worker sends on the wire in one DiLoCo round, under ring algorithms over
    the M workers, for every collective the round runs, as if every worker had its own link
    (whatever the device layout): the sum of what each part of the method contributes. Per
    sync of the schedule (one, or one per fragment: `schedule.synced_groups`), the exchange's
    collectives (`exchange.transfers`; `weighted`: the round carries fault weights) and the
    weights part's own (`Weights.sync_transfers`: EDiT's softmax, `softmax`, all-reduces
    the smallest delta norm); plus the all-reduce of the round's mean loss, 2(M-1)/M x 4.
    0 when M = 1. `fragments` is Streaming's P or pytree (None: one sync); `frozen` leaves
    (`diloco_jax.trainable`) send nothing. `specs`: each leaf's PartitionSpec, `params` being
    one device's shards of them: a compressed exchange then runs once per group of leaves
    split over the same axes (`exchange.shard_groups`), what that device sends. `gossip`
    (`noloco.NoLoCo`) exchanges with a group instead (`NoLoCo.transfers`), plus the all-reduce
    of its "outer_grad_norm" metric, 2(M-1)/M x 4."""
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
            if gossip is not None:
                entries = gossip.transfers([leaves[i] for i in group])
                entries.append(("all-reduce", LOSS_BYTES))
            else:
                entries = transfers(c, [leaves[i] for i in group], num_workers, weighted)
            total += wire_bytes(entries, num_workers)
        total += wire_bytes(weights.sync_transfers(), num_workers)
    return total


def sync_step_wire_bytes(params: Any, num_workers: int) -> float:
    """Bytes each worker sends on the wire in one data-parallel step: the all-reduce of the
    gradients (the params' dtypes) and of the step's mean loss, 2(M-1)/M x (|θ| + 4)."""
    return ring_wire_bytes("all-reduce", payload_bytes(params), num_workers) + ring_wire_bytes(
        "all-reduce", LOSS_BYTES, num_workers
    )


class Bill(NamedTuple):
    """What one iteration of a run (a DiLoCo round, a data-parallel step) sends, to add up in
    its history entries (`entries`).

    payload: "bytes_communicated" per iteration. wire: "wire_bytes" per iteration, without
    what parts run on their own step schedule. device: "wire_bytes_per_device" per iteration,
    or None where a device sends what its worker does (not reported). on_schedule: (the
    method's parts, one worker's inner state, one device's shard of it or None) for the
    collectives parts run on their own step schedule (`Part.transfers_through`: DES-LOC's
    state syncs); None without. merge: "model_state_wire_bytes" per iteration, or None
    without a model state. num_workers: M; steps_each: inner steps per iteration.
    """

    payload: int
    wire: float
    device: float | None = None
    on_schedule: Any = None
    merge: float | None = None
    num_workers: int = 1
    steps_each: int = 1

    def entries(self, done: int) -> dict[str, int]:
        """The cumulative bytes after `done` iterations, as history keys."""
        steps = done * self.steps_each
        synced = device_synced = 0.0
        if self.on_schedule is not None:
            parts, inner, inner_shards = self.on_schedule
            entries = [e for p in parts for e in p.transfers_through(steps, inner)]
            synced = wire_bytes(entries, self.num_workers)
            if inner_shards is not None:
                entries = [e for p in parts for e in p.transfers_through(steps, inner_shards)]
                device_synced = wire_bytes(entries, self.num_workers)
        out = {"bytes_communicated": done * self.payload}
        out["wire_bytes"] = round(done * self.wire + synced)
        if self.device is not None:
            out["wire_bytes_per_device"] = round(done * self.device + device_synced)
        if self.merge is not None:
            out["model_state_wire_bytes"] = round(done * self.merge)
        return out


def merge_wire_bytes(model_state: Any, rules: Any, num_workers: int) -> float | None:
    """ "model_state_wire_bytes" per merge (None without a model state)."""
    if rules is None:
        return None
    return wire_bytes(model_state_lib.transfers(model_state, rules), num_workers)


def split_outer_wire_bytes(num_syncs: int, num_workers: int) -> float:
    """What splitting the outer state over the workers adds to a round's wire bytes."""
    return wire_bytes(outer_sharding.transfers(num_syncs), num_workers)
