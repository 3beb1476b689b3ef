"""One value per leaf: options given as a pytree like the params (or the model state)."""

from typing import Any

import jax
import numpy as np


def per_leaf(tree: Any, values: Any, error: str) -> list:
    """`values`, a pytree with `tree`'s structure holding anything at its leaves (bools,
    strings, `PartitionSpec`s, None), as one entry per leaf of `tree` in `jax.tree.leaves`
    order. ValueError(`error`) for another structure."""
    try:
        return jax.tree.structure(tree).flatten_up_to(values)
    except (ValueError, TypeError):
        raise ValueError(error) from None


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
