"""One elastic worker: an independent JAX program that joins the syncer, runs its inner
phases on its own devices and pushes its deltas (`diloco_jax.syncer`).

Each round: ask the syncer for the round (θ, the round number and this worker's data
position p), take the inner optimizer state of position p, run the H inner steps on
`task.batches(worker, p)`, save the new inner state as position p + 1, push Δ = θ - θ_m,
and ask again. The syncer's reply says where the worker stands: a worker left out of a sync
(dead, stalled, late) keeps position p and its state of p; a restarted process takes its
state of p from its checkpoint folder (or starts it fresh, `Elastic.inner_state`).
"""

import functools
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diloco_jax import inner, wire
from diloco_jax.elastic_task import Elastic, ElasticTask
from diloco_jax.outer import worker_delta
from diloco_jax.rpc import SyncerClient

log = logging.getLogger("diloco_jax.worker")

# Fault injection for tests and chaos runs: "ROUND" pauses this worker inside its push of
# that round (after its first leaf) for an hour, so a test can kill it mid-push.
PAUSE_PUSH_ENV = "DILOCO_JAX_PAUSE_PUSH"
KEEP_STATES = 3


class WorkerExit(Exception):
    """The run ended for this worker: `code` 0 (finished) or 1 (aborted, `line` says why)."""

    def __init__(self, code: int, line: str):
        super().__init__(line)
        self.code, self.line = code, line


def _phase(loss_fn, optimizer, theta, opt_state, batches, key):
    params, opt_state, losses = inner.inner_loop(
        loss_fn, optimizer, theta, opt_state, batches, key=key
    )
    return worker_delta(theta, params), opt_state, jnp.mean(losses)


class Worker:
    def __init__(self, task: ElasticTask, worker: int, address: str, directory: Path):
        if not 0 <= worker < task.num_workers:
            raise ValueError(f"worker must be in [0, {task.num_workers}), got {worker}")
        self.task, self.worker = task, worker
        self.directory = Path(directory) / f"worker-{worker}"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.client = SyncerClient(address)
        self.optimizer = task.method.inner_optimizer
        self.phase = jax.jit(functools.partial(_phase, task.loss_fn, self.optimizer))
        self.opt_like = jax.tree.map(np.asarray, self.optimizer.init(task.params))
        self.states: dict[int, Any] = {}  # position -> inner state, the newest few
        self.opt_shardings = None  # under a param_sharding: where the inner state lives
        self.pause_round = os.environ.get(PAUSE_PUSH_ENV)
        self.incarnation: str | None = None
        self.options = Elastic()
        self.stop = threading.Event()

    def join(self) -> None:
        reply = self.client.call("Join", {"worker": self.worker, "incarnation": None})
        self.incarnation = reply["incarnation"]
        self.options = Elastic.from_message(reply["options"])
        self.client.syncer_timeout = self.options.syncer_timeout
        self.rejoined = True
        log.info("worker %d joined; its inner phase runs on %d device(s)", self.worker,
                 len(self._devices()))  # fmt: skip

    def heartbeats(self) -> None:
        """Until stopped: a heartbeat every heartbeat_interval (a thread of its own, so a
        long inner phase is not taken for a death)."""
        while not self.stop.wait(self.options.heartbeat_interval):
            me = {"worker": self.worker, "incarnation": self.incarnation}
            self.client.once("Heartbeat", me, deadline=self.options.heartbeat_interval * 4)

    def run(self) -> int:
        """Trains until the run ends; returns the process's exit code."""
        self.join()
        beat = threading.Thread(target=self.heartbeats, daemon=True)
        beat.start()
        after, pending = -1, None
        try:
            while True:
                reply = self.client.call("Next", self._me(after=after, timeout=5.0))
                status = reply["status"]
                if status == "pending":
                    continue
                if status in ("done", "abort"):
                    code = 0 if status == "done" else 1
                    raise WorkerExit(code, reply["reason"])
                if status == "rejoin":
                    log.info("worker %d: the syncer left it out; joining again", self.worker)
                    self.join()
                    after, pending = -1, None
                elif status == "push_again":
                    if pending is None:  # nothing kept to push: take the round afresh
                        after = -1
                    else:
                        self._push(*pending)
                elif status == "round":
                    pending = self._round(reply)
                    after = pending[0]
                    self._push(*pending)
        except WorkerExit as end:
            log.info("worker %d: %s", self.worker, end.line)
            return end.code
        finally:
            # No gRPC call may be in flight when the interpreter exits (gRPC aborts then).
            self.stop.set()
            beat.join()
            self.client.close()

    def _me(self, **fields: Any) -> dict[str, Any]:
        return {"worker": self.worker, "incarnation": self.incarnation, **fields}

    def _round(self, reply: dict) -> tuple:
        """Runs the round's inner phase: (serial, round, Δ's leaves, mean loss, its seconds:
        the batches drawn and the H steps)."""
        serial, round_, position = int(reply["serial"]), int(reply["round"]), reply["position"]
        theta = self._placed(wire.tree_like(self.task.params, reply["theta"], "the syncer's θ"))
        opt_state = self._state(position)
        if self.task.param_sharding is not None:  # the inner state where jit puts θ's
            if self.opt_shardings is None:
                self.opt_shardings = self._state_shardings(theta)
            opt_state = jax.device_put(opt_state, self.opt_shardings)
        key = None
        if self.task.rng_seed is not None:
            key = inner.worker_key(self.task.rng_seed, jnp.int32(round_), jnp.int32(self.worker))
        started = time.perf_counter()
        batches = self.task.batches(self.worker, position)
        if self.task.batch_sharding is not None:
            batches = jax.device_put(batches, self.task.batch_sharding)
        delta, opt_state, loss = self.phase(theta, opt_state, batches, key)
        leaves, loss = wire.leaves(delta), float(loss)  # waits for the phase to end
        seconds = time.perf_counter() - started
        self._keep(position + 1, jax.tree.map(np.asarray, opt_state))
        return serial, round_, leaves, loss, seconds

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
        return theta if sharding is None else jax.device_put(theta, sharding)

    def _push(self, serial: int, round_: int, leaves: list, loss: float, seconds: float) -> None:
        header = self._me(serial=serial, loss=loss, compute_s=seconds)
        reply = self.client.push(header, leaves, functools.partial(self._pause, round_))
        if reply["status"] == "refused":
            raise WorkerExit(1, f"the syncer refused this worker's delta: {reply['reason']}")

    def _pause(self, round_: int, leaf: int) -> None:
        if leaf == 1 and self.pause_round is not None and int(self.pause_round) == round_:
            log.warning("worker %d pausing inside its push of round %d", self.worker, round_)
            time.sleep(3600)

    def _state(self, position: int) -> Any:
        """The inner state this worker had after `position` phases."""
        fresh = self.rejoined and self.options.inner_state == "fresh"
        self.rejoined = False
        if fresh or position == 0:
            return self.opt_like
        if position in self.states:
            return self.states[position]
        path = self.directory / f"inner-{position:08d}.state"
        try:
            state = wire.tree_like(self.opt_like, wire.read_file(path)["state"], str(path))
        except (OSError, ValueError, KeyError) as error:
            log.warning("worker %d: no inner state of position %d (%s); starting it fresh",
                        self.worker, position, error)  # fmt: skip
            return self.opt_like
        log.info("worker %d: inner state of position %d from %s", self.worker, position, path)
        return state

    def _keep(self, position: int, state: Any) -> None:
        """Keeps `state` as position's, in memory and on disk (the newest KEEP_STATES)."""
        self.states[position] = state
        for old in sorted(self.states)[:-KEEP_STATES]:
            del self.states[old]
        wire.write_file(
            self.directory / f"inner-{position:08d}.state", {"state": wire.leaves(state)}
        )
        for old in sorted(self.directory.glob("inner-*.state"))[:-KEEP_STATES]:
            old.unlink()
