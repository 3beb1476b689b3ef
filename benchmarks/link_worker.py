"""The processes `link.py` starts inside its network namespace; not meant to be run by hand.

    python link_worker.py delay --queue NUM:DELAY_MS:LOSS [--queue ...]
    python link_worker.py probe --port P (--serve | --bytes N)
    python link_worker.py train --coordinator HOST:PORT --num-processes M --process-id I
        --config JSON --out PATH

- `delay`: a delay line for kernels without `netem` (the qdisc that usually adds delay): it
  takes every packet the namespace's netfilter PREROUTING hook queues to it (NFQUEUE, over a
  plain netlink socket) and hands each back DELAY_MS after it arrived, in arrival order,
  dropping a fraction LOSS if asked. Every loopback packet crosses PREROUTING once, so the
  delay is one-way and a round trip is 2 x DELAY_MS, as with netem on the loopback. It
  holds packets on the receiving side, where the sender's socket no longer owns them: held
  on the sending side they would count against TCP's small-queue limit (about a
  millisecond of data in the host) and cap the rate far below the link's.
- `probe`: a TCP echo / bulk sender that measures the shaped link itself (round trip of a
  small message, rate of a bulk transfer), so each table row says what the packets saw.
- `train`: one JAX process of the multi-process run (gloo CPU collectives); trains every
  method of `--config` once, in blocks of rounds on the links of its schedule (the unshaped
  loopback and each shaped link, interleaved; process 0 switches the shaping between
  blocks), and writes the time each round's history entry was recorded to `--out`.
"""

import argparse
import collections
import json
import os
import random
import select
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------------------
# The NFQUEUE delay line (netlink constants from linux/netfilter/nfnetlink_queue.h).

NETLINK_NETFILTER = 12
SOL_NETLINK = 270
NETLINK_NO_ENOBUFS = 5
NFNL_SUBSYS_QUEUE = 3
MSG_PACKET, MSG_VERDICT, MSG_CONFIG, MSG_VERDICT_BATCH = 0, 1, 2, 3
CFG_CMD, CFG_PARAMS, CFG_QUEUE_MAXLEN, CFG_MASK, CFG_FLAGS = 1, 2, 3, 4, 5
CFG_F_GSO = 4  # hand over segmentation-offload packets whole (no per-segment copies)
CMD_BIND = 1
COPY_META = 1  # the packet's metadata (its id), not its payload: the delay needs no more
ATTR_PACKET_HDR, ATTR_VERDICT_HDR = 1, 2
NF_DROP, NF_ACCEPT = 0, 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
QUEUE_MAXLEN = 65536  # packets held at once: far above what the links here keep in flight


def _attr(kind: int, payload: bytes) -> bytes:
    data = struct.pack("=HH", 4 + len(payload), kind) + payload
    return data + b"\0" * (-len(data) % 4)


def _message(kind: int, queue: int, attrs: bytes, flags: int = NLM_F_REQUEST) -> bytes:
    body = struct.pack("=BB", socket.AF_UNSPEC, 0) + struct.pack(">H", queue) + attrs
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, 0, 0) + (
        body
    )


def _check_ack(sock: socket.socket) -> None:
    data = sock.recv(65536)
    kind = struct.unpack_from("=H", data, 4)[0]
    if kind == NLMSG_ERROR:
        errno = -struct.unpack_from("=i", data, 16)[0]
        if errno:
            raise OSError(errno, f"nfqueue config: {os.strerror(errno)}")


def open_queues(queues: list[int]) -> socket.socket:
    """A netlink socket bound to each NFQUEUE of `queues`, copying packet metadata only."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.bind((0, 0))
    sock.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE (root): bursts fit
    sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
    cmd = struct.pack("=BB", CMD_BIND, 0) + struct.pack(">H", socket.AF_INET)
    gso = _attr(CFG_FLAGS, struct.pack(">I", CFG_F_GSO))
    gso += _attr(CFG_MASK, struct.pack(">I", CFG_F_GSO))
    for queue in queues:
        for attrs in (
            _attr(CFG_CMD, cmd),
            _attr(CFG_PARAMS, struct.pack(">IB", 0, COPY_META)),
            _attr(CFG_QUEUE_MAXLEN, struct.pack(">I", QUEUE_MAXLEN)),
            gso,
        ):
            sock.send(_message(MSG_CONFIG, queue, attrs, NLM_F_REQUEST | NLM_F_ACK))
            _check_ack(sock)
    return sock


def _packets(data: bytes) -> list[tuple[int, int]]:
    """(queue, packet id) of each queued packet in one recv's netlink messages."""
    out, offset = [], 0
    while offset + 20 <= len(data):
        length, kind = struct.unpack_from("=IH", data, offset)
        if length < 20:
            break
        if kind & 0xFF == MSG_PACKET:
            queue = struct.unpack_from(">H", data, offset + 18)[0]
            pos, end = offset + 20, offset + length  # after nlmsghdr and nfgenmsg
            while pos + 4 <= end:
                alen, akind = struct.unpack_from("=HH", data, pos)
                if akind & 0x7FFF == ATTR_PACKET_HDR:
                    out.append((queue, struct.unpack_from(">I", data, pos + 4)[0]))
                    break
                pos += (alen + 3) & ~3
        offset += (length + 3) & ~3
    return out


def _verdict(sock: socket.socket, queue: int, kind: int, verdict: int, packet: int) -> None:
    sock.send(_message(kind, queue, _attr(ATTR_VERDICT_HDR, struct.pack(">II", verdict, packet))))


def run_delay_line(queues: dict[int, tuple[float, float]]) -> None:
    """For each NFQUEUE q -> (delay_s, loss): holds every packet queued to q delay_s seconds,
    then accepts it (all of a queue's due packets by one batch verdict: ids rise in arrival
    order); drops a fraction `loss` on arrival."""
    sock = open_queues(list(queues))
    rng = random.Random(0)
    held = {q: collections.deque() for q in queues}
    try:  # a late verdict is extra delay: run ahead of the training processes
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except (AttributeError, OSError):
        os.nice(-10)
    print("ready", flush=True)
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    while True:
        due = [line[0][0] for line in held.values() if line]
        timeout = None if not due else max(0.0, min(due) - time.monotonic()) * 1e3
        if poller.poll(timeout):
            data = sock.recv(1 << 20)
            now = time.monotonic()
            for queue, packet in _packets(data):
                delay, loss = queues[queue]
                if loss and rng.random() < loss:
                    _verdict(sock, queue, MSG_VERDICT, NF_DROP, packet)
                else:
                    held[queue].append((now + delay, packet))
        now = time.monotonic()
        for queue, line in held.items():
            last = None
            while line and line[0][0] <= now:
                last = line.popleft()[1]
            if last is not None:
                _verdict(sock, queue, MSG_VERDICT_BATCH, NF_ACCEPT, last)


# --------------------------------------------------------------------------------------
# The link probe: round trip of a small message, then a bulk transfer's rate.


def _recv_exactly(conn: socket.socket, count: int) -> None:
    while count > 0:
        chunk = conn.recv(min(count, 1 << 20))
        if not chunk:
            raise ConnectionError("probe peer closed early")
        count -= len(chunk)


def serve_probe(port: int) -> None:
    """Echoes each 1-byte ping; then reads a bulk payload announced by its 8-byte length and
    answers one byte once it has all of it."""
    with socket.create_server(("127.0.0.1", port)) as server:
        print("ready", flush=True)
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                head = conn.recv(1)
                if not head:
                    return
                if head == b"p":
                    conn.sendall(b"p")
                    continue
                raw = b""
                while len(raw) < 8:
                    raw += conn.recv(8 - len(raw))
                _recv_exactly(conn, struct.unpack(">Q", raw)[0])
                conn.sendall(b"k")


def run_probe(port: int, bulk_bytes: int, pings: int = 5) -> dict[str, float]:
    """Median round trip of `pings` 1-byte messages and the rate (bit/s) of sending
    `bulk_bytes`, from the sender's first byte to the receiver's acknowledgement (so one
    round trip is inside it, which the rate corrects for)."""
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(pings):
            start = time.perf_counter()
            conn.sendall(b"p")
            _recv_exactly(conn, 1)
            rtts.append(time.perf_counter() - start)
        rtt = sorted(rtts)[len(rtts) // 2]
        payload = b"\0" * bulk_bytes
        times = []
        for _ in range(2):  # the first transfer grows the congestion window
            start = time.perf_counter()
            conn.sendall(b"b" + struct.pack(">Q", bulk_bytes) + payload)
            _recv_exactly(conn, 1)
            times.append(time.perf_counter() - start)
        elapsed = max(times[-1] - rtt, 1e-9)
    return {"rtt_s": rtt, "rate_bits_per_s": 8 * bulk_bytes / elapsed}


# --------------------------------------------------------------------------------------
# One training process.


def _new_dumps(directory: Path | None, seen: set[Path]) -> list[Path]:
    """Optimized-HLO dumps XLA wrote since `seen` (and adds them to it)."""
    if directory is None:
        return []
    new = sorted(
        path
        for pattern in (
            "*jit_diloco_round*after_optimizations.txt",
            "*jit_sync_step*after_optimizations.txt",
        )
        for path in directory.glob(pattern)
        if path not in seen
    )
    seen.update(new)
    return new


def train_method(
    spec: dict[str, Any], workload: Any, num_workers: int, on_entry: Any = None
) -> list[float]:
    """Trains one method (`spec` from link.py) and returns the perf_counter time at which
    each round's (or step's) history entry was recorded; `on_entry(i)` runs after entry i
    is timed (process 0 switches the link there)."""
    import diloco_jax as dj

    times: list[float] = []

    def callback(_entry: dict) -> None:
        times.append(time.perf_counter())
        if on_entry is not None:
            on_entry(len(times) - 1)

    run = dict(num_workers=num_workers, backend="shard_map", callback=callback)
    data = workload.sampler(num_workers)
    rounds = spec["rounds_per_block"] * spec["blocks"] + 1
    if spec["kind"] == "sync":
        dj.train_sync(workload.loss_fn, workload.params, data, num_steps=rounds, **run)
    else:
        dj.train_diloco(
            workload.loss_fn,
            workload.params,
            data,
            num_rounds=rounds,
            inner_steps=spec["inner_steps"],
            **spec.get("options", {}),
            **run,
        )
    return times


def switch_link(commands: list[list[str]]) -> None:
    """Runs the shaping commands of a phase (inside the namespace; deletions of what may not
    exist are allowed to fail)."""
    import subprocess

    for argv in commands:
        subprocess.run(
            argv,
            check=argv[:3] != ["tc", "qdisc", "del"] and "-F" not in argv,
            capture_output=True,
            timeout=30,
        )


def switcher(phases: list[dict[str, Any]], schedule: list[int], per_block: int) -> Any:
    """on_entry for process 0: block k of `per_block` rounds runs on phase schedule[k]'s link;
    after entry i with i + 1 a multiple of `per_block` the next block's link goes on (the
    round then running, or the next, straddles the switch; link.py drops that gap)."""

    def on_entry(i: int) -> None:
        block = (i + 1) // per_block
        if (i + 1) % per_block == 0 and block < len(schedule):
            if schedule[block] != schedule[block - 1]:
                switch_link(phases[schedule[block]]["commands"])

    return on_entry


def run_training(args: Any) -> None:
    """Joins the run and trains each method of the config once: blocks of `rounds_per_block`
    rounds, block k on the link of phase schedule[k] (link.py interleaves the unshaped
    loopback with the links), process 0 switching the link between rounds; writes the round
    times (and, where HLO is dumped, the compiled round's dump) after every method, so a
    cut-short run keeps what it got. One run per method, its phases interleaved, keeps its
    unshaped and shaped rounds close in time on a shared machine (load drifts hit both),
    and places and compiles it once."""
    config = json.loads(args.config)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from diloco_jax import distributed

    platform = config.get("platform", "cpu")  # cpu: collectives through gloo over TCP
    distributed.initialize(args.coordinator, args.num_processes, args.process_id, platform=platform)
    import common
    import jax

    started = time.perf_counter()
    workload = common.lm_workload(config["preset"], config["batch_size"])
    dumps = Path(config["hlo_dir"]) if config.get("hlo_dir") else None
    seen: set[Path] = set()
    phases, schedule = config["phases"], config["schedule"]
    result: dict[str, Any] = {"process_id": args.process_id, "methods": {}}
    for spec in config["methods"]:
        spec = dict(spec, blocks=len(schedule))
        on_entry = None
        if args.process_id == 0:
            switch_link(phases[schedule[0]]["commands"])
            on_entry = switcher(phases, schedule, spec["rounds_per_block"])
        _new_dumps(dumps, seen)
        start = time.perf_counter()
        times = train_method(spec, workload, args.num_processes, on_entry)
        entry: dict[str, Any] = {"round_end_s": times, "phases": [p["name"] for p in phases]}
        entry |= {"schedule": schedule, "rounds_per_block": spec["rounds_per_block"]}
        new = _new_dumps(dumps, seen)
        if new:  # the last program compiled is the round that ran in steady state
            entry["hlo"] = str(new[-1])
        result["methods"][spec["name"]] = entry
        Path(args.out).write_text(json.dumps(result))
        gaps = [round(b - a, 2) for a, b in zip(times, times[1:], strict=False)]
        print(
            f"[{time.perf_counter() - started:6.1f} s] {spec['name']}: first entry after "
            f"{times[0] - start:.1f} s, then {gaps}",
            file=sys.stderr,
            flush=True,
        )
    jax.distributed.shutdown()


# --------------------------------------------------------------------------------------
# Command line.


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    delay = sub.add_parser("delay")
    delay.add_argument(
        "--queue", action="append", required=True, help="NUM:DELAY_MS:LOSS, once per queue"
    )
    probe = sub.add_parser("probe")
    probe.add_argument("--port", type=int, required=True)
    probe.add_argument("--serve", action="store_true")
    probe.add_argument("--bytes", type=int, default=0)
    train = sub.add_parser("train")
    train.add_argument("--coordinator", required=True)
    train.add_argument("--num-processes", type=int, required=True)
    train.add_argument("--process-id", type=int, required=True)
    train.add_argument("--config", required=True, help="JSON: what link.py asks to run")
    train.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.command == "delay":
        queues = {}
        for item in args.queue:
            num, delay_ms, loss = item.split(":")
            queues[int(num)] = (float(delay_ms) / 1e3, float(loss))
        run_delay_line(queues)
    elif args.command == "probe":
        if args.serve:
            serve_probe(args.port)
        else:
            print(json.dumps(run_probe(args.port, args.bytes)), flush=True)
    else:
        run_training(args)


if __name__ == "__main__":
    main(sys.argv[1:])
