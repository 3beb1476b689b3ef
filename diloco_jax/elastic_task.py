"""What an elastic run trains and how it treats its members: `ElasticTask` (the user's model,
data and method, built the same way in every process) and `Elastic` (membership, timeouts,
heal). See `diloco_jax.elastic` for the run itself."""

import dataclasses
import importlib
import math
from collections.abc import Callable
from typing import Any

import jax

from diloco_jax import limits
from diloco_jax.decoupled import DecoupledDiLoCo
from diloco_jax.halos import HALoS
from diloco_jax.halos import default_global_optimizer as halos_default_global
from diloco_jax.heloco_outer import job_start
from diloco_jax.method import DiLoCo, only_optimizers

ALGOS = ("diloco", "async")


@dataclasses.dataclass(frozen=True)
class ElasticTask:
    """One elastic run's model, data and method; every process (the syncer and each worker)
    builds the same task from the same `module:function` (`load_task`).

    loss_fn: (params, batch) -> float scalar, or (params, batch, key) with `rng_seed`.
    params: θ_0, a pytree of float arrays.
    batches: (worker m in [0, M), position p >= 0) -> one inner phase's batch, leaves
      [H, ...]. Position p is the worker's p-th completed inner phase: it advances once per
      phase that entered a sync, so no sample is skipped or repeated across a death.
    num_workers: M >= 1. inner_steps: H >= 1. num_rounds: R >= 1 syncs (with algo "async":
      server updates, one per delta applied).
    algo: "diloco" (a sync per round over the round's members, `diloco_jax.syncer`) or
      "async" (asynchronous DiLoCo: each delta applied as it arrives, with its age, and the
      worker sent on from the θ of that moment; `diloco_jax.arrival_syncer`). Its replay on
      the simulated clock: `train_async(arrivals=elastic.arrivals(syncer_dir))`.
    dynamic_steps: with algo "async", DyLU: each job's inner steps floor(H v_m / max v), v
      the workers' measured inner steps per second (H for a worker not timed yet; a step
      count's first phase in a worker process compiles its program and is not timed).
    server: with algo "async", None (one server applying each delta as it arrives),
      `dj.DecoupledDiLoCo(...)`: learners that never wait and a syncer merging a quorum of
      their fragment pushes (`diloco_jax.decoupled_syncer`; num_rounds counts its merges),
      or `dj.HALoS(...)` with no simulated latencies: a syncer per region under a global one,
      each its own process (`diloco_jax.halos_syncer`; num_rounds counts the global
      syncer's updates). Its replay: `train_async(server=...,
      arrivals=elastic.arrivals(syncer_dir))`.
    method: a `DiLoCo` (its inner and outer optimizers and outer_state_dtype; the parts that
      can't run elastically are refused, `refusal`); None: the paper's DiLoCo.
    rng_seed: None, or the seed of each step's key (`inner.worker_key(seed, round, m)`), as
      in `train_diloco`.
    param_sharding, batch_sharding: where a worker's inner phase runs, over the devices of
      its own process (a worker is one JAX program; build its mesh in the task function, as
      the task is built in the process that uses it). `param_sharding`: one
      `jax.sharding.Sharding` for every param leaf, or a pytree of them like `params` (θ and
      the inner state follow it); `batch_sharding`: one for every batch leaf (leaves
      [H, B, ...]: e.g. `NamedSharding(mesh, P(None, "data"))` splits each step's batch over
      the worker's devices, its gradients reduced there by XLA). None: the default device.
    """

    loss_fn: Callable[..., Any]
    params: Any
    batches: Callable[[int, int], Any]
    num_workers: int
    inner_steps: int
    num_rounds: int
    method: DiLoCo | None = None
    rng_seed: int | None = None
    param_sharding: Any = None
    batch_sharding: Any = None
    algo: str = "diloco"
    dynamic_steps: bool = False
    server: Any = None

    def __post_init__(self):
        if self.algo not in ALGOS:
            raise ValueError(f"ElasticTask.algo must be one of {ALGOS}, got {self.algo!r}")
        if not isinstance(self.dynamic_steps, bool):
            raise ValueError(
                f"ElasticTask.dynamic_steps must be True or False, got {self.dynamic_steps!r}"
            )
        if self.dynamic_steps and self.algo != "async":
            raise ValueError("ElasticTask.dynamic_steps (DyLU) needs algo='async'")
        for name in ("num_workers", "inner_steps", "num_rounds"):
            limits.check_count(f"ElasticTask.{name}", getattr(self, name), 1)
            object.__setattr__(self, name, int(getattr(self, name)))
        limits.check_steps("ElasticTask", self.num_rounds, self.inner_steps)
        method = DiLoCo() if self.method is None else self.method
        if not isinstance(method, DiLoCo):
            raise ValueError(f"ElasticTask.method must be a DiLoCo or None, got {method!r}")
        why = refusal(method)
        if why is not None:
            raise ValueError(f"ElasticTask.method can't run elastically: {why}")
        if self.algo == "async":  # what train_async, its replay, takes
            only_optimizers(method, "ElasticTask with algo='async'", "each arrival applies "
                            "one worker's whole delta")  # fmt: skip
        elif job_start(method.outer) is not None:
            raise ValueError(
                "ElasticTask.method's outer rule starts jobs from a look-ahead θ̄ (HeLoCo): "
                "algo='async' does; a round starts every worker from θ"
            )
        if method.gossip is not None:
            _check_gossip_task(self, method)
        object.__setattr__(self, "method", method)
        if self.server is not None:
            _check_server(self)
        seed = self.rng_seed
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= limits.SEED_MAX
        ):
            raise ValueError(
                f"ElasticTask.rng_seed must be None or an integer in [0, {limits.SEED_MAX}], "
                f"got {seed!r}"
            )
        for name in ("loss_fn", "batches"):
            if not callable(getattr(self, name)):
                raise ValueError(f"ElasticTask.{name} must be callable")
        _check_shardings("param_sharding", self.param_sharding, self.params)
        _check_shardings("batch_sharding", self.batch_sharding, None)


def _check_server(task: "ElasticTask") -> None:
    """ValueError naming ElasticTask.server unless it is a Decoupled DiLoCo or HALoS this task
    runs."""
    server = task.server
    if task.algo != "async":
        raise ValueError("ElasticTask.server needs algo='async': its workers never wait")
    if isinstance(server, HALoS):
        _check_halos(task, server)
        return
    if not isinstance(server, DecoupledDiLoCo):
        raise ValueError(
            f"ElasticTask.server must be None, dj.DecoupledDiLoCo(...) or dj.HALoS(...), got "
            f"{server!r}"
        )
    if task.dynamic_steps:
        raise ValueError("ElasticTask.dynamic_steps is for jobs of H steps; DecoupledDiLoCo's "
                         "learners never stop")  # fmt: skip
    server.checked(task.num_workers, task.inner_steps, task.params)


def _check_halos(task: "ElasticTask", server: HALoS) -> None:
    """ValueError naming what a HALoS run on processes can't take: simulated latencies (its
    hops are the network's), or regions that don't fit the task."""
    if server.simulates_latency:
        raise ValueError(
            "ElasticTask.server's worker_seconds and region_seconds simulate latencies: on "
            "processes the hops are the network's (leave them 0)"
        )
    server.checked(task.num_workers)
    if job_start(server.global_optimizer or halos_default_global()) is not None:
        raise ValueError("ElasticTask.server's global_optimizer starts from a look-ahead θ̄ "
                         "(HeLoCo): an LPS merges θ_G itself")  # fmt: skip


def _check_gossip_task(task: ElasticTask, method: DiLoCo) -> None:
    """ValueError naming what a gossip run on real processes can't take: algo "async", a
    worker's own shardings, or a run its part refuses (M a power of 2 >= group_size)."""
    name = type(method.gossip).__name__
    if task.algo != "diloco":
        raise ValueError(f"ElasticTask.algo must be 'diloco' with {name} (gossip=): its "
                         "workers sync in groups, each sync together")  # fmt: skip
    if task.param_sharding is not None or task.batch_sharding is not None:
        raise ValueError(f"ElasticTask.param_sharding and batch_sharding are not taken with "
                         f"{name} (gossip=): its workers run on their default device")  # fmt: skip
    method.gossip.check_run(task.params, task.num_workers, task.inner_steps, None)


def _check_shardings(name: str, value: Any, like: Any) -> None:
    """ValueError naming ElasticTask.`name` unless `value` is None, one Sharding, or (with a
    `like` tree) a pytree of Shardings of `like`'s structure."""
    if value is None or isinstance(value, jax.sharding.Sharding):
        return
    leaves, treedef = jax.tree.flatten(
        value, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
    )
    if like is None or not all(isinstance(x, jax.sharding.Sharding) for x in leaves):
        what = "a jax.sharding.Sharding" + (" or a pytree of them like params" if like else "")
        raise ValueError(f"ElasticTask.{name} must be None or {what}, got {value!r}")
    if treedef != jax.tree.structure(like):
        raise ValueError(
            f"ElasticTask.{name} must have params' structure {jax.tree.structure(like)}, got "
            f"{treedef}"
        )


def refusal(method: DiLoCo) -> str | None:
    """Why `method` can't run on the elastic syncer (None if it can). The syncer applies one
    weighted mean per round, at once, to the one global θ and its outer state; the inner
    optimizer (AdamW, Muon/MuLoCo, any optax rule), the compression (each worker pushes its
    payload and keeps its error-feedback residual, `elastic_merge`), the outer rule
    (Nesterov, a clip, a cast outer state) and the non-finite exclusion run as in
    `train_diloco`. A gossip part (NoLoCo, GASLoC) runs with no global θ: the workers
    exchange with their groups directly (`diloco_jax.gossip_worker`)."""
    if method.fragmented:
        return (
            "fragments (Streaming DiLoCo) sync each fragment at its own inner step; the syncer "
            "closes one sync per round"
        )
    if method.delay is not None:
        return "a delay or eager updates: the syncer applies each sync's mean at once"
    if method.state_sync is not None:
        return (
            "state sync (DES-LOC) averages the workers' inner optimizer state, which lives in "
            "each worker process and is not sent to the syncer"
        )
    w = method.weights
    if w.drop_probability is not None or w.membership is not None:
        return "simulated drops or membership: an elastic run's membership is its live workers"
    if w.worker_steps is not None or w.scheme != "uniform" or w.anomaly is not None:
        return (
            "worker_steps, weighting and anomaly skips are not carried by the syncer: every "
            "included worker weighs 1"
        )
    return None


def refuse_round_options(options: "Elastic", who: str, grace: str, inner: str) -> None:
    """ValueError naming the round options a runtime without the syncer's rounds (`who`)
    can't honor: round_timeout or grace_seconds (`grace`: why), inner_state "fresh"
    (`inner`: why)."""
    for name in ("round_timeout", "grace_seconds"):
        if getattr(options, name) is not None:
            raise ValueError(f"Elastic.{name} does not apply to {who}: {grace}")
    if options.inner_state != "checkpoint":
        raise ValueError(f"Elastic.inner_state must be 'checkpoint' for {who}: {inner}")


def check_worker(worker: Any, num_workers: int) -> None:
    """ValueError unless `worker` (a call's worker id) is an integer in [0, num_workers)."""
    if isinstance(worker, bool) or not isinstance(worker, int):
        raise ValueError(f"worker must be an integer, got {worker!r}")
    if not 0 <= worker < num_workers:
        raise ValueError(f"worker must be in [0, {num_workers}), got {worker}")


def end_reply(done: str) -> dict[str, Any]:
    """A syncer's reply saying the run ended: "done" (`done` is "finished") or "abort" with
    its reason."""
    if done == "finished":
        return {"status": "done", "reason": "the run finished"}
    return {"status": "abort", "reason": done}


def load_task(spec: str) -> ElasticTask:
    """The task `module:function` names: `function()` (or `function` itself if it is already
    an `ElasticTask`). Raises ValueError naming the spec if it can't be imported, raises while
    it is imported or called, or is not a task."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"task must be 'module:function', got {spec!r}")
    try:  # whatever the user's module raises (a syntax error too): one line, not a traceback
        value = getattr(importlib.import_module(module_name), attr)
        task = value if isinstance(value, ElasticTask) else value()
    except Exception as error:  # noqa: BLE001
        raise ValueError(
            f"task {spec!r} can't be loaded: {type(error).__name__}: {error}"
        ) from error
    if not isinstance(task, ElasticTask):
        raise ValueError(f"task {spec!r} must give an ElasticTask, got {type(task).__name__}")
    return task


@dataclasses.dataclass(frozen=True)
class Elastic:
    """How an elastic run treats its members (times in seconds).

    min_workers: the quorum, in [1, M]: a sync needs this many deltas. A round that can no
      longer reach it is opened again for the live workers; fewer than min_workers alive for
      longer than `quorum_timeout` ends the run (its last sync is checkpointed).
    join_timeout: how long the first round waits for all M workers before it starts with the
      ones there (at least min_workers); a resumed syncer waits as long for the workers of its
      last sync.
    heartbeat_interval, heartbeat_timeout: each worker's heartbeat period, and the silence
      after which the syncer takes it for dead (SIGKILL, a crash, SIGSTOP, a lost host); it is
      left out of the open sync and heals when it comes back.
    round_timeout: a worker alive (heartbeating) but without its delta this long after the
      round opened is taken for stuck, like a dead one; None: no limit.
    grace_seconds: once min_workers deltas are in, the longest the sync waits for the other
      live workers' (None: it waits for every live worker, or its death).
    inner_state: where a worker that joins again (a restarted process, or one left out)
      takes its inner optimizer state from: "checkpoint" (its own, as of its last phase that
      entered a sync: the simulated membership's rule) or "fresh" (the optimizer's init, as
      torchft's healing does for what it does not copy from a peer).
    syncer_timeout: how long a worker keeps retrying an unreachable syncer before it exits.
    """

    min_workers: int = 1
    join_timeout: float = 120.0
    heartbeat_interval: float = 0.25
    heartbeat_timeout: float = 3.0
    round_timeout: float | None = None
    grace_seconds: float | None = None
    quorum_timeout: float = 60.0
    inner_state: str = "checkpoint"
    syncer_timeout: float = 60.0

    def __post_init__(self):
        limits.check_count("Elastic.min_workers", self.min_workers, 1)
        seconds = ("join_timeout", "heartbeat_interval", "heartbeat_timeout", "quorum_timeout",
                   "syncer_timeout", "round_timeout", "grace_seconds")  # fmt: skip
        for name in seconds:
            value = getattr(self, name)
            if value is None and name in ("round_timeout", "grace_seconds"):
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"Elastic.{name} must be a number of seconds, got {value!r}")
            if not 0 < value < math.inf and not (name == "grace_seconds" and value == 0):
                raise ValueError(f"Elastic.{name} must be finite and > 0, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError(
                f"Elastic.heartbeat_timeout ({self.heartbeat_timeout}) must exceed "
                f"heartbeat_interval ({self.heartbeat_interval})"
            )
        if self.inner_state not in ("checkpoint", "fresh"):
            raise ValueError(
                f"Elastic.inner_state must be 'checkpoint' or 'fresh', got {self.inner_state!r}"
            )

    def checked(self, num_workers: int) -> "Elastic":
        """Itself; ValueError naming min_workers unless it is at most M."""
        if self.min_workers > num_workers:
            raise ValueError(
                f"Elastic.min_workers must be at most the task's num_workers ({num_workers}), "
                f"got {self.min_workers}"
            )
        return self

    def to_message(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> "Elastic":
        return cls(**message)
