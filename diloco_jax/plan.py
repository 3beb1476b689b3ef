"""Which role fills each point of a round (`diloco_jax.body`): the method's parts and the
run's options assembled once, when the round is built, into a `Plan`; the body runs whatever
the plan holds.

The round's standard roles fill every point first; then each part of the spec, in the order
of `DiLoCo`'s fields, puts its own (`carry.Part.plan`): a part is registered by being a field
of `DiLoCo`. The points and who may fill them:

- starts (where a segment's workers start): `schedule.FromTheta`, or `schedule.OwnParams`
  (Streaming, drops, eager updates, NoLoCo);
- steps: `inner.PlainSteps`, or `state_sync.SyncedSteps` (DES-LOC);
- delta: `body.DeltaFromTheta`, or `delay.EagerSync` / `noloco.GossipSync` (against each
  worker's own θ);
- weights: `faults.UniformWeights`, or `faults.WeighedRule` (the weights part);
- exchange: `exchange.ExchangeRole` (the compression part), or `delay.DelayedExchange`
  around it;
- merge (into the workers after a sync): `schedule.RestartFromTheta`, or
  `schedule.MergeIntoOwn` (Streaming, drops);
- sync: `body.SyncNow` on the points above, `delay.EagerSync`, `noloco.GossipSync` (NoLoCo's
  group means), or, with the outer state split over the workers (a run option),
  `outer_sharding.SplitOuterSync`;
- memory (where θ and the outer state live, a run option): `offload.DeviceMemory` or
  `offload.HostMemory`;
- model (a run option): `model_state.KeepModelState` or `model_state.MergeModelState`.
"""

from typing import Any, NamedTuple

from diloco_jax import faults, inner, model_state, offload, outer_sharding
from diloco_jax.body import DeltaFromTheta, Plan, SyncNow
from diloco_jax.exchange import exchange_role
from diloco_jax.schedule import FromTheta, RestartFromTheta, Schedule, segments


class Build(NamedTuple):
    """What a round is built from: the method (`DiLoCo`), its schedule for these params
    (`DiLoCo.check_run`), the params' leaves (shapes) and structure, M and H,
    the inner `step` and the round's `batches`, and the run's options."""

    method: Any
    schedule: Schedule
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
    unroll_inner_steps: bool = False  # the inner steps as straight-line code (no loop)


def build_plan(b: Build) -> Plan:
    """The round's `Plan` (see the module docstring)."""
    method = b.method
    memory = offload.HostMemory() if b.host else offload.DeviceMemory()
    mesh = b.backend.mesh if b.backend.mesh_axes else None
    roles = {
        "memory": memory,
        "weights": faults.UniformWeights(),
        "exchange": exchange_role(
            method, b.schedule, b.leaves, b.treedef, b.num_workers, mesh, b.param_specs
        ),
        "merge": RestartFromTheta(),
        "starts": FromTheta(memory),
        "steps": inner.PlainSteps(
            b.step,
            b.batches,
            b.num_steps,
            method.weights.masked,
            b.rng_seed,
            b.backend.worker_map,
            b.unroll_inner_steps,
        ),  # fmt: skip
        "delta": DeltaFromTheta(memory),
        "model": model_state.KeepModelState(),
        "kept": [],
    }
    for part in method.parts:
        part.plan(b, roles)
    if b.model_rules is not None:
        roles["model"] = model_state.MergeModelState(b.model_rules)
    if b.outer_shards is not None:
        roles["sync"] = outer_sharding.SplitOuterSync(
            b.outer_shards, method.outer_optimizer, roles["exchange"], memory, roles["weights"],
            roles["merge"],
        )  # fmt: skip
    if "sync" not in roles:
        roles["sync"] = SyncNow(
            method.outer_optimizer, roles["exchange"], memory, roles["weights"], roles["merge"],
            method.outer_delay or None,
        )  # fmt: skip
    # Every role once, in the order their `begin` runs: a wrapped role before its wrapper,
    # the workers' own params loaded before a sync that reads them.
    order = [memory, roles["weights"], *roles["kept"], roles["exchange"], roles["merge"]]
    order += [roles[p] for p in ("sync", "steps", "model", "starts", "delta")]
    unique = tuple({id(r): r for r in order}.values())
    return Plan(
        segments=segments(b.schedule, b.num_steps),
        starts=roles["starts"],
        steps=roles["steps"],
        delta=roles["delta"],
        weights=roles["weights"],
        sync=roles["sync"],
        model=roles["model"],
        roles=unique,
        fragmented=b.schedule.fragmented,
    )
