"""DiLoCo state and one communication round: the one round every method runs.

A round is the workers' inner steps interleaved with the syncs of its schedule. Each part of
the method acts at named points of it (`diloco_jax.body`), through the role the part calls
for (`diloco_jax.plan`):

- schedule (`diloco_jax.schedule`): which leaves sync after which inner step, and how the
  synced values merge into each worker's params (standard DiLoCo: every leaf after step H;
  Streaming DiLoCo: P fragments on a staggered schedule with overlap and merge alpha);
- weights (`diloco_jax.faults`): each worker's weight at each sync (1; 0 for a non-finite,
  dropped or anomalous worker; h_m under step weighting; EDiT's softmax of -‖Δ_m‖ / T) and
  what a left-out worker does next;
- exchange (`diloco_jax.exchange`): how the weighted deltas are averaged (an exact all-reduce
  or compressed payloads) around the backend's collectives;
- outer rule (`diloco_jax.outer`): the optax outer update of the synced leaves with their own
  outer state (a sync where no worker is included leaves both unchanged);
- delay (`diloco_jax.delay`): when a sync's mean is applied (at once, 1-2 rounds late, or
  eagerly);
- state sync (`diloco_jax.state_sync`): DES-LOC's averaging of inner optimizer state fields.

Each part's state between rounds lives beside it, in `DiLoCoState.parts` under its name,
present only when the part is. One round is one traced function (jit it once; H steps never
dispatch alone).
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from diloco_jax import delay, faults, offload
from diloco_jax import model_state as model_states
from diloco_jax import outer_sharding as outer_shards_lib
from diloco_jax import placement as placement_lib
from diloco_jax.body import Local, Shared, round_body
from diloco_jax.checks import check_bool
from diloco_jax.compression import Residuals
from diloco_jax.inner import LossFn, check_loss_options, loss_step, step_means, train_step
from diloco_jax.method import DiLoCo, method_from_options
from diloco_jax.model_state import check_model_state
from diloco_jax.outer import delta_dtype, outer_init
from diloco_jax.plan import Build, build_plan
from diloco_jax.sampler import Sampler, num_workers_of, split_data
from diloco_jax.schedule import (
    WORKER_PARAMS,
    Sync,
    WorkerParams,
    leaf_indices,
    part,
    synced_groups,
)
from diloco_jax.trainable import frozen_leaves, masked_optimizer
from diloco_jax.workers import Backend, make_backend, stack_workers


class DiLoCoState(NamedTuple):
    """Everything a DiLoCo run carries between rounds.

    params: global θ, the caller's structure, shapes and dtypes (with fragments: each
      fragment's values as of its last sync). None under eager updates and NoLoCo (each
      worker holds its own: `parts["eager"]`, `parts["gossip"]`).
    outer_opt_state: outer optimizer state in `delta_dtype` (float32 or wider): over θ; with
      fragments, a tuple of P states, fragment p's over the list of its leaves. None under
      eager updates and NoLoCo.
    inner_opt_state: each worker's inner optimizer state, leaves stacked [M, ...] (with a
      worker step, `train_diloco_step`, each worker's whole worker state).
    round: int32 scalar, rounds completed.
    model_state: each worker's model state (`diloco_jax.model_state`), leaves stacked [M, ...]
      (merged leaves equal on every worker after a round); None without one.
    parts: each part's own state, by name, present only when the part is:
      "workers" (`schedule.WorkerParams`: each worker's own params, where it continues from,
      under Streaming DiLoCo and simulated drops), "compression" (`exchange.Residuals`: the
      error-feedback residuals), "weights" (`faults.Anomalies`: EDiT's norm statistics),
      "delay" (`delay.InFlight`: the deltas and means in flight), "eager" (`delay.OwnTheta`:
      each worker's own θ and outer state), "gossip" (`noloco.OwnOuter`: NoLoCo's, the
      same).
    """

    params: Any
    outer_opt_state: Any
    inner_opt_state: Any
    round: jax.Array
    model_state: Any = None
    parts: dict = {}  # noqa: RUF012 (never mutated: a round builds a new dict)

    # The schema: which fields hold one entry per worker (leading dim M), which live in host
    # memory under outer_state_memory="pinned_host", and which a left-out worker's restore
    # reads again after the inner steps (`diloco_jax.donation`). Each part's state declares
    # its own per-worker fields (`PER_WORKER`); `diloco_jax.placement` reads them all.
    PER_WORKER = ("inner_opt_state", "model_state")
    HOST = ("params", "outer_opt_state")
    RESTORED = ("inner_opt_state", "model_state")

    def legacy_layout(self) -> dict[str, Any]:
        """The state in the flat layout of checkpoints written before each part held its own
        state (`checkpoint.FORMAT_VERSION` 2 and older), field name -> value: what a resume
        restores such a checkpoint onto (`from_legacy` converts back)."""
        parts = self.parts
        workers, eager = parts.get(WORKER_PARAMS), parts.get(delay.EAGER)
        flight, stats = parts.get(delay.DELAY), parts.get("weights")
        own = None if workers is None else workers.params
        return {
            "params": self.params,
            "outer_opt_state": self.outer_opt_state if eager is None else eager.outer,
            "inner_opt_state": self.inner_opt_state,
            "round": self.round,
            "residual": parts["compression"].residual if "compression" in parts else None,
            # Eager updates without fragments: each worker's θ_m was its own params.
            "local_params": eager.theta if own is None and eager is not None else own,
            "pending_deltas": None if flight is None else flight.deltas,
            "pending_weights": None if flight is None else flight.weights,
            "delayed_means": None if flight is None else flight.means or None,
            "norm_stats": None if stats is None else tuple(tuple(x) for x in stats.stats),
            "worker_params": eager.theta if own is not None and eager is not None else None,
            "model_state": self.model_state,
        }

    @classmethod
    def from_legacy(cls, fields: dict[str, Any], like: "DiLoCoState") -> "DiLoCoState":
        """A state like `like` from a checkpoint's flat layout (`legacy_layout`)."""
        parts = {}
        for name in like.parts:
            if name == WORKER_PARAMS:
                parts[name] = WorkerParams(fields["local_params"])
            elif name == "compression":
                parts[name] = Residuals(fields["residual"])
            elif name == "weights":
                parts[name] = faults.Anomalies(
                    tuple(faults.NormStats(*x) for x in fields["norm_stats"])
                )
            elif name == delay.DELAY:
                means = fields.get("delayed_means") or ()
                parts[name] = delay.InFlight(
                    fields["pending_deltas"], fields["pending_weights"], means
                )
            elif name == delay.EAGER:
                theta = fields["worker_params" if WORKER_PARAMS in like.parts else "local_params"]
                parts[name] = delay.OwnTheta(theta, fields["outer_opt_state"])
            else:
                raise ValueError(f"no flat-layout field holds the state of part {name!r}")
        outer = None if delay.EAGER in parts else fields["outer_opt_state"]
        return cls(
            params=fields["params"],
            outer_opt_state=outer,
            inner_opt_state=fields["inner_opt_state"],
            round=fields["round"],
            model_state=fields.get("model_state"),
            parts=parts,
        )


def init_state(
    params: Any,
    num_workers: int,
    method: DiLoCo | None = None,
    *,
    trainable: Any = None,
    model_state: Any = None,
    worker_state: Any = None,
    backend: "str | Backend | None" = None,
    **options,
) -> DiLoCoState:
    """Round-0 state for `method` (a `DiLoCo`; or its keyword shorthand, see
    `method_from_options`), M = `num_workers` >= 1 workers: θ copied (never aliased), M
    identical inner states, fresh outer state (one per fragment under Streaming DiLoCo), and
    each part's own state (`DiLoCoState.parts`): zero float32 residuals [M, ...] when the
    compression feeds its error back; θ stacked [M, ...] as each worker's own params with
    fragments or drops; with a delay, zero deltas in flight (the first d rounds apply a zero
    mean); with eager updates, every worker's own θ and outer state (see
    `diloco_jax.delay`); with an anomaly skip, empty norm statistics. `trainable` (see
    `diloco_jax.trainable`): frozen leaves get no inner optimizer state and no outer state.
    `model_state` (a pytree of arrays, see `diloco_jax.model_state`): copied to every worker,
    [M, ...]. `worker_state`: a worker step's state (`train_diloco_step`), copied to every
    worker as `inner_opt_state` in place of the inner optimizer's. `backend`: a `Backend` from
    `make_backend(..., mesh=, param_sharding=)` builds the state in place on its mesh, every
    field at its shards (`diloco_jax.placement`), as `train_diloco` does; without a mesh it
    changes nothing. `diloco_round` refuses a state built for another method."""
    method = method_from_options(method, options, caller="init_state")
    if backend is not None:
        backend = make_backend(backend, num_workers)
    frozen = frozen_leaves(params, trainable)
    if backend is not None and backend.mesh_axes:
        placed = placement_lib.of_backend(backend, params, None, method.schedule, frozen)
        init = functools.partial(
            init_state, num_workers=num_workers, method=method, trainable=trainable
        )
        return placement_lib.build_in_place(init, placed, params, model_state, worker_state)
    params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
    groups = synced_groups(params, method.schedule, frozen)
    if method.fragmented:
        outer_opt_state = tuple(outer_init(method.outer_optimizer, group) for group in groups)
    else:  # over the caller's tree, or the list of its trainable leaves
        outer_opt_state = outer_init(method.outer_optimizer, groups[0] if frozen else params)
    if worker_state is None:
        worker_state = masked_optimizer(method.inner_optimizer, params, frozen).init(params)
    if model_state is not None:
        check_model_state(model_state)
        model_state = stack_workers(model_state, num_workers)
    parts = _initial_parts(params, outer_opt_state, num_workers, method)
    if method.owns_theta:  # every worker holds its own θ and outer state (eager, NoLoCo)
        params = outer_opt_state = None
    inner_opt_state = stack_workers(worker_state, num_workers)
    zero = jnp.zeros((), jnp.int32)
    return DiLoCoState(
        params=params,
        outer_opt_state=outer_opt_state,
        inner_opt_state=inner_opt_state,
        round=zero,
        model_state=model_state,
        parts=parts,
    )


def _initial_parts(params: Any, outer_opt_state: Any, num_workers: int, method: DiLoCo) -> dict:
    """Each part's round-0 state, by name (`DiLoCoState.parts`)."""
    parts = {}
    for spec_part in method.parts:
        parts |= spec_part.initial(params, outer_opt_state, num_workers, method)
    return parts


def diloco_round(
    loss_fn: LossFn,
    state: DiLoCoState,
    batches: Any,
    method: DiLoCo | None = None,
    backend: "str | Backend" = "vmap",
    *,
    num_workers: int | None = None,
    inner_steps: int | None = None,
    has_aux: bool = False,
    rng_seed: int | None = None,
    trainable: Any = None,
    model_state_merge: Any = None,
    params_of: Any = None,
    with_params: Any = None,
    outer_shards: "outer_shards_lib.OuterShards | None" = None,
    outer_state_memory: str = "device",
    param_specs: "tuple[jax.sharding.PartitionSpec, ...] | None" = None,
    unroll_inner_steps: bool = False,
    **options,
) -> tuple[DiLoCoState, dict[str, jax.Array]]:
    """One DiLoCo communication round (Algorithm 1, one outer iteration). Pure; jit it.

    Args:
      loss_fn: (params, batch) -> float scalar; with a model state in `state` (`init_state(...,
        model_state=)`), (params, model_state, batch) -> (loss, new_model_state). With
        `params_of` and `with_params`, a worker step instead (see `train_diloco_step`).
      state: from `init_state` with the same method, or a previous round (a state built for
        another method is a ValueError).
      batches: batch pytree with leaves [M, H, ...] (worker m's step h uses leaf[m, h]); or a
        `Sampler` drawing each step's batch in the graph, with `num_workers` and `inner_steps`.
      method: a `DiLoCo` spec (its parts: `diloco_jax.method`), or its keyword shorthand in
        `options` (`inner_optimizer`, `outer_optimizer`, `compression`, `fragments`,
        `outer_delay`, ...: `method_from_options`). None and no options: plain DiLoCo.
      backend: "vmap" | "shard_map" | "pmap" | "auto", or a `Backend` from `make_backend`.
      num_workers, inner_steps: M and H, needed only when `batches` is a Sampler.
      has_aux: `loss_fn` returns (loss, aux), aux a dict of scalars; each aux metric joins
        the metrics like "loss" / "worker_loss": its mean over the steps taken, over workers
        as metrics[name], per worker as metrics["worker_" + name] (float32 [M]).
      rng_seed: an int >= 0: `loss_fn(params, batch, key)` with one key per (round, worker,
        inner step): `step_key(worker_key(rng_seed, round, m), h)` (`diloco_jax.inner`), the
        same on every backend and after a resume. None: `loss_fn(params, batch)`.
      trainable: a pytree of bools like the params, or a callable (path, leaf) -> bool; the
        frozen leaves keep their values bit for bit (`diloco_jax.trainable`). The state must
        be built with the same mask.
      model_state_merge: the merge rule of the model state's leaves at the round's end, one
        rule or a pytree of rules: "mean" (float leaves' default), "first", "keep" (the
        default for other leaves; `diloco_jax.model_state`).
      params_of, with_params: `loss_fn` is a worker step `(worker_state, batch, info) ->
        (worker_state, metrics)` over the worker states in `state.inner_opt_state`
        (`init_state(..., worker_state=)`); these read and write its params.
      outer_shards: the outer state split over the workers (ZeRO-1; see
        `diloco_jax.outer_sharding`), its leaves in storage at `OuterShards.storage_spec`
        (what `train_diloco(..., shard_outer_over_workers=True)` passes). None: replicated.
      outer_state_memory: "device", or "pinned_host" when θ and the outer state arrive in
        host memory (`diloco_jax.offload`): the round copies them to the device where it
        reads them, after the inner steps (with outer_shards, each device's shards of the
        outer state). Not with a delay, eager updates or pmap.
      param_specs: each param leaf's `PartitionSpec` over the mesh's non-worker axes, in
        `jax.tree.leaves` order (`diloco_jax.placement.resolve_param_specs`; what
        `train_diloco` passes on a mesh). Read by a compressed exchange on a mesh backend:
        each device encodes and exchanges its own shards (the codec's blocks per shard).
        None: the backend's `make_backend(param_sharding=)`, resolved against the state's
        params; without one, the leaves are taken as replicated inside a worker.
      unroll_inner_steps: True compiles each worker's H inner steps as straight-line code
        (`lax.scan(..., unroll=True)`) instead of one loop: the same arithmetic (up to
        float rounding), a program H times the step's size that takes longer to compile.
        Worth it where a loop slows the step: XLA's CPU backend runs a convolution's
        gradient many times slower inside a loop (docs/devices.md). False: one loop.

    A weights part with fault options on (exclusion, drops, worker steps, weighting, anomaly)
    leaves workers out of a sync's mean or weighs them (`diloco_jax.faults`); a delay applies
    the mean launched d rounds earlier, its own exchange running at the start of the next
    round, independent of that round's inner steps (`diloco_jax.delay`).

    Returns:
      (new state, metrics) with metrics "loss" (float32 mean inner loss over the steps
      taken), "worker_loss" (float32 [M], each worker's mean over its steps, each loss taken
      before that step's update) and "outer_grad_norm" (global L2 norm of the averaged deltas
      of every sync). With any fault option on, metrics also hold "excluded_workers" (bool
      [M], a non-finite delta or an anomaly outlier at some sync), "dropped_workers" (bool
      [M], dropped at some sync) and "skipped" (bool scalar: some sync included no worker,
      so those leaves and their outer state are unchanged and their delta counts as 0;
      `round` still advances).
    """
    method = method_from_options(method, options, caller="diloco_round")
    check_loss_options(has_aux, rng_seed)
    custom = _check_step_functions(params_of, with_params, method, has_aux)
    num_workers = num_workers_of(batches, num_workers)
    backend = make_backend(backend, num_workers)
    _check_round_mesh(backend, state, "state")
    _check_round_mesh(backend, batches, "batches")
    num_steps = _inner_steps_of(batches, inner_steps)
    # Under eager updates (and for a state built for them, which `_check_state` refuses
    # below) θ is the workers' mean.
    like = state.params
    if like is None:
        like = jax.eval_shape(delay.global_params, state)
    frozen = frozen_leaves(like, trainable)
    worker_like = _one_worker(state.inner_opt_state) if custom else None
    model_like = None if state.model_state is None else _one_worker(state.model_state)
    schedule = method.check_run(like, num_workers, num_steps, frozen, worker_like)
    _check_state(state, like, num_workers, method, trainable, model_like, worker_like)
    if custom:
        step = train_step(loss_fn, params_of, with_params, frozen)
    else:
        inner = masked_optimizer(method.inner_optimizer, like, frozen)
        step = loss_step(loss_fn, inner, has_aux, with_model_state=model_like is not None)
    leaves, treedef = jax.tree.flatten(like)
    if param_specs is None and backend.param_sharding is not None:
        param_specs = placement_lib.resolve_param_specs(
            like, backend.mesh, backend.param_sharding.value()
        )
    plan = build_plan(
        Build(
            method=method,
            schedule=schedule,
            leaves=leaves,
            treedef=treedef,
            num_workers=num_workers,
            num_steps=num_steps,
            step=step,
            batches=batches,
            backend=backend,
            rng_seed=rng_seed,
            model_rules=model_states.merge_rules(model_like, model_state_merge),
            outer_shards=_sync_shards(
                outer_shards, method, backend, schedule, leaves, treedef, state
            ),
            host=_check_host(outer_state_memory, method, backend),
            param_specs=_checked_specs(param_specs, len(leaves)),
            unroll_inner_steps=check_bool("unroll_inner_steps", unroll_inner_steps),
        )
    )
    ids_M = None
    if rng_seed is not None or custom:  # what a step's key or StepInfo needs
        ids_M = jnp.arange(num_workers, dtype=jnp.int32)
    shared, local = _inputs(plan, state, batches, num_workers, ids_M)
    body = functools.partial(round_body, plan=plan, treedef=treedef, num_workers=num_workers)
    # Fragmented rounds keep the program they ran before the round bodies were folded into
    # one (on vmap, the workers under a size-1 device axis), so those runs stay bit for bit;
    # un-nesting it is faster on CPU but rounds differently.
    same, mine = backend.map_workers(body, nested=plan.fragmented)(shared, local)
    return _outputs(plan, state, local, same, mine)


def _inputs(plan, state: DiLoCoState, batches: Any, num_workers: int, ids_M: Any):
    """The round's (`body.Shared`, `body.Local`) inputs from the state."""
    outer = state.outer_opt_state
    if outer is not None and not plan.fragmented:  # one sync: its outer state is the whole
        outer = (outer,)
    shared_outer, local_outer = plan.sync.outer_in(outer)
    shared_data, per_worker_data = split_data(batches, num_workers, state.round)
    halves = {name: split_state(s) for name, s in state.parts.items()}
    shared = Shared(
        theta=state.params,
        outer=shared_outer,
        data=shared_data,
        round=state.round,
        parts={name: h[0] for name, h in halves.items()},
    )
    local = Local(
        opt=state.inner_opt_state,
        model=state.model_state,
        outer=local_outer,
        data=per_worker_data,
        ids=ids_M,
        inputs=plan.weights.round_inputs(state.round, num_workers),
        parts={name: h[1] for name, h in halves.items()},
    )
    return shared, local


def _outputs(plan, state: DiLoCoState, local, same, mine) -> tuple[DiLoCoState, dict]:
    """The new state and the round's metrics from the body's outputs."""
    outer = plan.sync.outer_out(same.outer, mine.outer)
    if outer is not None and not plan.fragmented:
        outer = outer[0]
    metrics = step_means(mine.losses, mine.aux, plan.weights.steps_taken(local.inputs))
    metrics["outer_grad_norm"] = same.grad_norm
    metrics |= mine.metrics | same.metrics
    names = [*same.parts, *(n for n in mine.parts if n not in same.parts)]
    parts = {n: join_states(same.parts.get(n), mine.parts.get(n)) for n in names}
    new_state = DiLoCoState(
        params=same.theta,
        outer_opt_state=outer,
        inner_opt_state=mine.opt,
        round=state.round + 1,
        model_state=mine.model,
        parts=parts,
    )
    return new_state, metrics


def split_state(state: Any) -> tuple[Any, Any]:
    """A part's state as (shared half, per-worker half): the same NamedTuple, each with the
    other half's fields None (its `PER_WORKER` fields are the per-worker ones)."""
    per_worker = set(type(state).PER_WORKER)
    shared = state._replace(**{f: None for f in state._fields if f in per_worker})
    local = state._replace(**{f: None for f in state._fields if f not in per_worker})
    return shared, local


def join_states(shared: Any, local: Any) -> Any:
    """`split_state`'s inverse (either half may be None: a part with no fields there)."""
    if shared is None or local is None:
        return local if shared is None else shared
    per_worker = set(type(shared).PER_WORKER)
    return local._replace(**{f: getattr(shared, f) for f in shared._fields if f not in per_worker})


def _check_host(memory, method, backend) -> bool:
    """Whether θ and the outer state arrive in host memory; ValueError naming
    outer_state_memory for what it can't run with."""
    if offload.check_memory(memory) != offload.HOST:
        return False
    why = _refusal("host_memory_refusal", method, backend)
    if why is not None:
        raise ValueError(f"outer_state_memory='pinned_host' does not run with {why}")
    return True


def _refusal(name: str, method: DiLoCo, backend: Backend) -> str | None:
    """The first of the method's parts' (in field order), then the backend's, reasons `name`
    ("host_memory_refusal" or "zero_refusal") why a run option can't run; None if none."""
    reasons = [getattr(part, name) for part in method.parts] + [getattr(backend, name)]
    return next((why for why in reasons if why is not None), None)


def _sync_shards(shards, method, backend, schedule, leaves, treedef, state):
    """Each sync's `SyncShards` under a split outer state (None without one); ValueError
    naming shard_outer_over_workers for what it can't run with."""
    if shards is None:
        return None
    if not isinstance(shards, outer_shards_lib.OuterShards):
        raise ValueError(f"outer_shards must be an OuterShards, got {shards!r}")
    why = _refusal("zero_refusal", method, backend)
    if why is not None:
        raise ValueError(f"shard_outer_over_workers does not run with {why}")
    if shards.num_workers != backend.num_workers or len(shards.dims) != len(leaves):
        raise ValueError(
            f"outer_shards was built for {shards.num_workers} workers and {len(shards.dims)} "
            f"param leaves, not {backend.num_workers} and {len(leaves)}"
        )
    wide = [jax.ShapeDtypeStruct(x.shape, delta_dtype(x.dtype)) for x in leaves]
    outer_shards_lib.check_per_coordinate(method.outer_optimizer, jax.tree.unflatten(treedef, wide))
    outer_states = state.outer_opt_state if schedule.fragmented else (state.outer_opt_state,)
    return tuple(
        outer_shards_lib.sync_shards(
            shards,
            jax.eval_shape(functools.partial(part, sync, wide, treedef)),
            leaf_indices(sync, len(leaves)),
            jax.eval_shape(lambda s=s: s),
        )
        for sync, s in zip(schedule.syncs, outer_states, strict=True)
    )


def _checked_specs(param_specs: Any, num_leaves: int) -> tuple | None:
    """`param_specs` (None, or one `PartitionSpec` per param leaf); ValueError naming
    param_specs for a malformed one."""
    if param_specs is None:
        return None
    if not isinstance(param_specs, tuple | list) or len(param_specs) != num_leaves:
        raise ValueError(
            f"param_specs must be a tuple of one PartitionSpec per param leaf ({num_leaves}), "
            f"got {param_specs!r}"
        )
    for spec in param_specs:
        if not isinstance(spec, P):
            raise ValueError(f"param_specs must hold PartitionSpecs, got {spec!r}")
    return tuple(param_specs)


def _check_round_mesh(backend: Backend, tree: Any, name: str) -> None:
    """ValueError naming `name` for an array typed on a mesh with Explicit axes other than the
    round's (`Backend.mesh`): the round can't take it (e.g. a state placed by hand on the
    user's mesh with a worker axis of another name)."""
    if not backend.mesh_axes:
        return
    names = tuple(backend.mesh.axis_names)
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array):
            continue
        mesh = getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None)
        types = getattr(mesh, "axis_types", ())
        if tuple(getattr(mesh, "axis_names", names)) != names and AxisType.Explicit in types:
            raise ValueError(
                f"{name} holds arrays on a mesh with Explicit axes {mesh.axis_names}, not the "
                f"round's mesh {names}: build the state with init_state(..., backend=backend) "
                "and put batches with backend.place_batches (Backend.on_user_mesh moves "
                "results back)"
            )


def _check_state(
    state: DiLoCoState,
    params_like: Any,
    num_workers: int,
    method: DiLoCo,
    trainable: Any,
    model_like: Any = None,
    worker_like: Any = None,
) -> None:
    """Raises one ValueError when `state` is not what `init_state(params, M, method,
    trainable=...)` builds: the fields that differ in structure, shape or dtype are named."""
    if not isinstance(state, DiLoCoState):
        raise ValueError(
            f"state must be a DiLoCoState (from init_state), got {type(state).__name__}"
        )
    want = jax.eval_shape(
        lambda p, m, w: init_state(
            p, num_workers, method, trainable=trainable, model_state=m, worker_state=w
        ),
        params_like,
        model_like,
        worker_like,
    )
    differ = [
        name
        for name, have, expect in zip(DiLoCoState._fields, state, want, strict=True)
        if name != "parts" and _shapes(have) != _shapes(expect)
    ]
    parts = state.parts if isinstance(state.parts, dict) else {}
    differ += [
        f"parts[{name!r}]"
        for name in sorted(set(parts) | set(want.parts))
        if _shapes(parts.get(name)) != _shapes(want.parts.get(name))
    ]
    if differ:
        raise ValueError(
            f"state was built for another method than {method!r}, another number of workers "
            f"({num_workers}) or another trainable mask: its fields {differ} differ from "
            "init_state(params, num_workers, method, trainable=...)'s; build the state with "
            "what you run"
        )


def _one_worker(tree_M: Any) -> Any:
    """The shapes of one worker's slice of a [M, ...]-stacked pytree."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), tree_M)


def _check_step_functions(params_of: Any, with_params: Any, method: DiLoCo, has_aux: bool) -> bool:
    """Whether the round runs a worker step: both `params_of` and `with_params` are
    callables (ValueError naming the one missing; or a method with its own inner optimizer,
    which a worker step replaces)."""
    if params_of is None and with_params is None:
        return False
    for name, fn in (("params_of", params_of), ("with_params", with_params)):
        if not callable(fn):
            raise ValueError(f"{name} must be a callable with a worker step, got {fn!r}")
    if method.inner is not None:
        raise ValueError("a worker step is its own inner optimizer: give a DiLoCo without inner")
    if has_aux:
        raise ValueError("has_aux does not apply to a worker step: its metrics dict is the aux")
    return True


def _shapes(tree: Any) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, [(tuple(jnp.shape(x)), jnp.result_type(x)) for x in leaves]


def _inner_steps_of(batches: Any, inner_steps: int | None) -> int:
    """H from host batches' second dim [M, H, ...], or the explicit `inner_steps`."""
    if isinstance(batches, Sampler):
        if inner_steps is None:
            raise ValueError("inner_steps is required when batches is a Sampler")
        return inner_steps
    return jax.tree.leaves(batches)[0].shape[1]


__all__ = ["DiLoCoState", "Sync", "diloco_round", "init_state"]
