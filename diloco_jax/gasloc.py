"""GASLoC: local updates and gossip in one outer step, no global θ (Cagnasso, Belilovsky and
Oyallon 2026, "Unifying Local Communications and Local Updates for LLM Pretraining", arXiv
2606.11081; the rule as stated in the paper's summary, no public code).

Every worker m keeps its own outer weights θ_m, as under NoLoCo (`DiLoCoState.params` is
None and `delay.global_params` averages the θ_m). At sync t, after its H inner steps from
θ_m, worker m has its delta Δ_m = θ_m - (its params), the drift g_m = -Δ_m, and:

    y_m = outer(θ_m, s_m, Δ_m)                 (the paper: θ_m + η g_m, `optax.sgd(η)`)
    θ_m <- y_m - α (Λ y)_m + γ (y_m - y_m^prev)

with Λ the weighted Laplacian of the sync's communication graph and y_m^prev worker m's
y of the sync before (the momentum term is 0 at the first sync: no y before it). The graph
here is the sync's random groups of NoLoCo (`noloco.group_masks`: `group_size` workers a
group, new groups every sync; pairs are the paper's one-peer matchings), with weight 1 /
group_size on each edge inside a group, so (Λ y)_m = y_m - ȳ_G, the mean of y over m's
group, and

    θ_m <- y_m - α (y_m - ȳ_G) + γ (y_m - y_m^prev).

α = 1 takes each group's mean; γ = 0 is the non-accelerated form. One group of all M
workers with α = 1 and γ = 0 is DiLoCo with the same outer rule on an SGD-like step (every
θ_m stays equal, and the mean of the y_m is the step on the mean Δ for any rule linear in
Δ: SGD, heavy-ball, Nesterov). Each sync sends y_m in float32 through log2(group_size)
collective-permutes (NoLoCo sends Δ and φ: twice the bytes).

The outer rule is the spec's (`DiLoCo(outer=...)`), `optax.sgd(0.7)` by default: the
paper's step is SGD, and its η, α and γ for a given run are the user's (the paper's values
are not in its summary).
"""

import dataclasses
import functools
import math
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from diloco_jax.carry import Carry, Part, set_leaves
from diloco_jax.checks import check_number
from diloco_jax.noloco import (
    GroupSync,
    Sent,
    check_gossip_run,
    check_gossip_with,
    check_groups,
    group_masks,
    group_mean,
    mean_norm,
)
from diloco_jax.outer import outer_update, widen
from diloco_jax.schedule import OwnParams, leaf_indices, part
from diloco_jax.trees import payload_bytes
from diloco_jax.workers import stack_workers

GASLOC = "gasloc"  # its state's name in `DiLoCoState.parts`
_OWN_STATE = "GASLoC (gossip=: each worker holds its own outer weights and state)"


@dataclasses.dataclass(frozen=True)
class GASLoC(Part):
    """GASLoC as the gossip part of a `DiLoCo` spec (`DiLoCo(gossip=GASLoC(...))`): each
    worker's outer step, then a pull toward its group's mean and momentum on the result (see
    the module docstring).

    group_size: workers per group, a power of 2 >= 2 dividing M (2: one-peer matchings; M:
      one group).
    alpha: the gossip step α, a finite float in [0, 1] (1: the group's mean).
    gamma: the momentum γ on the post-update iterates y, a finite float in [0, 1) (0: none).
    seed: the groups' seed, an integer in [0, 2**32).
    """

    group_size: int = 2
    alpha: float = 1.0
    gamma: float = 0.0
    seed: int = 0

    host_memory_refusal: ClassVar[str] = _OWN_STATE
    zero_refusal: ClassVar[str] = _OWN_STATE

    def __post_init__(self):
        check_groups("GASLoC", self.group_size, self.seed)
        check_number("GASLoC.alpha", self.alpha, lambda x: 0 <= x <= 1, "in [0, 1]")
        check_number("GASLoC.gamma", self.gamma, lambda x: 0 <= x < 1, "in [0, 1)")
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "gamma", float(self.gamma))

    @staticmethod
    def default_outer() -> optax.GradientTransformation:
        """SGD, the paper's step on the drift (its learning rate is ours: DiLoCo's 0.7)."""
        return optax.sgd(0.7)

    def check_with(self, method: Any) -> None:
        check_gossip_with("GASLoC", method)

    def check_run(self, params: Any, num_workers: int, inner_steps: int, inner_state: Any) -> None:
        check_gossip_run("GASLoC", num_workers, self.group_size)

    def initial(self, params: Any, outer_state: Any, num_workers: int, method: Any) -> dict:
        """Each worker's own θ_m, outer state and y of the sync before (θ_0 until the
        first: unused there), copies of θ and of the fresh outer state."""
        previous = widen(params)
        state = stack_workers((params, outer_state, previous), num_workers)
        return {GASLOC: GossipIterates(*state)}

    def plan(self, build: Any, roles: dict) -> None:
        """Each worker's delta against its own θ_m and its own step, gossip and momentum
        (`GASLoCSync`); workers continue from their own θ_m."""
        roles["sync"] = roles["delta"] = GASLoCSync(
            build.method.outer_optimizer, self, build.num_workers
        )
        roles["starts"] = OwnParams()

    def variant(self) -> dict:
        return {"gasloc": [self.group_size, self.alpha, self.gamma, self.seed]}

    def worker_state(self, params: Any, outer_state: Any) -> "GossipIterates":
        """One worker's own state on real processes (`diloco_jax.gossip_worker`): θ_m = θ_0,
        a fresh outer state and y^prev = θ_0 widened, as `initial` gives each worker."""
        return GossipIterates(params, outer_state, widen(params))

    def worker_send(self, outer_optimizer, own: "GossipIterates", delta: Any) -> Sent:
        """One worker's outer step to y_m (the values it averages with its group), its new
        outer state kept for `worker_step`."""
        y, outer = outer_update(outer_optimizer, own.theta, own.outer, delta)
        return Sent(widen(y), outer)

    def worker_step(
        self, outer_optimizer, own: "GossipIterates", sent: Sent, mean: Any, sync: Any
    ) -> "GossipIterates":
        """θ_m from y_m, its group's mean ȳ_G and y^prev (the momentum term from sync 1 on):
        `GASLoCSync.apply`'s rule for one worker."""
        started = sync > 0

        def step(y, ybar, prev, old):
            momentum = jnp.where(started, y - prev, jnp.zeros_like(y))
            return (y - self.alpha * (y - ybar) + self.gamma * momentum).astype(old.dtype)

        theta = jax.tree.map(step, sent.values, mean, own.previous, own.theta)
        return GossipIterates(theta, sent.kept, sent.values)

    def transfers(self, synced: list) -> list:
        """(op, operand bytes, times) per sync per worker: log2(group_size) stages, each a
        collective-permute of the worker's y in float32 (`synced`: the leaves it syncs)."""
        wide = payload_bytes(jax.eval_shape(widen, synced))
        return [("collective-permute", wide, int(math.log2(self.group_size)))]


class GossipIterates(NamedTuple):
    """GASLoC's state (`DiLoCoState.parts["gasloc"]`): each worker's own outer weights θ_m
    (leaves [M, ...] in the params' dtypes), its outer optimizer state (leaves [M, ...]) and
    its y of the sync before (float32 or wider, [M, ...])."""

    theta: Any
    outer: Any
    previous: Any

    PER_WORKER = ("theta", "outer", "previous")
    OWNS_THETA = True  # `theta` stands in for the global θ (`delay.global_params`)


class GASLoCSync(GroupSync):
    """GASLoC's sync: each worker's delta against its own θ_m, its outer step to y_m, its
    group's mean of y (`noloco.group_mean`), and the gossip and momentum terms."""

    name = GASLOC

    def begin(self, c: Carry, ctx: Any) -> Carry:
        own = ctx.local[self.name]
        theta = tuple(ctx.treedef.flatten_up_to(own.theta))
        previous = tuple(ctx.treedef.flatten_up_to(own.previous))
        c = c.with_own(self.name, _Own(theta, own.outer, previous, None))
        return c._replace(workers=c.workers._replace(params=own.theta))

    def apply(self, c: Carry, ctx: Any, sync: Any, delta_k: Any, weighed: Any) -> Carry:
        own, spec = c.own[self.name], self.spec
        old_k = part(sync, own.theta, ctx.treedef)
        y_k, outer_k = self.apply_outer(old_k, own.outer, delta_k)
        y_k = widen(y_k)
        masks = group_masks(spec.seed, ctx.round, self.num_workers, spec.group_size)
        ybar_k = group_mean(y_k, masks, self.num_workers)
        started = ctx.round > 0  # no y before the first sync: no momentum term
        previous_k = part(sync, own.previous, ctx.treedef)

        def step(y, ybar, prev, old):
            momentum = jnp.where(started, y - prev, jnp.zeros_like(y))
            return (y - spec.alpha * (y - ybar) + spec.gamma * momentum).astype(old.dtype)

        new_k = jax.tree.map(step, y_k, ybar_k, previous_k, old_k)
        indices = leaf_indices(sync, len(own.theta))
        theta = tuple(set_leaves(own.theta, indices, new_k))
        previous = tuple(set_leaves(own.previous, indices, y_k))
        norm = ctx.collectives.reduce(
            functools.partial(mean_norm, num_workers=self.num_workers), delta_k
        )
        c = c.with_own(self.name, _Own(theta, outer_k, previous, norm))
        params_k = jax.tree.unflatten(ctx.treedef, theta)  # frozen leaves as they were
        return c._replace(workers=c.workers._replace(params=params_k))

    def end(self, c: Carry, ctx: Any) -> tuple[Any, Any]:
        own = c.own[self.name]
        state = GossipIterates(
            jax.tree.unflatten(ctx.treedef, own.theta),
            own.outer,
            jax.tree.unflatten(ctx.treedef, own.previous),
        )
        return None, state


class _Own(NamedTuple):
    """What `GASLoCSync` keeps through a round: each worker's θ_m leaves [k, ...], its outer
    state [k, ...], its y of the last sync (leaves [k, ...]) and the round's one sync's
    "outer_grad_norm" (None before it)."""

    theta: tuple
    outer: Any
    previous: tuple
    norm: Any
