"""NoLoCo: no all-reduce; each worker averages with a small random group (Kolehmainen et al.
2025, "NoLoCo: No-all-reduce Low Communication Training Method for Large Models", arXiv
2506.10911; the rule as the authors' code runs it, `jkolehm/noloco` at 37d1a8a,
`src/noloco/sparse_optimizer_c.py`).

Every worker m keeps its own outer weights φ_m and its own outer optimizer state (there is no
global θ: `DiLoCoState.params` is None, as under eager updates, and `delay.global_params`
averages the φ_m when one set of params is wanted). At each sync the workers split into
groups G of `group_size` workers, new groups every sync, and worker m, after its H inner steps
from φ_m to θ_m:

    Δ_m = φ_m - θ_m                                   (its delta, as DiLoCo's)
    Δ̄_G = mean_{j in G} Δ_j,   φ̄_G = mean_{j in G} φ_j
    g_m = Δ̄_G - consensus * (φ̄_G - φ_m)
    φ_m, s_m = outer(φ_m, s_m, g_m)                   (the spec's outer optax transformation)

and continues from the new φ_m. The authors' step is heavy-ball momentum on exactly this
g_m with one learning rate η for both terms (`m = α m - η Δ̄_G + η (φ̄_G - φ_m)`,
`φ += m`): `optax.sgd(η, momentum=α)` with `consensus=1` is that step, so it is the default
outer rule here (`default_outer`: η 0.7, α 0.5, the authors' configs), not DiLoCo's Nesterov.
Any optax transformation may replace it; `consensus` is the paper's γ / β. The consensus term
pulls a worker's φ_m toward its group's; with one group of all M workers every φ_m stays
equal, the term is zero and the step is DiLoCo's with the same outer rule.

Groups. The authors draw a uniformly random partition per sync (a `numpy` permutation seeded
with the step). A compiled SPMD program can only route data along patterns fixed when it is
compiled, so here a group is a coset of a random subgroup of the worker indices under XOR:
with M = 2^n and `group_size` = 2^a, each sync draws a linearly independent masks
s_1..s_a in {1..M-1} (uniformly, from `seed` and the sync's round), and worker m's group is
{m ^ (any XOR of a subset of the masks)}. With pairs (a = 1) worker m's partner is m ^ s,
uniform over the other M - 1 workers, as under a random pairing (the pairings drawn are the
M - 1 of the XOR family, not all (M - 1)!! of them). The mean over a group is a butterfly of
a stages, each averaging with the partner m ^ s_j, so every member of a group computes the
same sums in the same order (bit-identical means on every backend). On D devices with k
workers each, the partner's values come from device d ^ (s_j // k) by one collective-permute
(a `lax.switch` over the D device pairings; the branch taken depends on the sync's mask) and
slot j ^ (s_j % k): each stage sends k x (Δ and φ in float32) per device, whatever M is.
`groups` lists a sync's groups (for analysis and tests).

The round's metrics are still all-reduced (the loss, and "outer_grad_norm": the mean over the
workers of |Δ̄_G|, a float32 each); the exchange is not.
"""

import dataclasses
import functools
import math
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from diloco_jax.carry import Carry, Part, set_leaves
from diloco_jax.checks import check_number
from diloco_jax.outer import outer_update, widen
from diloco_jax.schedule import OwnParams, OwnThetaSync, leaf_indices, part
from diloco_jax.trees import payload_bytes
from diloco_jax.workers import WORKER_AXIS, stack_workers

GOSSIP = "gossip"  # its state's name in `DiLoCoState.parts`
_OWN_STATE = "NoLoCo (gossip=: each worker holds its own outer weights and state)"


def default_outer() -> optax.GradientTransformation:
    """The authors' outer step: heavy-ball momentum, lr 0.7, momentum 0.5 (every NoLoCo
    config of `jkolehm/noloco`)."""
    return optax.sgd(0.7, momentum=0.5)


@dataclasses.dataclass(frozen=True)
class NoLoCo(Part):
    """The gossip part of a `DiLoCo` spec (`DiLoCo(gossip=NoLoCo())`): at each sync every
    worker averages its delta and its outer weights with its group only (see the module
    docstring).

    group_size: workers per group, a power of 2 >= 2 dividing M (2: pairs, the authors'
      configs; M: one group, which is DiLoCo).
    consensus: the weight of the pull toward the group's outer weights (the paper's γ / β),
      a finite float >= 0; 1 as in the authors' code.
    seed: the groups' seed, an integer in [0, 2**32).
    """

    group_size: int = 2
    consensus: float = 1.0
    seed: int = 0

    host_memory_refusal: ClassVar[str] = _OWN_STATE
    zero_refusal: ClassVar[str] = _OWN_STATE

    def __post_init__(self):
        check_groups("NoLoCo", self.group_size, self.seed)
        check_number("NoLoCo.consensus", self.consensus, lambda x: x >= 0, ">= 0")
        object.__setattr__(self, "consensus", float(self.consensus))

    @staticmethod
    def default_outer() -> optax.GradientTransformation:
        return default_outer()

    def check_with(self, method: Any) -> None:
        check_gossip_with("NoLoCo", method)

    def check_run(self, params: Any, num_workers: int, inner_steps: int, inner_state: Any) -> None:
        check_gossip_run("NoLoCo", num_workers, self.group_size)

    def initial(self, params: Any, outer_state: Any, num_workers: int, method: Any) -> dict:
        """Each worker's own φ_m and outer state, copies of θ and of the fresh outer state."""
        return {GOSSIP: OwnOuter(*stack_workers((params, outer_state), num_workers))}

    def plan(self, build: Any, roles: dict) -> None:
        """Each worker's delta against its own φ_m and its own outer step on its group's
        means (`GossipSync`); workers continue from their own φ_m."""
        roles["sync"] = roles["delta"] = GossipSync(
            build.method.outer_optimizer, self, build.num_workers
        )
        roles["starts"] = OwnParams()

    def variant(self) -> dict:
        return {"noloco": [self.group_size, self.consensus, self.seed]}

    def worker_state(self, params: Any, outer_state: Any) -> "OwnOuter":
        """One worker's own state on real processes (`diloco_jax.gossip_worker`): φ_m = θ_0
        and a fresh outer state, as `initial` gives each worker."""
        return OwnOuter(params, outer_state)

    def worker_send(self, outer_optimizer, own: "OwnOuter", delta: Any) -> "Sent":
        """What one worker averages with its group: its Δ_m and its φ_m in float32 or wider
        (nothing is kept for `worker_step` beyond them)."""
        return Sent((delta, widen(own.theta)), None)

    def worker_step(
        self, outer_optimizer, own: "OwnOuter", sent: "Sent", mean: Any, sync: Any
    ) -> "OwnOuter":
        """One worker's outer step from its group's means (Δ̄_G, φ̄_G) of `sent.values`:
        `GossipSync.apply`'s rule for one worker."""
        (_, phi), (mean_delta, mean_phi) = sent.values, mean
        grad = jax.tree.map(
            lambda d, pbar, p: d - self.consensus * (pbar - p), mean_delta, mean_phi, phi
        )
        return OwnOuter(*outer_update(outer_optimizer, own.theta, own.outer, grad))

    def transfers(self, synced: list) -> list:
        """(op, operand bytes, times) per sync per worker: log2(group_size) stages, each a
        collective-permute of the worker's Δ and φ in float32 (`synced`: the leaves it
        syncs)."""
        wide = payload_bytes(jax.eval_shape(widen, synced))
        return [("collective-permute", 2 * wide, int(math.log2(self.group_size)))]


def check_groups(name: str, group_size: Any, seed: Any) -> None:
    """ValueError naming `name`.group_size unless it is a power of 2 >= 2, or `name`.seed
    unless it is an integer in [0, 2**32)."""
    g = group_size
    if isinstance(g, bool) or not isinstance(g, int) or g < 2 or g & (g - 1):
        raise ValueError(f"{name}.group_size must be a power of 2 >= 2, got {g!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"{name}.seed must be an integer in [0, 2**32), got {seed!r}")


def check_gossip_with(name: str, method: Any) -> None:
    """Raises ValueError naming the part a gossip method (`name`) can't run with: fragments,
    a delay, compression, DES-LOC's state syncs, or weights that leave a worker out or weigh
    it (a group's mean has no rule for either here)."""
    others = {
        "schedule (Streaming DiLoCo)": method.schedule is not None,
        "delay (delayed or eager outer updates)": method.delay is not None,
        f"compression={method.compression!r}": method.compression.kind != "none",
        "state_sync (DES-LOC)": method.state_sync is not None,
        "weights (exclusion, drops, worker steps, weighting, anomaly)": method.weights.active
        or method.weights.worker_steps is not None,
    }
    for what, present in others.items():
        if present:
            raise ValueError(
                f"{name} (gossip=) can't be combined with {what}: each worker averages with "
                "its group, every worker weighing 1"
            )


def check_gossip_run(name: str, num_workers: int, group_size: int) -> None:
    m, g = num_workers, group_size
    if m & (m - 1) or m < g:
        raise ValueError(
            f"{name} needs num_workers a power of 2 and >= group_size={g} (its groups "
            f"are cosets of worker indices under XOR), got num_workers={m}"
        )


class OwnOuter(NamedTuple):
    """The gossip part's state (`DiLoCoState.parts["gossip"]`): each worker's own outer
    weights φ_m (leaves [M, ...] in the params' dtypes) and its own outer optimizer state
    (leaves [M, ...])."""

    theta: Any
    outer: Any

    PER_WORKER = ("theta", "outer")
    OWNS_THETA = True  # `theta` stands in for the global θ (`delay.global_params`)


class Sent(NamedTuple):
    """One worker's side of a gossip sync on real processes: `values`, the tree it averages
    with its group (float32 or wider), and `kept`, what its step reads besides (GASLoC's new
    outer state; None for NoLoCo)."""

    values: Any
    kept: Any


def group_masks(seed: int, sync: Any, num_workers: int, group_size: int) -> jax.Array:
    """int32 [log2(group_size)]: linearly independent (under XOR) masks s_1..s_a for sync
    number `sync` (an int32 scalar), each drawn uniformly from the values outside the span of
    the ones before it, from `seed` alone; the group of worker m is m XORed with every subset
    of them."""
    key = jax.random.fold_in(jax.random.key(seed), sync)
    values = jnp.arange(num_workers, dtype=jnp.int32)
    span = jnp.zeros((1,), jnp.int32)
    masks = []
    for j in range(int(math.log2(group_size))):
        outside = ~jnp.any(values[:, None] == span[None, :], axis=1)
        r = jax.random.randint(jax.random.fold_in(key, j), (), 0, num_workers - 2**j, jnp.int32)
        s = jnp.argmax(jnp.cumsum(outside) > r).astype(jnp.int32)  # the r-th one outside
        masks.append(s)
        span = jnp.concatenate([span, span ^ s])
    return jnp.stack(masks)


def groups(seed: int, sync: int, num_workers: int, group_size: int) -> np.ndarray:
    """int [M / group_size, group_size]: the groups of sync number `sync` (the round counter
    before it, for one sync per round), each sorted, sorted by first member."""
    masks = np.asarray(jax.jit(group_masks, static_argnums=(0, 2, 3))(
        seed, jnp.int32(sync), num_workers, group_size
    ))  # fmt: skip
    offsets = np.zeros(1, np.int64)
    for s in masks:
        offsets = np.concatenate([offsets, offsets ^ int(s)])
    members = np.sort(np.arange(num_workers)[:, None] ^ offsets[None, :], axis=1)
    return np.unique(members, axis=0)


def group_mean(x_k: Any, masks: jax.Array, num_workers: int) -> Any:
    """Each of this device's k workers' mean of `x_k` (a tree of [k, ...] leaves) over its
    group: a stages of (x + x[m ^ s_j]) / 2. Runs where the backend runs a round's body: on
    one device (no collective), or with WORKER_AXIS bound over D = M / k devices."""
    k = jax.tree.leaves(x_k)[0].shape[0]
    num_devices = num_workers // k
    for j in range(masks.shape[0]):
        partner = _partners(x_k, masks[j], k, num_devices)
        x_k = jax.tree.map(lambda a, b: (a + b) * 0.5, x_k, partner)
    return x_k


def _partners(x_k: Any, mask: jax.Array, k: int, num_devices: int) -> Any:
    """x of worker m ^ mask for each of this device's workers m."""
    if num_devices > 1:
        branches = [_from_device(h, num_devices) for h in range(num_devices)]
        x_k = lax.switch(mask // k, branches, x_k)
    slots = jnp.arange(k, dtype=jnp.int32) ^ (mask % k)
    return jax.tree.map(lambda x: jnp.take(x, slots, axis=0), x_k)


def _from_device(h: int, num_devices: int):
    """The values of device d ^ h, on every device d (one collective-permute)."""
    if h == 0:
        return lambda x: x
    pairs = [(d, d ^ h) for d in range(num_devices)]
    return lambda x: lax.ppermute(x, WORKER_AXIS, pairs)


class GroupSync(OwnThetaSync):
    """A gossip part's sync (NoLoCo's, GASLoC's): each worker's own outer step (vmapped over
    the device's workers) under `spec`'s groups, and the round's "outer_grad_norm" as the
    sync keeps it (`_Own.norm`)."""

    def __init__(self, outer_optimizer, spec: Any, num_workers: int):
        self.apply_outer = jax.vmap(functools.partial(outer_update, outer_optimizer))
        self.spec, self.num_workers = spec, num_workers

    def grad_norm(self, c: Carry) -> jax.Array:
        return c.own[self.name].norm


class GossipSync(GroupSync):
    """NoLoCo's sync: each worker's delta against its own φ_m, its group's means of Δ and φ
    (`group_mean`), and its own outer step on g_m (see the module docstring)."""

    name = GOSSIP

    def begin(self, c: Carry, ctx: Any) -> Carry:
        own = ctx.local[self.name]
        theta = tuple(ctx.treedef.flatten_up_to(own.theta))
        c = c.with_own(self.name, _Own(theta, own.outer, None))
        return c._replace(workers=c.workers._replace(params=own.theta))

    def apply(self, c: Carry, ctx: Any, sync: Any, delta_k: Any, weighed: Any) -> Carry:
        own, spec = c.own[self.name], self.spec
        old_k = part(sync, own.theta, ctx.treedef)
        phi_k = widen(old_k)
        masks = group_masks(spec.seed, ctx.round, self.num_workers, spec.group_size)
        mean_k, phibar_k = group_mean((delta_k, phi_k), masks, self.num_workers)
        grad_k = jax.tree.map(
            lambda d, pbar, p: d - spec.consensus * (pbar - p), mean_k, phibar_k, phi_k
        )
        new_k, outer_k = self.apply_outer(old_k, own.outer, grad_k)
        theta = tuple(set_leaves(own.theta, leaf_indices(sync, len(own.theta)), new_k))
        norm = ctx.collectives.reduce(
            functools.partial(mean_norm, num_workers=self.num_workers), mean_k
        )
        c = c.with_own(self.name, _Own(theta, outer_k, norm))
        params_k = jax.tree.unflatten(ctx.treedef, theta)  # frozen leaves as they were
        return c._replace(workers=c.workers._replace(params=params_k))

    def end(self, c: Carry, ctx: Any) -> tuple[Any, Any]:
        own = c.own[self.name]
        return None, OwnOuter(jax.tree.unflatten(ctx.treedef, own.theta), own.outer)


def mean_norm(tree_k: Any, num_workers: int) -> jax.Array:
    """float32: the mean over all M workers of the norm of each one's tree (leaves [k, ...]
    on this device; a scalar all-reduce): NoLoCo's |Δ̄_G|, GASLoC's |Δ_m|."""
    norms_k = jax.vmap(lambda t: optax.tree.norm(t).astype(jnp.float32))(tree_k)
    return lax.psum(jnp.sum(norms_k), WORKER_AXIS) / num_workers


class _Own(NamedTuple):
    """What `GossipSync` keeps through a round: each worker's φ_m leaves [k, ...], its outer
    state [k, ...], and the round's one sync's "outer_grad_norm" (None before it)."""

    theta: tuple
    outer: Any
    norm: Any
