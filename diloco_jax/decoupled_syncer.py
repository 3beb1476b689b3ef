"""Decoupled DiLoCo's syncer on real processes (`ElasticTask(algo="async",
server=dj.DecoupledDiLoCo(...))`): the rule of `diloco_jax.decoupled` on the real clock, for
learners that never wait (`diloco_jax.decoupled_worker`).

- A learner pushes fragment p after its own inner steps k H + (p + 1) H / P, for the
  fragment's sync k, with c_steps (its steps since it last applied fragment p) and the mean
  of those steps' losses. Pushes of a sync already merged are "late" and dropped.
- Sync (p, k) merges when `quorum.QuorumRule` says, the rule the simulated clock runs: once
  its quorum K of pushes is in and `grace_seconds` have passed after the K-th, and never
  before the fragment's sync k - 1 (a fragment's syncs merge in order). The merge is the
  simulated clock's own program (`decoupled.programs`): each delta against the syncer's
  Θ_p, weighted by c_tokens² / c_steps, averaged or RDA per leaf, and the fragment's outer
  step.
- Every learner asks for the merges after the last it holds (a long poll) and applies them at
  its next step boundary, reporting where (`applied.jsonl`).

Each merge is a history.jsonl line: update, fragment, sync, step, time (seconds since the
first merge), wall (Unix seconds), merged, weights,
c_steps, late, loss, total_steps (the learners' newest pushed steps, summed) and pushes (each
learner's pushes of each fragment so far, late ones too). `elastic.arrivals(directory)` joins
it with applied.jsonl into `decoupled.Merge`s, and `train_async(server=spec,
arrivals=...)` replays the run on the simulated clock: the same Θ.

A learner silent past heartbeat_timeout is removed (its pushes are no longer expected; it is
told to rejoin when it speaks again); fewer than K members for quorum_timeout ends the run.
Each merge is checkpointed (`syncer.ckpt`: Θ, the fragments' outer states, the syncs next
due) before any learner hears of it. A restarted syncer resumes from it: the learners join
again and send again the pushes of syncs not merged yet (which it lost), and a learner
holding a version older than the merges it keeps (the newest KEEP_MERGES, none after a
restart) takes Θ whole at its next step boundary, its inner state and step kept; it says
where in its next push (`starts.jsonl`, as a restart the replay runs the same way).

The adaptive grace (`adaptive_grace`) is budgeted on the step time each learner measures
and sends with its pushes (the median of its last few). What it does not do: a learner group
over several processes.
"""

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diloco_jax import wire
from diloco_jax.decoupled import fragments_and_rules, merge_weights, programs
from diloco_jax.elastic_task import Elastic, ElasticTask, refuse_round_options
from diloco_jax.outer import outer_init
from diloco_jax.quorum import Due, QuorumRule
from diloco_jax.round_rule import Shortage
from diloco_jax.step_times import StepTimes
from diloco_jax.syncer_base import SyncerBase

log = logging.getLogger("diloco_jax.syncer")
APPLIED_FILE = "applied.jsonl"
STARTS_FILE = "starts.jsonl"  # each learner process's start: the Θ it took, its step
HISTORY_FILE = "history.jsonl"
CHECKPOINT_FILE = "syncer.ckpt"  # the state after the newest merge
KEEP_MERGES = 64  # the merged fragments kept for learners to fetch one by one


@dataclasses.dataclass
class Push:
    leaves: list
    c_steps: int
    loss: float
    origin: list  # [version, step]: where the trajectory that made it began


class DecoupledSyncer(SyncerBase):
    """Decoupled DiLoCo's syncer (see the module docstring); every method is safe to call
    from the gRPC threads."""

    CLOCK_PERIOD = 0.01  # a merge is due at its grace's end: a finer clock

    def __init__(
        self, task: ElasticTask, options: Elastic, directory: Path, *,
        clock: Callable[[], float] = time.monotonic,
    ):  # fmt: skip
        super().__init__(task, clock)
        self.spec = task.server
        self.options = checked_for_decoupled(options, task.num_workers)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.members_of, rules = fragments_and_rules(self.spec, task.params)
        self.rules = [tuple(rules[i] for i in idx) for idx in self.members_of]
        method = task.method
        _, merge = programs(task.loss_fn, method.inner_optimizer, method.outer_optimizer, False,
                            task.rng_seed)  # fmt: skip
        self.merge = [merge(r) for r in self.rules]
        self.theta = [np.asarray(x) for x in jax.tree.leaves(task.params)]
        self.outer = [
            jax.tree.map(
                np.asarray, outer_init(method.outer_optimizer, [self.theta[i] for i in idx])
            )
            for idx in self.members_of
        ]
        m_count, p_count = task.num_workers, self.spec.fragments
        self.tokens = self.spec.tokens_per_step or (1.0,) * m_count
        self.starts: dict[int, tuple[int, bool]] = {}  # a new process's (step, from its ckpt)
        self.update = 0  # merges applied
        self.merged: list[tuple[int, list]] = []  # (fragment, leaves) of each merge, in order
        # When each sync merges: the rule the simulated clock runs (on the monotonic clock),
        # an adaptive grace budgeted on each learner's measured seconds per step.
        self.step_times = StepTimes()  # each learner's, from its pushes
        self.rule = QuorumRule(p_count, self.spec.quorum, self.spec.grace(self.step_times))
        self.pending: dict[tuple[int, int], dict[int, Push]] = {}  # each sync's payloads
        self.pushes = [[0] * p_count for _ in range(m_count)]
        self.newest_step = [0] * m_count
        self.started = self.clock()
        self.first_merge: float | None = None  # its wall-clock time
        self.shortage = Shortage(self.options.quorum_timeout)
        # Resumed: the merges before `base` are in Θ but not kept one by one, so a learner
        # holding an older version takes Θ whole.
        self.base = self._restore()
        if self.update >= task.num_rounds:
            self.done = "finished"

    # ---- the learners' calls ------------------------------------------------------------

    def join(
        self, worker: int, incarnation: str | None, start: int | None = None,
        from_checkpoint: bool = False,
    ) -> dict[str, Any]:  # fmt: skip
        """Learner `worker` (re)joins; a new process says the step it starts at (`start`)
        and whether its inner state is its checkpoint's, logged when it takes Θ."""
        self._check_worker(worker)
        if start is not None and (isinstance(start, bool) or not isinstance(start, int)
                                  or start < 0):  # fmt: skip
            raise ValueError(f"start must be an integer step >= 0, got {start!r}")
        with self.cond:
            if self.done is not None:
                return self._ended(worker)
            joined = self.members.join(worker, incarnation, self.clock())
            if joined.new:
                self.starts.pop(worker, None)
                log.info("learner %d joined (after merge %d)", worker, self.update)
            if start is not None:
                self.starts[worker] = (start, bool(from_checkpoint))
            return {"incarnation": joined.member.incarnation,
                    "options": self.options.to_message()}  # fmt: skip

    def heartbeat(self, worker: int, incarnation: str) -> dict[str, Any]:
        self._check_worker(worker)
        with self.cond:
            return self._heard(worker, incarnation) or {"status": "ok"}

    def next_round(
        self, worker: int, incarnation: str, after: int, timeout: float, held: int = -1
    ) -> dict:
        """With `after` = -1 (a new learner process) or a version from before this syncer's
        restart: Θ whole and its version (the merges in it). Else, once there are merges
        after version `after` (waiting at most `timeout` s): {"status": "round", "round": the
        new version, "updates": [[update, fragment, sync], ...], "reply": their leaves in
        that order}; "pending" if none came; or "rejoin", "done", "abort"."""
        self._check_worker(worker)
        deadline = self.clock() + timeout
        with self.cond:
            while True:
                ended = self._heard(worker, incarnation)
                if ended is not None:
                    return ended
                if after < self.base:  # a new process, or one behind a syncer restart
                    if after < 0:
                        self._note_start(worker)
                    return {"status": "round", "serial": self.update, "round": self.update,
                            "position": 0, "theta": list(self.theta)}  # fmt: skip
                if self.update > after:
                    news = self.merged[after - self.base :]
                    return {"status": "round", "serial": self.update, "round": self.update,
                            "position": 0, "updates": [[u, p, k] for u, (p, k, _) in
                                                       enumerate(news, start=after)],
                            "reply": [x for *_, leaves in news for x in leaves]}  # fmt: skip
                left = deadline - self.clock()
                if left <= 0:
                    return {"status": "pending"}
                self.cond.wait(left)

    def push(
        self, worker: int, incarnation: str, serial: int, leaves: list, loss: float,
        compute_s: float = 0.0, steps_s: float = 0.0, finite: bool = True, c_steps: int = 0,
        applied: Any = (), resynced: Any = (), origin: Any = (0, 0), timed_steps: int = 0,
    ) -> dict:  # fmt: skip
        """Learner `worker`'s push of the fragment due at its step `serial`, with its
        `c_steps`, the merges it `applied` since its last push ([[update, boundary], ...])
        and where it took Θ whole after a syncer restart (`resynced`: [[version, boundary],
        ...]); `origin`, where the trajectory that made it began ([version, step]); `steps_s`,
        the seconds of its `timed_steps` steps since its push before:
        {"status": "ok"}, "late" (its sync already merged), or "rejoin".
        """
        self._check_worker(worker)
        sync = self.spec.sync_of(serial, self.task.inner_steps)
        if sync is None:
            raise ValueError(f"a push follows a step k H + (p + 1) H / P, got step {serial}")
        p, k = sync
        like = [self.theta[i] for i in self.members_of[p]]
        values = wire.tree_like(like, leaves, f"learner {worker}'s push of fragment {p}")
        with self.cond:
            ended = self._heard(worker, incarnation)
            if ended is not None:
                return ended
            self._note_applied(worker, incarnation, applied)
            for version, boundary in resynced:  # the replay restarts it there, state kept
                self._log_start(worker, int(version), int(boundary), True)
            self.pushes[worker][p] += 1
            self.newest_step[worker] = max(self.newest_step[worker], serial)
            if steps_s > 0 and isinstance(timed_steps, int) and timed_steps > 0:
                self.step_times.add(worker, steps_s / timed_steps)
            if not finite or not self.rule.push(p, k, worker, self.clock()):
                log.info("learner %d's push of sync (%d, %d) is late", worker, p, k)
                return {"status": "late"}
            self.pending.setdefault((p, k), {})[worker] = Push(
                [np.array(x) for x in values], int(c_steps), float(loss), [int(x) for x in origin]
            )
            self._merge_due()
            return {"status": "ok"}

    # ---- the clock ----------------------------------------------------------------------

    def tick(self) -> None:
        """Merges what is due, removes learners silent past heartbeat_timeout, and ends the
        run after quorum_timeout with fewer than K members."""
        now, o = self.clock(), self.options
        with self.cond:
            if self.done is not None:
                return
            for m, silent in self.members.silent(now, o.heartbeat_timeout):
                self.members.remove(m)
                log.info("learner %d removed: silent for %.1f s", m, silent)
            self._merge_due()
            if len(self.members) < self.spec.quorum and now - self.started > o.join_timeout:
                if self.shortage.short(now):
                    self.done = (f"{len(self.members)} live learners, fewer than the quorum "
                                 f"K = {self.spec.quorum}, for {o.quorum_timeout:g} s")  # fmt: skip
                    log.error("%s", self.done)
                    self.cond.notify_all()
            else:
                self.shortage.clear()

    # ---- internals (with the lock held) -------------------------------------------------

    def _merge_due(self) -> None:
        """Merges every sync whose quorum and grace have passed, earliest due first."""
        while self.done is None:
            due = self.rule.next_due()
            if due is None or due.time > self.clock():
                return
            self._merge(due)

    def _merge(self, due: Due) -> None:
        p, k = due.fragment, due.sync
        m_count, idx = self.task.num_workers, self.members_of[p]
        pushed = self.pending.pop((p, k))
        fragment = [self.theta[i] for i in idx]
        c_steps = [pushed[m].c_steps if m in pushed else 0 for m in range(m_count)]
        weights = merge_weights([c * t for c, t in zip(c_steps, self.tokens, strict=True)],
                                c_steps)  # fmt: skip
        slots = [pushed[m].leaves if m in pushed else fragment for m in range(m_count)]
        stacked = [jnp.stack([s[j] for s in slots]) for j in range(len(idx))]
        new, outer = self.merge[p](fragment, self.outer[p], stacked, jnp.asarray(weights))
        new = [np.asarray(x) for x in new]
        self.outer[p] = jax.tree.map(np.asarray, outer)
        for i, v in zip(idx, new, strict=True):
            self.theta[i] = v
        wall = time.time()
        self.first_merge = wall if self.first_merge is None else self.first_merge
        merged = list(self.rule.merge(due, self.clock()))
        losses = [pushed[m].loss for m in merged]
        record = {
            "round": self.update, "update": self.update, "fragment": p, "sync": k,
            "step": self.spec.push_step(p, k, self.task.inner_steps),
            "time": wall - self.first_merge, "wall": wall, "merged": merged,
            "weights": [float(w) for w in weights], "c_steps": c_steps,
            "late": m_count - len(merged), "loss": float(np.mean(losses)),
            "total_steps": sum(self.newest_step), "pushes": [list(n) for n in self.pushes],
            "origins": [pushed[m].origin if m in pushed else None for m in range(m_count)],
        }  # fmt: skip
        with open(self.directory / HISTORY_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.merged.append((p, k, new))
        if len(self.merged) > KEEP_MERGES:
            del self.merged[0]
            self.base += 1
        self.update += 1
        self._save()  # before any learner hears of the merge: a restart never loses one told
        log.info("merge %d: fragment %d's sync %d of learners %s", record["update"], p, k, merged)
        if self.update >= self.task.num_rounds:
            theta = jax.tree.unflatten(jax.tree.structure(self.task.params), self.theta)
            wire.write_file(self.directory / "final.msgpack", {"theta": wire.leaves(theta)})
            self.done = "finished"
        self.cond.notify_all()

    def _note_start(self, worker: int) -> None:
        """A new learner process takes Θ of now: the replay restarts it from the same."""
        if worker not in self.starts:
            return
        step, saved = self.starts.pop(worker)
        self._log_start(worker, self.update, step, saved)

    def _log_start(self, worker: int, version: int, step: int, from_checkpoint: bool) -> None:
        line = {"learner": worker, "version": version, "step": step,
                "from_checkpoint": from_checkpoint}  # fmt: skip
        with open(self.directory / STARTS_FILE, "a") as f:
            f.write(json.dumps(line) + "\n")

    def _save(self) -> None:
        """The state after the newest merge, whole or not at all (`CHECKPOINT_FILE`)."""
        message = {
            "update": self.update, "theta": list(self.theta),
            "outer": [wire.leaves(o) for o in self.outer], "next_sync": list(self.rule.next_sync),
            "pushes": [list(n) for n in self.pushes], "newest_step": list(self.newest_step),
            "first_merge": self.first_merge,
        }  # fmt: skip
        wire.write_file(self.directory / CHECKPOINT_FILE, message)

    def _restore(self) -> int:
        """The state of the folder's checkpoint, if any (history.jsonl cut back to it): the
        merges in it."""
        path = self.directory / CHECKPOINT_FILE
        if not path.exists():
            return 0
        saved = wire.read_file(path)
        self.update = int(saved["update"])
        self.theta = wire.tree_like(self.theta, saved["theta"], str(path))
        self.outer = [wire.tree_like(o, leaves, str(path))
                      for o, leaves in zip(self.outer, saved["outer"], strict=True)]  # fmt: skip
        self.rule.resume([int(k) for k in saved["next_sync"]])
        self.pushes = [[int(x) for x in n] for n in saved["pushes"]]
        self.newest_step = [int(x) for x in saved["newest_step"]]
        self.first_merge = saved["first_merge"]
        history = self.directory / HISTORY_FILE
        lines = history.read_text().splitlines(keepends=True)[: self.update]
        history.write_text("".join(lines))
        log.info("resumed after merge %d from %s", self.update, path)
        return self.update

    def _note_applied(self, worker: int, incarnation: str, applied: Any) -> None:
        lines = [
            json.dumps(
                {
                    "learner": worker,
                    "incarnation": incarnation,
                    "update": int(u),
                    "boundary": int(b),
                }
            )  # fmt: skip
            for u, b in applied
        ]
        if lines:
            with open(self.directory / APPLIED_FILE, "a") as f:
                f.write("\n".join(lines) + "\n")


def checked_for_decoupled(options: Elastic, num_workers: int) -> Elastic:
    """`options` checked for a Decoupled DiLoCo run; ValueError naming an option it can't
    honor: its quorum is the spec's, and nobody waits for a round."""
    options = options.checked(num_workers)
    if options.min_workers != 1:
        raise ValueError(
            "Elastic.min_workers does not apply to Decoupled DiLoCo: its quorum is "
            f"DecoupledDiLoCo.quorum, got {options.min_workers}"
        )
    refuse_round_options(
        options, "Decoupled DiLoCo",
        "its grace is DecoupledDiLoCo.grace_seconds, and no learner waits",
        "a restarted learner takes its checkpoint's inner state",
    )  # fmt: skip
    return options
