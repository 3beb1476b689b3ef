"""Which role fills each point of a round (`diloco_jax.body`): the method's parts and the
run's options assembled once, when the round is built, into a `Plan`. This is where a part
is registered: its role goes into the plan here, and the body runs whatever the plan holds.

- where a segment starts: `body.FromTheta` or `body.OwnParams` (schedule, drops, eager);
- the inner steps: `inner.PlainSteps` or `state_sync.SyncedSteps` (the state-sync part);
- the deltas: `body.DeltaFromTheta` or `delay.EagerSync` (the delay part, eager);
- the weights: `faults.UniformWeights` or `faults.WeighedRule` (the weights part);
- the exchange: `exchange.ExchangeRole` (compression), inside `delay.DelayedExchange`;
- the sync: `body.SyncNow`, `delay.EagerSync` or `outer_sharding.SplitOuterSync` (ZeRO-1);
- the merge into the workers: `schedule.RestartFromTheta` or `schedule.MergeIntoOwn`;
- θ's memory: `offload.DeviceMemory` or `offload.HostMemory` (outer_state_memory);
- the model state: `model_state.KeepModelState` or `model_state.MergeModelState`.
"""

from typing import Any, NamedTuple

from diloco_jax import delay, faults, inner, model_state, offload, outer_sharding, state_sync
from diloco_jax.body import DeltaFromTheta, FromTheta, OwnParams, Plan, SyncNow
from diloco_jax.exchange import exchange_role
from diloco_jax.schedule import MergeIntoOwn, RestartFromTheta, Schedule, segments


class Build(NamedTuple):
    """What a round is built from: the method (`DiLoCo`), its schedule and state syncs for
    these params (`DiLoCo.check_run`), the params' leaves (shapes) and structure, M and H,
    the inner `step` and the round's `batches`, and the run's options."""

    method: Any
    schedule: Schedule
    state_syncs: Any
    leaves: list
    treedef: Any
    num_workers: int
    num_steps: int
    step: Any
    batches: Any
    backend: Any
    rng_seed: int | None = None
    model_rules: Any = None
    outer_shards: Any = None  # per sync `outer_sharding.SyncShards` (ZeRO-1), or None
    host: bool = False
    param_specs: Any = None


def build_plan(b: Build) -> Plan:
    """The round's `Plan` (see the module docstring)."""
    method, schedule = b.method, b.schedule
    memory = offload.HostMemory() if b.host else offload.DeviceMemory()
    weights = faults.weights_role(method.weights, b.num_steps, len(schedule.syncs))
    mesh = b.backend.mesh if b.backend.mesh_axes else None
    exchange = exchange_role(
        method, schedule, b.leaves, b.treedef, b.num_workers, mesh, b.param_specs
    )
    own_params = method.carries_params
    merge = MergeIntoOwn(schedule.merge_alpha, memory) if own_params else RestartFromTheta()
    step_args = (b.step, b.batches, b.num_steps, method.weights.worker_steps is not None,
                 b.rng_seed, b.backend.worker_map)  # fmt: skip
    steps = (
        inner.PlainSteps(*step_args)
        if not b.state_syncs
        else state_sync.SyncedSteps(*step_args, b.state_syncs)
    )
    delta = DeltaFromTheta(memory)
    roles = [memory, weights, exchange, merge]
    if method.delay is not None:
        delayed = delay.DelayedExchange(exchange, weights, schedule.fragmented, method.eager)
        roles.append(delayed)
        if method.eager:
            sync = delta = delay.EagerSync(
                method.outer_optimizer, delayed, schedule.merge_alpha, schedule.fragmented
            )
        else:
            sync = SyncNow(method.outer_optimizer, delayed, memory, weights, merge)
    elif b.outer_shards is not None:
        sync = outer_sharding.SplitOuterSync(
            b.outer_shards, method.outer_optimizer, exchange, memory, weights, merge
        )
    else:
        sync = SyncNow(method.outer_optimizer, exchange, memory, weights, merge)
    model = (
        model_state.KeepModelState()
        if b.model_rules is None
        else model_state.MergeModelState(b.model_rules)
    )
    starts = OwnParams() if own_params or method.eager else FromTheta(memory)
    roles += [sync, steps, model, starts, delta]
    unique = tuple({id(r): r for r in roles}.values())
    return Plan(
        segments(schedule, b.num_steps), starts, steps, delta, weights, sync, model, unique,
        schedule.fragmented,
    )  # fmt: skip
