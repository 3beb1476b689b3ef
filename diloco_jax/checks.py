"""Argument checks shared by the trainers: each raises a ValueError naming the argument."""

import math
from collections.abc import Callable
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


def check_number(name: str, value: Any, ok: Callable[[float], bool], what: str) -> None:
    """Raises ValueError naming `name` unless `value` is a finite real number (not a bool)
    with ok(value); `what` says the range in the message (e.g. "> 0")."""
    try:
        good = not isinstance(value, bool) and math.isfinite(float(value)) and ok(float(value))
    except (TypeError, ValueError):
        good = False
    if not good:
        raise ValueError(f"{name} must be a finite number {what}, got {value!r}")


def check_rate(name: str, value: Any) -> None:
    """A learning rate is an optax schedule (a callable of the step) or a number > 0."""
    if not callable(value):
        check_number(name, value, lambda x: x > 0, "> 0")


def check_params(params: Any) -> None:
    """Raises ValueError unless `params` is a pytree with at least one floating-point leaf and
    no other kind, each in a dtype JAX runs as is (float64 needs x64 on)."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    if not leaves:
        raise ValueError("params must be a pytree with at least one array leaf")
    for path, leaf in leaves:
        dtype = np.dtype(jnp.result_type(leaf))
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"params leaves must be floating point, got a {dtype} leaf")
        # JAX computes a float64 array as float32 unless x64 is on: the result would come
        # back in another dtype than the params went in.
        given = getattr(leaf, "dtype", None)
        if given is not None and np.dtype(given) != dtype:
            raise ValueError(
                f"params{jax.tree_util.keystr(path)} is {np.dtype(given)}, which JAX runs as "
                f"{dtype} while 64-bit mode is off: the run would train and return {dtype}; "
                f"cast it to {dtype}, or call jax.config.update('jax_enable_x64', True) first"
            )


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
