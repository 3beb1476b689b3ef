"""The syncer's gRPC service and its client: five calls, each message a packed dict
(`diloco_jax.wire`), no generated code.

- Join {worker, incarnation?, address?, start?, from_checkpoint?} -> {incarnation, options}
- Heartbeat {worker, incarnation, saved?} -> {status}
  (address and saved: a gossip run's, `diloco_jax.gossip_syncer`; start and
  from_checkpoint: a Decoupled DiLoCo learner's, `diloco_jax.decoupled_syncer`)
- Next {worker, incarnation, after, timeout} -> a stream: the worker's next round
  (`Syncer.next_round`) with {parts: {name: [pieces of each leaf]}}, then those pieces: the
  raw bytes of θ's leaves (and the outer state's, a reply's: PARTS)
- Epoch -> the syncer's epoch (16 bytes, drawn at its start; every call's MAC covers it)
- Push: a stream of {worker, incarnation, serial, loss, compute_s, steps_s, leaves: n,
  pieces: [pieces of each leaf]} then the pieces of the n delta leaves (their raw bytes) ->
  {status}. A stream that ends before its last piece (its sender died inside the push) is
  dropped whole. A Decoupled DiLoCo learner's push also carries PUSH_EXTRA
  (`diloco_jax.decoupled_syncer`).

A leaf travels as its raw bytes in pieces of at most PIECE_BYTES (gRPC moves many mid-sized
messages about three times as fast as one large one), joined again by the receiver, which
reads them as the leaves of the tree it already has (`wire.tree_like`). θ's pieces are made
once per θ for every worker.

Every message the client sends proves the run's secret (`diloco_jax.auth`); the syncer
refuses one that does not with UNAUTHENTICATED, logging the caller's address, before it reads
the message.

The client retries a call the syncer could not answer (it is down or restarting) until
`syncer_timeout` has passed, then raises `SyncerLost`.
"""

import itertools
import logging
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc

from diloco_jax import auth, wire

log = logging.getLogger("diloco_jax.syncer")
SERVICE = "diloco_jax.Syncer"
# A leaf's bytes travel in pieces of at most this many (`pieces`).
PIECE_BYTES = 4 << 20
# No size cap on a message beyond gRPC's own 2 GB (a packed header, a gossip exchange's values).
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
# A worker reconnects to a restarted syncer within a second (gRPC's default backoff grows to
# two minutes, longer than a heartbeat timeout).
CLIENT_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# A worker never cancels its own calls, so CANCELLED is the syncer's side ending the call (a
# SIGKILLed or stopping syncer reads so at times, as UNAVAILABLE at others): retried alike.
RETRIED = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
)


# What a Next reply streams after its header, in this order: θ, the outer state, a sync's
# reply (`diloco_jax.elastic_merge`), each a list of raw leaves where present.
PARTS = ("theta", "outer", "reply")


class SyncerLost(ConnectionError):
    """The syncer did not answer for longer than the worker's syncer_timeout."""


def serve(
    syncer: Any, port: int, secret: bytes, host: str = "127.0.0.1"
) -> tuple[grpc.Server, int]:
    """Starts the syncer's gRPC server on host:port (0: any free port), taking only calls that
    prove `secret`. Returns (server, the port it bound)."""
    service = _Service(syncer, auth.Verifier(secret))
    handlers = {
        "Join": service.unary(
            "Join",
            lambda m: syncer.join(m["worker"], m.get("incarnation"), **_given(m, *JOIN_EXTRA)),
        ),
        "Heartbeat": service.unary(
            "Heartbeat",
            lambda m: syncer.heartbeat(m["worker"], m["incarnation"], **_given(m, "saved")),
        ),
        "Next": grpc.unary_stream_rpc_method_handler(service.next_round),
        # Not a secret: the calls' MACs cover it, so none made for an earlier syncer passes.
        "Epoch": grpc.unary_unary_rpc_method_handler(
            lambda request, context: service.verifier.epoch
        ),
        "Push": grpc.stream_unary_rpc_method_handler(service.push),
    }
    # A thread per call in flight: each worker's Next and heartbeat, plus pushes.
    pool = futures.ThreadPoolExecutor(max_workers=4 * syncer.task.num_workers + 8)
    server = grpc.server(pool, options=CHANNEL_OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"the syncer could not bind {host}:{port}")
    server.start()
    return server, bound


# The optional fields of a Join (a gossip worker's peer address; a Decoupled DiLoCo learner
# process's first step and whether its inner state is its checkpoint's) and of a push (a
# Decoupled DiLoCo learner's c_steps, the merges it applied, where it took Θ whole, where its
# trajectory began).
JOIN_EXTRA = ("address", "start", "from_checkpoint")
PUSH_EXTRA = ("c_steps", "applied", "resynced", "origin", "timed_steps")


def pieces(leaf: Any) -> list[memoryview]:
    """A leaf's raw bytes in pieces of at most PIECE_BYTES, in order (views: no copy)."""
    data = wire.raw(leaf)
    return [data[i : i + PIECE_BYTES] for i in range(0, len(data), PIECE_BYTES)]


def joined(leaf_pieces: list) -> bytes | memoryview:
    """The raw bytes of a leaf sent as `leaf_pieces` (one piece as it is, more copied once
    into one buffer)."""
    return leaf_pieces[0] if len(leaf_pieces) == 1 else b"".join(leaf_pieces)


def piece_counts(value: Any, what: str) -> list[int]:
    """A message's piece counts (a list of integers >= 0); ValueError naming `what`."""
    if not isinstance(value, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value
    ):
        raise ValueError(f"{what} must be a list of piece counts, got {value!r}")
    return value


def _given(message: dict, *names: str) -> dict:
    """The optional fields among `names` that a call's message carries."""
    return {name: message[name] for name in names if name in message}


def refuse(context: grpc.ServicerContext, error: auth.Refused) -> None:
    """Ends a call that does not prove the run's secret, logging the caller's address."""
    log.warning("refused %s: %s", context.peer(), error)
    context.abort(grpc.StatusCode.UNAUTHENTICATED, str(error))


class _Service:
    """The syncer's side of each call: the message's proof checked (`verifier`) before it is
    read, then handed to `syncer`."""

    def __init__(self, syncer: Any, verifier: auth.Verifier):
        self.syncer, self.verifier = syncer, verifier
        # part -> the ids of its leaves last sent, them (held: their ids stay theirs), raw bytes
        self.sent: dict[str, tuple] = {}

    def unary(self, name: str, call: Callable[[dict], dict]) -> grpc.RpcMethodHandler:
        def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
            try:
                message = wire.unpack(self.verifier.call(name, request))
            except auth.Refused as error:
                refuse(context, error)
            try:
                return wire.pack(call(message))
            except (ValueError, KeyError, TypeError) as error:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{type(error).__name__}: {error}")

        return grpc.unary_unary_rpc_method_handler(handle)

    def push(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        try:
            head = next(requests)
            header = wire.unpack(self.verifier.call("Push", head))
            counts = piece_counts(header["pieces"], "a push's pieces")
            if len(counts) != int(header["leaves"]):
                raise ValueError(f"{len(counts)} piece counts for {header['leaves']} leaves")
            frames = enumerate(requests)  # each piece's MAC covers its place in the push
            leaves = []  # raw bytes, read as θ's leaves by the syncer
            for count in counts:
                got = [self.verifier.part(head, i, f) for i, f in itertools.islice(frames, count)]
                if len(got) != count:  # the sender went away inside its push
                    context.abort(grpc.StatusCode.CANCELLED,
                                  f"push ended after {len(leaves)} whole leaves")  # fmt: skip
                leaves.append(joined(got))
        except auth.Refused as error:
            refuse(context, error)
        except (StopIteration, ValueError, KeyError, TypeError) as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed push: {error}")
        try:
            reply = self.syncer.push(
                header["worker"], header["incarnation"], int(header["serial"]), leaves,
                float(header["loss"]), float(header.get("compute_s", 0.0)),
                float(header.get("steps_s", 0.0)), bool(header.get("finite", True)),
                **_given(header, *PUSH_EXTRA),
            )  # fmt: skip
        except (ValueError, KeyError, TypeError) as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{type(error).__name__}: {error}")
        if reply["status"] in ("rejoin", "refused"):  # not merged: say who sent it
            why = reply.get("reason", "an incarnation the syncer does not hold (told to rejoin)")
            log.warning("push from %s as worker %s not merged: %s", context.peer(),
                        header["worker"], why)  # fmt: skip
        return wire.pack(reply)

    def raw_part(self, name: str, arrays: list) -> list[list[bytes]]:
        """A part's leaves (θ, the outer state, a sync's reply) as pieces of raw bytes, made
        once per value for every worker that asks."""
        ids, _, raw = self.sent.get(name, ((), [], []))
        if ids != tuple(map(id, arrays)):
            raw = [[bytes(piece) for piece in pieces(x)] for x in arrays]
            self.sent[name] = (tuple(map(id, arrays)), arrays, raw)
        return raw

    def next_round(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        try:
            m = wire.unpack(self.verifier.call("Next", request))
        except auth.Refused as error:
            refuse(context, error)
        try:
            timeout = min(float(m["timeout"]), 10.0)
            reply = self.syncer.next_round(m["worker"], m["incarnation"], int(m["after"]),
                                           timeout, int(m.get("held", -1)))  # fmt: skip
        except (ValueError, KeyError, TypeError) as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{type(error).__name__}: {error}")
        parts = {name: self.raw_part(name, reply.pop(name)) for name in PARTS if name in reply}
        counts = {name: [len(leaf) for leaf in raw] for name, raw in parts.items()}
        yield wire.pack({**reply, "parts": counts})
        for raw in parts.values():
            for leaf in raw:
                yield from leaf  # gRPC's own copy is the only one made for this worker


class SyncerClient:
    """A worker's calls to the syncer at `address` ("host:port")."""

    def __init__(self, address: str, secret: bytes, syncer_timeout: float = 60.0):
        self.address, self.syncer_timeout = address, syncer_timeout
        self.signer = auth.Signer(secret)
        self.epoch: bytes | None = None  # the syncer's, asked before the first call
        # The run's end ("done" / "abort" reply) once any call heard it: every later call
        # returns it at once, without reaching for a syncer that exits once its members heard
        # the end (a call to a stopped server of this very process once hung in grpc).
        self.ended: dict[str, Any] | None = None
        self.channel = grpc.insecure_channel(address, options=CLIENT_OPTIONS)
        self._unary = {
            name: self.channel.unary_unary(f"/{SERVICE}/{name}")
            for name in ("Join", "Heartbeat", "Epoch")
        }
        self._next = self.channel.unary_stream(f"/{SERVICE}/Next")
        self._push = self.channel.stream_unary(f"/{SERVICE}/Push")

    def call(self, name: str, message: dict[str, Any], deadline: float = 15.0) -> dict:
        """One call, retried while the syncer is unreachable (at most syncer_timeout). Next's
        reply holds its PARTS (where sent) as lists of raw leaf bytes."""
        return self._retried(name, lambda: self._send(name, message, deadline))

    def once(self, name: str, message: dict[str, Any], deadline: float) -> dict | None:
        """One call, not retried: its reply (the run's end, once heard), or None if the
        syncer did not answer."""
        if self.ended is not None:
            return self.ended
        try:
            return self._heard(self._send(name, message, deadline))
        except grpc.RpcError:
            self.epoch = None  # the syncer may have restarted: ask its epoch again
            return None

    def push(self, header: dict[str, Any], leaves: list, pause: Callable[[int], None]) -> dict:
        """Streams a delta (header, then each leaf's pieces; `pause(i)` runs before leaf i
        is sent, for fault injection)."""
        split = [pieces(leaf) for leaf in leaves]
        header = {**header, "leaves": len(leaves), "pieces": [len(p) for p in split]}

        def messages(epoch: bytes):  # signed afresh for each try (a new nonce: no replay)
            head = self.signer.call("Push", wire.pack(header), epoch)
            yield head
            index = itertools.count()
            for i, leaf in enumerate(split):
                pause(i)
                for piece in leaf:
                    yield self.signer.part(head, next(index), piece)

        def send():  # the epoch asked before the stream: a failure is the call's, retried
            return wire.unpack(self._push(messages(self._epoch(15.0)), timeout=120.0))

        return self._retried("Push", send)

    def _epoch(self, deadline: float) -> bytes:
        if self.epoch is None:
            self.epoch = self._unary["Epoch"](b"", timeout=deadline)
        return self.epoch

    def _send(self, name: str, message: dict[str, Any], deadline: float) -> dict:
        request = self.signer.call(name, wire.pack(message), self._epoch(deadline))
        if name != "Next":
            return wire.unpack(self._unary[name](request, timeout=deadline))
        head, *frames = self._next(request, timeout=deadline)  # the reply, then its parts
        reply = wire.unpack(head)
        counts = {name: piece_counts(c, f"Next's {name}") for name, c in reply.pop("parts").items()}
        if sum(map(sum, counts.values())) != len(frames):
            raise ValueError(f"the syncer's Next sent {len(frames)} pieces of {counts}")
        at = 0
        for name in PARTS:
            if name in counts:
                reply[name] = []
                for count in counts[name]:
                    reply[name].append(joined(frames[at : at + count]))
                    at += count
        return reply

    def _retried(self, name: str, send: Callable[[], dict]) -> dict:
        if self.ended is not None:
            return self.ended
        start, wait, refused = time.monotonic(), 0.05, False
        while True:
            try:
                return self._heard(send())
            except grpc.RpcError as error:
                self.epoch = None  # a restarted syncer has a new one
                if error.code() == grpc.StatusCode.UNAUTHENTICATED and not refused:
                    refused = True  # made for the syncer before a restart: once more, anew
                    continue
                if error.code() not in RETRIED:
                    raise
                if self.ended is not None:
                    return self.ended
                if time.monotonic() - start > self.syncer_timeout:
                    raise SyncerLost(
                        f"the syncer at {self.address} did not answer {name} for "
                        f"{self.syncer_timeout:g} s ({error.code().name}: {error.details()})"
                    ) from error
                time.sleep(wait)
                wait = min(wait * 2, 1.0)

    def _heard(self, reply: dict[str, Any]) -> dict[str, Any]:
        if reply.get("status") in ("done", "abort"):
            self.ended = reply
        return reply

    def close(self) -> None:
        self.channel.close()
