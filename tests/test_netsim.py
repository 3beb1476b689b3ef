"""The simulated network model against hand arithmetic."""

import math

import pytest

from diloco_jax import comm, netsim


def test_allreduce_and_round_time_by_hand():
    # 4 workers, 1e6 bytes, 1 Gbit/s, 1 ms latency: 2 * 3/4 * 8e6 bits / 1e9 = 12 ms + 1 ms.
    assert netsim.allreduce_seconds(1e6, 4, 1e9, 1e-3) == pytest.approx(0.013)
    assert netsim.allreduce_seconds(1e6, 1, 1e9, 1e-3) == 0.0
    # H = 10 steps of 2 ms = 20 ms compute; 1.5e6 wire bytes = 12 ms + 1 ms; round 33 ms.
    assert netsim.round_seconds(2e-3, 10, 1.5e6, 1e9, 1e-3) == pytest.approx(0.033)
    assert netsim.utilization(2e-3, 10, 1.5e6, 1e9, 1e-3) == pytest.approx(20 / 33)
    assert netsim.comm_seconds(0, 1e9) == 0.0


def test_bandwidth_for_90_percent_by_hand():
    # Budget for comm at 90%: 20 ms * (1/0.9 - 1) - 1 ms = 1.2222 ms; bits 1.2e7 -> 9.82 Gbit/s.
    bw = netsim.bandwidth_for_utilization(2e-3, 10, 1.5e6, 0.9, 1e-3)
    assert bw == pytest.approx(1.2e7 / (0.02 / 9 - 1e-3))
    assert netsim.utilization(2e-3, 10, 1.5e6, bw, 1e-3) == pytest.approx(0.9)
    # With H = 1 the 1 ms latency alone exceeds the 0.22 ms budget: unreachable.
    assert math.isinf(netsim.bandwidth_for_utilization(2e-3, 1, 1.5e6, 0.9, 1e-3))
    assert netsim.bandwidth_for_utilization(2e-3, 1, 0.0) == 0.0


def test_network_table_and_formatting():
    table = netsim.network_table(2e-3, {"diloco": (10, 1.5e6), "sync": (1, 1.5e6)}, 100)
    diloco, sync = table["runs"]["diloco"], table["runs"]["sync"]
    assert diloco["1 Gbit/s"]["wall_seconds"] == pytest.approx(10 * 0.033)
    assert sync["1 Gbit/s"]["wall_seconds"] == pytest.approx(100 * (0.002 + 0.013))
    assert diloco["100 Mbit/s"]["utilization"] > sync["100 Mbit/s"]["utilization"]
    assert netsim.format_bandwidth(9.82e9) == "9.82 Gbit/s"
    assert netsim.format_bandwidth(math.inf) == "unreachable"


def test_each_collective_is_costed_by_its_kind():
    """A gathered payload costs (M-1) x, a two-stage one 2(M-1)/M x its padded rows: at
    M = 8 an int8 gather of 1 MiB of float32 sends 3.5x an int8 two-stage all-reduce."""
    params = {"w": __import__("numpy").zeros((512, 512), "float32")}
    gather = comm.round_wire_bytes(params, "int8,exchange=gather", 8)
    two_stage = comm.round_wire_bytes(params, "int8", 8)
    loss = 2 * 7 / 8 * 4
    rows = 512 * 512 // 32 * (32 + 4)
    assert gather - loss == pytest.approx(7 * rows)
    assert two_stage - loss == pytest.approx(2 * 7 / 8 * rows)
    assert netsim.comm_seconds(gather, 1e9) > 3 * netsim.comm_seconds(two_stage, 1e9)


def test_overlapped_exchange_costs_the_max_not_the_sum():
    # 20 ms of compute, a 13 ms exchange: 33 ms in sequence, 20 ms overlapped; a 50 ms
    # exchange overlapped still stalls the round to 50 ms.
    assert netsim.round_seconds(2e-3, 10, 1.5e6, 1e9, 1e-3, overlap=True) == pytest.approx(0.02)
    assert netsim.round_seconds(2e-3, 10, 6.125e6, 1e9, 1e-3, overlap=True) == pytest.approx(0.05)
    assert netsim.utilization(2e-3, 10, 1.5e6, 1e9, 1e-3, overlap=True) == 1.0
    # 90% overlapped: the exchange may take 20 / 0.9 ms (latency 1 ms included).
    bw = netsim.bandwidth_for_utilization(2e-3, 10, 1.5e6, 0.9, 1e-3, overlap=True)
    assert bw == pytest.approx(1.2e7 / (0.02 / 0.9 - 1e-3))
    assert netsim.utilization(2e-3, 10, 1.5e6, bw, 1e-3, overlap=True) == pytest.approx(0.9)
    table = netsim.network_table(2e-3, {"eager": (10, 6.125e6, True)}, 100)
    assert table["runs"]["eager"]["1 Gbit/s"]["utilization"] == pytest.approx(0.4)
