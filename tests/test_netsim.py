"""The simulated network model against hand arithmetic."""

import math

import pytest

from diloco_jax import netsim


def test_allreduce_and_round_time_by_hand():
    # 4 workers, 1e6 bytes, 1 Gbit/s, 1 ms latency: 2 * 3/4 * 8e6 bits / 1e9 = 12 ms + 1 ms.
    assert netsim.allreduce_seconds(1e6, 4, 1e9, 1e-3) == pytest.approx(0.013)
    assert netsim.allreduce_seconds(1e6, 1, 1e9, 1e-3) == 0.0
    # H = 10 steps of 2 ms = 20 ms compute; round 33 ms; utilization 20 / 33.
    assert netsim.round_seconds(2e-3, 10, 1e6, 4, 1e9, 1e-3) == pytest.approx(0.033)
    assert netsim.utilization(2e-3, 10, 1e6, 4, 1e9, 1e-3) == pytest.approx(20 / 33)


def test_bandwidth_for_90_percent_by_hand():
    # Budget for comm at 90%: 20 ms * (1/0.9 - 1) - 1 ms = 1.2222 ms; bits 1.2e7 -> 9.82 Gbit/s.
    bw = netsim.bandwidth_for_utilization(2e-3, 10, 1e6, 4, 0.9, 1e-3)
    assert bw == pytest.approx(1.2e7 / (0.02 / 9 - 1e-3))
    assert netsim.utilization(2e-3, 10, 1e6, 4, bw, 1e-3) == pytest.approx(0.9)
    # With H = 1 the 1 ms latency alone exceeds the 0.22 ms budget: unreachable.
    assert math.isinf(netsim.bandwidth_for_utilization(2e-3, 1, 1e6, 4, 0.9, 1e-3))
    assert netsim.bandwidth_for_utilization(2e-3, 1, 1e6, 1) == 0.0


def test_network_table_and_formatting():
    table = netsim.network_table(2e-3, 1e6, 4, {"diloco": 10, "sync": 1}, total_steps=100)
    diloco, sync = table["runs"]["diloco"], table["runs"]["sync"]
    assert diloco["1 Gbit/s"]["wall_seconds"] == pytest.approx(10 * 0.033)
    assert sync["1 Gbit/s"]["wall_seconds"] == pytest.approx(100 * (0.002 + 0.013))
    assert diloco["100 Mbit/s"]["utilization"] > sync["100 Mbit/s"]["utilization"]
    assert netsim.format_bandwidth(9.82e9) == "9.82 Gbit/s"
    assert netsim.format_bandwidth(math.inf) == "unreachable"
