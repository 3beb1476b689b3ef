"""Simulated network time: what a round would cost on a real network, from measured compute.

A worker's communication is costed from its wire bytes (`diloco_jax.comm`: what it sends
under ring algorithms for every collective, each by its kind: all-reduce 2(n-1)/n, all-gather
(n-1), all-to-all and reduce-scatter (n-1)/n x its operand). A round of H inner steps then one
exchange of `wire_bytes` takes

    t_round = H * t_step + latency + 8 * wire_bytes / bandwidth

(bandwidth in bit/s). Synchronous data parallelism is the same with H = 1 and the gradients'
all-reduce. Compute utilization is H * t_step / t_round. This is the model of Charles et al.
2025 (arXiv 2503.09799, Table 6) with the collective's real shape. With the exchange hidden
behind the next round's inner steps (delayed or eager outer updates, `overlap=True`):

    t_round = max(H * t_step, latency + 8 * wire_bytes / bandwidth)

That formula charges one latency per exchange. Measured over a shaped link (benchmarks/
link.py: two processes with gloo CPU collectives, each in a network namespace of its own,
joined by a link of known rate and one-way delay) the rounds took up to 6.4x its figure (a
data-parallel step at 100 Mbit/s, 20 ms; 2.2x a DiLoCo round and 3.7x a SparseLoCo round
at 10 Mbit/s, 50 ms), because a round is many collectives and each waits for the link's
delay several times. `program_seconds` costs the compiled program's collectives
(`diloco_jax.hlo.collectives`) message by message as a transport sends them (`Transport`;
`GLOO_TCP`, what XLA's CPU runtime uses across processes), which predicted every measured
round within 5% (six methods, three links):

* every operand of a combined (variadic) all-reduce / all-gather is its own call, one after
  the other (XLA's CPU thunks loop over the operands);
* a message leaves only once its receiver has announced the matching receive (gloo's TCP
  pairs are rendezvous-based): one round trip, 2 x the one-way delay, before its bytes;
* a ring all-reduce splits its operand into at least 2n segments of at most 1 MiB, runs a
  reduce-scatter then an all-gather phase of n - 1 segments per rank each, two messages in
  flight; a ring all-gather sends its shard in two halves per step, n - 1 steps; XLA's
  all-to-all posts every peer's chunk at once; a collective-permute is one message (a
  reduce-scatter, which no round here uses, is costed as log2 n halving exchanges);
* bytes cross at the link's payload rate: TCP/IP headers (52 bytes a segment) come out of
  every MTU-sized packet.

With `link.delay` the one-way delay (a round trip is 2 x delay), a round then takes

    t_round = t_compute + program_seconds(collectives, link)

or, where the exchange really runs under the next round's inner steps, the max of the two
(`predict_round_seconds(..., overlap=True)`; on XLA's CPU runtime an eager round's exchange
ran in sequence with its inner steps, so the measured rounds are the sum: see
benchmarks/README.md, "link.py").
"""

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

from diloco_jax import hlo
from diloco_jax.comm import ring_wire_bytes

BANDWIDTHS = {"100 Gbit/s": 100e9, "10 Gbit/s": 10e9, "1 Gbit/s": 1e9, "100 Mbit/s": 100e6}
DEFAULT_LATENCY = 1e-3  # seconds per exchange


def comm_seconds(wire_bytes: float, bandwidth: float, latency: float = DEFAULT_LATENCY) -> float:
    """Time to send `wire_bytes` at `bandwidth` bit/s plus one `latency`; 0 when nothing is
    sent (a lone worker)."""
    if wire_bytes <= 0:
        return 0.0
    return latency + 8 * wire_bytes / bandwidth


def allreduce_seconds(
    payload_bytes: float, num_workers: int, bandwidth: float, latency: float = DEFAULT_LATENCY
) -> float:
    """Ring all-reduce time of `payload_bytes` per worker over M workers; 0 when M = 1."""
    return comm_seconds(
        ring_wire_bytes("all-reduce", payload_bytes, num_workers), bandwidth, latency
    )


def round_seconds(
    step_seconds: float,
    steps_per_sync: int,
    wire_bytes: float,
    bandwidth: float,
    latency: float = DEFAULT_LATENCY,
    overlap: bool = False,
) -> float:
    """t_round for `steps_per_sync` (H) steps of `step_seconds` each and the exchange: after
    them, or (`overlap`) running under the next round's steps."""
    compute = steps_per_sync * step_seconds
    comm = comm_seconds(wire_bytes, bandwidth, latency)
    return max(compute, comm) if overlap else compute + comm


def utilization(
    step_seconds: float,
    steps_per_sync: int,
    wire_bytes: float,
    bandwidth: float,
    latency: float = DEFAULT_LATENCY,
    overlap: bool = False,
) -> float:
    """Fraction of the round spent computing: H * t_step / t_round, in (0, 1]."""
    compute = steps_per_sync * step_seconds
    return compute / round_seconds(
        step_seconds, steps_per_sync, wire_bytes, bandwidth, latency, overlap
    )


def bandwidth_for_utilization(
    step_seconds: float,
    steps_per_sync: int,
    wire_bytes: float,
    target: float = 0.9,
    latency: float = DEFAULT_LATENCY,
    overlap: bool = False,
) -> float:
    """The bandwidth (bit/s) at which utilization reaches `target`; inf when latency alone
    already keeps it below the target, 0 when there is nothing to communicate."""
    if wire_bytes <= 0:
        return 0.0
    compute = steps_per_sync * step_seconds
    # Overlapped, the exchange may take up to compute / target; else the rest of the round.
    budget = (compute / target if overlap else compute * (1 / target - 1)) - latency
    if budget <= 0:
        return math.inf
    return 8 * wire_bytes / budget


def network_table(
    step_seconds: float,
    runs: dict[str, tuple],
    total_steps: int,
    latency: float = DEFAULT_LATENCY,
) -> dict[str, Any]:
    """For each run (name -> (steps between syncs, wire bytes a worker sends per sync[,
    overlap])), the simulated wall time of `total_steps` and the compute utilization at each
    of BANDWIDTHS, and the bandwidth for 90%."""
    table: dict[str, Any] = {"step_seconds": step_seconds, "latency_seconds": latency, "runs": {}}
    for name, (steps_per_sync, wire_bytes, *rest) in runs.items():
        overlap = bool(rest and rest[0])
        rounds = total_steps / steps_per_sync
        row = {
            "steps_per_sync": steps_per_sync,
            "wire_bytes_per_sync": wire_bytes,
            "overlap": overlap,
            "bandwidth_for_90pct_bit_s": bandwidth_for_utilization(
                step_seconds, steps_per_sync, wire_bytes, 0.9, latency, overlap
            ),
        }
        for label, bw in BANDWIDTHS.items():
            t = round_seconds(step_seconds, steps_per_sync, wire_bytes, bw, latency, overlap)
            row[label] = {
                "wall_seconds": rounds * t,
                "utilization": steps_per_sync * step_seconds / t,
            }
        table["runs"][name] = row
    return table


def format_bandwidth(bits_per_second: float) -> str:
    if math.isinf(bits_per_second):
        return "unreachable"
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:.3g} {unit}"
    return f"{bits_per_second:.3g} bit/s"


# --------------------------------------------------------------------------------------
# Collectives costed message by message (the model benchmarks/link.py checks on packets).

TCP_IP_HEADER_BYTES = 52  # IPv4 (20) + TCP (20) + timestamps option (12), each segment


@dataclasses.dataclass(frozen=True)
class Link:
    """One worker's link: `rate` bit/s of IP packets (headers included) each way, `delay`
    seconds one way (a round trip is 2 x delay), packets of at most `mtu` bytes."""

    rate: float
    delay: float
    mtu: int = 1500

    @property
    def payload_rate(self) -> float:
        """bit/s of TCP payload: each packet's TCP/IP headers take their share of the rate."""
        return self.rate * (self.mtu - TCP_IP_HEADER_BYTES) / self.mtu


@dataclasses.dataclass(frozen=True)
class Transport:
    """How a collectives library turns a collective into messages.

    rendezvous: a message leaves only once the receiver has announced the matching receive
      (one round trip before the bytes); in_flight: messages a ring keeps outstanding;
      max_segment_bytes: the largest piece of an all-reduce operand sent as one message.
    """

    name: str
    rendezvous: bool = True
    in_flight: int = 2
    max_segment_bytes: int = 1 << 20


GLOO_TCP = Transport("gloo-tcp")


def messages_seconds(count: int, message_bytes: float, link: Link, transport: Transport) -> float:
    """Seconds until the last of `count` back-to-back messages of `message_bytes` arrives.

    Message j may leave once its receiver's ready notice, sent when message j - in_flight
    arrived, has crossed the link (rendezvous), and once message j - 1 is on the wire:
    arrival_j = max(arrival_{j-k} + 2 delay + s, arrival_{j-1} + s), s = its serialization
    time, with the first k ready notices sent at time 0. Without rendezvous a message only
    needs the wire: delay + count * s.
    """
    if count <= 0:
        return 0.0
    serialize = 8 * message_bytes / link.payload_rate
    if not transport.rendezvous:
        return link.delay + count * serialize
    k = transport.in_flight
    arrivals = [0.0] * k
    for _ in range(count):
        arrivals.append(max(arrivals[-k] + 2 * link.delay, arrivals[-1]) + serialize)
    return arrivals[-1]


def collective_seconds(
    op: str, operand_bytes: float, n: int, link: Link, transport: Transport = GLOO_TCP
) -> float:
    """Seconds for one call of collective `op` over n ranks with `operand_bytes` per rank
    (one operand; the local shard for all-gather), as `transport`'s algorithms send it."""
    if n <= 1 or operand_bytes <= 0:
        return 0.0
    if op == "all-reduce":  # ring: reduce-scatter, then all-gather, of 2n+ segments
        segments = max(math.ceil(operand_bytes / transport.max_segment_bytes), 2 * n)
        segments = math.ceil(segments / n) * n
        per_phase = segments - segments // n
        return 2 * messages_seconds(per_phase, operand_bytes / segments, link, transport)
    if op == "all-gather":  # ring: n - 1 steps, the shard in two halves each
        return messages_seconds(2 * (n - 1), operand_bytes / 2, link, transport)
    if op == "all-to-all":  # every peer's chunk posted at once: one wait, n - 1 chunks
        chunk = operand_bytes / n
        return messages_seconds(1, chunk, link, transport) + (n - 2) * 8 * chunk / (
            link.payload_rate
        )
    if op == "collective-permute":
        return messages_seconds(1, operand_bytes, link, transport)
    if op == "reduce-scatter":  # recursive halving: log2(n) exchanges of halving size
        steps = math.ceil(math.log2(n))
        size = ring_wire_bytes(op, operand_bytes, n) / steps
        return steps * messages_seconds(1, size, link, transport)
    raise ValueError(f"no message model for collective {op!r}")


def operand_sizes(c: "hlo.Collective") -> list[int]:
    """Bytes of each operand of a collective (the same widths `hlo` counts with)."""
    return [
        math.ceil(math.prod(shape) * hlo.dtype_bits(dtype) / 8)
        for dtype, shape in zip(c.operand_dtypes, c.operand_shapes, strict=True)
    ]


def program_seconds(
    collectives: Iterable["hlo.Collective"],
    link: Link,
    num_devices: int | None = None,
    transport: Transport = GLOO_TCP,
) -> float:
    """Seconds a compiled program spends in its collectives (`hlo.collectives(compiled)`),
    one after another: each operand of a combined all-reduce / all-gather its own call, an
    all-to-all's operands (one per peer) one call. A collective printed without replica
    groups spans `num_devices`. Of a conditional's branches only the slowest counts (one
    runs). In-loop collectives raise (their trip count is the caller's)."""

    def seconds(c: "hlo.Collective") -> float:
        n = hlo.participants(c, num_devices)
        sizes = [c.operand_bytes] if c.op == "all-to-all" else operand_sizes(c)
        return sum(collective_seconds(c.op, size, n, link, transport) for size in sizes)

    return hlo.one_path_total(collectives, seconds)


def predict_round_seconds(
    compute_seconds: float,
    collectives: Iterable["hlo.Collective"],
    link: Link,
    num_devices: int | None = None,
    overlap: bool = False,
    transport: Transport = GLOO_TCP,
) -> float:
    """A round's seconds on `link`: its compute (measured without shaping) plus its
    collectives (`program_seconds`), or with `overlap` the larger of the two."""
    comm = program_seconds(collectives, link, num_devices, transport)
    return max(compute_seconds, comm) if overlap else compute_seconds + comm
