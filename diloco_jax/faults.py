"""Worker faults: the weight rule of `diloco_round` (non-finite deltas, simulated drops,
uneven inner steps).

At each sync every worker m gets `included_m` and a weight w_m: the exchange
(`diloco_jax.exchange`) then takes the weighted mean over the included workers, and a sync
where no worker is included leaves its leaves and their outer state unchanged.

- Non-finite deltas (`exclude_nonfinite=True`): a worker whose Δ_m (of the synced leaves) has
  a NaN or Inf is left out of the mean; it restarts from the current global θ (every leaf)
  with its inner optimizer state from the start of the round (the state it reached may hold
  NaNs).
- Drops (`drop_probability=p`, `drop_seed`): at each sync, worker m is dropped with
  probability p, from `drop_masks(drop_seed, round, M, p, syncs)` (a key folded from the seed
  and the round counter, so a run is reproducible and resumes from `state.round`). A dropped
  worker's Δ is left out and it carries on from its own params (the paper's ablation).
- Membership (`membership=((in_1, ..., in_M), ...)`, one row per round): the simulated
  counterpart of a real worker process that dies and heals (`diloco_jax.elastic`). A worker
  out of round r takes no inner step (its params, inner optimizer and model state stay as
  they were), is left out of every sync's mean that round, and its data for the round is
  unused; back in a later round it starts from θ like every worker, with the inner state it
  had when it left. Rounds past the last row have every worker.
- Uneven steps (`worker_steps=(h_1, ..., h_M)`, 1 <= h_m <= H): worker m takes its first h_m
  of each round's H scanned steps; later steps leave its params and optimizer state
  unchanged. `weighting="steps"` weights Δ_m by h_m (sample-weighted mean; with fragments
  too, as every fragment's window spans one round of steps); "uniform" by 1.
- EDiT (Cheng et al. 2024, arXiv 2412.07210): `weighting="norm_softmax"` weighs Δ_m by
  exp(-‖Δ_m‖ / T) (the weighted mean normalizes: a softmax of -‖Δ‖ / T over the included
  workers; computed as exp(-(‖Δ_m‖ - min_j ‖Δ_j‖) / T), the same ratios without underflow);
  `anomaly=AnomalySkip(...)` leaves out, like a non-finite one, a worker whose ‖Δ_m‖ is an
  outlier by an EWMA z-score of its own history (see `AnomalySkip`).
"""

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from diloco_jax import limits
from diloco_jax.carry import Carry, Part, Role, Weighed
from diloco_jax.schedule import WORKER_PARAMS, MergeIntoOwn, OwnParams, WorkerParams
from diloco_jax.workers import WORKER_AXIS, stack_workers


@dataclasses.dataclass(frozen=True)
class AnomalySkip:
    """EDiT's anomaly skip: at each sync, worker m's delta norm x = ‖Δ_m‖ is scored against
    an exponentially weighted mean μ_m and variance v_m of its own earlier norms (that
    sync's), z = (x - μ_m) / sqrt(v_m); after `warmup_rounds` rounds, z > `threshold` leaves
    the worker out like a non-finite one. Norms that are scored as outliers (or non-finite)
    don't update the statistics; the others do: μ <- (1 - a) μ + a x,
    v <- (1 - a) (v + a (x - μ)^2), with a = `alpha` (the first kept norm sets μ = x,
    v = 0). The statistics live in `DiLoCoState.parts["weights"]` (`Anomalies`)."""

    threshold: float = 3.0
    alpha: float = 0.02
    warmup_rounds: int = 120

    def __post_init__(self):
        for name, lo, hi in (("threshold", 0.0, math.inf), ("alpha", 0.0, 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"AnomalySkip.{name} must be a number, got {value!r}")
            if not lo < value <= hi or math.isinf(value):
                raise ValueError(f"AnomalySkip.{name} must be in ({lo}, {hi}], got {value!r}")
        w = self.warmup_rounds
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(f"AnomalySkip.warmup_rounds must be an integer >= 0, got {w!r}")


@dataclasses.dataclass(frozen=True)
class NormSoftmax:
    """EDiT's weighting: worker m weighs exp(-‖Δ_m‖ / temperature), temperature T > 0."""

    temperature: float = 1.0

    def __post_init__(self):
        t = self.temperature
        is_number = isinstance(t, int | float | np.integer | np.floating) and not isinstance(
            t, bool
        )
        if not is_number or not 0 < t < math.inf:
            raise ValueError(f"NormSoftmax.temperature must be a finite number > 0, got {t!r}")
        object.__setattr__(self, "temperature", float(t))


@dataclasses.dataclass(frozen=True)
class Weights(Part):
    """The weights part of a `DiLoCo` spec: each worker's weight at each sync.

    exclude_nonfinite: leave a worker with a NaN / Inf delta out of the mean (it restarts
      from θ); None: on for the exact exchange without eager updates, off otherwise
      (resolved by `DiLoCo`).
    drop_probability, drop_seed: drop each worker from each sync's mean with probability p in
      [0, 1) (None: off; 1, which would train nothing, is refused), keyed by (seed >= 0,
      round, sync).
    worker_steps: per-worker inner step counts (h_1, ..., h_M), each in [1, H]; None: all H.
    weighting: "uniform" (1), "steps" (h_m) or `NormSoftmax(T)` (EDiT; "norm_softmax" is
      NormSoftmax(1.0)).
    anomaly: EDiT's anomaly skip, an `AnomalySkip` (True: its defaults) or None.
    membership: which workers take part in each round, a sequence of rows (one per round
      from round 0, each M bools, at least one True); rounds past the last row have every
      worker; None: every worker every round. Not with drops or fragments.
    """

    exclude_nonfinite: bool | None = None
    drop_probability: float | None = None
    drop_seed: int = 0
    worker_steps: tuple[int, ...] | None = None
    weighting: "str | NormSoftmax" = "uniform"
    anomaly: "AnomalySkip | None" = None
    membership: tuple[tuple[bool, ...], ...] | None = None

    def __post_init__(self):
        x = self.exclude_nonfinite
        if x is not None and not isinstance(x, bool | np.bool_):
            raise ValueError(f"Weights.exclude_nonfinite must be a bool or None, got {x!r}")
        if x is not None:
            object.__setattr__(self, "exclude_nonfinite", bool(x))
        object.__setattr__(self, "drop_probability", _drop_probability(self.drop_probability))
        seed = self.drop_seed
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
            raise ValueError(f"Weights.drop_seed must be an integer >= 0, got {seed!r}")
        if seed > limits.SEED_MAX:  # a PRNG key keeps 32 bits of a seed
            raise ValueError(f"Weights.drop_seed must be at most {limits.SEED_MAX:,}, got {seed!r}")
        object.__setattr__(self, "drop_seed", int(seed))
        object.__setattr__(self, "worker_steps", _worker_steps(self.worker_steps))
        weighting = self.weighting
        if weighting == "norm_softmax":
            weighting = NormSoftmax()
        if not isinstance(weighting, NormSoftmax) and weighting not in ("uniform", "steps"):
            raise ValueError(
                f"Weights.weighting must be 'uniform', 'steps' or a NormSoftmax, got {weighting!r}"
            )
        object.__setattr__(self, "weighting", weighting)
        anomaly = self.anomaly
        if anomaly is True:
            anomaly = AnomalySkip()
        elif anomaly is False:
            anomaly = None
        if anomaly is not None and not isinstance(anomaly, AnomalySkip):
            raise ValueError(
                f"Weights.anomaly must be an AnomalySkip, True or None, got {anomaly!r}"
            )
        object.__setattr__(self, "anomaly", anomaly)
        object.__setattr__(self, "membership", _membership(self.membership))
        if self.membership is not None and self.drop_probability is not None:
            raise ValueError(
                "Weights.membership does not run with drop_probability (a dropped worker carries "
                "on from its own params, a worker back in the membership from θ)"
            )

    def __repr__(self) -> str:
        """The fields set away from their defaults."""
        shown = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default
        ]
        return f"Weights({', '.join(shown)})"

    @property
    def scheme(self) -> str:
        """ "uniform", "steps" or "norm_softmax"."""
        return "norm_softmax" if isinstance(self.weighting, NormSoftmax) else self.weighting

    @property
    def temperature(self) -> float:
        """T of the NormSoftmax weighting (1.0 otherwise)."""
        return self.weighting.temperature if isinstance(self.weighting, NormSoftmax) else 1.0

    @property
    def leaves_out(self) -> bool:
        """Whether a worker may be left out and restart (non-finite or an outlier)."""
        return bool(self.exclude_nonfinite) or self.anomaly is not None

    @property
    def uneven(self) -> bool:
        """Whether a worker may be left out of a mean or weigh other than 1."""
        return (
            self.leaves_out
            or self.drop_probability is not None
            or self.membership is not None
            or self.scheme != "uniform"
        )

    @property
    def active(self) -> bool:
        """Whether the round carries weights (any option on; the seed alone is not one)."""
        return self.uneven or self.worker_steps is not None

    @property
    def masked(self) -> bool:
        """Whether some worker may take fewer than H inner steps in a round."""
        return self.worker_steps is not None or self.membership is not None

    def initial(self, params: Any, outer_state: Any, num_workers: int, method: Any) -> dict:
        """Under drops every worker's own params (`schedule.WorkerParams`); under an anomaly
        skip empty norm statistics (`Anomalies`)."""
        parts = {}
        if self.drop_probability is not None:
            parts[WORKER_PARAMS] = WorkerParams(stack_workers(params, num_workers))
        if self.anomaly is not None:
            parts["weights"] = Anomalies(initial_stats(num_workers, method.num_syncs(params)))
        return parts

    def plan(self, build: Any, roles: dict) -> None:
        """Its rule weighs the workers (`WeighedRule`) when some option is on; under drops a
        dropped worker carries on from its own params."""
        if self.active:
            roles["weights"] = WeighedRule(self, build.num_steps, len(build.schedule.syncs))
        if self.drop_probability is not None:
            roles["merge"] = MergeIntoOwn(build.schedule.merge_alpha, roles["memory"])
            roles["starts"] = OwnParams()

    def fingerprint(self) -> dict:
        faults = dict(
            exclude_nonfinite=self.exclude_nonfinite,
            drop_probability=self.drop_probability,
            drop_seed=self.drop_seed,
            worker_steps=self.worker_steps,
            weighting=self.scheme,
        )
        if self.membership is not None:  # only where set: older fingerprints stay the same
            faults["membership"] = self.membership
        return {"faults": repr(faults)}

    def variant(self) -> dict:
        out = {}
        if self.scheme == "norm_softmax":
            out["temperature"] = self.temperature
        if self.anomaly is not None:
            out["anomaly"] = self.anomaly
        return out

    def check_with(self, method: Any) -> None:
        """Raises ValueError saying why `membership` can't run with fragments or with each
        worker's own θ: a worker back in the membership must start from the one global θ."""
        if self.membership is None:
            return
        if method.fragmented or method.owns_theta:
            what = "fragments (Streaming)" if method.fragmented else "eager updates or NoLoCo"
            raise ValueError(
                f"Weights.membership does not run with {what}: a worker back in the "
                "membership starts from the global θ, which these keep per worker"
            )

    def check_run(self, params: Any, num_workers: int, inner_steps: int, inner_state: Any) -> None:
        """Raises ValueError naming `Weights.worker_steps` or `Weights.membership` unless it
        fits M workers and H."""
        rows = self.membership
        if rows is not None and len(rows[0]) != num_workers:
            raise ValueError(
                f"Weights.membership must have one entry per worker ({num_workers}) in each "
                f"round's row, got {len(rows[0])}"
            )
        steps = self.worker_steps
        if steps is None:
            return
        if len(steps) != num_workers:
            raise ValueError(
                f"Weights.worker_steps must have one entry per worker ({num_workers}), got "
                f"{len(steps)}"
            )
        if max(steps) > inner_steps:
            raise ValueError(
                f"Weights.worker_steps must be in [1, inner_steps={inner_steps}], got {list(steps)}"
            )

    def sync_transfers(self) -> list:
        """The collectives each sync runs for the weights themselves, beside the exchange, as
        (op, operand bytes) pairs: EDiT's softmax all-reduces the smallest delta norm (a
        float32). The weight each worker's payload carries is the exchange's
        (`exchange.transfers`)."""
        return [("all-reduce", 4)] if self.scheme == "norm_softmax" else []


def softmax_weights(norms_k: jax.Array, smallest: jax.Array, temperature: float) -> jax.Array:
    """exp(-(‖Δ_m‖ - min_j ‖Δ_j‖) / T) for this device's workers (float32 [k]); a
    non-finite norm weighs 0 (its worker is left out anyway)."""
    finite = jnp.isfinite(norms_k)
    safe = jnp.where(finite, norms_k, smallest)
    return jnp.where(finite, jnp.exp(-(safe - smallest) / temperature), 0.0).astype(jnp.float32)


def initial_stats(num_workers: int, num_syncs: int) -> tuple["NormStats", ...]:
    """Empty statistics: per sync, float32 mean and variance [M] and int32 count [M]."""
    return tuple(
        NormStats(
            jnp.zeros((num_workers,), jnp.float32),
            jnp.zeros((num_workers,), jnp.float32),
            jnp.zeros((num_workers,), jnp.int32),
        )
        for _ in range(num_syncs)
    )


def anomalous(
    norms_k: jax.Array, stats_k: "NormStats", round_: jax.Array, rule: AnomalySkip
) -> jax.Array:
    """bool [k]: the workers whose norm's z-score against their statistics exceeds the
    threshold, once `rule.warmup_rounds` rounds have passed."""
    mean_k, var_k, _ = stats_k
    z = (norms_k - mean_k) / jnp.sqrt(jnp.maximum(var_k, 1e-30))
    return (round_ >= rule.warmup_rounds) & jnp.isfinite(norms_k) & (z > rule.threshold)


def updated_stats(
    norms_k: jax.Array, stats_k: "NormStats", keep_k: jax.Array, rule: AnomalySkip
) -> "NormStats":
    """The EWMA statistics after this sync: updated by the norms where `keep_k` (finite, not
    an outlier; the first kept norm sets them), unchanged elsewhere."""
    mean_k, var_k, seen_k = stats_k
    a = rule.alpha
    diff = norms_k - mean_k
    first = seen_k == 0
    new_mean = jnp.where(first, norms_k, mean_k + a * diff)
    new_var = jnp.where(first, 0.0, (1 - a) * (var_k + a * diff**2))
    return (
        jnp.where(keep_k, new_mean, mean_k),
        jnp.where(keep_k, new_var, var_k),
        seen_k + keep_k.astype(jnp.int32),
    )


def _drop_probability(p: Any) -> float | None:
    if p is None:
        return None
    if isinstance(p, bool) or not isinstance(p, int | float | np.integer | np.floating):
        raise ValueError(f"Weights.drop_probability must be a float in [0, 1), got {p!r}")
    if not 0.0 <= float(p) <= 1.0 or math.isnan(p):
        raise ValueError(f"Weights.drop_probability must be in [0, 1), got {p!r}")
    if float(p) == 1.0:  # every worker dropped from every sync: θ would never change
        raise ValueError(
            "Weights.drop_probability must be below 1, got 1 (every worker dropped from every "
            "sync: nothing would train)"
        )
    return float(p)


def _membership(rows: Any) -> tuple[tuple[bool, ...], ...] | None:
    if rows is None:
        return None
    try:
        table = np.asarray(rows)
    except ValueError:  # ragged rows
        table = None
    if table is None or table.ndim != 2 or table.size == 0 or table.dtype != np.bool_:
        raise ValueError(
            "Weights.membership must be rows of bools, one row per round and one bool per "
            f"worker, all rows the same length; got {rows!r}"
        )
    empty = [r for r, row in enumerate(table) if not row.any()]
    if empty:
        raise ValueError(
            f"Weights.membership must have some worker in every round; round {empty[0]} has none"
        )
    return tuple(tuple(bool(x) for x in row) for row in table)


def membership_mask(rows: tuple, round_: jax.Array, num_workers: int) -> jax.Array:
    """bool [M]: the workers in round `round_` by `rows` (every worker past the last row)."""
    table = jnp.asarray(rows + ((True,) * num_workers,), bool)
    return table[jnp.minimum(round_, len(rows))]


def data_positions(rows: Any, num_rounds: int) -> np.ndarray:
    """int64 [num_rounds, M]: how many inner phases each worker has completed before each
    round under the membership `rows` (a worker's data position: it advances by one in every
    round the worker is in, and not in the others)."""
    table = _membership(rows)
    member = np.ones((num_rounds, len(table[0])), bool)
    known = min(num_rounds, len(table))
    member[:known] = np.asarray(table[:known], bool)
    return np.cumsum(member, axis=0) - member


def _worker_steps(worker_steps: Sequence[int] | None) -> tuple[int, ...] | None:
    if worker_steps is None:
        return None
    values = np.asarray(worker_steps)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(
            f"Weights.worker_steps must be a sequence of step counts, got shape {values.shape}"
        )
    if not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"Weights.worker_steps must be integers, got dtype {values.dtype}")
    if values.min() < 1:
        raise ValueError(f"Weights.worker_steps must be >= 1, got {values.tolist()}")
    return tuple(int(h) for h in values)


def drop_masks(
    seed: int, round_: jax.Array, num_workers: int, p: float, num_syncs: int = 1
) -> jax.Array:
    """Which workers are dropped at each sync of round `round_`: bool [num_syncs, M], each
    True with probability `p`.

    The key is `fold_in(PRNGKey(seed), round_)`, so the masks depend only on (seed, round):
    deterministic and resumable; row 0 is the same draw for any number of syncs. p = 0 never
    drops and p = 1 always does (a uniform draw in [0, 1) is compared with p).
    """
    key = jax.random.fold_in(jax.random.PRNGKey(seed), round_)
    return jax.random.uniform(key, (num_syncs, num_workers)) < p


def drop_mask(seed: int, round_: jax.Array, num_workers: int, p: float) -> jax.Array:
    """The drops of a round with one sync: `drop_masks(...)[0]`, bool [M]."""
    return drop_masks(seed, round_, num_workers, p)[0]


def all_finite(tree: Any) -> jax.Array:
    """bool scalar: every element of every leaf of `tree` is finite."""
    # Over each leaf flattened: XLA's CPU backend reduces a 1-D array in one vectorized loop,
    # a matrix's cells slower (the whole check took 2-4% of a small model's round). Not where
    # the partitioner splits the leaves (a worker's own mesh axes, e.g. fsdp): flattening a
    # leaf split along a later dim gathers it whole onto every device first (the 1b fsdp=4
    # round held a gigabyte of such copies); reduced in place, each device checks its shard.
    flatten = not _partitioned_here()
    leaves = [jnp.all(jnp.isfinite(x.reshape(-1) if flatten else x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def _partitioned_here() -> bool:
    """Whether the mesh in context has an axis of size > 1 that XLA partitions (not manual)."""
    mesh = jax.sharding.get_abstract_mesh()
    return any(
        size > 1 and kind != jax.sharding.AxisType.Manual
        for size, kind in zip(mesh.axis_sizes, mesh.axis_types, strict=True)
    )


def select_tree(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """Leafwise `where(pred, on_true, on_false)` for a scalar bool `pred` (no NaN leaks)."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def restore_workers(keep_k: jax.Array, new_k: Any, start_k: Any) -> Any:
    """Per worker (leaves [k, ...]): its leaves of `new_k` where keep_k [k] is True, else
    those of `start_k`. A loop of zero or one trip, taken only when some worker is not kept:
    when every worker is, `new_k` passes on in place (a select would read both trees and
    write a third)."""

    def restore(carry):
        pending, current = carry
        return pending & False, jax.vmap(select_tree)(keep_k, current, start_k)

    _, restored = jax.lax.while_loop(lambda carry: carry[0], restore, (~jnp.all(keep_k), new_k))
    return restored


def unless(skip: jax.Array, update: Callable[..., tuple], values: tuple, *args: Any) -> tuple:
    """`update(*values, *args)` (a tuple like `values`: same structure, shapes and dtypes),
    or `values` unchanged where the bool scalar `skip` is True. A loop of zero or one trip:
    unlike a select after the update, the usual case updates in place."""

    def run(carry):
        pending, current = carry
        return pending & False, tuple(update(*current, *args))

    _, out = jax.lax.while_loop(lambda carry: carry[0], run, (~skip, tuple(values)))
    return out


class NormStats(NamedTuple):
    """EDiT's anomaly statistics of one sync: each worker's EWMA mean and variance of its
    delta norms (float32 [M]) and how many norms it has kept (int32 [M])."""

    mean: Any
    variance: Any
    count: Any


class Anomalies(NamedTuple):
    """The weights part's state (`DiLoCoState.parts["weights"]`) under an anomaly skip: one
    `NormStats` per sync."""

    stats: tuple

    PER_WORKER = ("stats",)


class RoundInputs(NamedTuple):
    """The weights part's per-worker inputs of one round, drawn before the workers run:
    steps (int32 [M], each worker's inner steps) and dropped (bool [M, P], its drop at each
    sync); None where the rule has none."""

    steps: Any = None
    dropped: Any = None


class UniformWeights(Role):
    """Every worker weighs 1 at every sync and none is ever left out: the exchange takes the
    plain mean, and nothing is kept or restored."""

    name = "weights"

    def round_inputs(self, round_: jax.Array, num_workers: int) -> RoundInputs:
        return RoundInputs()

    def steps_taken(self, inputs: RoundInputs) -> None:
        return None

    def weigh(self, c: Carry, ctx: Any, sync: Any, delta_k: Any) -> tuple[Weighed, Carry]:
        return Weighed(), c

    def unless_empty(self, c: Carry, ctx: Any, update, old, outer, mean, weight_sum) -> tuple:
        return *update(old, outer, mean), c

    def keep_if_empty(self, weight_sum: Any, before: Any, after: Any) -> Any:
        return after

    def skip(self, c: Carry, weight_sum: Any) -> Carry:
        return c

    def split_sent(self, sent_k: Any, collectives: Any) -> tuple[Any, None]:
        return sent_k, None

    def in_flight(self, weighed: Weighed, num_local: int) -> jax.Array:
        return jnp.ones((num_local,), jnp.float32)

    def launched(self, weights_k: jax.Array) -> tuple[None, None]:
        return None, None

    def applied_sum(self, weights: jax.Array, sync: Any, fragmented: bool) -> None:
        return None

    def after_sync(self, c: Carry, ctx: Any, weighed: Weighed) -> Carry:
        return c

    def metrics(self, c: Carry, ctx: Any) -> tuple[dict, dict]:
        return {}, {}


class WeighedRule(Role):
    """A `Weights` rule with some option on: each worker's weight and whether it is
    included at each sync, a sync that includes no worker left as it was, a left-out worker
    restored to the round's start. With one worker per device the skip and the restore are
    loops of zero or one trip (`unless`, `restore_workers`): the usual round passes the values
    on in place, where a select reads two copies, writes a third and makes XLA keep the old
    ones alive; with several workers on a device (vmap) they stay selects: XLA fuses the
    workers' sum into the outer update (a loop would change its rounding), and with the whole
    state donated it copies the inner state twice more around a restore loop."""

    name = "weights"

    def __init__(self, rule: Weights, inner_steps: int, num_syncs: int):
        self.rule, self.inner_steps, self.num_syncs = rule, inner_steps, num_syncs

    def round_inputs(self, round_: jax.Array, num_workers: int) -> RoundInputs:
        rule = self.rule
        steps = jnp.asarray(rule.worker_steps or (self.inner_steps,) * num_workers, jnp.int32)
        dropped = None
        if rule.membership is not None:
            member = membership_mask(rule.membership, round_, num_workers)
            steps = jnp.where(member, steps, 0)
            dropped = jnp.broadcast_to(~member[:, None], (num_workers, self.num_syncs))
        if rule.drop_probability is not None:
            dropped = drop_masks(
                rule.drop_seed, round_, num_workers, rule.drop_probability, self.num_syncs
            ).T
        return RoundInputs(steps, dropped)

    def steps_taken(self, inputs: RoundInputs) -> Any:
        return inputs.steps if self.rule.masked else None

    def begin(self, c: Carry, ctx: Any) -> Carry:
        false_k = jnp.zeros((ctx.num_local,), bool)
        stats = ctx.local.get(self.name)
        stats_k = None if stats is None else list(stats.stats)
        return c.with_own(self.name, _Verdicts(stats_k, false_k, false_k, jnp.bool_(False)))

    def weigh(self, c: Carry, ctx: Any, sync: Any, delta_k: Any) -> tuple[Weighed, Carry]:
        own = c.own[self.name]
        stats_k = None if own.stats is None else list(own.stats)
        finite_k, weight_k = self._weights(ctx, delta_k, stats_k, sync.index)
        dropped_k = ctx.inputs_k.dropped
        dropped_k = jnp.zeros_like(finite_k) if dropped_k is None else dropped_k[:, sync.index]
        weighed = Weighed(finite_k, weight_k, finite_k & ~dropped_k, dropped_k)
        return weighed, c.with_own(self.name, own._replace(stats=stats_k))

    def _weights(self, ctx, delta_k, stats_k, index):
        """(finite_k: bool [k], False for a worker left out as non-finite or an outlier;
        weight_k: float32 [k], or None for weight 1). Updates `stats_k[index]` (the anomaly
        statistics) in place."""
        rule, steps_k = self.rule, ctx.inputs_k.steps
        finite_k = jnp.ones((steps_k.shape[0],), bool)
        if rule.exclude_nonfinite:
            finite_k = jax.vmap(all_finite)(delta_k)
        norms_k = None
        if rule.scheme == "norm_softmax" or rule.anomaly is not None:
            norms_k = jax.vmap(lambda d: optax.tree.norm(d).astype(jnp.float32))(delta_k)
        if rule.anomaly is not None:
            stats = NormStats(*stats_k[index])
            outlier_k = anomalous(norms_k, stats, ctx.round, rule.anomaly)
            keep_k = jnp.isfinite(norms_k) & ~outlier_k
            stats_k[index] = NormStats(*updated_stats(norms_k, stats, keep_k, rule.anomaly))
            finite_k = finite_k & ~outlier_k
        weight_k = None
        if rule.scheme == "steps":
            weight_k = steps_k.astype(jnp.float32)
        elif rule.scheme == "norm_softmax":
            finite_norms = jnp.where(jnp.isfinite(norms_k), norms_k, jnp.inf)
            smallest = ctx.collectives.reduce(_smallest, finite_norms)
            weight_k = softmax_weights(norms_k, smallest, rule.temperature)
        return finite_k, weight_k

    def unless_empty(self, c: Carry, ctx: Any, update, old, outer, mean, weight_sum) -> tuple:
        """`update(old, outer, mean)`, or (old, outer) when the sync included no worker."""
        none_included = weight_sum <= 0
        if ctx.num_local == 1:
            new, new_outer = unless(none_included, update, (old, outer), mean)
        else:
            new, new_outer = update(old, outer, mean)
            new = select_tree(none_included, old, new)
            new_outer = select_tree(none_included, outer, new_outer)
        return new, new_outer, self.skip(c, weight_sum)

    def keep_if_empty(self, weight_sum: Any, before: Any, after: Any) -> Any:
        return select_tree(weight_sum <= 0, before, after)

    def skip(self, c: Carry, weight_sum: Any) -> Carry:
        own = c.own[self.name]
        return c.with_own(self.name, own._replace(skipped=own.skipped | (weight_sum <= 0)))

    def split_sent(self, sent_k: Any, collectives: Any) -> tuple[Any, jax.Array]:
        sent_k, weights_k = sent_k
        return sent_k, collectives.reduce(_total, weights_k)

    def in_flight(self, weighed: Weighed, num_local: int) -> jax.Array:
        ones = jnp.ones((num_local,), jnp.float32)
        weight_k = ones if weighed.weight_k is None else weighed.weight_k
        return jnp.where(weighed.included_k, weight_k, 0.0)

    def launched(self, weights_k: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        return weights_k > 0, None if self.rule.scheme == "uniform" else weights_k

    def applied_sum(self, weights: jax.Array, sync: Any, fragmented: bool) -> jax.Array:
        return weights[sync.index] if fragmented else weights

    def after_sync(self, c: Carry, ctx: Any, weighed: Weighed) -> Carry:
        own = c.own[self.name]
        c = c.with_own(
            self.name,
            own._replace(
                excluded=own.excluded | ~weighed.finite_k,
                dropped=own.dropped | weighed.dropped_k,
            ),
        )
        if not self.rule.leaves_out:
            return c
        # A non-finite worker's new inner state may hold NaNs: back to the round's start.
        restore = restore_workers if ctx.num_local == 1 else jax.vmap(select_tree)
        start = (ctx.start.opt, ctx.start.model)
        opt_k, model_k = restore(weighed.finite_k, (c.workers.opt, c.workers.model), start)
        return c._replace(workers=c.workers._replace(opt=opt_k, model=model_k))

    def metrics(self, c: Carry, ctx: Any) -> tuple[dict, dict]:
        own = c.own[self.name]
        local = {"excluded_workers": own.excluded, "dropped_workers": own.dropped}
        return {"skipped": own.skipped}, local

    def end(self, c: Carry, ctx: Any) -> tuple[Any, Any]:
        stats = c.own[self.name].stats
        return None, None if stats is None else Anomalies(tuple(stats))


class _Verdicts(NamedTuple):
    """What `WeighedRule` keeps through a round: the anomaly statistics per sync (a list, or
    None), which workers were left out or dropped at some sync (bool [k]) and whether some
    sync included no worker (bool)."""

    stats: Any
    excluded: Any
    dropped: Any
    skipped: Any


def _smallest(local: jax.Array) -> jax.Array:
    """Reducer: the smallest value over every worker (one all-reduce of a float32)."""
    return jax.lax.pmin(jnp.min(local), WORKER_AXIS)


def _total(local: jax.Array) -> jax.Array:
    """Reducer: the sum over every worker (one all-reduce of a float32)."""
    return jax.lax.psum(jnp.sum(local), WORKER_AXIS)
