"""A trainable mask: leaves of the params that no optimizer moves.

`trainable` is a pytree of bools with the params' structure, or a callable `(path, leaf) ->
bool` (`jax.tree_util` key paths). A frozen leaf keeps its value bit for bit: the inner
optimizer gives it a zero update (`optax.set_to_zero` under `optax.multi_transform`, so no
weight decay and no optimizer state for it), and DiLoCo's syncs leave it out (no delta, no
outer state, no bytes on the wire).
"""

from typing import Any, NamedTuple

import jax
import optax

from diloco_jax.trees import per_leaf


class LeafMask(NamedTuple):
    """A resolved mask: one bool per leaf of the params, in `jax.tree.leaves` order (hashable,
    so a trainer's compiled round can be cached by it)."""

    flags: tuple[bool, ...]


def frozen_leaves(params: Any, trainable: Any) -> tuple[int, ...]:
    """Indices into `jax.tree.leaves(params)` of the leaves `trainable` freezes (() for None).
    Raises ValueError naming `trainable` for a wrong structure, a non-bool value, or a mask
    that freezes every leaf."""
    if trainable is None:
        return ()
    leaves = jax.tree.leaves(params)
    if isinstance(trainable, LeafMask):
        flags = list(trainable.flags)
    elif callable(trainable):
        flags = [
            trainable(path, leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
        ]
    else:
        flags = per_leaf(
            params,
            trainable,
            "trainable must be a pytree of bools with the params' structure, or a callable "
            f"(path, leaf) -> bool; got {trainable!r}",
        )
    if len(flags) != len(leaves) or not all(isinstance(f, bool) for f in flags):
        raise ValueError(f"trainable must give one bool per param leaf, got {flags!r}")
    if not any(flags):
        raise ValueError("trainable freezes every param leaf: nothing would train")
    return tuple(i for i, f in enumerate(flags) if not f)


def masked_optimizer(
    optimizer: optax.GradientTransformation, params: Any, frozen: tuple[int, ...]
) -> optax.GradientTransformation:
    """`optimizer` on the trainable leaves and a zero update on the `frozen` ones (the
    optimizer itself when nothing is frozen)."""
    if not frozen:
        return optimizer
    leaves, treedef = jax.tree.flatten(params)
    labels = jax.tree.unflatten(
        treedef, ["frozen" if i in frozen else "trained" for i in range(len(leaves))]
    )
    return optax.multi_transform({"trained": optimizer, "frozen": optax.set_to_zero()}, labels)


def resolved(params: Any, trainable: Any) -> LeafMask | None:
    """`trainable` as a `LeafMask` (None when nothing is frozen); checked as `frozen_leaves`."""
    frozen = frozen_leaves(params, trainable)
    if not frozen:
        return None
    return LeafMask(tuple(i not in frozen for i in range(len(jax.tree.leaves(params)))))
