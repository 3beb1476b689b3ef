"""Flax NNX models, directly: a module split into the params DiLoCo trains, the model state it
merges (`diloco_jax.model_state`) and a pure apply.

    fns = dj.nnx_model_fns(model)
    def loss_fn(params, model_state, batch, key):
        logits, model_state = fns.apply(params, model_state, batch["x"], rng=key)
        return cross_entropy(logits, batch["y"]), model_state
    result = dj.train_diloco(loss_fn, fns.params, data, model_state=fns.model_state,
                             rng_seed=0, ...)
    trained = fns.merge(result.params, result.model_state)

The params are every `nnx.Param`, the model state everything else (`nnx.BatchStat`, RNG
streams' keys and counts, any other variable), both as plain nested dicts of arrays. RNG keys
travel as their uint32 key data (`jax.random.key_data`), so the model state is plain arrays
that checkpoints, merges and stacking accept.

Randomness, both ways Flax NNX offers it. `apply(..., rng=key)`:
  * reseeds every RNG stream stored in the module (`nnx.Dropout(rate, rngs=rngs)`) from
    `key`: the n streams, sorted by name, stream i from `fold_in(key, i)`;
  * and, when the module's `__call__` takes an `rngs` argument (today's Flax idiom: the
    official MNIST tutorial's CNN, the NNX transformer examples) and the call does not pass
    one, calls it with `rngs=nnx.Rngs(fold_in(key, n))`.
So each (round, worker, step) of a run with `rng_seed` draws its own dropout masks either
way. Without `rng` the stored streams advance as the module's own do (and start equal on
every worker), and a module that wants call-time `rngs` gets none: Flax then refuses dropout
in train mode, as it does when the module is called directly.
"""

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from flax import nnx


class NNXModelFns(NamedTuple):
    """params: the `nnx.Param` values (a nested dict of arrays); model_state: every other
    variable's value (RNG keys as key data); apply(params, model_state, *args, rng=None,
    train=True, **kwargs) -> (output, new model state): the module called in train mode
    (`model.train()`: batch statistics, dropout on) or with train=False in eval mode
    (`model.eval()`: running statistics, no dropout); with `rng`, stored RNG streams are
    reseeded and a `__call__` taking `rngs` gets `nnx.Rngs` from it (module docstring) unless
    the call passes its own (by keyword, or by position as in `model(x, rngs)`); any other
    argument (`deterministic=`) goes to the call as it is;
    merge(params, model_state) -> a new module with those values (model state leaves stacked
    [M, ...] by a "keep" rule: pass one worker's)."""

    params: Any
    model_state: Any
    apply: Callable[..., tuple[Any, Any]]
    merge: Callable[[Any, Any], nnx.Module]


def nnx_model_fns(model: nnx.Module) -> NNXModelFns:
    """Splits `model` (never modified) into params, model state and a pure apply."""
    if not isinstance(model, nnx.Module):
        raise ValueError(f"model must be a flax.nnx.Module, got {type(model).__name__}")
    copy = nnx.merge(*nnx.split(model))
    copy.train()
    train_def, params, rest = nnx.split(copy, nnx.Param, ...)
    copy.eval()
    eval_def = nnx.split(copy, nnx.Param, ...)[0]
    streams = sorted({n.tag for _, n in nnx.iter_graph(copy) if isinstance(n, nnx.RngStream)})
    signature = inspect.signature(copy.__call__)
    takes_rngs = "rngs" in signature.parameters
    params_like, rest_like = params, rest

    def build(graphdef, params, model_state):
        p, r = jax.tree.map(lambda x: x, (params_like, rest_like))  # fresh states to fill
        nnx.replace_by_pure_dict(p, params)
        nnx.replace_by_pure_dict(r, _as_keys(model_state))
        return nnx.merge(graphdef, p, r)

    def apply(params, model_state, *args, rng=None, train=True, **kwargs):
        module = build(train_def if train else eval_def, params, model_state)
        if rng is not None and streams:
            nnx.reseed(module, **{s: jax.random.fold_in(rng, i) for i, s in enumerate(streams)})
        if rng is not None and takes_rngs and not _given(signature, "rngs", args, kwargs):
            kwargs["rngs"] = nnx.Rngs(jax.random.fold_in(rng, len(streams)))
        out = module(*args, **kwargs)
        return out, _as_data(nnx.to_pure_dict(nnx.split(module, nnx.Param, ...)[2]))

    def merge(params, model_state):
        return build(train_def, params, model_state)

    return NNXModelFns(nnx.to_pure_dict(params), _as_data(nnx.to_pure_dict(rest)), apply, merge)


def _given(signature: inspect.Signature, name: str, args: tuple, kwargs: dict) -> bool:
    """Whether the call passes `name`, by keyword or by position (the tutorial's
    `model(x, rngs)`)."""
    try:
        return name in signature.bind_partial(*args, **kwargs).arguments
    except TypeError:  # a call the module refuses: it says why itself
        return name in kwargs


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _as_data(tree: Any) -> Any:
    """Typed PRNG keys as `{"key_data": uint32 data}` (plain arrays everywhere)."""
    return jax.tree.map(lambda x: {"key_data": jax.random.key_data(x)} if _is_key(x) else x, tree)


def _as_keys(tree: Any) -> Any:
    """Inverse of `_as_data`."""
    if isinstance(tree, dict):
        if set(tree) == {"key_data"}:
            return jax.random.wrap_key_data(tree["key_data"])
        return {k: _as_keys(v) for k, v in tree.items()}
    return tree


__all__ = ["NNXModelFns", "nnx_model_fns"]
