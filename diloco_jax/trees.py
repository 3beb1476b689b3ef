"""One value per leaf: options given as a pytree like the params (or the model state); a
tree's size and finiteness."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def per_leaf(tree: Any, values: Any, error: str) -> list:
    """`values`, a pytree with `tree`'s structure holding anything at its leaves (bools,
    strings, `PartitionSpec`s, None), as one entry per leaf of `tree` in `jax.tree.leaves`
    order. ValueError(`error`, followed by the paths one has and the other lacks) for another
    structure."""
    try:
        return jax.tree.structure(tree).flatten_up_to(values)
    except (ValueError, TypeError):
        raise ValueError(error + _difference(tree, values)) from None


def payload_bytes(tree: Any) -> int:
    """Bytes of one worker's payload: sum of size x itemsize over the leaves of `tree`.

    `tree` may hold arrays or `jax.ShapeDtypeStruct`s (e.g. from `jax.eval_shape`).
    """
    return int(
        sum(
            np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize
            for x in jax.tree.leaves(tree)
        )
    )


@jax.jit
def all_finite(tree: Any) -> jax.Array:
    """Whether every element of every leaf of `tree` is finite (integer codes always are),
    as a bool scalar: one fused pass, where `np.isfinite` makes a mask of the tree's size."""
    return jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def _difference(tree: Any, values: Any) -> str:
    """' (missing: ['b']; extra: ['c'])': the leaf paths of `tree` that `values`
    lacks and the other way round, as far as plain dicts, lists and tuples tell them apart;
    '' when they don't (the same paths, other containers)."""
    ours = _paths(tree, lambda x: False)
    # A value at a leaf may be anything (a PartitionSpec is a tuple), a None included.
    theirs = _paths(values, lambda x: x is None or type(x) not in (dict, list, tuple))
    missing, extra = sorted(ours - theirs), sorted(theirs - ours)
    parts = ([f"missing: {', '.join(missing)}"] if missing else []) + (
        [f"extra: {', '.join(extra)}"] if extra else []
    )
    return f" ({'; '.join(parts)})" if parts else ""


def _paths(tree: Any, is_leaf) -> set[str]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return {jax.tree_util.keystr(path) for path, _ in flat}
