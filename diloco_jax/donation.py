"""What of the round's state is donated to its jit.

A weight rule that leaves a worker out (the default non-finite exclusion, EDiT's anomaly skip)
sends that worker's inner optimizer and model state back to the round's start after its inner
steps, so the round reads those round-start values after the H steps. With the whole state
donated, XLA aliases the new inner state to the old buffers and copies the round-start values
into its temporaries before the steps. Left undonated, the round reads them from its
arguments and writes the new state to fresh output buffers. Both the old and the new inner
state are live either way, so the peak is about the same; what differs is where the second
copy lives, and that matters on one platform:

- CPU: XLA's runtime allocates an execution's temporaries as one block through malloc, and
  glibc maps a block over 32 MiB (its largest mmap threshold) afresh every time, so a copy
  held in temporaries is faulted in again every round (15-20% of a small model's round,
  benchmarks/README.md "device_round.py"). Output buffers are allocated leaf by leaf and
  reused: the restored fields are not donated.
- GPU and TPU: buffers come from a pooled allocator, so a copy in temporaries costs no
  faults, and the donated layout's peak is the lower one where they differ (XLA's CPU
  compiler needed up to half an inner state more undonated for tests/test_donation.py's
  model): the whole state is donated.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from diloco_jax import placement as placement_lib
from diloco_jax.method import SHORTHAND, DiLoCo, method_from_options
from diloco_jax.round import DiLoCoState, diloco_round
from diloco_jax.workers import Backend


def restored_fields(method: DiLoCo | None) -> tuple[str, ...]:
    """The `DiLoCoState` fields `diloco_round(..., method)` reads again after the inner steps
    (a left-out worker's restore): () when its weight rule never leaves a worker out."""
    weights = (method or DiLoCo()).weights
    return DiLoCoState.RESTORED if weights.active and weights.leaves_out else ()


def kept_fields(method: DiLoCo | None, platform: str) -> tuple[str, ...]:
    """The fields `jit_round` leaves undonated on `platform` ("cpu", "gpu", "tpu", ...): the
    restored ones on CPU, none elsewhere."""
    return restored_fields(method) if platform == "cpu" else ()


def jit_donating(
    step: Callable[[NamedTuple, Any], Any], kept: tuple[str, ...] = (), **jit_kwargs
) -> Callable[[NamedTuple, Any], Any]:
    """`jax.jit(step, donate_argnums=0, **jit_kwargs)` for `step(state, batch)` with a NamedTuple
    state, except that the fields named in `kept` are not donated. The result also has
    `.lower(state, batch)`."""
    if not kept:
        return jax.jit(step, donate_argnums=0, **jit_kwargs)

    def split_step(donated, read, batch):
        return step(donated._replace(**read), batch)

    # jit names the program (profiles, HLO dumps) after the function: the step's own name.
    inner = step
    while isinstance(inner, functools.partial):
        inner = inner.func
    split_step.__name__ = split_step.__qualname__ = getattr(inner, "__name__", "step")
    jitted = jax.jit(split_step, donate_argnums=0, **jit_kwargs)

    def split(state):
        return state._replace(**dict.fromkeys(kept)), {name: getattr(state, name) for name in kept}

    def call(state, batch):
        return jitted(*split(state), batch)

    call.lower = lambda state, batch: jitted.lower(*split(state), batch)
    return call


def platform_of(backend: Any) -> str:
    """The platform a round on `backend` (a `Backend` or a backend name) runs on."""
    devices = getattr(backend, "devices", None)
    return devices[0].platform if devices else jax.default_backend()


def jit_round(loss_fn: Callable, method: DiLoCo | None = None, **round_options) -> Callable:
    """`diloco_round(loss_fn, state, batches, method, **round_options)` jitted as `train_diloco`
    runs it: `step(state, batches) -> (new state, metrics)`, the state donated (don't use it
    after the call), on CPU except the fields a left-out worker's restore reads back
    (`kept_fields`). `round_options`: `diloco_round`'s keyword arguments (backend,
    num_workers, inner_steps, ..., or the method's keyword shorthand)."""
    shorthand = {k: round_options.pop(k) for k in list(round_options) if k in SHORTHAND}
    method = method_from_options(method, shorthand, caller="jit_round", allowed=SHORTHAND)

    backend = round_options.get("backend", "vmap")
    # On a mesh whose param specs are known, as train_diloco: the new state constrained to
    # the placement, every field kept at its shards round after round (a constraint keeps no
    # memory kind, so not with the state in host memory).
    constrained = (
        isinstance(backend, Backend)
        and backend.mesh_axes
        and round_options.get("outer_state_memory", "device") == "device"
    )

    def step(state, batches):
        new_state, metrics = diloco_round(loss_fn, state, batches, method, **round_options)
        placed = None
        if constrained:
            placed = placement_lib.of_round_state(
                backend, state, method, round_options.get("trainable"),
                round_options.get("param_specs"), round_options.get("outer_shards") is not None,
            )  # fmt: skip
        if placed is not None:
            new_state = jax.lax.with_sharding_constraint(new_state, placed.shardings(new_state))
        return new_state, metrics

    return jit_donating(step, kept_fields(method, platform_of(backend)))
