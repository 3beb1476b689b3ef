"""Delayed and eager outer updates: the part of `diloco_round` that hides the exchange behind
the next round's inner steps (Kale, Douillard, Donchev 2025, arXiv 2502.12996).

With `outer_delay` d >= 1 a round does not wait for its own exchange. Each worker's delta
Δ_m^t of round t stays in flight (`InFlight`, with its weight); round t + 1
starts by exchanging it (a collective that depends only on the state, not on that round's
inner steps, so XLA's asynchronous collectives can run it under the inner scan on GPU/TPU),
and its mean Δ̄_t is applied d rounds after it was launched (the means in between wait in
`InFlight.means`). The first d rounds apply a zero mean.

- Delayed (naive): every worker holds the same θ; θ_t = OuterOpt(θ_{t-1}, Δ̄_{t-d}).
- Eager: each worker m keeps its own θ_m and its own outer optimizer state, and applies
  Δ̃_m = Δ̄_{t-d} + (Δ_m^t - Δ_m^{t-d}) / M: the stale mean with its own stale share
  replaced by its fresh delta (Δ_m^t = θ_m^{t-1} - θ_m after its inner steps). With M = 1
  it is DiLoCo for any d. There is no global θ (`DiLoCoState.params` is None);
  `global_params` averages the workers' θ_m when one is wanted (evaluation, the result).

With Streaming DiLoCo's fragments (the paper's Table 3) each fragment p follows the same rule
over its own syncs: the deltas of its sync in round t are exchanged at the start of round
t + 1 (every fragment's, one exchange each) and applied at its sync in round t + d, by the
fragment's outer state (eager: each worker's own). Eager workers then keep two copies: their
own global θ_m (`OwnTheta.theta`, what their deltas are taken against and the outer step
moves) and the params they keep training (`schedule.WorkerParams`), merged at each sync as
Streaming DiLoCo merges θ'. With one fragment, tau = 0 and alpha = 0 that is the unfragmented
rule.

d = 0 is DiLoCo. Fault options combine with the naive delay (a worker's weight travels with
its delta); eager updates take per-worker step counts but refuse the options that leave a
worker out or weigh it (the eager rule swaps a worker's 1/M share of the stale mean, which
weighted shares or a left-out worker leave undefined).
"""

import dataclasses
import functools
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from diloco_jax.carry import Carry, Part, Role, set_leaves
from diloco_jax.outer import mean_norm, outer_update, widen
from diloco_jax.schedule import OwnParams, OwnThetaSync, leaf_indices, merged, part
from diloco_jax.workers import stack_workers

MAX_DELAY = 2


@dataclasses.dataclass(frozen=True)
class Delayed(Part):
    """The delay part of a `DiLoCo` spec: each round's mean is applied `rounds` (d = 1 or 2)
    rounds after it was launched, by every worker alike (the naive delay)."""

    rounds: int = 1

    eager: ClassVar[bool] = False
    host_memory_refusal: ClassVar[str] = (
        "a delayed or eager outer update (its mean is ready before the inner steps)"
    )
    zero_refusal: ClassVar[str] = (
        "a delayed or eager outer update (its means are launched a round early)"
    )

    def __post_init__(self):
        d, name = self.rounds, type(self).__name__
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ValueError(f"{name}.rounds (outer_delay) must be an integer >= 1, got {d!r}")
        if d == 0:
            raise ValueError(
                f"{name}.rounds (outer_delay) must be >= 1: with no delay there is no stale "
                "mean (delay=None is plain DiLoCo)"
            )
        if d > MAX_DELAY:
            raise ValueError(f"{name}.rounds (outer_delay) must be at most {MAX_DELAY}, got {d}")

    def check_with(self, method: Any) -> None:
        """The naive delay combines with every other part (a weight travels with its delta)."""

    def fingerprint(self) -> dict:
        return {"outer_delay": [self.rounds, self.eager]}

    def initial(self, params: Any, outer_state: Any, num_workers: int, method: Any) -> dict:
        """Zero deltas in flight (`InFlight`; eager updates: each worker's own θ and outer
        state too, `OwnTheta`)."""
        fragments = method.num_syncs(params) if method.fragmented else None
        return initial(params, outer_state, num_workers, self.rounds, self.eager, fragments)

    def plan(self, build: Any, roles: dict) -> None:
        """The sync applies the mean launched d rounds earlier (`DelayedExchange` in place of
        the exchange, which it runs at the round's start)."""
        roles["kept"].append(roles["exchange"])
        roles["exchange"] = DelayedExchange(
            roles["exchange"], roles["weights"], build.schedule.fragmented, eager=False
        )


@dataclasses.dataclass(frozen=True)
class Eager(Delayed):
    """Eager outer updates: like `Delayed`, but each worker applies the stale mean with its
    own stale share replaced by its fresh delta (see the module docstring)."""

    eager: ClassVar[bool] = True

    def check_with(self, method: Any) -> None:
        """Raises ValueError saying why eager updates can't take weights that leave a worker
        out or weigh it other than 1 (per-worker step counts with uniform weights are fine)."""
        if method.weights.uneven:
            raise ValueError(
                "Eager can't be combined with Weights that leave a worker out or weigh it "
                "(exclude_nonfinite, drop_probability, weighting, anomaly, membership): the "
                "eager rule swaps each worker's own 1/M share of the stale mean for its fresh "
                "delta, which has no defined form once shares are weighted or a worker is left "
                "out"
            )

    def plan(self, build: Any, roles: dict) -> None:
        """Each worker's own outer step at each sync (`EagerSync`: the deltas and the sync),
        on the stale mean of `DelayedExchange`; workers continue from their own params."""
        schedule = build.schedule
        delayed = DelayedExchange(roles["exchange"], roles["weights"], schedule.fragmented, True)
        roles["kept"] += [roles["exchange"], delayed]
        roles["sync"] = roles["delta"] = EagerSync(
            build.method.outer_optimizer, delayed, schedule.merge_alpha, schedule.fragmented,
            self.rounds,
        )  # fmt: skip
        roles["starts"] = OwnParams()


class InFlight(NamedTuple):
    """The delay part's state (`DiLoCoState.parts["delay"]`): what is in flight. deltas: each
    worker's deltas of the last round (eager: of the last d rounds), a tuple of leaves
    [M, ...] in the delta dtype, oldest first; weights: each worker's weight in last round's
    mean (float32 [M]; with fragments [M, P]); means: the means launched in the last d - 1
    rounds, a tuple of (mean delta, float32 weight sum: a scalar, with fragments [P]),
    oldest first."""

    deltas: Any
    weights: Any
    means: Any

    PER_WORKER = ("deltas", "weights")


class OwnTheta(NamedTuple):
    """The eager part's state (`DiLoCoState.parts["eager"]`): each worker's own θ_m (leaves
    [M, ...] in the params' dtypes; with fragments, each fragment as of that worker's last
    outer step of it) and its own outer state (leaves [M, ...]; with fragments a tuple, one
    per fragment). Under eager updates there is no global θ: `DiLoCoState.params` and
    `outer_opt_state` are None."""

    theta: Any
    outer: Any

    PER_WORKER = ("theta", "outer")
    OWNS_THETA = True  # `theta` stands in for the global θ (`global_params`)


def initial(
    params: Any, outer_state: Any, num_workers: int, outer_delay: int, eager: bool,
    num_fragments: int | None,
) -> dict[str, Any]:  # fmt: skip
    """The round-0 states of a delay: zero deltas of weight 1 in flight, and under eager
    updates each worker's own θ and outer state (`outer_state`: the global one, copied).
    `num_fragments` is P under Streaming DiLoCo (weights then per fragment: [M, P] in flight,
    [P] for a mean's weight sum), None without fragments."""
    like = jax.eval_shape(widen, params)
    per_sync = () if num_fragments is None else (num_fragments,)
    # Separate buffers for every entry: the state is donated to each round.
    deltas = tuple(
        jax.tree.map(lambda x: jnp.zeros((num_workers, *x.shape), x.dtype), like)
        for _ in range(outer_delay if eager else 1)
    )
    means = tuple(
        (
            jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), like),
            jnp.full(per_sync, num_workers, jnp.float32),
        )
        for _ in range(outer_delay - 1)
    )
    weights = jnp.ones((num_workers, *per_sync), jnp.float32)
    states = {DELAY: InFlight(deltas, weights, means)}
    if eager:
        states[EAGER] = OwnTheta(*stack_workers((params, outer_state), num_workers))
    return states


DELAY, EAGER = "delay", "eager"  # their states' names in `DiLoCoState.parts`


def global_params(state: Any) -> Any:
    """The params a run's state stands for: θ, or where each worker holds its own (params
    None: eager updates, NoLoCo) the mean of the workers' θ_m (in float32 or wider, cast back
    to each leaf's dtype)."""
    if state.params is not None:
        return state.params
    own = next(s.theta for s in state.parts.values() if getattr(s, "OWNS_THETA", False))
    return jax.tree.map(lambda x: jnp.mean(widen(x), axis=0).astype(x.dtype), own)


def eager_delta(mean: Any, fresh_k: Any, stale_k: Any, num_workers: int) -> Any:
    """Δ̃_m = Δ̄ + (Δ_m^t - Δ_m^{t-d}) / M for this device's workers (leaves [k, ...])."""
    return jax.tree.map(
        lambda m, fresh, stale: m[None] + (fresh - stale) / num_workers, mean, fresh_k, stale_k
    )


class DelayedExchange(Role):
    """The delay part's exchange point: at the round's start it exchanges last round's deltas
    (in flight in `InFlight`, through the compression part's exchange), and at each sync it
    puts this round's delta in flight and hands the sync the mean launched d rounds earlier
    (`Delayed`; `Eager` keeps the last d rounds' deltas, each worker's stale share)."""

    name = DELAY

    def __init__(self, exchange: Role, weights: Role, fragmented: bool, eager: bool):
        self.now, self.weights = exchange, weights  # the exchange that runs at once
        self.fragmented, self.eager = fragmented, eager

    def begin(self, c: Carry, ctx: Any) -> Carry:
        # Last round's deltas first: this exchange reads only the state, so it can run while
        # the workers take this round's inner steps.
        flight = ctx.local[self.name]
        launched, c = self.now.launch(c, ctx, flight.deltas[-1], flight.weights, self.weights)
        means = ctx.shared[self.name].means
        (applied, applied_weights), waiting = (
            (launched, ()) if not means else (means[0], (*means[1:], launched))
        )
        treedef = ctx.treedef
        own = _Flight(
            applied=tuple(treedef.flatten_up_to(applied)),
            applied_weights=applied_weights,
            stale=tuple(treedef.flatten_up_to(flight.deltas[0])),
            # Each synced leaf's slot is filled at its sync; a frozen leaf (in no sync) keeps
            # the zero delta it started with.
            fresh=tuple(treedef.flatten_up_to(flight.deltas[-1])),
            in_flight=(),
            tie=jax.tree.leaves(launched[0])[0].ravel()[0],
            waiting=waiting,
            older=flight.deltas[1:] if self.eager else (),
        )
        return c.with_own(self.name, own)

    def exchange(self, c: Carry, ctx: Any, sync: Any, delta_k: Any, weighed: Any) -> tuple:
        """(the mean launched d rounds ago of the sync's leaves, its weight sum or None, the
        carry with `delta_k` in flight)."""
        own = c.own[self.name]
        # The round's mean loss is all-reduced after the inner loop. Made to read the
        # launched mean (adding 0 x one of its values: exact, and not folded for floats),
        # XLA can't combine the two all-reduces into one that waits for the loop
        # (optimization barriers don't survive XLA's CPU pipeline).
        c = c._replace(losses=(*c.losses[:-1], c.losses[-1] + 0.0 * own.tie))
        own = own._replace(
            in_flight=(*own.in_flight, self.weights.in_flight(weighed, ctx.num_local)),
            fresh=tuple(set_leaves(own.fresh, leaf_indices(sync, len(own.fresh)), delta_k)),
        )
        mean = part(sync, own.applied, ctx.treedef)
        weight_sum = self.weights.applied_sum(own.applied_weights, sync, self.fragmented)
        return mean, weight_sum, c.with_own(self.name, own)

    def stale(self, c: Carry, ctx: Any, sync: Any) -> Any:
        """Each worker's delta of d rounds ago, the sync's leaves (the eager rule's stale
        share)."""
        return part(sync, c.own[self.name].stale, ctx.treedef)

    def end(self, c: Carry, ctx: Any) -> tuple[Any, Any]:
        own = c.own[self.name]
        fresh_k = jax.tree.unflatten(ctx.treedef, own.fresh)
        in_flight = own.in_flight[0]
        if self.fragmented:
            in_flight = jnp.stack(own.in_flight, axis=1)
        return InFlight(None, None, own.waiting), InFlight((*own.older, fresh_k), in_flight, None)


class _Flight(NamedTuple):
    """What `DelayedExchange` keeps through a round: the applied mean's leaves and weight
    sum, the stale and fresh delta leaves [k, ...], each sync's in-flight weights [k], one
    value of the launched mean (`tie`), the means still waiting, and (eager) the deltas of
    the rounds between."""

    applied: tuple
    applied_weights: Any
    stale: tuple
    fresh: tuple
    in_flight: tuple
    tie: Any
    waiting: tuple
    older: tuple


class EagerSync(OwnThetaSync):
    """Eager updates at a sync: each worker's delta against its own θ_m, and its own outer
    step on Δ̃_m = Δ̄_{t-d} + (Δ_m^t - Δ_m^{t-d}) / M (`eager_delta`; the stale mean from
    `DelayedExchange`). Without fragments the worker then continues from its new θ_m; with
    them its params merge θ_m' as Streaming DiLoCo merges θ'."""

    name = EAGER

    def __init__(
        self, outer_optimizer, delayed: DelayedExchange, alpha: float, fragmented: bool, age: int
    ):
        # `age`: d, the rounds the stale mean waited (the outer rule's extra argument).
        self.apply_outer = jax.vmap(functools.partial(outer_update, outer_optimizer, age=age))
        self.delayed, self.alpha, self.fragmented = delayed, alpha, fragmented

    def begin(self, c: Carry, ctx: Any) -> Carry:
        own = ctx.local[self.name]
        theta = tuple(ctx.treedef.flatten_up_to(own.theta))
        outer = tuple(own.outer) if self.fragmented else (own.outer,)
        c = c.with_own(self.name, _Own(theta, outer, ()))
        if self.fragmented:  # the params it trains are the schedule's own
            return c
        # Without fragments a worker restarts each round from its θ_m.
        return c._replace(workers=c.workers._replace(params=own.theta))

    def apply(self, c: Carry, ctx: Any, sync: Any, delta_k: Any, weighed: Any) -> Carry:
        local_leaves = ctx.treedef.flatten_up_to(c.workers.params)
        mean, _, c = self.delayed.exchange(c, ctx, sync, delta_k, weighed)
        own = c.own[self.name]
        tilde_k = eager_delta(mean, delta_k, self.delayed.stale(c, ctx, sync), ctx.num_workers)
        old_k = part(sync, own.theta, ctx.treedef)
        new_k, new_outer_k = self.apply_outer(old_k, own.outer[sync.index], tilde_k)
        indices = leaf_indices(sync, len(own.theta))
        theta = tuple(set_leaves(own.theta, indices, new_k))
        outer = (*own.outer[: sync.index], new_outer_k, *own.outer[sync.index + 1 :])
        c = c.with_own(self.name, _Own(theta, outer, (*own.means, mean)))
        if not self.fragmented:  # the whole tree (frozen leaves as they were)
            params_k = jax.tree.unflatten(ctx.treedef, theta)
        else:
            params_k = merged(
                local_leaves, theta, indices, self.alpha, None, None, ctx.treedef,
                ctx.collectives.vary, per_worker=True,
            )  # fmt: skip
        return c._replace(workers=c.workers._replace(params=params_k))

    def grad_norm(self, c: Carry) -> jax.Array:
        return mean_norm(c.own[self.name].means)

    def end(self, c: Carry, ctx: Any) -> tuple[Any, Any]:
        own = c.own[self.name]
        outer = own.outer if self.fragmented else own.outer[0]
        return None, OwnTheta(jax.tree.unflatten(ctx.treedef, own.theta), outer)


class _Own(NamedTuple):
    """What `EagerSync` keeps through a round: each worker's θ_m leaves [k, ...], its outer
    state per sync, and each sync's stale mean (for "outer_grad_norm")."""

    theta: tuple
    outer: tuple
    means: tuple
