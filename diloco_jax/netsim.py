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
"""

import math
from typing import Any

from diloco_jax.hlo import ring_wire_bytes

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
