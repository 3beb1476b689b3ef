"""One worker of a gossip run on real processes: NoLoCo or GASLoC (`DiLoCo(gossip=...)`)
with no global θ and no syncer in the data path.

Worker m keeps its own state (θ_m, its outer state, GASLoC's y of the sync before; the
part's `worker_state`) and its inner optimizer state. Each sync r:

1. H inner steps from θ_m on `task.batches(m, r)`: Δ_m, as in a round of `train_diloco`;
2. `worker_send`: the values it averages with its group (NoLoCo: Δ_m and θ_m; GASLoC: its
   outer step's y_m);
3. its group's mean, the butterfly of `noloco.group_mean`: at stage j it publishes what it
   holds (`peer.Offered`), fetches the same stage of its partner m ^ s_j straight from that
   worker's peer server, and takes (own + partner's) / 2. The masks s_j are the compiled
   round's (`noloco.group_masks` of the part's seed and r), so the groups are the same;
4. `worker_step`: its new state from the mean; then its checkpoint
   (`gossip-RRRRRRRR.state`: the state after r + 1 syncs, written whole or not at all).

The syncer (`diloco_jax.gossip_syncer`) only tells where each peer serves and how far every
worker has saved. A worker that dies is waited for: restarted, it resumes from its newest
checkpoint and runs its syncs again on the same data and keys, publishing the same values;
its partners' values of those syncs are still on their disks (`Offered` keeps each sync
until every worker has saved past it). So a run with a worker SIGKILLed and restarted ends
with the same θ_m as one without: `train_diloco` with the same method.

Results in the worker's folder: `final.msgpack` (θ_m after R syncs; `elastic.worker_params`)
and `metrics.jsonl` (a line per sync it ran, restarts included).
"""

import functools
import json
import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from diloco_jax import inner, peer, wire
from diloco_jax.elastic_task import Elastic, ElasticTask
from diloco_jax.elastic_worker import METRICS_FILE, WorkerExit, inner_phase, worker_folder
from diloco_jax.noloco import group_masks
from diloco_jax.outer import outer_init
from diloco_jax.rpc import SyncerClient

log = logging.getLogger("diloco_jax.worker")

FINAL_FILE = "final.msgpack"
KEEP_STATES = 2


class Saved(NamedTuple):
    """A worker's state after `sync` syncs: its own (the part's `worker_state` tree) and
    its inner optimizer state, host trees."""

    sync: int
    own: Any
    inner: Any


def state_path(directory: Path, sync: int) -> Path:
    return directory / f"gossip-{sync:08d}.state"


class GossipWorker:
    def __init__(
        self, task: ElasticTask, worker: int, address: str, directory: Path, secret: bytes,
        syncer_timeout: float | None = None, peer_host: str = "127.0.0.1",
    ):  # fmt: skip
        if not 0 <= worker < task.num_workers:
            raise ValueError(f"worker must be in [0, {task.num_workers}), got {worker}")
        self.task, self.worker, self.secret = task, worker, secret
        self.spec = task.method.gossip
        self.directory = worker_folder(directory, worker)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.client = SyncerClient(address, secret, syncer_timeout or Elastic().syncer_timeout)
        self.syncer_timeout = syncer_timeout
        method = task.method
        self.phase = jax.jit(functools.partial(inner_phase, task.loss_fn, method.inner_optimizer))
        self.send = jax.jit(functools.partial(self.spec.worker_send, method.outer_optimizer))
        self.step = jax.jit(functools.partial(self.spec.worker_step, method.outer_optimizer))
        self.masks = jax.jit(group_masks, static_argnums=(0, 2, 3))
        host = functools.partial(jax.tree.map, np.asarray)
        self.inner_like = host(method.inner_optimizer.init(task.params))
        outer_state = outer_init(method.outer_optimizer, task.params)
        self.own_like = host(self.spec.worker_state(task.params, outer_state))
        self.offered = peer.Offered(self.directory)
        self.server, port = peer.serve(self.offered, peer_host, secret)
        advertised = socket.getfqdn() if peer_host in ("0.0.0.0", "::", "") else peer_host
        self.address = f"{advertised}:{port}"
        self.peers: dict[int, str] = {}
        self.clients: dict[str, peer.PeerClient] = {}
        self.options = Elastic()
        self.incarnation: str | None = None
        self.saved = 0
        self.ended: dict | None = None  # the syncer's "done" or "abort" reply
        self.stop = threading.Event()

    def run(self) -> int:
        """Trains its R syncs, then serves its values until every worker has saved them all;
        returns the process's exit code."""
        beat = threading.Thread(target=self.heartbeats, daemon=True)
        try:
            self._join()
            beat.start()
            state = self._restore()
            self.saved = state.sync
            while state.sync < self.task.num_rounds:
                state = self._sync(state)
                self._save(state)
                self.saved = state.sync
            wire.write_file(self.directory / FINAL_FILE, {"theta": wire.leaves(state.own.theta)})
            while self.ended is None:  # partners may still need its values
                self.stop.wait(0.05)
            if self.ended["status"] == "done":  # every worker saved them all: none will ask
                self.offered.prune(self.task.num_rounds)
            self._check_ended()
            raise WorkerExit(0, "the run finished")
        except WorkerExit as end:
            log.info("worker %d: %s", self.worker, end.line)
            return end.code
        finally:
            self.stop.set()
            if beat.is_alive():
                beat.join()
            self.server.stop(grace=1.0).wait()
            for client in self.clients.values():
                client.close()
            self.client.close()

    def _join(self) -> None:
        reply = self.client.call("Join", self._me(address=self.address, incarnation=None))
        if reply.get("status") in ("done", "abort"):
            self.ended = reply
            self._check_ended()
        self.incarnation = reply["incarnation"]
        self.options = Elastic.from_message(reply["options"])
        if self.syncer_timeout is None:
            self.client.syncer_timeout = self.options.syncer_timeout
        self._view(reply)
        log.info("worker %d joined; its peers' values come from them (serving at %s)",
                 self.worker, self.address)  # fmt: skip

    def heartbeats(self) -> None:
        """Until stopped or the run ends: a heartbeat every heartbeat_interval with the syncs
        this worker has saved; the reply updates its peers' addresses and prunes what no
        worker can ask again. A syncer unheard for syncer_timeout ends the run."""
        heard = time.monotonic()
        while not self.stop.wait(self.options.heartbeat_interval):
            me = self._me(saved=self.saved)
            reply = self.client.once("Heartbeat", me, deadline=self.options.heartbeat_interval * 4)
            now = time.monotonic()
            if reply is None:
                if now - heard > self.client.syncer_timeout:
                    why = f"the syncer did not answer for {self.client.syncer_timeout:g} s"
                    self.ended = {"status": "abort", "reason": why}
                    return
                continue
            heard = now
            if reply["status"] == "rejoin":  # a restarted syncer: tell it where we serve
                self._join()
            elif reply["status"] in ("done", "abort"):
                self.ended = reply
                return
            else:
                self._view(reply)

    def _view(self, reply: dict) -> None:
        self.peers = {int(m): address for m, address in reply["peers"].items()}
        self.offered.prune(int(reply["floor"]))

    def _me(self, **fields: Any) -> dict[str, Any]:
        return {"worker": self.worker, "incarnation": self.incarnation, **fields}

    def _check_ended(self) -> None:
        if self.ended is not None:
            raise WorkerExit.of(self.ended)

    def _sync(self, state: Saved) -> Saved:
        """One sync: the inner phase from θ_m, the group's mean, the part's step."""
        sync, m = state.sync, self.worker
        key = None
        if self.task.rng_seed is not None:
            key = inner.worker_key(self.task.rng_seed, jnp.int32(sync), jnp.int32(m))
        started = time.perf_counter()
        batches = self.task.batches(m, sync)
        delta, inner_state, loss = self.phase(state.own.theta, state.inner, batches, key)
        sent = self.send(state.own, delta)
        mean = self._group_mean(sync, jax.tree.map(np.asarray, sent.values))
        own = self.step(state.own, sent, mean, jnp.int32(sync))
        host = functools.partial(jax.tree.map, np.asarray)
        line = {"round": sync, "position": sync, "loss": float(loss),
                "compute_s": time.perf_counter() - started, "time": time.time()}  # fmt: skip
        with open(self.directory / METRICS_FILE, "a") as f:
            f.write(json.dumps(line) + "\n")
        return Saved(sync + 1, host(own), host(inner_state))

    def _group_mean(self, sync: int, values: Any) -> Any:
        """The mean of `values` over this worker's group of `sync`: at each stage, its own
        and its partner's halved sum, the partner's fetched from it."""
        spec, num_workers = self.spec, self.task.num_workers
        masks = np.asarray(self.masks(spec.seed, jnp.int32(sync), num_workers, spec.group_size))
        for stage, mask in enumerate(masks):
            self.offered.put(sync, stage, wire.leaves(values))
            partner = self.worker ^ int(mask)
            raw = self._fetch(partner, sync, stage)
            theirs = wire.tree_like(values, raw, f"worker {partner}'s values of sync {sync}")
            values = jax.tree.map(lambda a, b: (a + b) * a.dtype.type(0.5), values, theirs)
        return values

    def _fetch(self, partner: int, sync: int, stage: int) -> list:
        """Partner's raw leaves of (sync, stage), asked until it has them (restarted, it
        serves them again at the address the syncer then gives)."""
        while True:
            self._check_ended()
            address = self.peers.get(partner)
            if address is not None:
                if address not in self.clients:
                    self.clients[address] = peer.PeerClient(address, self.secret)
                leaves = self.clients[address].fetch(sync, stage, peer.LONG_POLL_S)
                if leaves is not None:
                    return leaves
            self.stop.wait(0.05)

    def _restore(self) -> Saved:
        """The newest intact checkpoint in its folder, or the state before the first sync."""
        for path in sorted(self.directory.glob("gossip-*.state"), reverse=True):
            try:
                saved = wire.read_file(path)
                state = Saved(
                    int(saved["sync"]),
                    wire.tree_like(self.own_like, saved["own"], str(path)),
                    wire.tree_like(self.inner_like, saved["inner"], str(path)),
                )
            except (OSError, ValueError, KeyError) as error:
                log.warning("worker %d: %s can't be read (%s)", self.worker, path, error)
                continue
            log.info("worker %d: resuming after sync %d from %s", self.worker, state.sync, path)
            return state
        return Saved(0, self.own_like, self.inner_like)

    def _save(self, state: Saved) -> None:
        message = {"sync": state.sync, "own": wire.leaves(state.own),
                   "inner": wire.leaves(state.inner)}  # fmt: skip
        wire.write_file(state_path(self.directory, state.sync), message)
        for old in sorted(self.directory.glob("gossip-*.state"))[:-KEEP_STATES]:
            old.unlink()
