"""What one round carries on a device, and the base of the parts that act on it.

`diloco_jax.body` runs a round on each device's k workers as a sequence of named points:
the round's start, each segment of inner steps, and at each sync the delta, the weights, the
exchange with the outer update and the merge back into the workers, then the round's end. A
`Role` is one part's behaviour at those points (the weights part's rule, the delay part's
sync, the schedule's merge, ...): `diloco_jax.plan` builds the roles a method's parts call
for, once per round, and the body calls them in order without knowing which they are.

Everything the body passes between the points is named: `Carry` (what changes) and
`Context` (what holds for the whole round). A role keeps its own values in `Carry.own`
under its `name`, and its state between rounds in `DiLoCoState.parts` under the same name.
"""

from typing import Any, NamedTuple

import jax


class Segment(NamedTuple):
    """Inner steps [start, stop) of a round; then the snapshots taken at `stop` and the syncs
    that happen there (`schedule.Sync`s, in sync order)."""

    start: int
    stop: int
    snapshots: tuple
    syncs: tuple


class Workers(NamedTuple):
    """This device's k workers, leaves [k, ...]: their params (where each continues from;
    None while they start from θ), inner optimizer (or worker step) state and model state."""

    params: Any
    opt: Any
    model: Any


class Context(NamedTuple):
    """What holds for one round on one device.

    round: int32 scalar, rounds completed before this one. collectives: the backend's
    (`workers.Collectives`). treedef: the params' structure. num_workers: M; num_local: k.
    data, data_k: the round's shared and per-worker data (`sampler.split_data`). ids_k: the
    workers' int32 indices [k] (None when no step needs them). inputs_k: the weights part's
    per-worker inputs of this round (`faults.RoundInputs`). outer_k: the outer states'
    per-worker halves when the sync splits them (`outer_sharding`), else None. start: the
    workers at the round's start. shared, local: every role's state halves as the round
    received them, by name.
    """

    round: Any
    collectives: Any
    treedef: Any
    num_workers: int
    num_local: int
    data: Any
    data_k: Any
    ids_k: Any
    inputs_k: Any
    outer_k: Any
    start: Workers
    shared: dict
    local: dict


class Carry(NamedTuple):
    """What a round changes on a device as it goes.

    workers: the workers now. theta: θ's leaves (a tuple; None under eager updates, where
    each worker holds its own). outer: one outer optimizer state per sync (None under eager
    updates). snapshots: per sync index, the workers' param leaves its delta is taken from.
    losses, auxes: per segment of inner steps, the losses [k, S] and aux dicts of [k, S].
    own: each role's own values, by role name.
    """

    workers: Workers
    theta: tuple | None
    outer: tuple | None
    snapshots: dict
    losses: tuple
    auxes: tuple
    own: dict

    def with_own(self, name: str, value: Any) -> "Carry":
        return self._replace(own={**self.own, name: value})

    def with_theta(self, indices: tuple[int, ...], values: list) -> "Carry":
        """θ with its leaves at `indices` replaced by `values` (in that order)."""
        theta = list(self.theta)
        for i, value in zip(indices, values, strict=True):
            theta[i] = value
        return self._replace(theta=tuple(theta))

    def with_outer(self, index: int, value: Any) -> "Carry":
        outer = list(self.outer)
        outer[index] = value
        return self._replace(outer=tuple(outer))


class Weighed(NamedTuple):
    """The weights part's verdict on this device's workers at one sync (every field None
    when the method weighs every worker 1): finite_k (bool [k], False for a worker left out
    as non-finite or an outlier), weight_k (float32 [k], or None for weight 1), included_k
    (bool [k], the workers whose delta enters the mean), dropped_k (bool [k])."""

    finite_k: Any = None
    weight_k: Any = None
    included_k: Any = None
    dropped_k: Any = None


class Part:
    """A part of a `DiLoCo` spec (a mixin of its frozen dataclass). The defaults do nothing;
    a part overrides what it owns:

    - check_with(method): its rules with the other parts of `method` (a ValueError saying
      why a combination can't run), called once when the spec is built;
    - check_run(params, num_workers, inner_steps, inner_state): what it needs of a run (a
      ValueError naming its field), when a round or trainer is built;
    - initial(params, outer_state, num_workers, method): its state at round 0, a dict
      {name: NamedTuple} merged into `DiLoCoState.parts` (`params`: θ; `outer_state`: the
      global outer state, one per fragment under Streaming DiLoCo);
    - plan(build, roles): the roles it puts at the round's points (`diloco_jax.plan`):
      `roles` maps each point's name to its role, and its "kept" list holds the roles a part
      wraps (they still begin and end with the round);
    - transfers_through(steps, inner_state): the collectives it runs on its own schedule in
      a worker's first `steps` inner steps, beyond each sync's (`comm.wire_bytes` entries);
    - fingerprint(), variant(): its identity in a checkpoint's metadata (top-level fields,
      and entries of the shared "variant" field);
    - host_memory_refusal, zero_refusal: why the run options outer_state_memory="pinned_host"
      and shard_outer_over_workers can't run with it (None: they can), as a backend says.
    """

    host_memory_refusal: str | None = None
    zero_refusal: str | None = None

    def check_with(self, method: Any) -> None:
        """No rule with the other parts."""

    def check_run(self, params: Any, num_workers: int, inner_steps: int, inner_state: Any) -> None:
        """Runs with any params, M, H and inner state."""

    def initial(self, params: Any, outer_state: Any, num_workers: int, method: Any) -> dict:
        return {}

    def plan(self, build: Any, roles: dict) -> None:
        """No role of its own: the round's standard ones."""

    def transfers_through(self, steps: int, inner_state: Any) -> list:
        return []

    def fingerprint(self) -> dict:
        return {}

    def variant(self) -> dict:
        return {}


class Role:
    """One part's behaviour in a round (see the module docstring). The defaults do nothing:
    a role overrides the points it acts at."""

    name = ""

    def begin(self, c: Carry, ctx: Context) -> Carry:
        """At the round's start, before any inner step."""
        return c

    def end(self, c: Carry, ctx: Context) -> tuple[Any, Any]:
        """At the round's end: (shared, per-worker) halves of this role's state after the
        round, as `DiLoCoState.parts[name]` splits them (None for a half it has not)."""
        return None, None


class SyncRole(Role):
    """A role that fills the sync point: it also says how the outer states enter and leave
    the round (here whole, shared by every worker) and the round's "outer_grad_norm"."""

    def theta_in(self, theta: Any, treedef: Any) -> tuple | None:
        """θ (a tree) as the round carries it: a tuple of its leaves."""
        return tuple(treedef.flatten_up_to(theta))

    def theta_out(self, c: Carry, treedef: Any) -> Any:
        """θ at the round's end, a tree again."""
        return jax.tree.unflatten(treedef, c.theta)

    def outer_in(self, outer: Any) -> tuple[Any, Any]:
        """The outer states (a tuple, one per sync; None under eager updates) as (shared,
        per-worker) inputs of the round."""
        return outer, None

    def outer_out(self, shared: Any, local: Any) -> Any:
        """`outer_in`'s inverse, after the round."""
        return shared

    def outer_carried(self, shared: Any) -> tuple | None:
        """The shared outer states as the round carries them: a tuple, one per sync."""
        return tuple(shared)

    def local_outer(self, c: Carry) -> Any:
        """The per-worker half of the outer states at the round's end (None: none)."""
        return None

    def grad_norm(self, c: Carry) -> Any:
        raise NotImplementedError


def set_leaves(leaves: list, indices: tuple[int, ...], tree: Any) -> list:
    """`leaves` (a list, copied) with the leaves of `tree` (in order) at `indices`."""
    out = list(leaves)
    for i, value in zip(indices, jax.tree.leaves(tree), strict=True):
        out[i] = value
    return out
