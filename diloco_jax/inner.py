"""The inner loop: H optax steps of one worker, as one `lax.scan`."""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from diloco_jax import limits
from diloco_jax.carry import Role
from diloco_jax.sampler import Sampler, worker_batches
from diloco_jax.workers import match_varying

LossFn = Callable[..., Any]
Aux = dict[str, jax.Array]


def loss_and_aux(
    loss_fn: LossFn,
    params: Any,
    batch: Any,
    key: jax.Array | None = None,
    has_aux: bool = False,
    what: str = "loss_fn",
) -> tuple[jax.Array, Aux]:
    """Calls `loss_fn(params, batch)` (or `(params, batch, key)` with a key) and checks what
    it returns, at trace time, naming `loss_fn`: a float scalar loss; with `has_aux`, a pair
    (loss, aux) with aux a dict of str -> numeric scalars (returned as float32; {} without
    has_aux)."""
    out = loss_fn(params, batch) if key is None else loss_fn(params, batch, key)
    if has_aux:
        if not (isinstance(out, tuple | list) and len(out) == 2):
            raise ValueError(
                f"{what} with has_aux=True must return (loss, aux), aux a dict of scalars; "
                f"got {type(out).__name__}"
            )
        loss, aux = out
        if not isinstance(aux, dict) or not all(isinstance(k, str) for k in aux):
            raise ValueError(f"{what}'s aux must be a dict of str -> scalar, got {aux!r}")
        for name, value in aux.items():
            dtype = jnp.result_type(value)
            if jnp.shape(value) != () or not (
                jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
                or jnp.issubdtype(dtype, jnp.bool_)
            ):  # fmt: skip
                raise ValueError(
                    f"{what}'s aux[{name!r}] must be a numeric scalar, got shape "
                    f"{jnp.shape(value)} and dtype {dtype}"
                )
        aux = {k: jnp.asarray(v).astype(jnp.float32) for k, v in aux.items()}
    elif isinstance(out, tuple | list):
        raise ValueError(
            f"{what} returned a tuple: to report (loss, aux) metrics pass has_aux=True"
        )
    else:
        loss, aux = out, {}
    shape, dtype = jnp.shape(loss), jnp.result_type(loss)
    if shape != () or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{what} must return a float scalar, got shape {shape} and dtype {dtype}")
    return loss, aux


# The names a round's metrics and a trainer's history already use: aux names must differ.
RESERVED_METRICS = (
    "loss", "worker_loss", "outer_grad_norm", "excluded_workers", "dropped_workers", "skipped",
    "round", "step", "steps", "bytes_communicated", "wire_bytes",
)  # fmt: skip


def check_loss_options(has_aux: Any, rng_seed: Any) -> None:
    """Raises ValueError naming `has_aux` (not a bool) or `rng_seed` (not None or an int in
    [0, 2**32 - 1], the bits a PRNG key keeps of a seed)."""
    if not isinstance(has_aux, bool):
        raise ValueError(f"has_aux must be True or False, got {has_aux!r}")
    if rng_seed is not None and (
        isinstance(rng_seed, bool) or not isinstance(rng_seed, int) or rng_seed < 0
    ):
        raise ValueError(f"rng_seed must be None or an integer >= 0, got {rng_seed!r}")
    if rng_seed is not None and rng_seed > limits.SEED_MAX:
        raise ValueError(f"rng_seed must be at most {limits.SEED_MAX:,}, got {rng_seed!r}")


def step_means(loss_MxH: jax.Array, aux_MxH: Aux, steps_M: jax.Array | None) -> dict:
    """The loss and each aux output [M, H] as means over the steps taken: over every worker's
    steps as metrics[name], per worker as metrics["worker_" + name] ([M]). `steps_M`: the
    steps each worker took (masked steps hold 0), None for all H. Raises ValueError naming
    `loss_fn` for an aux name that collides with a metric or history key."""
    names = ["loss", *aux_MxH]
    for name in aux_MxH:
        for key in (name, "worker_" + name):
            if key in RESERVED_METRICS or (key != name and key in names):
                raise ValueError(f"loss_fn's aux name {name!r} collides with the metric {key!r}")
    metrics = {}
    for name, x_MxH in {"loss": loss_MxH, **aux_MxH}.items():
        if steps_M is None:
            metrics[name], metrics["worker_" + name] = jnp.mean(x_MxH), jnp.mean(x_MxH, axis=1)
        else:  # skipped steps hold 0: divide by the steps taken
            steps_f = steps_M.astype(jnp.float32)
            metrics[name] = jnp.sum(x_MxH) / jnp.sum(steps_f)
            metrics["worker_" + name] = jnp.sum(x_MxH, axis=1) / steps_f
    return metrics


def step_key(base_key: jax.Array, step: jax.Array) -> jax.Array:
    """The key of one inner step: `fold_in(base_key, step)` (see `worker_key`)."""
    return jax.random.fold_in(base_key, step)


def worker_key(seed: int, round_: jax.Array, worker: jax.Array) -> jax.Array:
    """The base key of worker m's inner steps in round r: fold_in(fold_in(PRNGKey(seed), r),
    m); step h's key is `step_key(worker_key(...), h)`. It depends on (seed, round, worker,
    step) only: not on the backend, the mesh, or where a run resumed."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), round_), worker)


class StepInfo(NamedTuple):
    """Where one inner step is: int32 scalars `round` (rounds completed before this one),
    `worker` (m in [0, M)) and `step` (h in [0, H) within the round), and `key`: the step's
    PRNG key `step_key(worker_key(rng_seed, round, m), h)` with an rng_seed, else None."""

    round: Any
    worker: Any
    step: Any
    key: Any


# One worker's inner step, the contract every round runs:
# (params, opt_state, model_state, batch, info) -> (params, opt_state, model_state, loss, aux)
# with the loss float32 taken before the update and aux a dict of float32 scalars.
Step = Callable[[Any, Any, Any, Any, StepInfo], tuple[Any, Any, Any, jax.Array, Aux]]


def loss_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    has_aux: bool = False,
    with_model_state: bool = False,
) -> Step:
    """The `loss_fn` form as a `Step`: one optax step on the gradient of `loss_fn(params,
    [model_state,] batch[, key])`. With a model state, `loss_fn` returns (loss,
    new_model_state), or (loss, (new_model_state, aux)) with `has_aux`; the model state is
    not differentiated and no optimizer sees it."""

    def step(params, opt_state, model_state, batch, info):
        grads, model_state, loss, aux = loss_gradients(
            loss_fn, params, model_state, batch, info.key, has_aux, with_model_state
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, model_state, loss, aux

    return step


def loss_gradients(
    loss_fn: LossFn,
    params: Any,
    model_state: Any,
    batch: Any,
    key: jax.Array | None = None,
    has_aux: bool = False,
    with_model_state: bool = False,
) -> tuple[Any, Any, jax.Array, Aux]:
    """(gradients of the loss wrt `params`, new model state, loss, aux) of `loss_fn(params,
    [model_state,] batch[, key])`, checked as `loss_and_aux` does; the model state is not
    differentiated (without one it is returned as given)."""

    def loss_of(p):
        if not with_model_state:
            loss, aux = loss_and_aux(loss_fn, p, batch, key, has_aux)
            return loss, (model_state, aux)
        new = {}  # the new model state, peeled off inside this trace

        def plain(p, batch, *key):
            loss, new["model_state"], aux = _split_model_state(
                loss_fn(p, model_state, batch, *key), model_state, has_aux
            )
            return (loss, aux) if has_aux else loss

        loss, aux = loss_and_aux(plain, p, batch, key, has_aux)
        return loss, (new["model_state"], aux)

    (loss, (new_model_state, aux)), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
    return grads, new_model_state, loss, aux


def _split_model_state(out: Any, model_state: Any, has_aux: bool) -> tuple[Any, Any, Any]:
    """(loss, new model state, aux or None) from what a model-state `loss_fn` returned."""
    want = "(loss, (new_model_state, aux))" if has_aux else "(loss, new_model_state)"
    if not (isinstance(out, tuple | list) and len(out) == 2):
        raise ValueError(f"loss_fn with a model_state must return {want}, got {type(out).__name__}")
    loss, rest = out
    if has_aux and not (isinstance(rest, tuple | list) and len(rest) == 2):
        raise ValueError(f"loss_fn with a model_state must return {want}")
    new_model_state, aux = rest if has_aux else (rest, None)
    _check_same("loss_fn's new model_state", model_state, new_model_state)
    return loss, new_model_state, aux


def _check_same(what: str, like: Any, new: Any) -> None:
    """Raises ValueError unless `new` has the structure, shapes and dtypes of `like`."""
    if jax.tree.structure(like) != jax.tree.structure(new):
        raise ValueError(f"{what} must have the structure of the one passed in")
    for a, b in zip(jax.tree.leaves(like), jax.tree.leaves(new), strict=True):
        if jnp.shape(a) != jnp.shape(b) or jnp.result_type(a) != jnp.result_type(b):
            raise ValueError(
                f"{what} must keep every leaf's shape and dtype: {jnp.shape(a)} "
                f"{jnp.result_type(a)} became {jnp.shape(b)} {jnp.result_type(b)}"
            )


def train_step(
    worker_step: Callable[[Any, Any, StepInfo], tuple[Any, dict]],
    params_of: Callable[[Any], Any],
    with_params: Callable[[Any, Any], Any],
    frozen: tuple[int, ...] = (),
) -> Step:
    """A user's `worker_step(worker_state, batch, info) -> (worker_state, metrics)` as a
    `Step`: the `opt_state` slot carries the whole worker state, DiLoCo writes its params
    in with `with_params(worker_state, params)` and reads them out with `params_of`.
    `metrics` is a dict of scalars with a float "loss" (taken before the update); the other
    entries are the step's aux metrics. Leaves in `frozen` keep their values."""

    def step(params, worker_state, model_state, batch, info):
        new_state, metrics = worker_step(with_params(worker_state, params), batch, info)
        new_params = params_of(new_state)
        _check_same("worker_step's params (params_of of its new worker state)", params, new_params)
        if not isinstance(metrics, dict) or "loss" not in metrics:
            raise ValueError(
                "worker_step must return (worker_state, metrics) with metrics a dict of "
                f"scalars holding 'loss'; got metrics {metrics!r}"
            )
        metrics = dict(metrics)
        loss = metrics.pop("loss")
        loss, aux = loss_and_aux(lambda *_: (loss, metrics), None, None, None, True, "worker_step")
        if frozen:
            leaves, treedef = jax.tree.flatten(new_params)
            old = jax.tree.leaves(params)
            new_params = jax.tree.unflatten(
                treedef, [old[i] if i in frozen else x for i, x in enumerate(leaves)]
            )
        return new_params, new_state, model_state, loss, aux

    return step


def _step(loss_fn, optimizer, params, opt_state, batch, key, has_aux):
    """One optax step: (params, opt_state, loss before the update, aux)."""
    info = StepInfo(None, None, None, key)
    params, opt_state, _, loss, aux = loss_step(loss_fn, optimizer, has_aux)(
        params, opt_state, None, batch, info
    )
    return params, opt_state, loss, aux


def inner_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    params,
    opt_state,
    batch,
    *,
    key: jax.Array | None = None,
    has_aux: bool = False,
) -> tuple:
    """One optax step on `batch`: returns (params, opt_state, loss before the update), and
    the aux dict after them with `has_aux`. With `key`, `loss_fn(params, batch, key)`."""
    params, opt_state, loss, aux = _step(loss_fn, optimizer, params, opt_state, batch, key, has_aux)
    return (params, opt_state, loss, aux) if has_aux else (params, opt_state, loss)


def masked_step(
    step: Step,
    params: Any,
    opt_state: Any,
    model_state: Any,
    batch: Any,
    info: StepInfo,
    active: jax.Array | None = None,
) -> tuple[Any, Any, Any, jax.Array, Aux]:
    """`step` with its loss in float32; where the bool scalar `active` is False the params,
    optimizer and model state stay as they were and the loss and aux are 0 (a worker past
    its h_m steps). None: always active. Returns (params, opt_state, model_state, loss, aux)."""
    new = step(params, opt_state, model_state, batch, info)
    old = (params, opt_state, model_state)
    kept, (loss, aux) = match_varying(tuple(new[:3]), old), new[3:]
    loss = loss.astype(jnp.float32)
    if active is None:
        return *kept, loss, aux
    kept = jax.tree.map(
        lambda a, b: jnp.where(active, a, b), kept, (params, opt_state, model_state)
    )
    zeroed = jax.tree.map(lambda x: jnp.where(active, x, 0.0), (loss, aux))
    return *kept, *zeroed


def inner_loop(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    params: Any,
    opt_state: Any,
    batches_H: Any,
    *,
    num_steps: int | None = None,
    active_steps: jax.Array | None = None,
    key: jax.Array | None = None,
    first_step: int = 0,
    has_aux: bool = False,
) -> tuple:
    """Runs H inner steps of one worker under `lax.scan`.

    Args:
      loss_fn: (params, batch) -> float scalar; (params, batch, key) with `key`; returning
        (loss, aux dict of scalars) with `has_aux`.
      optimizer: any optax transformation (DiLoCo's default is AdamW).
      params: the worker's starting params (the global params at the round's start).
      opt_state: the worker's inner optimizer state (persists across rounds).
      batches_H: batch pytree whose leaves are [H, ...] (step h uses leaf[h]); or a function
        step -> batch (int32 scalar step in [0, H)) that draws each batch inside the scan,
        with `num_steps=H`.
      active_steps: optional int32 scalar h_m in [1, H]: only the first h_m steps update
        (a slow worker under vmap still scans H steps; later steps' results are discarded
        with `jnp.where` on the carry, so optimizer counts don't advance and their losses
        are 0).
      key: optional base key (`worker_key`): step h draws `step_key(key, first_step + h)`.
      first_step: the index of this scan's first step within the round (0 unless the round
        pauses, e.g. at a Streaming DiLoCo sync).

    Returns:
      (params after H steps, opt_state after H steps, losses_H float32 [H]) where
      losses_H[h] is the loss at step h taken before that step's update, and with `has_aux`
      the aux dict of float32 [H] after them. Dtypes of params and opt_state are kept. Pure:
      nothing is mutated.
    """
    out = run_steps(
        loss_step(loss_fn, optimizer, has_aux),
        params,
        opt_state,
        None,
        batches_H,
        num_steps=num_steps,
        active_steps=active_steps,
        key=key,
        first_step=first_step,
    )
    params, opt_state, _, losses_H, aux_H = out
    return (params, opt_state, losses_H, aux_H) if has_aux else (params, opt_state, losses_H)


def run_steps(
    step: Step,
    params: Any,
    opt_state: Any,
    model_state: Any,
    batches_H: Any,
    *,
    num_steps: int | None = None,
    active_steps: jax.Array | None = None,
    key: jax.Array | None = None,
    first_step: int = 0,
    round_: Any = None,
    worker: Any = None,
    unroll: bool = False,
) -> tuple[Any, Any, Any, jax.Array, Aux]:
    """H steps of one worker under `lax.scan` (see `inner_loop`; `step` is any `Step`):
    returns (params, opt_state, model_state, losses_H float32 [H], aux dict of float32 [H]).
    Step h's `StepInfo` holds `round_`, `worker`, first_step + h and its key. `unroll`: the
    H steps as straight-line code, no loop (`lax.scan(..., unroll=True)`)."""
    if callable(batches_H):
        if num_steps is None:
            raise ValueError("num_steps is required when batches_H is a function")
        batch_of, xs = batches_H, jnp.arange(num_steps, dtype=jnp.int32)
    else:
        batch_of, xs = (lambda batch: batch), batches_H
    # Scan the step index along only when something reads it (keeps the plain program).
    indexed = active_steps is not None or key is not None or worker is not None
    if indexed:
        steps = jax.tree.leaves(xs)[0].shape[0]
        xs = (jnp.arange(steps, dtype=jnp.int32), xs)

    def body(carry, x):
        h, x = x if indexed else (None, x)
        active = None if active_steps is None else h < active_steps
        at = None if h is None else first_step + h
        info = StepInfo(round_, worker, at, None if key is None else step_key(key, at))
        *carry, loss, aux = masked_step(step, *carry, batch_of(x), info, active)
        return tuple(carry), (loss, aux)

    carry, (losses_H, aux_H) = lax.scan(
        body, (params, opt_state, model_state), xs, unroll=True if unroll else 1
    )
    return *carry, losses_H, aux_H


class PlainSteps(Role):
    """A segment of inner steps: each worker's `run_steps` from its start params, mapped over
    the device's workers by the backend (`Backend.worker_map`). With per-worker step counts
    (`masked`), worker m's steps past its h_m leave it as it was; with an `rng_seed`, step h
    of worker m in round r draws `step_key(worker_key(rng_seed, r, m), h)`."""

    name = "steps"

    def __init__(self, step: Step, batches: Any, num_steps: int, masked: bool,
                 rng_seed: int | None, worker_map: Callable, unroll: bool = False):  # fmt: skip
        self.step, self.batches, self.num_steps = step, batches, num_steps
        self.masked, self.rng_seed, self.worker_map = masked, rng_seed, worker_map
        self.unroll = unroll

    def begin(self, c: Any, ctx: Any) -> Any:
        keys_k = None  # each worker's base key of this round's steps (`worker_key`)
        if self.rng_seed is not None:
            keys_k = jax.vmap(lambda w: worker_key(self.rng_seed, ctx.round, w))(ctx.ids_k)
        return c.with_own(self.name, keys_k)

    def run(self, c: Any, ctx: Any, params: Any, axis: Any, start: int, stop: int) -> Any:
        keys_k = c.own[self.name]
        run = functools.partial(self._segment, ctx, start, stop)
        key_axis = None if keys_k is None else 0
        id_axis = None if ctx.ids_k is None else 0
        w = c.workers
        params_k, opt_k, model_k, loss_kxS, aux_kxS = self.worker_map(
            run, (axis, 0, 0, 0, 0, key_axis, id_axis)
        )(params, w.opt, w.model, ctx.inputs_k.steps, ctx.data_k, keys_k, ctx.ids_k)
        return c._replace(
            workers=w._replace(params=params_k, opt=opt_k, model=model_k),
            losses=(*c.losses, loss_kxS),
            auxes=(*c.auxes, aux_kxS),
        )

    def _segment(self, ctx, start, stop, params, opt_state, model_state, steps, my_data, key,
                 worker):  # fmt: skip
        data = worker_batches(self.batches, ctx.data, my_data)
        if isinstance(self.batches, Sampler):
            data = data if start == 0 else functools.partial(_offset, data, start)
        elif (start, stop) != (0, self.num_steps):
            data = jax.tree.map(lambda x: x[start:stop], data)
        active = steps - start if self.masked else None
        return run_steps(
            self.step,
            params,
            opt_state,
            model_state,
            data,
            num_steps=stop - start,
            active_steps=active,
            key=key,
            first_step=start,
            round_=None if worker is None else ctx.round,
            worker=worker,
            unroll=self.unroll,
        )


def _offset(batch_of, start, h):
    return batch_of(h + start)
