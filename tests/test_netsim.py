"""The simulated network model against hand arithmetic."""

import math

import pytest

from diloco_jax import comm, netsim
from diloco_jax.hlo import Collective


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


# --------------------------------------------------------------------------------------
# Collectives costed message by message (checked on packets by benchmarks/link.py).

# 10 Mbit/s, 20 ms one way, Ethernet MTU: 1448 payload bytes a packet, so 1448 bytes of
# payload take 1500 * 8 / 1e7 = 1.2 ms on the wire.
LINK = netsim.Link(rate=10e6, delay=0.02, mtu=1500)
PACKET = 1448


def test_payload_rate_takes_the_headers_out():
    assert LINK.payload_rate == pytest.approx(10e6 * 1448 / 1500)
    assert netsim.Link(1e9, 0.0).payload_rate == pytest.approx(1e9 * 1448 / 1500)


def test_messages_wait_a_round_trip_then_pipeline_two():
    gloo = netsim.GLOO_TCP
    # One message of 10 packets (12 ms): its ready notice over (20 ms), its bytes back
    # (20 ms + 12 ms).
    assert netsim.messages_seconds(1, 10 * PACKET, LINK, gloo) == pytest.approx(0.052)
    # Two in flight: the second follows the first on the wire: 52 + 12 ms.
    assert netsim.messages_seconds(2, 10 * PACKET, LINK, gloo) == pytest.approx(0.064)
    # The third's ready notice leaves when the first arrives (52 ms): 52 + 40 + 12 ms.
    assert netsim.messages_seconds(3, 10 * PACKET, LINK, gloo) == pytest.approx(0.104)
    # 60 ms messages keep the wire busy: only the first round trip shows, 40 + 3 x 60 ms.
    assert netsim.messages_seconds(3, 50 * PACKET, LINK, gloo) == pytest.approx(0.22)
    assert netsim.messages_seconds(0, PACKET, LINK, gloo) == 0.0
    # Without the rendezvous a message needs one one-way delay: 20 + 3 x 12 ms.
    eager_sender = netsim.Transport("push", rendezvous=False)
    assert netsim.messages_seconds(3, 10 * PACKET, LINK, eager_sender) == pytest.approx(0.056)


def test_each_collective_kind_by_hand():
    # All-reduce at n = 2 of 40 packets: 4 segments of 10, reduce-scatter then all-gather of
    # 2 messages each: 2 x 64 ms = 4 one-way delays + the 48 ms of bytes.
    assert netsim.collective_seconds("all-reduce", 40 * PACKET, 2, LINK) == pytest.approx(0.128)
    # At n = 4: 8 segments of 5 packets (6 ms), 6 messages a phase:
    # 46, 52, 92, 98, 138, 144 ms; twice.
    assert netsim.collective_seconds("all-reduce", 40 * PACKET, 4, LINK) == pytest.approx(0.288)
    # Over 1 MiB segments: 3 MiB at n = 2 is 6 segments, 3 messages a phase.
    big = 3 << 20
    s = 8 * (big / 6) / LINK.payload_rate
    assert netsim.collective_seconds("all-reduce", big, 2, LINK) == pytest.approx(
        2 * (0.04 + 3 * s)
    )
    # All-gather at n = 2 of a 20-packet shard: two halves of 10 packets: 64 ms.
    assert netsim.collective_seconds("all-gather", 20 * PACKET, 2, LINK) == pytest.approx(0.064)
    # All-to-all at n = 2 of 20 packets: the 10-packet chunk for the peer, one wait: 52 ms;
    # at n = 4 of 40 packets, three 10-packet chunks at once: 52 + 2 x 12 ms.
    assert netsim.collective_seconds("all-to-all", 20 * PACKET, 2, LINK) == pytest.approx(0.052)
    assert netsim.collective_seconds("all-to-all", 40 * PACKET, 4, LINK) == pytest.approx(0.076)
    assert netsim.collective_seconds("collective-permute", 10 * PACKET, 2, LINK) == (
        pytest.approx(0.052)
    )
    assert netsim.collective_seconds("all-reduce", 40 * PACKET, 1, LINK) == 0.0
    with pytest.raises(ValueError, match="no message model"):
        netsim.collective_seconds("send", 1, 2, LINK)


def _collective(op, shapes, groups=((0, 1),), in_loop=False):
    """A float32 collective as `hlo.collectives` reads it from a compiled program."""
    nbytes = sum(4 * math.prod(s) for s in shapes)
    dtypes = ("f32",) * len(shapes)
    return Collective(op, f"{op}.1", dtypes, tuple(shapes), nbytes, nbytes, groups, "main", in_loop)


def test_program_costs_every_operand_of_a_combined_collective():
    # A combined all-reduce of two 10-packet float32 arrays (3620 floats each) is two gloo
    # calls: each 4 segments of 2.5 packets (3 ms), 2 x (40 + 3 + 3) ms = 92 ms.
    ar = _collective("all-reduce", [(3620,), (3620,)])
    assert netsim.program_seconds([ar], LINK) == pytest.approx(2 * 0.092)
    # An all-to-all's operands (one per peer) are one call: 20 packets at n = 2, 52 ms.
    a2a = _collective("all-to-all", [(3620,), (3620,)])
    assert netsim.program_seconds([ar, a2a], LINK) == pytest.approx(0.184 + 0.052)
    # 12 ms of compute then the exchange; overlapped, the larger.
    assert netsim.predict_round_seconds(0.012, [ar], LINK) == pytest.approx(0.196)
    assert netsim.predict_round_seconds(0.5, [ar], LINK, overlap=True) == 0.5
    # No replica groups: the caller names the device count; loops are the caller's to count.
    everyone = _collective("all-reduce", [(3620,)], groups=())
    with pytest.raises(ValueError, match="num_devices"):
        netsim.program_seconds([everyone], LINK)
    assert netsim.program_seconds([everyone], LINK, num_devices=2) == pytest.approx(0.092)
    with pytest.raises(ValueError, match="loop"):
        netsim.program_seconds([_collective("all-reduce", [(4,)], in_loop=True)], LINK)


def test_one_latency_per_exchange_undercounts_a_many_operand_round():
    # 20 small float32 leaves all-reduced on a 50 ms link: the per-exchange formula charges
    # one 50 ms latency; gloo waits 4 one-way delays for each leaf, 4 s in all.
    slow = netsim.Link(10e6, 0.05)
    ar = _collective("all-reduce", [(256,)] * 20)
    modelled = netsim.program_seconds([ar], slow)
    assert modelled == pytest.approx(20 * (0.2 + 8 * 1024 / slow.payload_rate))
    assert netsim.comm_seconds(20 * 1024, 10e6, 0.05) < modelled / 10
