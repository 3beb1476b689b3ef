"""Communication accounting: the bytes a worker contributes to a collective."""

from typing import Any

import jax
import numpy as np


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
