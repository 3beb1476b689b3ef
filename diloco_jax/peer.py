"""Worker to worker: the exchange of a gossip run on real processes (NoLoCo, GASLoC;
`diloco_jax.gossip_worker`). No syncer is in this path: each worker serves the values it
publishes and fetches its partners' from them.

A worker publishes, for each sync r and butterfly stage j of its group's mean, the tree it
holds at that stage (`Offered.put`): written to its folder first (`values-RRRRRRRR-J.msgpack`,
whole or not at all), so that a partner that restarts from an older checkpoint can still
read it after this worker itself was restarted. A partner asks with `PeerClient.fetch`:

- Epoch -> the serving worker's epoch (16 bytes; every call's MAC covers it)
- Values {sync, stage, timeout} -> {status: "values", leaves: n} then n messages, the
  leaves' raw bytes; or {status: "pending"} when it is not published within `timeout`.

Calls prove the run's secret as the syncer's do (`diloco_jax.auth`); a call that does not is
refused with UNAUTHENTICATED and logged with the caller's address. Replies are not signed:
a worker trusts the addresses the syncer gave it.

`Offered.prune(floor)` drops what no worker can ask again: every worker has saved a state
past sync `floor - 1` (the syncer's heartbeat replies carry the floor).
"""

import re
import threading
from concurrent import futures
from pathlib import Path

import grpc

from diloco_jax import auth, wire
from diloco_jax.rpc import CHANNEL_OPTIONS, CLIENT_OPTIONS, RETRIED, refuse

SERVICE = "diloco_jax.Peer"
_FILE = re.compile(r"values-(\d{8})-(\d+)\.msgpack")
LONG_POLL_S = 5.0  # the longest a Values call waits for what it asks


def values_path(directory: Path, sync: int, stage: int) -> Path:
    return directory / f"values-{sync:08d}-{stage}.msgpack"


class Offered:
    """The values this worker publishes, by (sync, stage): on disk in `directory`, the
    newest also in memory. Safe to call from any thread."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.cond = threading.Condition()
        self.memory: dict[tuple[int, int], list] = {}

    def put(self, sync: int, stage: int, leaves: list) -> None:
        """Publishes `leaves` (host arrays) as (sync, stage)'s, on disk before any partner
        can read them."""
        wire.write_file(values_path(self.directory, sync, stage), {"leaves": leaves})
        with self.cond:
            self.memory[(sync, stage)] = [bytes(wire.raw(x)) for x in leaves]
            self.cond.notify_all()

    def get(self, sync: int, stage: int, timeout: float) -> list | None:
        """(sync, stage)'s raw leaves, waiting up to `timeout` s for them; None if they are
        not published by then."""
        with self.cond:
            found = self.cond.wait_for(lambda: self._read(sync, stage), timeout)
            return found or None

    def _read(self, sync: int, stage: int) -> list | None:
        key = (sync, stage)
        if key not in self.memory:
            path = values_path(self.directory, sync, stage)
            try:  # published by this worker's process before a restart
                leaves = wire.read_file(path)["leaves"]
            except (OSError, ValueError, KeyError):
                return None
            self.memory[key] = [bytes(wire.raw(x)) for x in leaves]
        return self.memory[key]

    def prune(self, floor: int) -> None:
        """Drops every sync below `floor`, in memory and on disk."""
        with self.cond:
            for key in [k for k in self.memory if k[0] < floor]:
                del self.memory[key]
        for path in self.directory.glob("values-*.msgpack"):
            match = _FILE.fullmatch(path.name)
            if match and int(match.group(1)) < floor:
                path.unlink(missing_ok=True)


def serve(offered: Offered, host: str, secret: bytes) -> tuple[grpc.Server, int]:
    """Starts this worker's peer server on host (any free port) for calls that prove
    `secret`. Returns (server, the port it bound)."""
    verifier = auth.Verifier(secret)

    def values(request: bytes, context: grpc.ServicerContext):
        try:
            m = wire.unpack(verifier.call("Values", request))
            sync, stage = int(m["sync"]), int(m["stage"])
            timeout = min(max(float(m["timeout"]), 0.0), LONG_POLL_S)
        except auth.Refused as error:
            refuse(context, error)
        except (ValueError, KeyError, TypeError) as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{type(error).__name__}: {error}")
        leaves = offered.get(sync, stage, timeout)
        if leaves is None:
            yield wire.pack({"status": "pending"})
            return
        yield wire.pack({"status": "values", "leaves": len(leaves)})
        yield from leaves

    handlers = {
        "Epoch": grpc.unary_unary_rpc_method_handler(lambda request, context: verifier.epoch),
        "Values": grpc.unary_stream_rpc_method_handler(values),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=CHANNEL_OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port(f"{host}:0")
    if port == 0:
        raise OSError(f"the worker's peer server could not bind {host}")
    server.start()
    return server, port


class PeerClient:
    """Calls to one partner's peer server at `address` ("host:port")."""

    def __init__(self, address: str, secret: bytes):
        self.address = address
        self.signer = auth.Signer(secret)
        self.epoch: bytes | None = None
        self.refused = False  # the last call was refused (once: a restarted partner's epoch)
        self.channel = grpc.insecure_channel(address, options=CLIENT_OPTIONS)
        self._epoch = self.channel.unary_unary(f"/{SERVICE}/Epoch")
        self._values = self.channel.unary_stream(f"/{SERVICE}/Values")

    def fetch(self, sync: int, stage: int, timeout: float) -> list | None:
        """The partner's raw leaves of (sync, stage); None if it did not answer with them
        (not published yet, or it is down or restarting: ask again)."""
        try:
            if self.epoch is None:
                self.epoch = self._epoch(b"", timeout=5.0)
            message = wire.pack({"sync": sync, "stage": stage, "timeout": timeout})
            request = self.signer.call("Values", message, self.epoch)
            head, *leaves = self._values(request, timeout=timeout + 30.0)
        except grpc.RpcError as error:
            self.epoch = None  # a restarted partner has a new one
            refused = error.code() == grpc.StatusCode.UNAUTHENTICATED
            if (refused and self.refused) or (not refused and error.code() not in RETRIED):
                raise  # refused twice, with the epoch asked afresh: not the run's secret
            self.refused = refused
            return None
        self.refused = False
        reply = wire.unpack(head)
        if reply["status"] != "values":
            return None
        if len(leaves) != int(reply["leaves"]):
            raise ValueError(f"{self.address} sent {len(leaves)} of {reply['leaves']} leaves")
        return leaves

    def close(self) -> None:
        self.channel.close()
