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

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from diloco_jax.comm import payload_bytes
from diloco_jax.hlo import ring_wire_bytes

StateSync = tuple[tuple[str, int], ...]  # (field name, every K steps), sorted by name


def check(state_sync: Any, inner_opt_state: Any) -> StateSync | None:
    """`state_sync` ({field: K}) as a sorted tuple, each field found (once) in the inner
    optimizer state `inner_opt_state` and K an integer >= 1; None when off. Raises
    ValueError naming `state_sync`."""
    if state_sync is None:
        return None
    if isinstance(state_sync, tuple):
        state_sync = dict(state_sync)
    if not isinstance(state_sync, dict) or not state_sync:
        raise ValueError(f"state_sync must be a dict {{field: every K steps}}, got {state_sync!r}")
    for name, every in state_sync.items():
        if isinstance(every, bool) or not isinstance(every, int | np.integer) or every < 1:
            raise ValueError(f"state_sync[{name!r}] must be an integer >= 1, got {every!r}")
        try:
            found = optax.tree.get(inner_opt_state, name, default=None)
        except (KeyError, ValueError) as error:  # e.g. two fields of that name
            found, why = None, f": {error}"
        else:
            why = ""
        if found is None:
            raise ValueError(
                f"state_sync field {name!r} is not one field of the inner optimizer state{why}"
            )
    return tuple(sorted((str(k), int(v)) for k, v in state_sync.items()))


def wire_bytes(
    syncs: StateSync | None, inner_opt_state: Any, num_workers: int, steps: int
) -> float:
    """Bytes each worker sends on the wire for the state syncs of its first `steps` inner
    steps (the multiples of K up to it): a ring all-reduce of the field per sync
    (`inner_opt_state` of one worker, unstacked). 0 without syncs or with one worker."""
    if not syncs:
        return 0.0
    return sum(
        (steps // every)
        * ring_wire_bytes(
            "all-reduce", payload_bytes(optax.tree.get(inner_opt_state, name)), num_workers
        )
        for name, every in syncs
    )


def synced_scan(
    step_k: Callable[[Any, Any, Any], tuple[Any, Any, jax.Array]],
    params_k: Any,
    opt_k: Any,
    xs_S: Any,
    first_step: jax.Array,
    syncs: StateSync,
    average: Callable[[Any], Any],
) -> tuple[Any, Any, jax.Array]:
    """S inner steps of this device's k workers under one `lax.scan`.

    step_k(params_k, opt_k, x) -> (params_k, opt_k, float32 losses [k]) steps every worker
    once (x: one entry of `xs_S`, leading dim S). After the step with global index
    s = first_step + i + 1, every field due (s % K == 0) is replaced by `average` of it
    (the mean over all M workers, given to each, leaves [k, ...]). Returns (params_k, opt_k,
    losses float32 [k, S])."""

    def body(carry, x):
        params_k, opt_k, step = carry
        params_k, opt_k, loss_k = step_k(params_k, opt_k, x)
        step = step + 1
        for name, every in syncs:
            field = optax.tree.get(opt_k, name)
            synced = lax.cond(step % every == 0, average, lambda f: f, field)
            opt_k = optax.tree.set(opt_k, **{name: synced})
        return (params_k, opt_k, step), loss_k

    start = jnp.asarray(first_step, jnp.int32)
    (params_k, opt_k, _), losses_Sxk = lax.scan(body, (params_k, opt_k, start), xs_S)
    return params_k, opt_k, losses_Sxk.T
