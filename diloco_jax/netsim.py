"""Simulated network time: what a round would cost on a real network, from measured compute.

A round of H inner steps followed by one ring all-reduce of `payload_bytes` per worker takes

    t_round = H * t_step + latency + 2 (M - 1) / M * 8 * payload_bytes / bandwidth

(bandwidth in bit/s). Synchronous data parallelism is the same with H = 1 and the gradients as
payload. Compute utilization is H * t_step / t_round. This is the model of Charles et al. 2025
(arXiv 2503.09799, Table 6); it ignores overlap of compute and communication.
"""

import math
from typing import Any

BANDWIDTHS = {"100 Gbit/s": 100e9, "10 Gbit/s": 10e9, "1 Gbit/s": 1e9, "100 Mbit/s": 100e6}
DEFAULT_LATENCY = 1e-3  # seconds per all-reduce


def allreduce_seconds(
    payload_bytes: float, num_workers: int, bandwidth: float, latency: float = DEFAULT_LATENCY
) -> float:
    """Ring all-reduce time of `payload_bytes` per worker over M workers; 0 when M = 1."""
    if num_workers <= 1:
        return 0.0
    return latency + 2 * (num_workers - 1) / num_workers * 8 * payload_bytes / bandwidth


def round_seconds(
    step_seconds: float,
    steps_per_sync: int,
    payload_bytes: float,
    num_workers: int,
    bandwidth: float,
    latency: float = DEFAULT_LATENCY,
) -> float:
    """t_round for `steps_per_sync` (H) steps of `step_seconds` each, then one all-reduce."""
    comm = allreduce_seconds(payload_bytes, num_workers, bandwidth, latency)
    return steps_per_sync * step_seconds + comm


def utilization(
    step_seconds: float,
    steps_per_sync: int,
    payload_bytes: float,
    num_workers: int,
    bandwidth: float,
    latency: float = DEFAULT_LATENCY,
) -> float:
    """Fraction of the round spent computing: H * t_step / t_round, in (0, 1]."""
    compute = steps_per_sync * step_seconds
    return compute / round_seconds(
        step_seconds, steps_per_sync, payload_bytes, num_workers, bandwidth, latency
    )


def bandwidth_for_utilization(
    step_seconds: float,
    steps_per_sync: int,
    payload_bytes: float,
    num_workers: int,
    target: float = 0.9,
    latency: float = DEFAULT_LATENCY,
) -> float:
    """The bandwidth (bit/s) at which utilization reaches `target`; inf when latency alone
    already keeps it below the target, 0 when there is nothing to communicate."""
    if num_workers <= 1:
        return 0.0
    budget = steps_per_sync * step_seconds * (1 / target - 1) - latency
    if budget <= 0:
        return math.inf
    return 2 * (num_workers - 1) / num_workers * 8 * payload_bytes / budget


def network_table(
    step_seconds: float,
    payload_bytes: float,
    num_workers: int,
    runs: dict[str, int],
    total_steps: int,
    latency: float = DEFAULT_LATENCY,
) -> dict[str, Any]:
    """For each run (name -> steps between syncs), the simulated wall time of `total_steps`
    and the compute utilization at each of BANDWIDTHS, and the bandwidth for 90%."""
    table: dict[str, Any] = {
        "step_seconds": step_seconds,
        "payload_bytes": payload_bytes,
        "num_workers": num_workers,
        "latency_seconds": latency,
        "runs": {},
    }
    for name, steps_per_sync in runs.items():
        rounds = total_steps / steps_per_sync
        row = {
            "steps_per_sync": steps_per_sync,
            "bandwidth_for_90pct_bit_s": bandwidth_for_utilization(
                step_seconds, steps_per_sync, payload_bytes, num_workers, 0.9, latency
            ),
        }
        for label, bw in BANDWIDTHS.items():
            t = round_seconds(step_seconds, steps_per_sync, payload_bytes, num_workers, bw, latency)
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
