"""The processes `link.py` starts; not meant to be run by hand.

    python link_worker.py relay --tun NAME=IPV4 [--tun ...] --control SOCKET
    python link_worker.py probe --host IPV4 --port P (--serve | --bytes N)
    python link_worker.py train --coordinator HOST:PORT --num-processes M --process-id I
        --config JSON --out PATH

- `relay`: the wire between the workers' namespaces. It makes one tun device per worker
  (link.py moves each into its worker's namespace, where it carries the worker's address)
  and moves every packet a worker sends to the device of the packet's destination, after
  the link's one-way delay, dropping a fraction of them if the link loses packets (set on
  the UNIX socket SOCKET at each switch of the link). tc shapes each worker's uplink on its
  own tun device, before the relay; where the kernel has `netem`, netem holds the delay
  there and the relay adds none. A packet handed to a tun device leaves its sender's
  socket (tun orphans it), so the delay does not count against TCP's small-queue limit.
  A datagram on SOCKET that is not "DELAY LOSS" (a delay in [0, 60] s, a loss in [0, 1)) is
  ignored; the relay ends when link.py does.
- `probe`: a TCP echo / bulk sender that measures the shaped link itself (round trip of a
  small message, rate of a bulk transfer), so each table row says what the packets saw.
- `train`: one JAX process of the multi-process run (gloo CPU collectives); trains every
  method of `--config` once, in blocks of rounds on the links of its schedule (the unshaped
  link and each shaped one, interleaved; process 0 switches the shaping between blocks),
  and writes the time each round's history entry was recorded to `--out`.
"""

import argparse
import collections
import contextlib
import fcntl
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
# The relay between the workers' namespaces.

TUNSETIFF = 0x400454CA  # linux/if_tun.h
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
PARENT_CHECK_S = 1.0  # how often an idle relay looks for the process that started it
MAX_DELAY_S = 60.0


def open_tun(name: str) -> int:
    """A new tun device `name` (IP packets, no extra header) and its non-blocking fd; the
    device lives as long as the fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def run_relay(tuns: dict[str, str], control: str) -> None:
    """Makes a tun device per worker (name -> its IPv4 address) and moves every IPv4 packet
    read from one to the device of its destination address, `delay` seconds after it was
    read, in order, dropping a fraction `loss` of them (seeded); other packets are dropped.
    (delay, loss) start at (0, 0) and change with each datagram "DELAY LOSS" received on the
    UNIX socket `control`, for packets read from then on (any other datagram is ignored).
    Returns when the process that started it is gone (link.py also has the kernel kill it
    then)."""
    parent = os.getppid()
    fds = {name: open_tun(name) for name in tuns}
    route = {socket.inet_aton(address): fds[name] for name, address in tuns.items()}
    with contextlib.suppress(FileNotFoundError):
        os.unlink(control)
    ctl = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ctl.bind(control)
    ctl.setblocking(False)
    delay, loss, rng = 0.0, 0.0, random.Random(0)
    held: collections.deque = collections.deque()  # (due, fd, packet), due rising
    try:  # a late packet is extra delay: run ahead of the training processes
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except (AttributeError, OSError):
        os.nice(-10)
    poller = select.poll()
    for fd in [*fds.values(), ctl.fileno()]:
        poller.register(fd, select.POLLIN)
    print("ready", flush=True)
    while os.getppid() == parent:
        timeout = PARENT_CHECK_S if not held else max(0.0, held[0][0] - time.monotonic())
        for fd, _ in poller.poll(min(timeout, PARENT_CHECK_S) * 1e3):
            if fd == ctl.fileno():
                setting = parse_relay_setting(ctl.recv(256))
                if setting is None:
                    print("relay: ignored a malformed setting", file=sys.stderr, flush=True)
                else:
                    delay, loss = setting
                continue
            now = time.monotonic()
            while True:
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                out = route.get(packet[16:20]) if packet[:1] and packet[0] >> 4 == 4 else None
                if out is None or (loss and rng.random() < loss):
                    continue
                # A shorter delay than the last packet's (a switch) must not overtake it.
                due = max(now + delay, held[-1][0]) if held else now + delay
                held.append((due, out, packet))
        now = time.monotonic()
        while held and held[0][0] <= now:
            _, out, packet = held.popleft()
            with contextlib.suppress(OSError):  # the receiver's device went down: lost
                os.write(out, packet)
    with contextlib.suppress(FileNotFoundError):  # its parent is gone: leave nothing
        os.unlink(control)


def parse_relay_setting(datagram: bytes) -> tuple[float, float] | None:
    """(delay s, loss) from a control datagram "DELAY LOSS": a finite delay in [0, 60] and a
    loss in [0, 1); None for anything else."""
    try:
        delay, loss = (float(x) for x in datagram.decode("ascii").split())
    except ValueError:  # not ASCII, not two fields, not numbers
        return None
    if not (0.0 <= delay <= MAX_DELAY_S and 0.0 <= loss < 1.0):  # NaN fails too
        return None
    return delay, loss


def set_relay(control: str, delay: float, loss: float) -> None:
    """Tells the relay listening on `control` its new (delay, loss)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(f"{delay!r} {loss!r}".encode(), control)


# --------------------------------------------------------------------------------------
# The link probe: round trip of a small message, then a bulk transfer's rate.


def _recv_exactly(conn: socket.socket, count: int) -> None:
    while count > 0:
        chunk = conn.recv(min(count, 1 << 20))
        if not chunk:
            raise ConnectionError("probe peer closed early")
        count -= len(chunk)


def serve_probe(host: str, port: int) -> None:
    """Echoes each 1-byte ping; then reads a bulk payload announced by its 8-byte length and
    answers one byte once it has all of it."""
    with socket.create_server((host, port)) as server:
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


def run_probe(host: str, port: int, bulk_bytes: int, pings: int = 5) -> dict[str, float]:
    """Median round trip of `pings` 1-byte messages and the rate (bit/s) of sending
    `bulk_bytes`, from the sender's first byte to the receiver's acknowledgement (so one
    round trip is inside it, which the rate corrects for)."""
    with socket.create_connection((host, port)) as conn:
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


def switch_link(phase: dict[str, Any]) -> None:
    """Puts `phase`'s link on (a phase of link.py): its tc commands on every worker's uplink
    (a deletion of shaping that may not be there is allowed to fail), then the relay's
    delay and loss (none on a cluster's real link)."""
    import subprocess

    for argv in phase["commands"]:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        if done.returncode != 0 and argv[3:5] != ["qdisc", "del"]:
            raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
    if "control" in phase:
        set_relay(phase["control"], *phase["relay"])


def switcher(phases: list[dict[str, Any]], schedule: list[int], per_block: int) -> Any:
    """on_entry for process 0: block k of `per_block` rounds runs on phase schedule[k]'s link;
    after entry i with i + 1 a multiple of `per_block` the next block's link goes on (the
    round then running, or the next, straddles the switch; link.py drops that gap)."""

    def on_entry(i: int) -> None:
        block = (i + 1) // per_block
        if (i + 1) % per_block == 0 and block < len(schedule):
            if schedule[block] != schedule[block - 1]:
                switch_link(phases[schedule[block]])

    return on_entry


def run_training(args: Any) -> None:
    """Joins the run and trains each method of the config once: blocks of `rounds_per_block`
    rounds, block k on the link of phase schedule[k] (link.py interleaves the unshaped
    link with the shaped ones), process 0 switching the link between rounds; writes the round
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
            switch_link(phases[schedule[0]])
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
    relay = sub.add_parser("relay")
    relay.add_argument("--tun", action="append", required=True, help="NAME=IPV4, once a worker")
    relay.add_argument("--control", required=True, help="the UNIX socket to listen on")
    probe = sub.add_parser("probe")
    probe.add_argument("--host", required=True)
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
    if args.command == "relay":
        run_relay(dict(item.split("=", 1) for item in args.tun), args.control)
    elif args.command == "probe":
        if args.serve:
            serve_probe(args.host, args.port)
        else:
            print(json.dumps(run_probe(args.host, args.port, args.bytes)), flush=True)
    else:
        run_training(args)


if __name__ == "__main__":
    main(sys.argv[1:])
