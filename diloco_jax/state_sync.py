"""Optimizer-state sync: the part of `diloco_round` for DES-LOC (Iacob et al. 2025, arXiv
2505.22549). Besides averaging params once a round, the workers average fields of their inner
optimizer state on their own schedules: `state_sync={"mu": K_u, "nu": K_v}` averages Adam's
first moment over all M workers right after every K_u-th inner step and its second moment
after every K_v-th, steps counted over the run (global step s = round * H + h + 1). The
fields are found by name in the optax state (`optax.tree.get`: e.g. scale_by_adam's "mu"
and "nu"). The paper's own setting averages params plainly (outer `optax.sgd(1.0)`) with
K_u = 3H and K_v = 6H. With `state_sync=None` the round is DiLoCo.

The inner steps then run as one scan whose body steps every worker (vmapped) and, when a
field is due, all-reduces it (inside `lax.cond`, so the collective runs only at its steps).
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from diloco_jax.carry import Part
from diloco_jax.inner import PlainSteps, StepInfo, masked_step, step_key
from diloco_jax.sampler import Sampler, worker_batches
from diloco_jax.trees import payload_bytes
from diloco_jax.workers import exact_mean

Syncs = tuple[tuple[str, int], ...]  # (field name, every K steps), sorted by name


@dataclasses.dataclass(frozen=True, init=False)
class StateSync(Part):
    """The state-sync part of a `DiLoCo` spec: `StateSync(mu=K_u, nu=K_v)` averages each
    named field of the inner optimizer state over the workers after every K-th inner step
    (K an integer >= 1). `every` holds the (field, K) pairs sorted by name. Whether each field
    is one field of the inner optimizer's state is checked by `check_run`."""

    every: Syncs

    def __init__(self, every: "Syncs | dict[str, int] | None" = None, /, **fields: int):
        if every is not None and not isinstance(every, dict | tuple):
            raise ValueError(
                "StateSync takes fields as keywords or a dict {field: every K steps}, got "
                f"{every!r}"
            )
        pairs = dict(every or {}) | fields
        if not pairs:
            raise ValueError("StateSync needs at least one field, e.g. StateSync(mu=75, nu=150)")
        for name, k in pairs.items():
            if not isinstance(name, str):
                raise ValueError(f"StateSync field names must be strings, got {name!r}")
            if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
                raise ValueError(f"StateSync.{name} must be an integer >= 1, got {k!r}")
        object.__setattr__(self, "every", tuple(sorted((n, int(k)) for n, k in pairs.items())))

    def __repr__(self) -> str:
        return "StateSync(" + ", ".join(f"{n}={k}" for n, k in self.every) + ")"

    def plan(self, build: Any, roles: dict) -> None:
        """The inner steps run under one scan that averages the fields when due."""
        roles["steps"] = SyncedSteps.of(roles["steps"], self.every)

    def variant(self) -> dict:
        return {"state_sync": self.every}

    def transfers_through(self, steps: int, inner_state: Any) -> list:
        """An all-reduce of each field at every multiple of its K up to `steps`."""
        return transfers(self.every, inner_state, steps)

    def check_run(self, params: Any, num_workers: int, inner_steps: int, inner_state: Any) -> None:
        """Raises ValueError naming the field unless each is found once in `inner_state` (one
        worker's inner optimizer state, or its shapes)."""
        for name, _ in self.every:
            try:
                found = optax.tree.get(inner_state, name, default=None)
            except (KeyError, ValueError) as error:  # e.g. two fields of that name (Muon's)
                found, why = None, f": {error}"
            else:
                why = ""
            if found is None:
                raise ValueError(
                    f"StateSync field {name!r} is not one field of the inner optimizer state{why}"
                )


def transfers(syncs: Syncs | None, inner_opt_state: Any, steps: int) -> list:
    """The collectives of the state syncs of a worker's first `steps` inner steps (the
    multiples of K up to it), as (op, operand bytes, times) triples: an all-reduce of the
    field per sync (`inner_opt_state` of one worker, unstacked). [] without syncs."""
    return [
        ("all-reduce", payload_bytes(optax.tree.get(inner_opt_state, name)), steps // every)
        for name, every in syncs or ()
    ]


def synced_scan(
    step_k: Callable[[Any, Any, Any], tuple[Any, Any, jax.Array]],
    params_k: Any,
    opt_k: Any,
    xs_S: Any,
    first_step: jax.Array,
    syncs: Syncs,
    average: Callable[[Any], Any],
    unroll: bool = False,
) -> tuple[Any, Any, jax.Array]:
    """S inner steps of this device's k workers under one `lax.scan`.

    step_k(params_k, opt_k, x) -> (params_k, opt_k, outputs: a pytree of [k]) steps every worker
    once (x: one entry of `xs_S`, leading dim S). After the step with global index
    s = first_step + i + 1, every field due (s % K == 0) is replaced by `average` of it
    (the mean over all M workers, given to each, leaves [k, ...]). Returns (params_k, opt_k,
    the outputs' leaves as [k, S]). `unroll`: the S steps as straight-line code."""

    def body(carry, x):
        params_k, opt_k, step = carry
        params_k, opt_k, out_k = step_k(params_k, opt_k, x)
        step = step + 1
        for name, every in syncs:
            field = optax.tree.get(opt_k, name)
            synced = lax.cond(step % every == 0, average, lambda f: f, field)
            opt_k = optax.tree.set(opt_k, **{name: synced})
        return (params_k, opt_k, step), out_k

    start = jnp.asarray(first_step, jnp.int32)
    (params_k, opt_k, _), out_Sxk = lax.scan(
        body, (params_k, opt_k, start), xs_S, unroll=True if unroll else 1
    )
    return params_k, opt_k, jax.tree.map(lambda x: x.T, out_Sxk)


class SyncedSteps(PlainSteps):
    """DES-LOC's inner steps: every worker steps under one scan (`synced_scan`), the inner
    state's fields averaged over all M workers when due."""

    def __init__(self, step, batches, num_steps, masked, rng_seed, worker_map, syncs: Syncs,
                 unroll: bool = False):  # fmt: skip
        super().__init__(step, batches, num_steps, masked, rng_seed, worker_map, unroll)
        self.syncs = syncs

    @classmethod
    def of(cls, steps: PlainSteps, syncs: Syncs) -> "SyncedSteps":
        """`steps` run under the synced scan."""
        return cls(
            steps.step, steps.batches, steps.num_steps, steps.masked, steps.rng_seed,
            steps.worker_map, syncs, steps.unroll,
        )  # fmt: skip

    def run(self, c: Any, ctx: Any, params: Any, axis: Any, start: int, stop: int) -> Any:
        keys_k, w = c.own[self.name], c.workers
        if axis is None:
            params = jax.tree.map(lambda x: jnp.broadcast_to(x, (ctx.num_local, *x.shape)), params)
        hs = jnp.arange(start, stop, dtype=jnp.int32)
        sampled = isinstance(self.batches, Sampler)
        if sampled:
            xs, x_axis = hs, None
        else:
            data_Sxk = jax.tree.map(lambda x: jnp.moveaxis(x[:, start:stop], 1, 0), ctx.data_k)
            xs, x_axis = (hs, data_Sxk), (None, 0)
        key_axis = None if keys_k is None else 0
        id_axis = None if ctx.ids_k is None else 0
        one_step = functools.partial(self._one_step, ctx, sampled)
        step_k = self.worker_map(one_step, (0, 0, 0, 0, key_axis, id_axis, x_axis))
        steps_k = ctx.inputs_k.steps

        def average(field_k):
            mean = ctx.collectives.reduce(
                functools.partial(_mean_to_every_worker, num_workers=ctx.num_workers), field_k
            )
            return ctx.collectives.vary(mean)

        (params_k, model_k), opt_k, (loss_kxS, aux_kxS) = synced_scan(
            lambda p, o, x: step_k(p, o, steps_k, ctx.data_k, keys_k, ctx.ids_k, x),
            (params, w.model),
            w.opt,
            xs,
            ctx.round * self.num_steps + start,
            self.syncs,
            average,
            self.unroll,
        )
        return c._replace(
            workers=w._replace(params=params_k, opt=opt_k, model=model_k),
            losses=(*c.losses, loss_kxS),
            auxes=(*c.auxes, aux_kxS),
        )

    def _one_step(self, ctx, sampled, carried, opt_state, steps, my_data, key, worker, x):
        # One worker's inner step h (masked after its h_m steps), for the synced scan; the
        # model state rides with the params (`synced_scan` averages optimizer fields only).
        h, batch = (x, worker_batches(self.batches, ctx.data, my_data)(x)) if sampled else x
        active = h < steps if self.masked else None
        info = StepInfo(
            None if worker is None else ctx.round,
            worker,
            h,
            None if key is None else step_key(key, h),
        )
        params, model_state = carried
        params, opt_state, model_state, loss, aux = masked_step(
            self.step, params, opt_state, model_state, batch, info, active
        )
        return (params, model_state), opt_state, (loss, aux)


def _mean_to_every_worker(local: Any, num_workers: int) -> Any:
    """Reducer: the mean over all M workers of leaves [k, ...], given to each of the k."""
    mean = exact_mean(local, num_workers)
    return jax.tree.map(lambda m, x: jnp.broadcast_to(m, x.shape), mean, local)
