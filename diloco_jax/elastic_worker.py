"""One elastic worker: an independent JAX program that joins the syncer, runs its inner
phases on its own devices and pushes its deltas (`diloco_jax.syncer`).

Each round: ask the syncer for the round (θ, the round number and this worker's data
position p), take the inner optimizer state of position p, run the H inner steps on
`task.batches(worker, p)`, save the new inner state as position p + 1, push Δ = θ - θ_m,
and ask again. The syncer's reply says where the worker stands: a worker left out of a sync
(dead, stalled, late) keeps position p and its state of p; a restarted process takes its
state of p from its checkpoint folder (or starts it fresh, `Elastic.inner_state`).

A worker may be one process or a group of processes, one `jax.distributed` cluster of its
own (a worker over several hosts; the task's shardings span the group's devices). Process 0
of the group, the leader, alone talks to the syncer; it shares each command (the round, θ,
the end) with the others by a broadcast, every process runs the phase on its part of the
devices, and the delta is gathered for the leader to push. The group shares one fate: a
process that dies ends the others (JAX's coordination service, `GROUP_HEARTBEAT_S`), and
the group joins again as a whole, as one restarted worker.
"""

import dataclasses
import functools
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from diloco_jax import distributed, inner, wire
from diloco_jax.elastic_merge import make_merge
from diloco_jax.elastic_task import Elastic, ElasticTask
from diloco_jax.outer import outer_init, worker_delta
from diloco_jax.rpc import SyncerClient
from diloco_jax.trees import all_finite

log = logging.getLogger("diloco_jax.worker")

# Fault injection for tests and chaos runs: "ROUND" pauses this worker inside its push of
# that round (after its first leaf) for an hour, so a test can kill it mid-push.
PAUSE_PUSH_ENV = "DILOCO_JAX_PAUSE_PUSH"
# A slower device for tests and chaos runs: this many seconds more per inner step, after the
# phase's compute (the worker's measured step time, which DyLU reads, includes it).
SLOW_STEP_ENV = "DILOCO_JAX_SLOW_STEP"
KEEP_STATES = 3
# One line per inner phase this worker ran: round, position, its mean loss, its seconds, how
# its θ came ("whole", or made from a sync's "reply"), time.
METRICS_FILE = "metrics.jsonl"
# How soon a worker group's survivors end after one of its processes dies (whole seconds;
# JAX's coordination service ends them, so the group restarts as one).
GROUP_HEARTBEAT_S = 10
# The commands the leader shares with its group, by their index.
COMMANDS = ("pending", "round", "rejoin", "push_again", "done", "abort")


class Phase(NamedTuple):
    """One inner phase run: the syncer's serial and round of it, the push's leaves (Δ, or
    its compressed payload), whether Δ was finite, the mean inner loss, its seconds (batches
    drawn and inner steps) and of those the inner steps'."""

    serial: int
    round: int
    leaves: list
    finite: bool
    loss: float
    compute_s: float
    steps_s: float


class Kept(NamedTuple):
    """What a worker keeps of each data position: its inner optimizer state and, under a
    compression with error feedback, its residual (else None)."""

    inner: Any
    residual: Any


class Held(NamedTuple):
    """θ of `version` (the syncer's round count), its outer state and θ's checksum
    (`wire.checksum`), kept where the merge sends a sync's reply instead of θ
    (`elastic_merge`): host trees like θ and its state."""

    version: int
    theta: Any
    outer_state: Any
    checksum: int


def _held(version: int, theta: Any, outer_state: Any) -> Held:
    theta, outer_state = jax.tree.map(np.asarray, theta), jax.tree.map(np.asarray, outer_state)
    return Held(version, theta, outer_state, wire.checksum(theta))


class WorkerExit(Exception):
    """The run ended for this worker: `code` 0 (finished) or 1 (aborted, `line` says why)."""

    def __init__(self, code: int, line: str):
        super().__init__(line)
        self.code, self.line = code, line

    @classmethod
    def of(cls, reply: dict) -> "WorkerExit":
        """The end a syncer's "done" or "abort" reply says."""
        return cls(0 if reply["status"] == "done" else 1, reply.get("reason", "the run ended"))


def inner_phase(loss_fn, optimizer, theta, opt_state, batches, key):
    """One worker's inner phase from `theta`: (Δ = theta - its params after the steps, the
    new inner state, the mean inner loss)."""
    params, opt_state, losses = inner.inner_loop(
        loss_fn, optimizer, theta, opt_state, batches, key=key
    )
    return worker_delta(theta, params), opt_state, jnp.mean(losses)


class Worker:
    def __init__(
        self, task: ElasticTask, worker: int, address: str, directory: Path, secret: bytes,
        syncer_timeout: float | None = None,
    ):  # fmt: skip
        if not 0 <= worker < task.num_workers:
            raise ValueError(f"worker must be in [0, {task.num_workers}), got {worker}")
        self.task, self.worker = task, worker
        self.grouped = jax.process_count() > 1
        self.leader = jax.process_index() == 0
        self.directory = worker_folder(directory, worker)
        self.directory.mkdir(parents=True, exist_ok=True)
        # The worker's own syncer_timeout, or (None) the syncer's, told at the join.
        self.syncer_timeout = syncer_timeout
        self.client = None
        if self.leader:
            timeout = syncer_timeout or Elastic().syncer_timeout
            self.client = SyncerClient(address, secret, timeout)
        self.optimizer = task.method.inner_optimizer
        self.phase = jax.jit(functools.partial(inner_phase, task.loss_fn, self.optimizer))
        self.opt_like = jax.tree.map(np.asarray, self.optimizer.init(task.params))
        self.merge = make_merge(task.method, task.params, task.num_workers)
        self.outer_like = jax.tree.map(
            np.asarray, outer_init(task.method.outer_optimizer, task.params)
        )
        # The leader's θ, where the syncer sends replies: θ_0 and its outer state are the
        # task's own, so even the first round's θ need not travel.
        self.held: Held | None = None
        if self.merge.reply_like is not None:
            self.held = _held(0, task.params, self.outer_like)
        self.theta_from = "whole"  # how the leader's last θ came: "whole", "held", "reply"
        self.states: dict[int, Kept] = {}  # position -> what it keeps, the newest few
        self.opt_shardings = None  # under a param_sharding: where the inner state lives
        self.pause_round = os.environ.get(PAUSE_PUSH_ENV)
        self.slow_step = float(os.environ.get(SLOW_STEP_ENV, "0"))
        self.timed_counts: set[int] = set()  # step counts whose program has run here
        self.incarnation: str | None = None
        self.options = Elastic()
        self.rejoined = True
        self.stop = threading.Event()

    def join(self) -> None:
        reply = self.client.call("Join", {"worker": self.worker, "incarnation": None})
        if reply.get("status") in ("done", "abort"):  # it ended while this worker was out
            raise WorkerExit.of(reply)
        self.incarnation = reply["incarnation"]
        self.options = Elastic.from_message(reply["options"])
        if self.syncer_timeout is None:
            self.client.syncer_timeout = self.options.syncer_timeout
        self.rejoined = True
        where = f"{len(self._devices())} device(s)"
        if self.grouped:
            where += f" of {jax.process_count()} processes"
        log.info("worker %d joined; its inner phase runs on %s", self.worker, where)

    def heartbeats(self) -> None:
        """Until stopped: a heartbeat every heartbeat_interval (a thread of its own, so a
        long inner phase is not taken for a death)."""
        while not self.stop.wait(self.options.heartbeat_interval):
            me = {"worker": self.worker, "incarnation": self.incarnation}
            self.client.once("Heartbeat", me, deadline=self.options.heartbeat_interval * 4)
            if self.client.ended is not None:  # the run ended during this phase: no push, no next
                return

    def run(self) -> int:
        """Trains until the run ends; returns the process's exit code."""
        beat = threading.Thread(target=self.heartbeats, daemon=True)
        after, pending, push = -1, None, None
        try:
            command = self._command(lambda: self._first(beat))
            while True:
                status = command["status"]
                if status in ("done", "abort"):
                    raise WorkerExit.of(command)
                if status == "rejoin":
                    after, pending = -1, None
                    self.rejoined = True
                elif status == "push_again":
                    if pending is None:  # nothing kept to push: take the round afresh
                        after = -1
                    else:
                        push = pending
                elif status == "round":
                    pending = self._round(command)
                    after, push = pending.serial, pending
                command = self._command(functools.partial(self._next, after, push))
                push = None
        except WorkerExit as end:
            if self.leader or end.code == 0:
                log.info("worker %d: %s", self.worker, end.line)
            return end.code
        finally:
            # No gRPC call may be in flight when the interpreter exits (gRPC aborts then).
            self.stop.set()
            if beat.is_alive():
                beat.join()
            if self.client is not None:
                self.client.close()

    def _first(self, beat: threading.Thread) -> dict:
        self.join()
        beat.start()
        return {"status": "pending"}

    def _next(self, after: int, push: "Phase | None") -> dict:
        """The leader's calls between two commands: push the last phase's delta (if any),
        then ask for the next command (joining again first where the syncer says so)."""
        if self.client.ended is not None:
            return self.client.ended
        if push is not None:
            self._push(push)
        held = -1 if self.held is None else self.held.version
        reply = self.client.call("Next", self._me(after=after, timeout=5.0, held=held))
        if reply["status"] == "rejoin":
            log.info("worker %d: the syncer left it out; joining again", self.worker)
            self.join()
        self.theta_from = "whole"
        if reply["status"] == "round" and "theta" not in reply:
            made = self._theta_from_held(reply)
            if made is None:  # this θ differs from the syncer's: ask for θ whole
                self.held = None
                made = self.client.call("Next", self._me(after=after, timeout=5.0, held=-1))
            reply = made
        if "outer" in reply:
            theta = wire.tree_like(self.task.params, reply["theta"], "the syncer's θ")
            outer = wire.tree_like(self.outer_like, reply.pop("outer"), "the outer state")
            self.held = _held(int(reply["round"]), theta, outer)
        return reply

    def _theta_from_held(self, reply: dict) -> dict | None:
        """The round's reply with its θ: the one held, or made from it and the outer state by
        the last sync's reply (the syncer's own step); None where θ's checksum differs from
        the syncer's."""
        if "reply" in reply:
            encoded = wire.tree_like(self.merge.reply_like, reply.pop("reply"), "a sync's reply")
            made = self.merge.receive(self.held.theta, self.held.outer_state, encoded)
            self.held, self.theta_from = _held(int(reply["round"]), *made), "reply"
        else:
            self.theta_from = "held"
        if self.held.checksum != reply.pop("checksum"):
            log.warning("worker %d: its θ of round %d differs from the syncer's; asking for θ "
                        "whole", self.worker, reply["round"])  # fmt: skip
            return None
        return {**reply, "theta": wire.leaves(self.held.theta)}

    def _command(self, lead) -> dict:
        """The group's next command: `lead()`'s reply on the leader (its calls to the
        syncer), shared with every process of a worker group. A leader that fails shares an
        abort first, so its group ends with it."""
        failure, reply = None, {}
        if self.leader:
            try:
                reply = lead()
            except BaseException as error:  # noqa: BLE001 (re-raised below, after sharing)
                failure, reply = error, {"status": "abort", "reason": str(error)}
        if self.grouped:
            reply = self._shared(reply)
        if failure is not None:
            raise failure
        return reply

    def _shared(self, reply: dict) -> dict:
        """The leader's reply on every process of the group: its status and numbers by a
        broadcast, then θ, when it is a round."""
        from jax.experimental import multihost_utils

        numbers = np.zeros(6, np.int32)  # status, serial, round, position, fresh, steps
        if self.leader:
            numbers[0] = COMMANDS.index(reply["status"])
            numbers[4] = self.options.inner_state == "fresh"
            if reply["status"] == "round":
                numbers[1:4] = [reply["serial"], reply["round"], reply["position"]]
                numbers[5] = reply.get("steps", self.task.inner_steps)
        numbers = np.asarray(multihost_utils.broadcast_one_to_all(numbers, self.leader))
        status = COMMANDS[int(numbers[0])]
        inner_state = "fresh" if numbers[4] else "checkpoint"
        self.options = dataclasses.replace(self.options, inner_state=inner_state)
        if status != "round":
            return {"status": status, "reason": reply.get("reason", "the run ended")}
        theta = wire.tree_like(self.task.params, reply["theta"], "θ") if self.leader else None
        theta = multihost_utils.broadcast_one_to_all(
            jax.tree.map(np.asarray, theta if self.leader else self.task.params), self.leader
        )
        serial, round_, position = (int(x) for x in numbers[1:4])
        theta = jax.tree.map(np.asarray, theta)
        return {"status": status, "serial": serial, "round": round_, "position": position,
                "steps": int(numbers[5]), "theta": wire.leaves(theta)}  # fmt: skip

    def _me(self, **fields: Any) -> dict[str, Any]:
        return {"worker": self.worker, "incarnation": self.incarnation, **fields}

    def _round(self, reply: dict) -> "Phase":
        """Runs the round's inner phase (its first `steps` inner steps where the syncer
        gives them: an async job under DyLU)."""
        serial, round_, position = int(reply["serial"]), int(reply["round"]), reply["position"]
        steps = int(reply.get("steps", self.task.inner_steps))
        theta = self._placed(wire.tree_like(self.task.params, reply["theta"], "the syncer's θ"))
        kept = self._state(position)
        opt_state = kept.inner
        if self.task.param_sharding is not None:  # the inner state where jit puts θ's
            if self.opt_shardings is None:
                self.opt_shardings = self._state_shardings(theta)
            opt_state = _put(opt_state, self.opt_shardings)
        key = None
        if self.task.rng_seed is not None:
            key = inner.worker_key(self.task.rng_seed, jnp.int32(round_), jnp.int32(self.worker))
        started = time.perf_counter()
        batches = self.task.batches(self.worker, position)
        if steps != self.task.inner_steps:
            batches = jax.tree.map(lambda x: x[:steps], batches)
        if self.task.batch_sharding is not None:
            batches = _put(batches, self.task.batch_sharding)
        drawn = time.perf_counter()
        delta, opt_state, loss = self.phase(theta, opt_state, batches, key)
        finite = bool(all_finite(delta))  # on the device, fused: not a mask on the host
        # Whole on the host (gathered over a group's processes); waits for the phase to end.
        delta, loss = distributed.to_host(delta), float(distributed.to_host(loss))
        leaves, residual = self.merge.encode(delta, kept.residual)
        time.sleep(self.slow_step * steps)
        done = time.perf_counter()
        seconds, steps_s = done - started, done - drawn
        if steps not in self.timed_counts:  # this count's first phase compiled its program:
            self.timed_counts.add(steps)  # no measure of speed (DyLU keeps its last one)
            steps_s = 0.0
        self._keep(position + 1, Kept(distributed.to_host(opt_state), residual))
        if self.leader:
            line = {"round": round_, "position": position, "steps": steps, "loss": loss,
                    "compute_s": seconds, "theta_from": self.theta_from,
                    "time": time.time()}  # fmt: skip
            with open(self.directory / METRICS_FILE, "a") as f:
                f.write(json.dumps(line) + "\n")
        return Phase(serial=serial, round=round_, leaves=leaves, finite=finite, loss=loss,
                     compute_s=seconds, steps_s=steps_s)  # fmt: skip

    def _devices(self) -> set:
        """The devices the task's shardings name (the default device without any)."""
        shardings = [self.task.param_sharding, self.task.batch_sharding]
        leaves = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
        devices = set().union(*(x.device_set for x in leaves))
        return devices or {jax.devices()[0]}

    def _state_shardings(self, theta: Any) -> Any:
        """The inner state's shardings: where jit puts the optimizer's init of the placed θ,
        a leaf it leaves elsewhere (a step count, on one device) replicated over θ's devices."""
        devices = set().union(*(x.sharding.device_set for x in jax.tree.leaves(theta)))
        mesh = jax.sharding.Mesh(np.array(sorted(devices, key=lambda d: d.id)), ("devices",))
        everywhere = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        like = jax.jit(self.optimizer.init)(theta)
        return jax.tree.map(
            lambda x: x.sharding if x.sharding.device_set == devices else everywhere, like
        )

    def _placed(self, theta: Any) -> Any:
        """θ on the task's param_sharding (as given, None: the default device)."""
        sharding = self.task.param_sharding
        return theta if sharding is None else _put(theta, sharding)

    def _push(self, phase: "Phase") -> None:
        """The leader's push of one phase's delta."""
        header = self._me(serial=phase.serial, loss=phase.loss, compute_s=phase.compute_s,
                          steps_s=phase.steps_s, finite=phase.finite)  # fmt: skip
        reply = self.client.push(header, phase.leaves, functools.partial(self._pause, phase.round))
        if reply["status"] == "refused":
            raise WorkerExit(1, f"the syncer refused this worker's delta: {reply['reason']}")

    def _pause(self, round_: int, leaf: int) -> None:
        if leaf == 1 and self.pause_round is not None and int(self.pause_round) == round_:
            log.warning("worker %d pausing inside its push of round %d", self.worker, round_)
            time.sleep(3600)

    def _state(self, position: int) -> Kept:
        """The inner state (and residual) this worker had after `position` phases."""
        fresh = self.rejoined and self.options.inner_state == "fresh"
        self.rejoined = False
        afresh = Kept(self.opt_like, self.merge.residual_like)
        if fresh or position == 0:
            return afresh
        if position in self.states:
            return self.states[position]
        path = self._saved_by() / f"inner-{position:08d}.state"
        try:
            saved = wire.read_file(path)
            kept = Kept(
                wire.tree_like(self.opt_like, saved["state"], str(path)),
                None if afresh.residual is None
                else wire.tree_like(afresh.residual, saved["residual"], str(path)),
            )  # fmt: skip
        except (OSError, ValueError, KeyError) as error:
            log.warning("worker %d: no inner state of position %d (%s); starting it fresh",
                        self.worker, position, error)  # fmt: skip
            return afresh
        log.info("worker %d: inner state of position %d from %s", self.worker, position, path)
        return kept

    def _saved_by(self) -> Path:
        """The folder a state is read back from: the group leader's where this host has it
        (every process of a group on one host then starts from the same state, even when
        one was killed while writing its own copy), else this process's own."""
        leader = self.directory.parent / "process-0"
        return leader if self.grouped and leader.is_dir() else self.directory

    def _keep(self, position: int, kept: Kept) -> None:
        """Keeps `kept` as position's, in memory and on disk (the newest KEEP_STATES)."""
        self.states[position] = kept
        for old in sorted(self.states)[:-KEEP_STATES]:
            del self.states[old]
        saved = {"state": wire.leaves(kept.inner)}
        if kept.residual is not None:
            saved["residual"] = wire.leaves(kept.residual)
        path = self.directory / f"inner-{position:08d}.state"
        wire.write_kept(path, saved, "inner-*.state", KEEP_STATES)


def worker_folder(directory: str | os.PathLike, worker: int) -> Path:
    """Where this process of worker `worker` keeps its inner states: DIR/worker-m, or
    DIR/worker-m/process-i for process i of a worker group (each host its own copy)."""
    folder = Path(directory) / f"worker-{worker}"
    if jax.process_count() > 1:
        folder = folder / f"process-{jax.process_index()}"
    return folder


def _put(tree: Any, shardings: Any) -> Any:
    """Host `tree` placed on `shardings` (one, or a tree of them like `tree`), across a
    group's processes too (every process holds the same host copy)."""
    if isinstance(shardings, jax.sharding.Sharding):
        return distributed.place_global(lambda x: jax.device_put(x, shardings), tree)
    return jax.tree.map(
        lambda x, s: distributed.place_global(lambda y: jax.device_put(y, s), x), tree, shardings
    )
