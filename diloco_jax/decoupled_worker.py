"""One Decoupled DiLoCo learner on real processes (`diloco_jax.decoupled_syncer`): it never
waits for the syncer.

It steps on and on from Θ as it joined: step s of its own (s = 0, 1, ...) is step s mod H of
round s div H of `task.batches(m, round)`, keyed as `train_diloco`'s, with the simulated
clock's own jitted step (`decoupled.programs`). At each step boundary s:

1. if s is k H + (p + 1) H / P, it pushes fragment p (its params of that fragment, its
   c_steps and the mean loss of those steps) on a sending thread of its own, so the push
   never holds up the steps;
2. it applies every merged fragment it has received since (a thread long-polls the syncer
   for them), in merge order, and resets their counts; the next push reports at which
   boundary it applied each (`applied.jsonl` at the syncer, read by the replay).

Once the syncer has a push, the learner keeps its inner state of that boundary
(`learner.state`: the step and the state, written whole or not at all). A learner process
that starts takes Θ as the syncer holds it then, at the step of its checkpoint (0 without
one) with that checkpoint's inner state (the optimizer's init without one) and its counts
at 0; the syncer logs where (`starts.jsonl`), and the replay restarts it there the same way.
A learner removed (silent past heartbeat_timeout, e.g. SIGSTOPped) joins again and goes on
as it was: a slow learner, its pushes late and its merges applied late. After any rejoin it
sends again its pushes of syncs it has not seen merged (a restarted syncer lost them), and a
learner behind a restarted syncer's kept merges takes Θ whole at its next step boundary,
its inner state and step kept, reporting where in its next push. It ends when the syncer
says the run is done.
"""

import functools
import json
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from diloco_jax import wire
from diloco_jax.decoupled import fragments_and_rules, programs
from diloco_jax.elastic_task import Elastic, ElasticTask
from diloco_jax.elastic_worker import METRICS_FILE, SLOW_STEP_ENV, WorkerExit, worker_folder
from diloco_jax.rpc import SyncerClient

log = logging.getLogger("diloco_jax.worker")
STATE_FILE = "learner.state"


class Push(NamedTuple):
    """One push, made at the boundary after `step`: its fragment's leaves, the fragment's
    steps since the learner last applied it (`c_steps`) and their mean `loss`, the merges
    applied and Θ taken whole since the push before ([[update or version, boundary], ...]),
    where the learner's trajectory began ([version, step]), its inner state then (kept once
    the syncer has the push), and the seconds of its steps since its push before
    (`steps_s`, over `timed_steps` steps: the adaptive grace's step time)."""

    step: int
    leaves: list
    c_steps: int
    loss: float
    applied: list
    resynced: list
    origin: list
    opt_state: Any
    steps_s: float
    timed_steps: int


class Merged(NamedTuple):
    """A merge received: its update index, fragment and leaves."""

    update: int
    fragment: int
    leaves: list


class WholeTheta(NamedTuple):
    """Θ whole, of `version`, received behind a restarted syncer."""

    version: int
    leaves: list


class DecoupledLearner:
    def __init__(
        self, task: ElasticTask, worker: int, address: str, directory: Path, secret: bytes,
        syncer_timeout: float | None = None,
    ):  # fmt: skip
        if not 0 <= worker < task.num_workers:
            raise ValueError(f"worker must be in [0, {task.num_workers}), got {worker}")
        self.task, self.worker, self.spec = task, worker, task.server
        self.directory = worker_folder(directory, worker)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.client = SyncerClient(address, secret, syncer_timeout or Elastic().syncer_timeout)
        self.syncer_timeout = syncer_timeout
        method = task.method
        self.step_fn, _ = programs(task.loss_fn, method.inner_optimizer, method.outer_optimizer,
                                   False, task.rng_seed)  # fmt: skip
        self.members_of, _ = fragments_and_rules(self.spec, task.params)
        self.treedef = jax.tree.structure(task.params)
        self.options = Elastic()
        self.incarnation: str | None = None
        self.version = 0  # merges received
        self.received: queue.Queue = queue.Queue()  # `Merged` or `WholeTheta`, in order
        self.outbox: queue.Queue = queue.Queue()  # `Push`es, in order
        # step -> its push, until its sync is known merged: sent again after a rejoin (a
        # restarted syncer lost the pushes of the syncs it had not merged)
        self.kept: dict[int, Push] = {}
        self.kept_lock = threading.Lock()
        self.resend = threading.Event()
        self.saved_step = -1  # the step of its newest checkpoint written
        self.like = [np.asarray(x) for x in jax.tree.leaves(task.params)]
        self.slow_step = float(os.environ.get(SLOW_STEP_ENV, "0"))  # a slower device
        self.state_path = self.directory / STATE_FILE
        opt_like = method.inner_optimizer.init(task.params)
        self.opt_like = jax.tree.map(np.asarray, opt_like)
        self.ended: dict | None = None
        self.stop = threading.Event()
        self.joining = threading.Lock()

    def run(self) -> int:
        threads = [threading.Thread(target=f, daemon=True)
                   for f in (self.heartbeats, self.listen, self.send)]  # fmt: skip
        try:
            start, opt_state = self._restore()
            self._join(start=start, from_checkpoint=opt_state is not None)
            theta = self._theta()
            origin = (self.version, start)  # where its trajectory begins: Θ's version, its step
            for t in threads:
                t.start()
            self._train(theta, origin, opt_state)
            raise WorkerExit.of(self.ended)
        except WorkerExit as end:
            log.info("learner %d: %s", self.worker, end.line)
            return end.code
        finally:
            self.stop.set()
            for t in threads:
                if t.is_alive():
                    t.join()
            self.client.close()

    # ---- the steps ----------------------------------------------------------------------

    def _train(self, theta: list, origin: tuple, opt_state: Any) -> None:
        """Steps from Θ of version origin[0] at step origin[1] until the run ends (see the
        module docstring)."""
        task, m, h_count = self.task, self.worker, self.task.inner_steps
        params = [jnp.asarray(x) for x in theta]
        if opt_state is None:
            opt_state = task.method.inner_optimizer.init(jax.tree.unflatten(self.treedef, params))
        counts, losses, applied, resynced = [0] * self.spec.fragments, [], [], []
        start = done = origin[1]
        timed = [0.0, 0]  # seconds and steps since the push before
        batches = functools.lru_cache(maxsize=2)(lambda job: task.batches(m, job))
        while self.ended is None:
            sync = self.spec.sync_of(done, h_count)
            if done > start and sync is not None:  # its push of this boundary first
                p, c = sync[0], counts[sync[0]]
                push = Push(done, [np.asarray(params[i]) for i in self.members_of[p]], c,
                            float(jnp.mean(jnp.asarray(losses[-c:], jnp.float32))), applied,
                            resynced, list(origin), opt_state, *timed)  # fmt: skip
                timed = [0.0, 0]
                with self.kept_lock:
                    self.kept[done] = push
                self.outbox.put(push)
                applied, resynced = [], []
            while not self.received.empty():  # then every merge received since
                got = self.received.get()
                if isinstance(got, WholeTheta):  # after a syncer restart
                    params, counts, losses = (
                        [jnp.asarray(v) for v in got.leaves],
                        [0] * len(counts),
                        [],
                    )
                    resynced.append([got.version, done])
                    origin = (got.version, done)
                    continue
                for i, v in zip(self.members_of[got.fragment], got.leaves, strict=True):
                    params[i] = jnp.asarray(v)
                counts[got.fragment] = 0
                applied.append([got.update, done])
            job, h = divmod(done, h_count)
            batch = jax.tree.map(lambda x, h=h: np.asarray(x)[h : h + 1], batches(job))
            started = time.perf_counter()
            tree, opt_state, loss, _ = self.step_fn(
                jax.tree.unflatten(self.treedef, params), opt_state, batch, jnp.int32(job),
                jnp.int32(m), jnp.int32(h),
            )  # fmt: skip
            params = jax.tree.leaves(tree)
            loss = float(loss)  # the step done (a slower device's sleep comes after it)
            time.sleep(self.slow_step)
            counts = [c + 1 for c in counts]
            losses = [*losses, loss][-max(counts) :]  # what a push's mean still reads
            done += 1
            line = {"step": done, "loss": loss, "seconds": time.perf_counter() - started,
                    "time": time.time()}  # fmt: skip
            timed = [timed[0] + line["seconds"], timed[1] + 1]
            with open(self.directory / METRICS_FILE, "a") as f:
                f.write(json.dumps(line) + "\n")

    # ---- the threads --------------------------------------------------------------------

    def send(self) -> None:
        """Sends the pushes in order (a late one is dropped by the syncer), after a rejoin
        the ones of syncs not known merged again first, and keeps the inner state of each
        push's boundary once the syncer has the push."""
        while not self.stop.is_set():
            if self.resend.is_set():
                self.resend.clear()
                with self.kept_lock:
                    again = [self.kept[s] for s in sorted(self.kept)]
                for push in again:
                    self._send(push)
            try:
                push = self.outbox.get(timeout=0.1)
            except queue.Empty:
                continue
            self._send(push)

    def _send(self, push: Push) -> None:
        for _ in range(2):  # once more after joining again: it may still be in time
            seen = self.incarnation
            header = self._me(serial=push.step, loss=push.loss, c_steps=push.c_steps,
                              applied=push.applied, resynced=push.resynced,
                              origin=push.origin, steps_s=push.steps_s,
                              timed_steps=push.timed_steps)  # fmt: skip
            reply = self.client.push(header, push.leaves, lambda leaf: None)
            if reply["status"] != "rejoin":
                break
            self._rejoin(seen)
        if reply["status"] in ("done", "abort"):
            self.ended = reply
        elif reply["status"] in ("ok", "late") and push.step > self.saved_step:
            message = {"step": push.step, "inner": wire.leaves(push.opt_state)}
            wire.write_file(self.state_path, message)
            self.saved_step = push.step

    def listen(self) -> None:
        """Long-polls the syncer for the merges after the newest it has received."""
        while not self.stop.is_set() and self.ended is None:
            seen = self.incarnation
            reply = self.client.call("Next", self._me(after=self.version, timeout=5.0), 15.0)
            status = reply["status"]
            if status in ("done", "abort"):
                self.ended = reply
            elif status == "rejoin":
                self._rejoin(seen)
            elif status == "round" and "theta" in reply:  # behind a restarted syncer
                theta = wire.tree_like(self.like, reply["theta"], "the syncer's Θ")
                self.received.put(WholeTheta(int(reply["round"]), theta))
                self.version = int(reply["round"])
            elif status == "round":
                at = 0
                for update, p, k in reply["updates"]:
                    count = len(self.members_of[p])
                    like = [self.like[i] for i in self.members_of[p]]
                    values = wire.tree_like(like, reply["reply"][at : at + count], "a merge")
                    self.received.put(Merged(update, p, values))
                    self._forget(p, k)
                    at += count
                self.version = int(reply["round"])

    def _forget(self, fragment: int, index: int) -> None:
        """Drops the kept pushes of fragment's syncs up to `index`: merged."""
        with self.kept_lock:
            for step in list(self.kept):
                p, k = self.spec.sync_of(step, self.task.inner_steps)
                if p == fragment and k <= index:
                    del self.kept[step]

    def heartbeats(self) -> None:
        while not self.stop.wait(self.options.heartbeat_interval) and self.ended is None:
            seen = self.incarnation
            reply = self.client.once("Heartbeat", self._me(),
                                     deadline=self.options.heartbeat_interval * 4)  # fmt: skip
            if reply is None:
                continue
            if reply["status"] in ("done", "abort"):
                self.ended = reply
            elif reply["status"] == "rejoin":
                self._rejoin(seen)

    # ---- the syncer ---------------------------------------------------------------------

    def _restore(self) -> tuple[int, Any]:
        """(the step of its checkpoint, its inner state), or (0, None) without one."""
        if not self.state_path.exists():
            return 0, None
        try:
            saved = wire.read_file(self.state_path)
            opt_state = wire.tree_like(self.opt_like, saved["inner"], str(self.state_path))
        except (OSError, ValueError, KeyError) as error:
            log.warning("learner %d: %s can't be read (%s); starting at step 0", self.worker,
                        self.state_path, error)  # fmt: skip
            return 0, None
        log.info("learner %d: resuming at step %d from %s", self.worker, int(saved["step"]),
                 self.state_path)  # fmt: skip
        return int(saved["step"]), opt_state

    def _join(self, **start: Any) -> None:
        """Joins; a new process says where it starts (`start`, `from_checkpoint`)."""
        reply = self.client.call("Join", {"worker": self.worker, "incarnation": None, **start})
        if reply.get("status") in ("done", "abort"):
            raise WorkerExit.of(reply)
        self.incarnation = reply["incarnation"]
        self.options = Elastic.from_message(reply["options"])
        if self.syncer_timeout is None:
            self.client.syncer_timeout = self.options.syncer_timeout
        log.info("learner %d joined", self.worker)

    def _rejoin(self, seen: str | None) -> None:
        """Joins again, unless another thread already did since its call as `seen`."""
        with self.joining:
            if self.incarnation == seen:
                log.info("learner %d: the syncer left it out; joining again", self.worker)
                self._join()
                self.resend.set()

    def _theta(self) -> list:
        """Θ whole as the syncer holds it now (its version becomes this learner's)."""
        reply = self.client.call("Next", self._me(after=-1, timeout=5.0), 15.0)
        if reply["status"] in ("done", "abort"):
            raise WorkerExit.of(reply)
        theta = wire.tree_like(self.task.params, reply["theta"], "the syncer's Θ")
        self.version = int(reply["round"])
        return jax.tree.leaves(theta)

    def _me(self, **fields: Any) -> dict[str, Any]:
        return {"worker": self.worker, "incarnation": self.incarnation, **fields}
