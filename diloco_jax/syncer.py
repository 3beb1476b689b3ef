"""The elastic run's syncer: one process that holds the global θ, its outer optimizer state
and the membership, and closes one sync per round over gRPC (`diloco_jax.rpc`).

Workers (`diloco_jax.elastic_worker`) join, heartbeat, ask for the next round, run their
inner phase on their own and push their delta. A round's participants are the members when
it opened; its sync closes when every live participant's delta is in (or `grace_seconds`
after the quorum's are), takes the mean of the included deltas, applies the outer step,
appends the sync to `history.jsonl`, checkpoints and opens the next round for the members
then. A worker silent past `heartbeat_timeout` (or without its delta past `round_timeout`)
is removed: left out of the open sync, like a simulated drop, and told to join again when it
speaks next. A worker joining while a round is open takes part from the next one.

State on disk (`directory`): `sync-RRRRRRRR.ckpt` (the state after sync R: θ, outer state,
each worker's data position, the members; the two newest are kept) and `history.jsonl` (one
line per sync). A checkpoint is written on a thread of its own while the next round runs, over
the file of the one it retires (`wire.write_kept`); the one after it waits for it, so the
newest on disk is at most one sync behind. A restarted
syncer resumes from its newest intact checkpoint (history.jsonl cut back to it) and opens
that round again once each member it had is back: reattached (their deltas pushed before
the restart are asked again; a worker already past that round runs its phase again from the
inner state it kept of that position, the same delta) or, after a whole-cluster restart,
joined as a new process; or, like a starting syncer, after join_timeout with min_workers
there. Each round's serial is written to `serial` as it is handed out; after that first
round a resumed syncer numbers its rounds above it, so a late push of a round the previous
process opened from a θ that was never checkpointed is "late", never merged.
"""

import dataclasses
import functools
import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from diloco_jax import wire
from diloco_jax.elastic_merge import make_merge
from diloco_jax.elastic_task import Elastic, ElasticTask
from diloco_jax.membership import Membership
from diloco_jax.outer import outer_init
from diloco_jax.round_rule import RoundRule
from diloco_jax.syncer_base import SyncerBase
from diloco_jax.trees import all_finite

log = logging.getLogger("diloco_jax.syncer")

CHECKPOINT_GLOB = "sync-*.ckpt"
SERIAL_FILE = "serial"  # the last round opening's serial, written as it is handed out
SERIAL_MARGIN = 1 << 20
KEEP_CHECKPOINTS = 2


class Reply(NamedTuple):
    """What turns θ of version - 1 (and its outer state) into θ of `version` on a worker that
    holds them: the merge's reply leaves."""

    version: int
    leaves: list


@dataclasses.dataclass
class Pushed:
    leaves: Any
    loss: float
    finite: bool
    compute_s: float


class _Writer:
    """Writes one checkpoint at a time on a thread of its own: `submit` waits for the write
    before it, then returns at once; `flush` waits for the last. A failed write is raised by
    the next call. Safe to call from any thread."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def submit(self, write: Callable[[], None]) -> None:
        with self._lock:
            self._flush()
            self._thread = threading.Thread(target=self._run, args=(write,), daemon=True)
            self._thread.start()

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as error:  # noqa: BLE001 (raised by the syncer's next call)
            self._error = error

    def flush(self) -> None:
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error


def checkpoint_path(directory: Path, round_: int) -> Path:
    return directory / f"sync-{round_:08d}.ckpt"


class Syncer(SyncerBase):
    """The sync's state machine; every method is safe to call from the gRPC threads."""

    def __init__(
        self, task: ElasticTask, options: Elastic, directory: Path, *,
        clock: Callable[[], float] = time.monotonic,
    ):  # fmt: skip
        super().__init__(task, clock)
        self.options = options.checked(task.num_workers)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.theta = jax.tree.map(np.asarray, task.params)
        self.outer_state = jax.tree.map(
            np.asarray, outer_init(task.method.outer_optimizer, self.theta)
        )
        self.merge = make_merge(task.method, self.theta, task.num_workers)
        self.round, self.serial, self.opened = 0, -1, False
        self.reply: Reply | None = None  # the last sync's, where the merge makes one
        self.theta_checksum: tuple[int, int] | None = None  # (version, θ's checksum)
        self.positions = [0] * task.num_workers
        self.rule = self._new_rule()  # when rounds open and close (`Syncer._step`)
        self.started = self.clock()
        self._writer = _Writer()
        # Resumed: the members of the last sync not heard from since. The round opens once
        # each is back (reattached, or a new process of it joined: a whole-cluster restart),
        # or as a starting syncer's first round does, after join_timeout.
        self.awaited: set[int] = set()
        # Resumed: the highest serial a process before may have handed out. Its rounds after
        # our checkpoint may have started from a θ this run will not have (the checkpoint
        # lags by one sync), so after the first opening (from the checkpoint's θ, which they
        # share) serials go on above it: a late push of such a round is never taken.
        self.issued_before: int | None = None
        if self._restore():
            self.awaited = set(self.members)
            self.issued_before = self._issued_serial()
        if self.round >= task.num_rounds:
            self.done = "finished"

    def _new_rule(self) -> Any:
        """The round's rule (`round_rule.RoundRule`), from the options."""
        o = self.options
        return RoundRule(self.task.num_workers, o.min_workers, grace_seconds=o.grace_seconds,
                         round_timeout=o.round_timeout, join_timeout=o.join_timeout,
                         quorum_timeout=o.quorum_timeout)  # fmt: skip

    # ---- the workers' calls -------------------------------------------------------------

    def join(self, worker: int, incarnation: str | None) -> dict[str, Any]:
        """Worker `worker` (re)joins: its old incarnation (if any) is replaced by a new one,
        unless it is reattaching with the incarnation a resumed syncer still has."""
        self._check_worker(worker)
        with self.cond:
            self.awaited.discard(worker)
            joined = self.members.join(worker, incarnation, self.clock())
            if joined.new:
                if joined.replaced:
                    self._drop(worker)  # its old process won't push
                log.info("worker %d joined (round %d)", worker, self.round)
            self._step()
            return {"incarnation": joined.member.incarnation,
                    "options": self.options.to_message()}  # fmt: skip

    def heartbeat(self, worker: int, incarnation: str) -> dict[str, Any]:
        """{"status": "ok"}, "rejoin", or the run's end ("done" / "abort" with its reason:
        a worker in the middle of a phase hears it here and ends after the phase)."""
        self._check_worker(worker)
        with self.cond:
            return self._heard(worker, incarnation) or {"status": "ok"}

    def next_round(
        self, worker: int, incarnation: str, after: int, timeout: float, held: int = -1
    ) -> dict:
        """Blocks (at most `timeout` s) until worker's next round: {"status": "round", serial,
        round, position} and θ of version `round` (`_theta_for`: the worker holds θ of
        version `held`, -1 none); or "push_again" (the open round lost its delta), "rejoin",
        "done", "abort" (with "reason"), "pending" (nothing yet: ask again)."""
        self._check_worker(worker)
        deadline = self.clock() + timeout
        with self.cond:
            while True:
                ended = self._heard(worker, incarnation)
                if ended is not None:
                    return ended
                if self.rule.awaits(worker):
                    if self.serial != after:
                        return {
                            "status": "round",
                            "serial": self.serial,
                            "round": self.round,
                            "position": self.positions[worker],
                            **self._theta_for(held),
                        }
                    return {"status": "push_again", "serial": self.serial}
                left = deadline - self.clock()
                if left <= 0:
                    return {"status": "pending"}
                self.cond.wait(min(left, 0.5))

    def _theta_for(self, held: int) -> dict[str, Any]:
        """θ for a worker holding θ of version `held`, where the merge has replies: θ's
        "checksum" alone where it holds this θ, with the last sync's "reply" where it holds
        the one before; else θ ("theta") and the outer state ("outer") whole, so it can take
        the next. Without replies: θ whole."""
        # The leaves themselves (the merge's arrays): the wire makes their bytes once per θ.
        theta = jax.tree.leaves(self.theta)
        if self.merge.reply_like is None:
            return {"theta": theta}
        if held == self.round:
            return {"checksum": self._checksum()}
        if self.reply is not None and self.reply.version == self.round == held + 1:
            return {"reply": self.reply.leaves, "checksum": self._checksum()}
        return {"theta": theta, "outer": jax.tree.leaves(self.outer_state)}

    def _checksum(self) -> int:
        """θ's checksum, made once per version."""
        if self.theta_checksum is None or self.theta_checksum[0] != self.round:
            self.theta_checksum = (self.round, wire.checksum(self.theta))
        return self.theta_checksum[1]

    def push(
        self, worker: int, incarnation: str, serial: int, leaves: list, loss: float,
        compute_s: float = 0.0, steps_s: float = 0.0, finite: bool = True,
    ) -> dict:  # fmt: skip
        """Worker's push for opening `serial` (`merge.push_like`'s leaves: its delta, or its
        compressed payload; its mean inner loss, the seconds its phase took and of those its
        inner steps', and whether its delta was finite, which a payload's integer codes can't
        show): "ok", or "late" (that opening closed, or the worker is not in it), "rejoin",
        "refused" (with "reason": leaves unlike the push's), or the run's end ("done" /
        "abort")."""
        self._check_worker(worker)
        try:
            delta = wire.tree_like(self.merge.push_like, leaves, f"worker {worker}'s push")
        except ValueError as error:
            log.warning("refused: %s", error)
            return {"status": "refused", "reason": str(error)}
        # On the device and checked before the lock, while other pushes arrive: the merge
        # then takes it as it is.
        delta = jax.device_put(delta)
        finite = bool(finite) and bool(all_finite(delta))
        with self.cond:
            ended = self._heard(worker, incarnation)
            if ended is not None:
                return ended
            pushed = Pushed(delta, float(loss), finite, float(compute_s))
            return self._take(worker, serial, pushed, float(steps_s))

    def _take(self, worker: int, serial: int, pushed: Pushed, steps_s: float) -> dict:
        """The rule's part of a push from a live member (with the lock held): this one
        keeps the delta for the open round's mean (`steps_s` unused: rounds are H steps)."""
        if serial != self.serial or not self.rule.push(worker, pushed, self.clock()):
            return {"status": "late"}
        self._step()
        return {"status": "ok"}

    # ---- the clock ---------------------------------------------------------------------

    def tick(self) -> None:
        """Removes silent workers, then does what the rule says is due."""
        with self.cond:
            if self.done is not None:
                return
            now = self.clock()
            for worker, silent in self.members.silent(now, self.options.heartbeat_timeout):
                self._remove(worker, f"silent for {silent:.1f} s")
            self._step()

    # ---- internals (called with the lock held) -----------------------------------------

    def _noted(self, worker: int) -> None:
        self.awaited.discard(worker)

    def _ended(self, worker: int) -> dict[str, Any]:
        return {**super()._ended(worker), "round": self.round}

    def _remove(self, worker: int, why: str) -> None:
        self.members.remove(worker)
        self.awaited.discard(worker)  # a resumed syncer opens without it, not at join_timeout
        self._drop(worker)
        log.info("worker %d removed: %s (round %d)", worker, why, self.round)
        self.cond.notify_all()

    def _drop(self, worker: int) -> None:
        """A removed worker, or one whose process was replaced: the open sync won't wait for
        it, even if it comes back (unless its delta is in)."""
        self.rule.leave(worker)

    def _step(self) -> None:
        """Removes stuck participants, then opens, closes or reopens what the rule says is
        due, or ends the run short of workers."""
        if self.done is not None:
            return
        now = self.clock()
        for worker in self.rule.stuck(now, set(self.members)):
            self._remove(worker, f"no delta {now - self.rule.opened_at:.1f} s into the round")
        resumed = self.serial >= 0  # from a checkpoint
        decision = self.rule.decide(now, set(self.members), self.awaited, resumed, self.started)
        if decision.action == "open":
            self._open(set(decision.participants), reason=decision.why)
        elif decision.action == "close":
            self._close()
        elif decision.action == "end":
            self._short_end(decision.why)

    def _short_end(self, what: str) -> None:
        """Ends the run: short of min_workers for quorum_timeout (`what`: how short)."""
        self.done = (
            f"fewer than min_workers={self.options.min_workers} workers for "
            f"{self.options.quorum_timeout:g} s ({what}); the run ends at round "
            f"{self.round}, checkpointed"
        )
        log.error("%s", self.done)
        self.cond.notify_all()

    def _open(self, participants: set, reason: str) -> None:
        serial = self.serial + 1
        if self.issued_before is not None and self.opened:
            serial = max(serial, self.issued_before + 1)
        self.serial, self.opened = serial, True
        (self.directory / SERIAL_FILE).write_text(f"{serial}\n")  # before anyone sees it
        self.rule.open(participants, self.clock())
        log.info("round %d open (%s) for workers %s", self.round, reason, sorted(participants))
        self.cond.notify_all()

    def _close(self) -> None:
        busy_since = self.clock()
        pushes = self.rule.close()
        included = sorted(m for m, p in pushes.items() if p.finite)
        self.reply = None
        if included:
            merged = self.merge.apply(
                self.theta, self.outer_state, {m: pushes[m].leaves for m in included}
            )
            self.theta, self.outer_state = merged.theta, merged.outer_state  # kept on the device
            if merged.reply is not None:
                self.reply = Reply(self.round + 1, merged.reply)
        for m in included:
            self.positions[m] += 1
        record = {
            "round": self.round,
            "included": included,
            "participants": sorted(self.rule.participants),
            "nonfinite": sorted(m for m, p in pushes.items() if not p.finite),
            "loss": float(np.mean([pushes[m].loss for m in included])) if included else None,
            "positions": list(self.positions),
            "compute_s": {str(m): round(p.compute_s, 4) for m, p in sorted(pushes.items())},
            "seconds": round(self.clock() - self.rule.opened_at, 4),
            "time": time.time(),
        }
        self._record(record, busy_since)
        log.info("sync %d closed with workers %s", record["round"], included)
        if not self._end_if_done():
            self._open(set(self.members), reason="next")

    def _record(self, record: dict, busy_since: float) -> None:
        """Counts the update `record` describes, appends it to history.jsonl, checkpoints."""
        self.round += 1
        with open(self.directory / "history.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        self._save()
        # The outer step and the checkpoint held the lock: no heartbeat could land meanwhile,
        # so that time counts for nobody's silence.
        self.members.excuse(self.clock() - busy_since)

    def _end_if_done(self) -> bool:
        """Ends the run (final.msgpack) once its last update is in; whether it ended (or had
        ended: a failed checkpoint)."""
        if self.done is not None:
            return True
        if self.round < self.task.num_rounds:
            return False
        try:
            self._writer.flush()  # the last checkpoint on disk before the result
            wire.write_file(self.directory / "final.msgpack", {"theta": wire.leaves(self.theta)})
        except Exception as error:  # noqa: BLE001 (the run ends with its line, never a hang)
            self._failed(error)
            return True
        self.done = "finished"
        self.cond.notify_all()
        return True

    def _failed(self, error: BaseException) -> None:
        """Ends the run with the syncer's failure (a checkpoint or the result not written)."""
        log.error("the syncer failed: %s", error)
        self.done = f"the syncer failed: {type(error).__name__}: {error}"
        self.cond.notify_all()

    def flush(self) -> None:
        """Waits until the newest checkpoint is on disk (before the process ends, or another
        syncer reads the folder); a failed write ends the run with its line (`done`)."""
        with self.cond:
            try:
                self._writer.flush()
            except Exception as error:  # noqa: BLE001 (reported by `done`)
                self._failed(error)

    def _save(self) -> None:
        """Hands the state to the writer (θ and the outer state by reference: an update
        replaces them, never changes them in place)."""
        message = {
            "round": self.round,
            "serial": self.serial,
            "theta": wire.leaves(self.theta),
            "outer": wire.leaves(self.outer_state),
            "positions": list(self.positions),
            "members": {str(m): inc for m, inc in self.members.incarnations().items()},
            **self._saved_extra(),
        }
        path = checkpoint_path(self.directory, self.round)
        try:
            self._writer.submit(
                functools.partial(wire.write_kept, path, message, CHECKPOINT_GLOB, KEEP_CHECKPOINTS)
            )
        except Exception as error:  # noqa: BLE001 (the write before this one failed)
            self._failed(error)

    def _restore(self) -> bool:
        """Loads the newest intact checkpoint (an unreadable one is skipped with a warning)
        and cuts history.jsonl back to it. Returns whether one was found."""
        for path in sorted(self.directory.glob(CHECKPOINT_GLOB), reverse=True):
            try:
                message = wire.read_file(path)
                theta = wire.tree_like(self.theta, message["theta"], f"{path}: theta")
                outer = wire.tree_like(self.outer_state, message["outer"], f"{path}: outer")
                positions = [int(p) for p in message["positions"]]
                if len(positions) != self.task.num_workers:
                    raise ValueError(f"{path}: {len(positions)} positions, not one per worker")
                self._restore_extra(message, path)
            except (ValueError, KeyError, TypeError) as error:
                log.warning("skipping checkpoint %s: %s", path.name, error)
                continue
            self.theta, self.outer_state, self.positions = theta, outer, positions
            self.round, self.serial = int(message["round"]), int(message["serial"])
            # The members get a heartbeat timeout more than usual to find the restarted syncer.
            now = self.clock() + self.options.heartbeat_timeout
            self.members = Membership({int(m): inc for m, inc in message["members"].items()}, now)
            self._cut_history()
            log.info("resumed from %s (round %d)", path.name, self.round)
            return True
        return False

    def _issued_serial(self) -> int:
        """The last serial SERIAL_FILE records (a large margin past the checkpoint's when it
        is missing or torn)."""
        try:
            return int((self.directory / SERIAL_FILE).read_text())
        except (OSError, ValueError):
            return self.serial + SERIAL_MARGIN

    def _saved_extra(self) -> dict:
        """What a subclass's rule adds to the checkpoint (none here)."""
        return {}

    def _restore_extra(self, message: dict, path: Path) -> None:
        """Restores `_saved_extra`'s fields from a checkpoint (none here)."""

    def _cut_history(self) -> None:
        path = self.directory / "history.jsonl"
        if not path.exists():
            return
        lines = path.read_text().splitlines()
        kept = [line for line in lines if _round_of(line) < self.round]
        if len(kept) != len(lines):  # a sync after the checkpoint, or a torn last line
            path.write_text("".join(line + "\n" for line in kept))


def _round_of(line: str) -> float:
    """The round a history line records (infinity for a torn or empty line)."""
    try:
        return json.loads(line)["round"]
    except (ValueError, KeyError, TypeError):
        return float("inf")
