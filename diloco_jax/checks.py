"""Argument checks shared by the trainers: each raises a ValueError naming the argument."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from diloco_jax import limits


def check_bool(name: str, value: Any) -> bool:
    """`value` if it is True or False; else ValueError naming `name`."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_int(name: str, value: Any, minimum: int) -> None:
    """Raises ValueError naming `name` unless `value` is an integer (not a bool) >= minimum
    and within the int32 the run counts in (`limits.check_count`)."""
    limits.check_count(name, value, minimum)


def check_params(params: Any) -> None:
    """Raises ValueError unless `params` is a pytree with at least one floating-point leaf and
    no other kind."""
    leaves = jax.tree.leaves(params)
    if not leaves:
        raise ValueError("params must be a pytree with at least one array leaf")
    for leaf in leaves:
        dtype = np.dtype(jnp.result_type(leaf))
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"params leaves must be floating point, got a {dtype} leaf")


def checked_optimizer(name: str, optimizer: Any, default) -> optax.GradientTransformation:
    """`optimizer`, or `default()` for None; ValueError naming `name` for anything that is not
    an optax GradientTransformation (an object with callable `init` and `update`)."""
    if optimizer is None:
        return default()
    if not (
        callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
    ):
        raise ValueError(f"{name} must be an optax GradientTransformation, got {optimizer!r}")
    return optimizer
