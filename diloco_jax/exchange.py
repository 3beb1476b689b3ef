"""How a sync averages the workers' deltas: the exchange part of `diloco_round`.

An exchange is a pair of functions run around the backend's collectives:

- `send(delta, residual, included, weight) -> (to_reduce, residual)` runs per worker on its
  delta Δ_m (delta dtype) and its error-feedback residual (float32 like Δ_m, or None);
  `included` (bool scalar) and `weight` (float32 scalar or None for 1) come from the weight
  rule and are None when the round has no fault options.
- `reduce(local) -> (mean, weight_sum)` runs per device on its k workers' `to_reduce`,
  stacked [k, ...], with collectives over `WORKER_AXIS`; `mean` is the (weighted) mean delta
  in the delta dtype, the same on every device; `weight_sum` is the float32 sum of the
  weights (None for an unweighted exchange). A weighted mean with weight sum 0 is zeros.

Five exchanges, picked by compression and by whether the round weighs workers:
- exact: one all-reduce of the deltas (a local sum over k, then psum), divided by M;
- exact, weighted: each worker sends `where(included, w Δ, 0)` and `where(included, w, 0)`;
  two all-reduces, the first divided by the second (`jnp.where`, not a product, zeroes a left
  out delta: 0 * NaN is NaN);
- gather (sparse codecs, SparseLoCo's among them; dense ones with `exchange="gather"`): each
  worker encodes Δ (+ its residual, decayed by SparseLoCo's beta, under error feedback) into
  integer payloads (`compression.encode_tree`), the payloads are all-gathered and every
  device decodes all M and averages in float32 (with `per_contributor`, each coordinate over
  the workers that sent it: `compression.decode_mean`); each device receives M - 1 payloads,
  so its wire bytes grow linearly with M;
- gather, weighted: each worker encodes `where(included, Δ, 0)` and sends its payload with
  its weight; both are all-gathered and the decoded deltas' weighted mean is taken. A left-out
  worker keeps its residual (it sent nothing);
- two-stage (the dense codecs' default: bf16, fp8, int8, int4, e3m0), the reduce-scatter +
  all-gather shape of a ring all-reduce with payloads quantized on the wire (as torchft's
  quantized all-reduce). Every worker encodes its delta (masked, + residual, as above) into
  block rows (`compression.encode_blocks`: each leaf padded to whole blocks, the blocks of the
  sync's leaves stacked). Over D devices the rows are padded to a multiple of D and split into
  D chunks of whole blocks; `lax.all_to_all` hands device d chunk d of every worker; it
  decodes them and sums them in float32 in worker order (weighted: w_m-weighted, divided by
  the weight sum; else divided by M), re-encodes its reduced chunk and `lax.all_gather`s it;
  every device decodes the whole mean. Each device sends 2 (D - 1) / D x its payload, the
  ring's scaling. Every worker encodes its own delta and the sums run in worker order, so the
  result does not depend on how workers are laid out on devices (one device, the vmap
  backend, runs the same arithmetic with no collectives). Error feedback keeps each worker's
  first-stage residual; the second quantization's error (at most half a quantization step of
  the mean's block per element for int8 / int4, see `compression`) is not fed back. Weights
  travel as one float32 per worker beside the payload (an all-gather).
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from diloco_jax.carry import Carry, Role, Weighed, set_leaves
from diloco_jax.compression import (
    Compression,
    Residuals,
    block_row_bytes,
    decode_blocks,
    decode_mean,
    encode_blocks,
    encode_tree,
    from_blocks,
    to_blocks,
    tree_payload_bytes,
)
from diloco_jax.outer import delta_dtype, widen
from diloco_jax.schedule import leaf_indices, part
from diloco_jax.workers import WORKER_AXIS, all_gather_workers, exact_mean, shard_shape


class Exchange(NamedTuple):
    """`send` per worker and `reduce` per device (see the module docstring)."""

    send: Callable[[Any, Any, Any, Any], tuple[Any, Any]]
    reduce: Callable[[Any], tuple[Any, jax.Array | None]]


def make_exchange(
    compression: Compression, like: Any, num_workers: int, weighted: bool
) -> Exchange:
    """The exchange for `compression` (validated) of deltas shaped like `like` (arrays or
    ShapeDtypeStructs in the delta dtype), over M = `num_workers`; `weighted` when the round
    has fault options (a weight per worker travels with its delta)."""
    lossy = compression.kind != "none"
    if not lossy and not weighted:
        return Exchange(_send_exact, functools.partial(_exact_reduce, num_workers=num_workers))
    if not lossy:
        return Exchange(_send_weighted, masked_mean)
    if compression.resolved_exchange == "two_stage":
        return Exchange(
            functools.partial(_send_blocks, compression, weighted),
            functools.partial(two_stage_mean, compression, like, num_workers, weighted),
        )
    if not weighted:
        return Exchange(
            functools.partial(_send_encoded, compression),
            functools.partial(_decoded_reduce, compression, like),
        )
    return Exchange(
        functools.partial(_send_weighted_encoded, compression),
        functools.partial(masked_decode_mean, compression, like),
    )


def transfers(compression: Compression, synced: list, num_workers: int, weighted: bool) -> list:
    """The collectives one sync's exchange of the delta leaves `synced` (arrays or shapes in
    the delta dtype) runs over the M workers, as (op, operand bytes per worker) pairs
    (`comm.wire_bytes` prices them):

    * exact: one all-reduce of the deltas, B bytes (with weights, the float32 weight rides in
      the operand: + 4 bytes);
    * two-stage (dense codecs): an all-to-all of the worker's block rows, the rows padded to
      a multiple of M blocks (NB' blocks of R bytes: codes + float32 scale), then an
      all-gather of its reduced chunk of NB'/M rows;
    * gather: an all-gather of the payload;
    with weights the lossy ones add an all-gather of the float32 weight."""
    m = num_workers
    exchange = compression.resolved_exchange
    if exchange == "exact":
        delta_bytes = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in synced)
        return [("all-reduce", delta_bytes + (_WEIGHT_BYTES if weighted else 0))]
    if exchange == "two_stage":
        blocks = jax.eval_shape(lambda xs: to_blocks(xs, compression.block_size), synced).shape[0]
        rows = -(-blocks // m) * m * block_row_bytes(compression)
        out = [("all-to-all", rows), ("all-gather", rows / m)]
    else:
        out = [("all-gather", tree_payload_bytes(synced, compression))]
    return out + ([("all-gather", _WEIGHT_BYTES)] if weighted else [])


_WEIGHT_BYTES = 4  # a worker's float32 weight at a sync


def shard_groups(specs: "Sequence[PartitionSpec]") -> list[tuple[tuple[str, ...], list[int]]]:
    """The positions of leaves split over the same mesh axes, by those axes (sorted names;
    () for a leaf whole on every device), in order of first appearance. On a mesh a
    compressed exchange runs once per group, manual over its axes: each device encodes its
    own shards (the codec's blocks per shard)."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, spec in enumerate(specs):
        names = set()
        for entry in spec:
            if entry is not None:
                names.update(entry if isinstance(entry, tuple) else (entry,))
        groups.setdefault(tuple(sorted(names)), []).append(i)
    return list(groups.items())


def _send_exact(delta, residual, included, weight):
    return delta, residual


def _exact_reduce(local, num_workers):
    return exact_mean(local, num_workers), None


def _send_weighted(delta, residual, included, weight):
    if weight is None:
        return unweighted_contribution(delta, included), residual
    return masked_contribution(delta, included, weight), residual


def _send_encoded(compression, delta, residual, included, weight):
    payloads, new_residual = encode_tree(delta, compression, residual)
    return payloads, new_residual if compression.error_feedback else residual


def _decoded_reduce(compression, like, local):
    return decode_mean(all_gather_workers(local), compression, like), None


def _send_weighted_encoded(compression, delta, residual, included, weight):
    # A left-out worker encodes zeros (its weight masks them) and keeps its residual.
    sent, _ = unweighted_contribution(delta, included)
    payloads, new_residual = encode_tree(sent, compression, residual)
    weight = jnp.float32(1) if weight is None else weight
    if compression.error_feedback:
        residual = jax.tree.map(lambda a, b: jnp.where(included, a, b), new_residual, residual)
    return (payloads, jnp.where(included, weight, 0.0)), residual


def masked_contribution(
    delta: Any, included: jax.Array, weight: jax.Array
) -> tuple[Any, jax.Array]:
    """One worker's `(where(included, weight * Δ, 0), where(included, weight, 0))`.

    delta: Δ_m in the delta dtype; included: bool scalar; weight: float32 scalar.
    """
    w = jnp.where(included, weight, 0.0).astype(jnp.float32)
    sent = jax.tree.map(lambda d: jnp.where(included, d * weight.astype(d.dtype), 0), delta)
    return sent, w


def unweighted_contribution(delta: Any, included: jax.Array) -> tuple[Any, jax.Array]:
    """`masked_contribution` with weight 1, without multiplying: `(where(included, Δ, 0),
    float32 0/1)`."""
    sent = jax.tree.map(lambda d: jnp.where(included, d, jnp.zeros_like(d)), delta)
    return sent, included.astype(jnp.float32)


def masked_mean(local: tuple[Any, jax.Array]) -> tuple[Any, jax.Array]:
    """Reducer: the weighted mean of the included workers' deltas.

    local: (sent, weights) of this device's k workers, leaves [k, ...] and float32 [k].
    Returns (mean Δ in each leaf's dtype — zeros when the weight sum is 0 —, float32 weight
    sum). Two all-reduces over the devices: the summed deltas and the summed weights.
    """
    sent, weights = local
    total = lax.psum(jnp.sum(weights), WORKER_AXIS)
    safe = jnp.where(total > 0, total, 1.0)

    def mean(x):
        s = lax.psum(jnp.sum(x, 0), WORKER_AXIS)
        return jnp.where(total > 0, s / safe.astype(x.dtype), jnp.zeros_like(s)).astype(x.dtype)

    return jax.tree.map(mean, sent), total


def masked_decode_mean(
    compression: Compression, like: Any, local: tuple[Any, jax.Array]
) -> tuple[Any, jax.Array]:
    """Reducer under a lossy compression: local = (payloads, weights) of this device's k
    workers ([k, ...] payload arrays, float32 [k]). Returns (weighted mean of the decoded
    deltas in `like`'s dtypes — zeros when the weight sum is 0 —, float32 weight sum). Two
    all-gathers over the devices: the payloads and the weights."""
    payloads, weights = local
    weights_M = all_gather_workers(weights)
    mean = decode_mean(all_gather_workers(payloads), compression, like, weights_M)
    return mean, jnp.sum(weights_M)


def _send_blocks(compression, weighted, delta, residual, included, weight):
    """A worker's block rows (codes [NB, row], scales [NB] or None) of Δ (masked when
    weighted, + residual under error feedback), its new residual, and its weight."""
    leaves, treedef = jax.tree.flatten(delta)
    if weighted:
        leaves = [jnp.where(included, d, jnp.zeros_like(d)) for d in leaves]
    values = [d.astype(jnp.float32) for d in leaves]
    feedback = compression.error_feedback
    if feedback:
        values = [
            v + r.astype(jnp.float32)
            for v, r in zip(values, treedef.flatten_up_to(residual), strict=True)
        ]
    codes, scales = encode_blocks(to_blocks(values, compression.block_size), compression)
    if feedback:
        decoded = from_blocks(decode_blocks(codes, scales, compression), values)
        new = treedef.unflatten([v - d for v, d in zip(values, decoded, strict=True)])
        residual = (
            new
            if not weighted
            else jax.tree.map(lambda a, b: jnp.where(included, a, b), new, residual)
        )
    if not weighted:
        return (codes, scales), residual
    weight = jnp.float32(1) if weight is None else weight
    return (codes, scales, jnp.where(included, weight, 0.0)), residual


def two_stage_mean(
    compression: Compression, like: Any, num_workers: int, weighted: bool, local: tuple
) -> tuple[Any, jax.Array | None]:
    """Reducer of the two-stage exchange (see the module docstring). local: this device's k
    workers' (codes [k, NB, row], scales [k, NB] or None[, weights float32 [k]]). Returns
    (the mean in `like`'s structure and dtypes, float32 weight sum or None)."""
    codes, scales, total = reduced_rows(compression, num_workers, weighted, local)
    devices = num_workers // local[0].shape[0]
    # Every device's reduced chunk to every device (with one device: a no-op that types the
    # result as the same everywhere).
    gathered = all_gather_workers(_pack_rows(codes, scales)[None])
    codes, scales = _unpack_rows(gathered.reshape(devices * codes.shape[0], -1), codes, scales)
    return rows_mean(compression, like, codes, scales, total), total


def reduced_rows(
    compression: Compression, num_workers: int, weighted: bool, local: tuple
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """The two-stage exchange's first stage and re-encode, run per device on its k workers'
    (codes [k, NB, row], scales [k, NB] or None[, weights float32 [k]]): this device's chunk
    of the mean, encoded (codes [NB' / D, row], scales or None; the rows padded to a multiple
    of the D devices), and the float32 weight sum (None unweighted). With one device the
    chunk is the whole mean: what the elastic syncer sends its workers back."""
    codes_k, scales_k = local[0], local[1]
    num_local, num_blocks = codes_k.shape[:2]
    devices = num_workers // num_local
    chunk = -(-num_blocks // devices)
    pad = chunk * devices - num_blocks
    if pad:
        codes_k = jnp.pad(codes_k, ((0, 0), (0, pad), (0, 0)))
        scales_k = None if scales_k is None else jnp.pad(scales_k, ((0, 0), (0, pad)))
    if devices > 1:  # chunk d of every worker to device d: [M, chunk, ...] in worker order
        packed = _pack_rows(codes_k, scales_k).reshape(num_local, devices, -1)
        received = lax.all_to_all(packed, WORKER_AXIS, split_axis=1, concat_axis=0, tiled=True)
        codes_M, scales_M = _unpack_rows(
            received.reshape(num_workers, chunk, -1), codes_k, scales_k
        )
    else:
        codes_M, scales_M = codes_k, scales_k
    decoded = [
        decode_blocks(codes_M[m], None if scales_M is None else scales_M[m], compression)
        for m in range(num_workers)
    ]
    if weighted:
        weights_M = all_gather_workers(local[2])
        total = jnp.sum(weights_M)
        decoded = [
            jnp.where(weights_M[m] > 0, d * weights_M[m], 0.0) for m, d in enumerate(decoded)
        ]
        divisor = jnp.where(total > 0, total, 1.0)
    else:
        total, divisor = None, jnp.float32(num_workers)
    summed = decoded[0]
    for d in decoded[1:]:  # in worker order, whatever the layout
        summed = summed + d
    codes, scales = encode_blocks(summed / divisor, compression)
    return codes, scales, total


def rows_mean(
    compression: Compression, like: Any, codes: jax.Array, scales: jax.Array | None,
    total: jax.Array | None,
) -> Any:  # fmt: skip
    """The mean the encoded rows of all of it (codes [NB', row], scales [NB'] or None, NB'
    >= the NB blocks of `like`'s leaves) decode to, in `like`'s structure and dtypes; zeros
    where a weight sum `total` is 0."""
    leaves, treedef = jax.tree.flatten(like)
    num_blocks = jax.eval_shape(lambda xs: to_blocks(xs, compression.block_size), leaves).shape[0]
    mean = decode_blocks(codes, scales, compression)[:num_blocks]
    if total is not None:
        mean = jnp.where(total > 0, mean, 0.0)
    return treedef.unflatten(from_blocks(mean, leaves))


def _pack_rows(codes: jax.Array, scales: jax.Array | None) -> jax.Array:
    """uint8 [..., NB, row bytes + 4]: each block's code bytes, then its scale's bytes."""
    parts = [lax.bitcast_convert_type(codes, jnp.uint8).reshape(*codes.shape[:-1], -1)]
    if scales is not None:
        parts.append(lax.bitcast_convert_type(scales, jnp.uint8))
    return jnp.concatenate(parts, axis=-1)


def _unpack_rows(packed: jax.Array, codes_like: jax.Array, scales_like: jax.Array | None):
    """Inverse of `_pack_rows` (dtypes and row widths from the `*_like` arrays)."""
    itemsize = jnp.dtype(codes_like.dtype).itemsize
    width = codes_like.shape[-1] * itemsize
    raw = packed[..., :width]
    if itemsize > 1:
        raw = raw.reshape(*raw.shape[:-1], codes_like.shape[-1], itemsize)
    codes = lax.bitcast_convert_type(raw, codes_like.dtype)
    if scales_like is None:
        return codes, None
    scales = lax.bitcast_convert_type(packed[..., width:], jnp.float32)
    return codes, scales


class ExchangeRole(Role):
    """The compression part in a round: one exchange per sync (`make_exchange`), run on each
    device's shards where a compressed exchange meets leaves split over the worker's own
    axes (`groups`), with each worker's error-feedback residual (`Residuals`) when the codec
    feeds its error back."""

    name = "compression"

    def __init__(self, exchanges: tuple, groups: tuple | None, syncs: tuple, fragmented: bool):
        self.exchanges, self.groups = exchanges, groups
        self.syncs, self.fragmented = syncs, fragmented

    def begin(self, c: Carry, ctx: Any) -> Carry:
        state = ctx.local.get(self.name)
        leaves = None if state is None else ctx.treedef.flatten_up_to(state.residual)
        return c.with_own(self.name, leaves)

    def exchange(self, c: Carry, ctx: Any, sync: Any, delta_k: Any, weighed: Any) -> tuple:
        """(the sync's mean delta, float32 weight sum or None, the carry with the new
        residuals)."""
        res_leaves = c.own[self.name]
        res_k = None if res_leaves is None else part(sync, res_leaves, ctx.treedef)
        mean, weight_sum, res_k = exchanged(
            self.exchanges[sync.index], ctx.collectives, self._groups(sync), delta_k, res_k,
            weighed.included_k, weighed.weight_k,
        )  # fmt: skip
        if res_leaves is not None:
            indices = leaf_indices(sync, len(res_leaves))
            c = c.with_own(self.name, set_leaves(res_leaves, indices, res_k))
        return mean, weight_sum, c

    def send(self, sync: Any, delta_k: Any, weighed: Any) -> Any:
        """Each worker's contribution to the sync's reduction (no residual), leaves [k, ...]."""
        send = jax.vmap(self.exchanges[sync.index].send)
        return send(delta_k, None, weighed.included_k, weighed.weight_k)[0]

    def launch(self, c: Carry, ctx: Any, deltas_k: Any, weights_k: Any, weights: Role) -> tuple:
        """Exchanges the deltas in flight (leaves [k, ...], one exchange per sync, each
        sync's weights from `weights_k`: [k], or [k, P] with fragments): ((mean tree,
        float32 weight sum: a scalar, or [P] with fragments), the carry)."""
        delta_leaves_k = ctx.treedef.flatten_up_to(deltas_k)
        # A frozen leaf (in no sync) has a zero mean.
        mean_leaves = [jnp.zeros(x.shape[1:], x.dtype) for x in delta_leaves_k]
        weight_sums = []
        for sync in self.syncs:
            sync_weights_k = weights_k[:, sync.index] if self.fragmented else weights_k
            included_k, weight_k = weights.launched(sync_weights_k)
            synced_k = part(sync, delta_leaves_k, ctx.treedef)
            mean, weight_sum, c = self.exchange(
                c, ctx, sync, synced_k, Weighed(included_k=included_k, weight_k=weight_k)
            )
            weight_sums.append(jnp.float32(ctx.num_workers) if weight_sum is None else weight_sum)
            mean_leaves = set_leaves(mean_leaves, leaf_indices(sync, len(mean_leaves)), mean)
        weight_sum = jnp.stack(weight_sums) if self.fragmented else weight_sums[0]
        return (jax.tree.unflatten(ctx.treedef, mean_leaves), weight_sum), c

    def end(self, c: Carry, ctx: Any) -> tuple[Any, Any]:
        leaves = c.own[self.name]
        return None, None if leaves is None else Residuals(jax.tree.unflatten(ctx.treedef, leaves))

    def _groups(self, sync: Any) -> Any:
        return None if self.groups is None else self.groups[sync.index]


def exchanged(exchange, collectives, groups, delta_k, residual_k, included_k, weight_k):
    """One sync's exchange of this device's workers' deltas (leaves [k, ...]): (the mean,
    float32 weight sum or None, the new residuals). `groups` (`sharded_groups`', for this
    sync): one exchange per group of leaves split over the same axes, run manual over those
    axes, so each device encodes and exchanges its own shards: XLA's partitioner would
    otherwise gather a sharded leaf to cut it into the codec's blocks, and every device would
    send the whole payload. (One exchange over leaves split differently would mix values that
    vary over an axis into leaves that don't.)"""

    def run(exchange, delta_k, residual_k, included_k, weight_k):
        to_reduce_k, residual_k = jax.vmap(exchange.send)(delta_k, residual_k, included_k, weight_k)
        mean, weight_sum = collectives.reduce(exchange.reduce, to_reduce_k)
        return mean, weight_sum, residual_k

    if groups is None:
        return run(exchange, delta_k, residual_k, included_k, weight_k)
    delta_leaves, treedef = jax.tree.flatten(delta_k)
    res_leaves = None if residual_k is None else treedef.flatten_up_to(residual_k)
    means, residuals = [None] * len(delta_leaves), [None] * len(delta_leaves)
    for positions, specs, axes, group_exchange in groups:
        deltas = [delta_leaves[i] for i in positions]
        res = None if res_leaves is None else [res_leaves[i] for i in positions]
        fn = functools.partial(run, group_exchange)
        if axes:
            specs_k = [PartitionSpec(None, *s) for s in specs]
            fn = jax.shard_map(
                fn,
                in_specs=(
                    specs_k,
                    None if res is None else specs_k,
                    PartitionSpec(),
                    PartitionSpec(),
                ),
                out_specs=(list(specs), PartitionSpec(), None if res is None else specs_k),
                axis_names=set(axes),
            )
        mean, weight_sum, res = fn(deltas, res, included_k, weight_k)
        for j, i in enumerate(positions):
            means[i] = mean[j]
            if res is not None:
                residuals[i] = res[j]
    residual_k = None if res_leaves is None else treedef.unflatten(residuals)
    # Every group sends the same weights, so any group's weight sum is the sync's.
    return treedef.unflatten(means), weight_sum, residual_k


def sharded_groups(compression, specs, mesh, schedule, leaves: list, num_workers, weighted):
    """Per sync, the groups a compressed exchange runs in on a mesh when some leaf is split
    over the worker's own axes: (positions in the sync's leaves, their specs, the axes they
    are split over, the exchange of their shards), by `shard_groups`. None when the exchange
    runs whole (no compression, no mesh, or every leaf whole on each worker's devices)."""
    split = specs is not None and any(e is not None for spec in specs for e in spec)
    if compression.kind == "none" or mesh is None or not split:
        return None
    out = []
    for sync in schedule.syncs:
        indices = leaf_indices(sync, len(leaves))
        sync_specs = [specs[i] for i in indices]
        groups = []
        for axes, positions in shard_groups(sync_specs):
            shards = [
                jax.ShapeDtypeStruct(
                    shard_shape(leaves[indices[j]].shape, sync_specs[j], mesh),
                    delta_dtype(leaves[indices[j]].dtype),
                )
                for j in positions
            ]
            exchange = make_exchange(compression, shards, num_workers, weighted)
            groups.append((positions, [sync_specs[j] for j in positions], axes, exchange))
        out.append(tuple(groups))
    return tuple(out)


def exchange_role(method, schedule, leaves, treedef, num_workers, mesh, param_specs) -> Role:
    """The round's exchange role: one exchange per sync of `schedule` for `method`'s
    compression (weighted when its weights part weighs), over the params' `leaves`."""
    weighted = method.weights.active
    exchanges = tuple(
        make_exchange(
            method.compression,
            jax.eval_shape(widen, part(sync, leaves, treedef)),
            num_workers,
            weighted,
        )
        for sync in schedule.syncs
    )
    groups = sharded_groups(
        method.compression, param_specs, mesh, schedule, leaves, num_workers, weighted
    )
    return ExchangeRole(exchanges, groups, schedule.syncs, schedule.fragmented)
