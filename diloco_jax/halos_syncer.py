"""HALoS (Kim et al. 2025, arXiv 2506.04531) on real processes: a syncer per region (the local
parameter server, LPS) under a global one (GPS), each its own process, with the rules of
`train_async(server=dj.HALoS(...))`'s simulated clock.

- `RegionSyncer` is asynchronous DiLoCo's syncer (`diloco_jax.arrival_syncer`) for the
  workers of its region: each delta applied at once with the local outer rule and its age,
  the worker sent on from θ_L. After an update that makes its count K (`local_updates`) more
  than at its last merge, with no push in flight, it hands Δ_L = snapshot - θ_L to its link
  to the GPS (a thread of its own: the workers never wait on the GPS); the link pushes it,
  asks for θ_G, and the LPS merges θ_L ← (1 - α) θ_L + α θ_G, which becomes its snapshot.
- `GlobalSyncer` is the same syncer with the regions as its workers and the global rule as
  its outer rule: a region's push is applied with its age (the GPS's updates since the θ_G
  the region last merged), and a region's next θ_G is the GPS's θ when it asks, right
  after its push. The run ends after `ElasticTask.num_rounds` GPS updates; each region hears
  it on its link and ends its workers.

Each writes what the replay needs (`diloco_jax.halos_replay`): a region's history.jsonl
lines carry where each job started (updates and merges), its merges.jsonl each merge; the
GPS's history.jsonl each push applied. `elastic.arrivals(gps_dir)` reads them (the regions'
folders inside the GPS's: `region-r/`) as a `halos_replay.Record`.

A region's syncer checkpoints each update as asynchronous DiLoCo's does, with its own state
beside (its snapshot, its counts, a push in flight and its Δ_L). A push leaves only once the
checkpoint of the update that armed it is on disk, and a merge is on disk before any job
starts from it, so a restarted region resumes knowing every push the GPS has from it and
every θ_L a job started from; a push whose "ok" it never heard is not sent twice (the GPS's
next job says how many of the region's pushes it holds). A worker that dies, stalls or
restarts is handled as in asynchronous DiLoCo.
"""

import dataclasses
import json
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from diloco_jax import wire
from diloco_jax.arrival_rule import Job
from diloco_jax.arrival_syncer import ArrivalSyncer
from diloco_jax.elastic_task import Elastic, ElasticTask
from diloco_jax.halos import HALoS, default_global_optimizer
from diloco_jax.halos import merge as merge_theta
from diloco_jax.method import DiLoCo
from diloco_jax.outer import worker_delta

log = logging.getLogger("diloco_jax.syncer")
MERGES_FILE = "merges.jsonl"


def region_folder(gps_dir: str | Path, region: int) -> Path:
    """Where region r's syncer writes, inside the global syncer's folder."""
    return Path(gps_dir) / f"region-{region}"


def global_task(task: ElasticTask) -> ElasticTask:
    """The GPS's view of a HALoS task: the regions are its workers, the global rule its outer
    rule, num_rounds its updates."""
    spec: HALoS = task.server
    outer = spec.global_optimizer or default_global_optimizer()
    return dataclasses.replace(
        task, num_workers=spec.num_regions, method=DiLoCo(inner=task.method.inner, outer=outer),
        dynamic_steps=False, server=None,
    )  # fmt: skip


def checked_for_halos(options: Elastic, task: ElasticTask) -> Elastic:
    """`options`, or ValueError naming what a HALoS run can't take: a quorum larger than a
    region (each region's syncer takes its quorum from its own workers)."""
    smallest = task.server.smallest_region
    if options.min_workers > smallest:
        raise ValueError(f"Elastic.min_workers must be at most the smallest region's workers "
                         f"({smallest}) for HALoS, got {options.min_workers}")  # fmt: skip
    return options


class GlobalSyncer(ArrivalSyncer):
    """The GPS (see the module docstring)."""

    def __init__(self, task: ElasticTask, options: Elastic, directory: Path):
        # A region's job lasts K of its updates: no round timeout; one live region suffices.
        options = dataclasses.replace(options, min_workers=1, round_timeout=None)
        super().__init__(global_task(task), options, directory)

    def _apply_arrival(self, worker: int, job: Job, pushed: Any, steps_s: float) -> None:
        # On disk before the region hears "ok": a region merges the θ_G after its push and
        # can't take it back, so a restarted GPS resumes with every push a region was told
        # of (and every θ_G it merged).
        super()._apply_arrival(worker, job, pushed, steps_s)
        self.flush()

    def _theta_for_jobs(self) -> Any:
        return self.theta  # a region merges θ_G itself: no look-ahead


class RegionSyncer(ArrivalSyncer):
    """Region `region`'s LPS (see the module docstring); `gps`: the GPS's "host:port"."""

    def __init__(
        self, task: ElasticTask, options: Elastic, directory: Path, region: int, gps: str,
        secret: bytes,
    ):  # fmt: skip
        spec: HALoS = task.server
        if not 0 <= region < spec.num_regions:
            raise ValueError(f"--region must be in [0, {spec.num_regions}), got {region}")
        self.spec, self.region = spec, region
        # The region's own state, saved with each checkpoint (a restart resumes it): its θ_L
        # at its last merge, the updates then, the Δ_L of its push in flight (None: none), its
        # merges and pushes so far, and the merges before each job handed out.
        self.snapshot: Any = None
        self.merged, self.merges, self.pushes = 0, 0, 0
        self.pending: Any = None
        self.start_merges: dict[int, int] = {}  # job serial -> merges before its θ_L
        self.outbox: queue.Queue = queue.Queue()
        super().__init__(task, checked_for_halos(options, task), directory)
        if self.snapshot is None:
            self.snapshot = self.theta
        if self.pending is not None:  # resumed with a push the GPS may or may not hold
            self.outbox.put((self.pushes - 1, self.pending))
        self.link = _Link(self, gps, secret)

    def start_link(self) -> threading.Thread:
        thread = threading.Thread(target=self.link.run, daemon=True, name="gps-link")
        thread.start()
        return thread

    def _check_worker(self, worker: Any) -> None:
        super()._check_worker(worker)
        if self.spec.regions[worker] != self.region:
            raise ValueError(f"worker {worker} is in region {self.spec.regions[worker]}, not "
                             f"this syncer's region {self.region}")  # fmt: skip

    def _theta_for_jobs(self) -> Any:
        # Called with the lock held as job `self.serial` is handed out: θ_L as it is now.
        self.start_merges[self.serial] = self.merges
        return self.theta

    def _job_fields(self, job: Job) -> dict:
        return {"region": self.region, "start_merges": self.start_merges.pop(job.serial)}

    def _record(self, record: dict, busy_since: float) -> None:
        # A push due after this update is part of the state its checkpoint saves, and leaves
        # only once that is on disk: a restarted region knows of every push the GPS has.
        armed = self.spec.push_due(self.round + 1, self.merged, self.pending is not None)
        if armed:
            self.pending = jax.tree.map(np.asarray, worker_delta(self.snapshot, self.theta))
            self.pushes += 1
        super()._record(record, busy_since)
        if armed:
            self.flush()
            self.outbox.put((self.pushes - 1, self.pending))

    def merge_global(self, theta_g: Any, version: int) -> None:
        """θ_G of `version` GPS updates reached this LPS: merged, recorded and on disk before
        any job starts from it; the next push armed."""
        with self.cond:
            merged = merge_theta(self.theta, theta_g, self.spec.merge_weight)
            self.theta = jax.tree.map(np.asarray, merged)
            self.snapshot, self.merged, self.pending = self.theta, self.round, None
            self.merges += 1
            line = {"merge": self.merges - 1, "after": self.round, "version": version,
                    "time": time.time()}  # fmt: skip
            with open(self.directory / MERGES_FILE, "a") as f:
                f.write(json.dumps(line) + "\n")
            self._save()
            self.flush()
            log.info("region %d merged θ_G of %d global updates after %d updates", self.region,
                     version, self.round)  # fmt: skip

    def end(self, reply: dict) -> None:
        """The GPS's end of the run, heard on the link: this region ends with it."""
        with self.cond:
            if self.done is not None:
                return
            finished = reply["status"] == "done"
            if finished:
                wire.write_file(
                    self.directory / "final.msgpack", {"theta": wire.leaves(self.theta)}
                )
            self.done = "finished" if finished else f"the global syncer: {reply.get('reason')}"
            self.cond.notify_all()

    def _end_if_done(self) -> bool:
        return self.done is not None  # the GPS's count ends the run, not this region's

    def _saved_extra(self) -> dict:
        region = {
            "snapshot": wire.leaves(self.snapshot),
            "counts": [self.merged, self.merges, self.pushes],
            "pending": [] if self.pending is None else wire.leaves(self.pending),
            "start_merges": {str(k): v for k, v in self.start_merges.items()},
        }
        return {**super()._saved_extra(), "region": region}

    def _restore_extra(self, message: dict, path: Path) -> None:
        super()._restore_extra(message, path)
        region = message["region"]
        self.snapshot = wire.tree_like(self.theta, region["snapshot"], f"{path}: snapshot")
        self.merged, self.merges, self.pushes = (int(x) for x in region["counts"])
        self.pending = (
            wire.tree_like(self.theta, region["pending"], f"{path}: pending")
            if region["pending"]
            else None
        )
        self.start_merges = {int(k): int(v) for k, v in region["start_merges"].items()}
        merges = self.directory / MERGES_FILE  # cut back to the checkpoint's merges
        if merges.exists():
            lines = merges.read_text().splitlines(keepends=True)
            if len(lines) > self.merges:
                merges.write_text("".join(lines[: self.merges]))


class _Link:
    """A region's calls to the GPS, on a thread of its own: join, heartbeats, and for each
    Δ_L from the LPS's outbox a push and the θ_G to merge."""

    def __init__(self, lps: RegionSyncer, address: str, secret: bytes):
        from diloco_jax.rpc import SyncerClient

        self.lps = lps
        self.client = SyncerClient(address, secret, lps.options.syncer_timeout)
        self.lock = threading.Lock()
        self.incarnation: str | None = None
        self.interval = lps.options.heartbeat_interval

    def run(self) -> None:
        try:
            self._join()
            threading.Thread(target=self._heartbeats, daemon=True, name="gps-beat").start()
            job = self._next()  # θ_G of now: θ_L starts at θ_0 whatever it is
            while self.lps.done is None:
                try:
                    index, delta = self.lps.outbox.get(timeout=0.2)
                except queue.Empty:
                    continue
                job = self._push(index, job, delta)
                self.lps.merge_global(job.theta, job.version)
        except _Ended as end:
            self.lps.end(end.reply)
        except Exception as error:  # noqa: BLE001 (the region ends with its line, never a hang)
            log.exception("region %d's link to the global syncer failed", self.lps.region)
            self.lps.end({"status": "abort", "reason": f"{type(error).__name__}: {error}"})

    def _me(self) -> dict:
        with self.lock:
            return {"worker": self.lps.region, "incarnation": self.incarnation}

    def _join(self) -> None:
        reply = self._ended(self.client.call("Join", {"worker": self.lps.region,
                                                      "incarnation": None}))  # fmt: skip
        with self.lock:
            self.incarnation = reply["incarnation"]
        log.info("region %d joined the global syncer", self.lps.region)

    def _heartbeats(self) -> None:
        while self.lps.done is None and not self.client.ended:
            time.sleep(self.interval)
            reply = self.client.once("Heartbeat", self._me(), deadline=self.interval * 4)
            if reply is not None and reply.get("status") in ("done", "abort"):
                self.lps.end(reply)
                return

    def _next(self) -> "_GlobalJob":
        """The next job the GPS hands this region (its θ_G, and this region's pushes the GPS
        has applied)."""
        while True:
            reply = self._ended(self.client.call("Next", {**self._me(), "after": -1,
                                                          "timeout": 5.0, "held": -1}))  # fmt: skip
            if reply["status"] == "rejoin":
                self._join()
            elif reply["status"] == "round":
                theta = wire.tree_like(self.lps.theta, reply["theta"], "the global θ")
                return _GlobalJob(int(reply["serial"]), theta, int(reply["update"]),
                                  int(reply["position"]))  # fmt: skip

    def _push(self, index: int, job: "_GlobalJob", delta: Any) -> "_GlobalJob":
        """Pushes this region's push number `index` under `job` until the GPS has applied it
        once; returns the job after it (the θ_G to merge)."""
        leaves = wire.leaves(delta)
        while True:
            if job.pushes > index:  # applied before a restart (the GPS's, or this region's)
                return job
            if job.pushes < index:
                raise ValueError(f"the global syncer holds {job.pushes} of this region's "
                                 f"pushes, not the {index} it was told of")  # fmt: skip
            header = {**self._me(), "serial": job.serial, "loss": 0.0}
            reply = self._ended(self.client.push(header, leaves, lambda i: None))
            status = reply["status"]
            if status == "ok":
                return self._next()
            if status == "rejoin":
                self._join()
            elif status != "late":
                raise ValueError(f"the global syncer answered {reply}")
            job = self._next()  # its job was dropped (a GPS restart, a removal)

    def _ended(self, reply: dict) -> dict:
        if reply.get("status") in ("done", "abort"):
            raise _Ended(reply)
        return reply


@dataclasses.dataclass(frozen=True)
class _GlobalJob:
    """A job the GPS handed a region: its serial, θ_G of `version` GPS updates, and the
    region's pushes the GPS had applied then."""

    serial: int
    theta: Any
    version: int
    pushes: int


class _Ended(Exception):
    def __init__(self, reply: dict):
        super().__init__(reply.get("reason"))
        self.reply = reply


__all__ = ["GlobalSyncer", "RegionSyncer", "checked_for_halos", "global_task", "region_folder"]
