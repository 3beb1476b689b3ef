"""Model state beside the params: what a model updates without an optimizer (BatchNorm's
running statistics, step counters, RNG counts), carried by each worker through its inner
steps and merged over the workers at the end of every round (every step under `train_sync`).

Merge rules, one per leaf (`model_state_merge=`: one rule, or a pytree of rules like the model
state):

- "mean": the exact mean over the M workers, in the leaf's dtype (an all-reduce; float leaves
  only). The default for float leaves.
- "first": worker 0's value, given to every worker (an all-gather; any dtype).
- "keep": each worker keeps its own (no traffic). The default for every other leaf.

A model state is never seen by an optimizer, never weight-decayed, and never part of the
deltas or of "wire_bytes"; its merge's own bytes are "model_state_wire_bytes" (`transfers`).
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from diloco_jax.carry import Role
from diloco_jax.trees import per_leaf
from diloco_jax.workers import all_gather_workers, exact_mean

MERGE_RULES = ("mean", "first", "keep")
Rules = tuple[str, ...]  # one rule per leaf of the model state, in `jax.tree.leaves` order


class Resolved(NamedTuple):
    """Rules already resolved by `merge_rules` (hashable: an option of a cached program)."""

    rules: Rules


def merge_rules(model_state: Any, model_state_merge: Any = None) -> Rules | None:
    """Each leaf's merge rule (`model_state_merge`: None for the defaults, one rule for
    every leaf, or a pytree of rules like `model_state`); None without a model state. Raises
    ValueError naming `model_state_merge` for rules without a model state, an unknown rule, a
    wrong structure or "mean" on a leaf that is not floating point."""
    if model_state is None:
        if model_state_merge is not None:
            raise ValueError("model_state_merge needs a model_state")
        return None
    leaves = jax.tree.leaves(model_state)
    if isinstance(model_state_merge, Resolved):
        rules = list(model_state_merge.rules)
        if len(rules) != len(leaves):
            raise ValueError("model_state_merge was resolved for another model state")
    elif model_state_merge is None:
        rules = ["mean" if _is_float(x) else "keep" for x in leaves]
    elif isinstance(model_state_merge, str):
        rules = [model_state_merge] * len(leaves)
    else:
        rules = per_leaf(
            model_state,
            model_state_merge,
            "model_state_merge must be one rule or a pytree of rules with the model state's "
            f"structure; got {model_state_merge!r}",
        )
    for i, (rule, leaf) in enumerate(zip(rules, leaves, strict=True)):
        if rule not in MERGE_RULES:
            raise ValueError(f"model_state_merge rules must be one of {MERGE_RULES}, got {rule!r}")
        if rule == "mean" and not _is_float(leaf):
            raise ValueError(
                f"model_state_merge 'mean' does not fit model state leaf {i} of dtype "
                f"{jnp.result_type(leaf)}: use 'first' or 'keep' for non-float leaves"
            )
    return tuple(rules)


def check_model_state(model_state: Any) -> None:
    """Raises ValueError naming `model_state` when it is not a pytree of arrays."""
    for leaf in jax.tree.leaves(model_state):
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise ValueError(f"model_state leaves must be arrays, got {type(leaf).__name__}")
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            raise ValueError(
                "model_state leaves must be plain arrays: store a typed PRNG key as "
                "jax.random.key_data(key) (nnx_model_fns does)"
            )


def merge(model_k: Any, rules: Rules, collectives, num_workers: int) -> Any:
    """The model state of this device's k workers (leaves [k, ...]) after the merge: each leaf
    by its rule, through the backend's `collectives` (`workers.Collectives`)."""
    leaves, treedef = jax.tree.flatten(model_k)
    merged = []
    for rule, x in zip(rules, leaves, strict=True):
        if rule == "mean":
            value = collectives.reduce(lambda v: exact_mean(v, num_workers), x)
        elif rule == "first":
            value = collectives.reduce(lambda v: all_gather_workers(v)[0], x)
        else:
            merged.append(x)
            continue
        merged.append(collectives.vary(jnp.broadcast_to(value, x.shape)))
    return jax.tree.unflatten(treedef, merged)


def merged_view(model_state_M: Any, rules: Rules) -> Any:
    """The merged model state a trainer returns: worker 0's copy of each merged leaf (every
    worker holds the same), the "keep" leaves stacked [M, ...]."""
    leaves, treedef = jax.tree.flatten(model_state_M)
    return jax.tree.unflatten(
        treedef, [x if r == "keep" else x[0] for r, x in zip(rules, leaves, strict=True)]
    )


def transfers(model_state: Any, rules: Rules) -> list:
    """The collectives of one merge, as (op, operand bytes) pairs: the all-reduce of each
    "mean" leaf, the all-gather of each "first" leaf."""
    ops = {"mean": "all-reduce", "first": "all-gather"}
    return [
        (ops[rule], int(np.prod(jnp.shape(x), dtype=np.int64)) * np.dtype(x.dtype).itemsize)
        for rule, x in zip(rules, jax.tree.leaves(model_state), strict=True)
        if rule in ops
    ]


def _is_float(x: Any) -> bool:
    return bool(jnp.issubdtype(jnp.result_type(x), jnp.floating))


class KeepModelState(Role):
    """No model state, or none merged: the workers' model states pass through the round."""

    name = "model"

    def merge(self, c: Any, ctx: Any) -> Any:
        return c


class MergeModelState(Role):
    """After the round's last sync, each model state leaf merged over the workers by its
    rule (`merge`)."""

    name = "model"

    def __init__(self, rules: Rules):
        self.rules = rules

    def merge(self, c: Any, ctx: Any) -> Any:
        model_k = merge(c.workers.model, self.rules, ctx.collectives, ctx.num_workers)
        return c._replace(workers=c.workers._replace(model=model_k))
