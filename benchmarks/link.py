"""Measured on a shaped link: M training processes (JAX's multi-process runtime, gloo CPU
collectives over TCP, one device each), each in a network namespace of its own, linked by
devices of a known rate and delay; wall-clock per round against `diloco_jax.netsim`'s
prediction, for data parallelism and six DiLoCo methods. See benchmarks/README.md,
"link.py".

    sudo .venv/bin/python benchmarks/link.py [--quick] [--links 1gbit:5ms,100mbit:20ms,10mbit:50ms]
        [--methods dp,diloco,streaming,int4,sparseloco,eager,noloco] [--preset tiny]
        [--batch-size 8] [--workers 2] [--rounds 4] [--dp-steps 4] [--cycles 2] [--inner-steps H]
        [--mtu 1500] [--delay-impl auto|netem|relay] [--out benchmarks/results/link.json]
        [--plot PATH] [--workdir DIR] [--reanalyze DIR]

    # several hosts, no shaping (the real link between them), on host I of N:
    .venv/bin/python benchmarks/link.py --links none --coordinator HOST:PORT \\
        --num-processes N --process-id I [--platform cpu] [--out PATH]

A link is RATE:DELAY[:LOSS], e.g. 100mbit:20ms or 10mbit:50ms:0.1%. RATE is each worker's
uplink (its packets, TCP/IP headers included: an HTB class on the worker's own device);
DELAY is one way (a round trip is 2 x DELAY). Needs root, `ip` and `tc` (iproute2) and tun
devices. Worker k has the address 127.0.1.(k + 1) on a tun device in its namespace; a relay
process (link_worker.py) carries packets between the devices and holds each for the delay,
unless the kernel has `netem`, which then holds it under the HTB class.

Each method is one `train_diloco` / `train_sync` call whose rounds run in blocks of
`--rounds` (data parallelism: `--dp-steps` steps, a "round" being one step), block by block
on the unshaped link (its compute time) and each shaped one, forwards then backwards
(`--cycles`), process 0 switching the link between blocks; a figure is the median of a
phase's rounds, less the first of each block. The prediction is
`netsim.predict_round_seconds` from the unshaped round time, the link and the collectives of
the compiled round (XLA's HLO dump of the program the run compiled).

Everything a run makes is named after its pid (djlink<PID>-K namespaces, their /etc/netns
entries, the relay's socket /tmp/djlink<PID>.sock, the work folder /tmp/djlink<PID>-*), and
every process it starts dies with it (PR_SET_PDEATHSIG). A run that ends removes its own; one
killed with SIGKILL cannot, so each start first removes those of runs that are gone
(`sweep_stale`).
"""

import argparse
import contextlib
import ctypes
import dataclasses
import json
import os
import re
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from link_worker import switch_link

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER = HERE / "link_worker.py"
DEFAULT_OUT = HERE / "results" / "link.json"
DEFAULT_LINKS = "1gbit:5ms,100mbit:20ms,10mbit:50ms"
QUICK_LINKS = "100mbit:20ms,10mbit:50ms"
TOOLS = ("ip", "tc")
SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")
ETC_NETNS = Path("/etc/netns")  # `ip netns exec NAME` mounts NAME's files here over /etc
COORDINATOR_PORT = 47001  # a fresh namespace has every port free
# Every namespace, /etc/netns entry, relay socket and work folder of link.py's process PID
# is named djlink<PID>...: `sweep_stale` finds those of a PID that is no link.py any more.
OWNED = re.compile(r"djlinkcheck(?P<check>\d+)|djlink(?P<pid>\d+)(?:\.sock|-.+)")
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def tun_prefix(pid: int) -> str:
    """The tun devices of link.py's process `pid` are named this + k (unique on the host,
    within the 15 characters of a device name)."""
    return f"dj{pid % 10**6}w"


WORKER_SUBNET = "127.0.1.0/24"  # the loopback range: nothing leaves the machine
MAX_WORKERS = 254


def worker_address(k: int) -> str:
    """Worker k's address (0 <= k < MAX_WORKERS), on its tun device inside its own
    namespace, in WORKER_SUBNET."""
    return f"127.0.1.{k + 1}"


# name -> (label, kind, inner steps, train_diloco keyword shorthand)
METHODS: dict[str, tuple[str, str, int, dict[str, Any]]] = {
    "dp": ("data parallel", "sync", 1, {}),
    "diloco": ("DiLoCo", "diloco", 25, {}),
    "streaming": ("Streaming DiLoCo P=4", "diloco", 24, {"fragments": 4}),  # H a multiple of P
    "int4": ("int4 two-stage + EF", "diloco", 25, {"compression": "int4,ef=1"}),
    "sparseloco": ("SparseLoCo", "diloco", 25, {"compression": "sparseloco"}),
    "eager": ("eager d=1", "diloco", 25, {"outer_delay": 1, "eager": True}),
    "noloco": ("NoLoCo pairs", "diloco", 25, {"gossip_group_size": 2}),
}
OVERLAPPING = ("eager",)  # methods whose exchange may run under the next round's inner steps

_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """A shaped link: rate (bit/s per worker uplink), one-way delay (s), loss (fraction)."""

    name: str
    rate: float
    delay: float
    loss: float = 0.0


def parse_link(text: str) -> LinkSpec:
    """'100mbit:20ms' or '10mbit:50ms:0.1%' -> LinkSpec; ValueError naming the bad part."""
    parts = text.strip().lower().split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"a link is RATE:DELAY[:LOSS], e.g. 100mbit:20ms, got {text!r}")
    rate = re.fullmatch(r"([\d.]+)(bit|kbit|mbit|gbit)", parts[0])
    delay = re.fullmatch(r"([\d.]+)(us|ms|s)", parts[1])
    if rate is None or delay is None:
        raise ValueError(f"link {text!r}: rate like 100mbit, delay like 20ms")
    loss = 0.0
    if len(parts) == 3:
        m = re.fullmatch(r"([\d.]+)%", parts[2])
        if m is None:
            raise ValueError(f"link {text!r}: loss like 0.1%")
        loss = float(m.group(1)) / 100
    spec = LinkSpec(
        text.strip(),
        float(rate.group(1)) * _RATE_UNITS[rate.group(2)],
        float(delay.group(1)) * _DELAY_UNITS[delay.group(2)],
        loss,
    )
    if spec.rate <= 0 or not 0 <= spec.loss < 1:
        raise ValueError(f"link {text!r}: rate must be > 0 and loss below 100%")
    return spec


# --------------------------------------------------------------------------------------
# The namespaces, the relay between them and the shaping.


def tool(name: str) -> str | None:
    """Path of a system tool, looking in the sbin directories too (not always on PATH)."""
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN))


def owner_alive(pid: int) -> bool:
    """Whether process `pid` is a running link.py (a pid reused by anything else is not)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return any(part.endswith(b"link.py") for part in cmdline.split(b"\0"))


def sweep_stale() -> list[str]:
    """Removes what link.py runs that are gone (killed, say) left behind, by the owner pid in
    each name (`OWNED`): the processes inside their namespaces, the namespaces, their
    /etc/netns entries, relay sockets and work folders. A running link.py's are kept.
    Returns what it removed."""
    removed = []
    for name in filter(_stale, _namespaces()):
        pids = subprocess.run([tool("ip"), "netns", "pids", name], capture_output=True, text=True)
        for pid in pids.stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run([tool("ip"), "netns", "del", name], capture_output=True)
        removed.append(f"namespace {name}")
    for folder in (ETC_NETNS, Path(tempfile.gettempdir())):
        paths = sorted(folder.glob("djlink*")) if folder.is_dir() else []
        for path in (p for p in paths if _stale(p.name)):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(str(path))
    return removed


def _stale(name: str) -> bool:
    """Whether `name` is link.py's (`OWNED`) and its owner is gone."""
    m = OWNED.fullmatch(name)
    return m is not None and not owner_alive(int(m.group("check") or m.group("pid")))


def _namespaces() -> list[str]:
    listed = subprocess.run([tool("ip"), "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]


def die_with_parent() -> None:
    """In a child before it runs (Popen's preexec_fn): the kernel sends it SIGKILL when
    link.py ends, however it ends (a SIGKILL included). It survives the `ip netns exec` that
    starts a worker, which execs without forking."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def requirements_problem() -> str | None:
    """Why this machine can't shape a link (one line), or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, tun devices and tc)"
    missing = [t for t in TOOLS if tool(t) is None]
    if missing:
        return f"needs {', '.join(missing)} (package iproute2)"
    if not os.path.exists("/dev/net/tun"):
        return "needs tun devices (/dev/net/tun)"
    name = f"djlinkcheck{os.getpid()}"
    made = subprocess.run([tool("ip"), "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run([tool("ip"), "netns", "del", name], capture_output=True)
    return None


def link_commands(
    link: LinkSpec | None, namespaces: list[str], device: str, netem: bool
) -> list[list[str]]:
    """The tc commands that put `link` on every worker's uplink (its tun device `device` in
    its namespace), after removing whatever shaping was there; None: no shaping. Per
    uplink an HTB class of `link.rate` over a netem leaf holding the delay and loss, or,
    without netem, a plain FIFO (the relay then holds the delay, `relay_setting`)."""
    commands = []
    for ns in namespaces:
        tc, dev = ["tc", "-n", ns], ["dev", device]
        commands.append([*tc, "qdisc", "del", *dev, "root"])
        if link is None:
            continue
        rate = f"{link.rate:.0f}bit"
        commands.append([*tc, "qdisc", "add", *dev, *"root handle 1: htb default 1".split()])
        commands.append(
            [*tc, "class", "add", *dev, *"parent 1: classid 1:1 htb".split()]
            + ["rate", rate, "ceil", rate, "quantum", "60000"]
        )
        leaf = [*tc, "qdisc", "add", *dev, *"parent 1:1 handle 10:".split()]
        if netem:
            leaf += f"netem delay {link.delay * 1e6:.0f}us limit 100000".split()
            leaf += ["loss", f"{link.loss * 100:g}%"] if link.loss else []
        else:
            leaf += "pfifo limit 100000".split()
        commands.append(leaf)
    return commands


def relay_setting(link: LinkSpec | None, netem: bool) -> tuple[float, float]:
    """(one-way delay s, loss) the relay adds to each packet: the link's, unless netem does."""
    if link is None or netem:
        return 0.0, 0.0
    return link.delay, link.loss


class Network:
    """One network namespace per worker, each holding a tun device with the worker's address
    (`worker_address`); a relay process (`link_worker.py relay`) moves packets between the
    tun devices: every packet between two workers leaves its sender's namespace through the
    tun device, where tc shapes it (the sender's uplink), and reaches the receiver's after
    the relay's delay. `close` (which `network()` calls on any exit) ends the processes and
    removes the namespaces (their devices with them) and their /etc/netns files."""

    def __init__(self, tag: str, workers: int, control: Path):
        self.names = [f"{tag}-{k}" for k in range(workers)]
        self.device = "djlink"  # each worker's tun device, inside its namespace
        self.control = control  # the relay's UNIX socket (`relay_setting`)
        self.processes: list[subprocess.Popen] = []
        self.made: list[str] = []
        self.made_etc = not ETC_NETNS.exists()

    def start(self, mtu: int) -> None:
        for name in self.names:
            self._run([tool("ip"), "netns", "add", name])
            self.made.append(name)
        # The relay makes the tun devices in this namespace, named after the pid (unique
        # here); each then moves into its worker's namespace, the relay keeping its end.
        tuns = [f"{tun_prefix(os.getpid())}{k}" for k in range(len(self.names))]
        argv = [sys.executable, str(WORKER), "relay", "--control", str(self.control)]
        for k, tun in enumerate(tuns):
            argv += ["--tun", f"{tun}={worker_address(k)}"]
        relay = self._spawn(argv, stdout=subprocess.PIPE, text=True)
        wait_ready(relay, "the relay")
        hostname = os.uname().nodename
        for k, (name, tun) in enumerate(zip(self.names, tuns, strict=True)):
            self._run([tool("ip"), "link", "set", tun, "netns", name])
            self._run([tool("ip"), "-n", name, "link", "set", tun, "name", self.device])
            self._configure(name, worker_address(k), mtu)
            # `ip netns exec` mounts these over /etc: the host's name resolves to the
            # worker's own address, where gloo's listening sockets go.
            etc = ETC_NETNS / name
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{worker_address(k)} {hostname}\n")

    def _configure(self, name: str, address: str, mtu: int) -> None:
        dev = self.device
        # Addresses of the loopback range may cross a non-loopback device only with
        # route_localnet (set before the address, or the kernel picks no source for it);
        # long-haul TCP tuning: no slow start after the compute phase's idle link, windows
        # and host queues large enough for the bandwidth-delay product.
        settings = {
            "net/ipv4/conf/all/route_localnet": 1,
            f"net/ipv4/conf/{dev}/route_localnet": 1,
            "net/ipv4/conf/all/rp_filter": 0,
            f"net/ipv4/conf/{dev}/rp_filter": 0,
            f"net/ipv6/conf/{dev}/disable_ipv6": 1,
            "net/ipv4/tcp_slow_start_after_idle": 0,
            "net/ipv4/tcp_limit_output_bytes": 67108864,
            "net/ipv4/tcp_rmem": "4096 131072 67108864",
            "net/ipv4/tcp_wmem": "4096 131072 67108864",
        }
        script = "; ".join(f"echo '{v}' > /proc/sys/{k}" for k, v in settings.items())
        self._run([tool("ip"), "netns", "exec", name, "sh", "-ec", script])
        ip = [tool("ip"), "-n", name]
        self._run([*ip, "link", "set", "lo", "up"])
        self._run([*ip, "link", "set", dev, "up", "mtu", str(mtu), "txqueuelen", "10000"])
        self._run([*ip, "addr", "add", f"{address}/32", "dev", dev])
        self._run([*ip, "route", "add", WORKER_SUBNET, "dev", dev])
        # The loopback owns all of 127/8 by default: keep only 127.0.0.1 local, so the other
        # workers' addresses route through the tun device.
        self._run([*ip, "route", "del", "local", "127.0.0.0/8", "dev", "lo", "table", "local"])

    @staticmethod
    def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
        return done

    def has_netem(self) -> bool:
        tc = [tool("tc"), "-n", self.names[0]]
        add = f"qdisc add dev {self.device} root netem delay 1ms".split()
        probe = self._run([*tc, *add], check=False)
        self._run([*tc, "qdisc", "del", "dev", self.device, "root"], check=False)
        return probe.returncode == 0

    def _spawn(self, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        # Its own process group, so `close` can end it and its children; gone with link.py.
        proc = subprocess.Popen(argv, start_new_session=True, preexec_fn=die_with_parent, **kwargs)
        self.processes.append(proc)
        return proc

    def spawn(self, worker: int, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        """Starts `argv` inside worker `worker`'s namespace."""
        return self._spawn([tool("ip"), "netns", "exec", self.names[worker], *argv], **kwargs)

    def close(self) -> None:
        for proc in self.processes:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
        for name in self.made:
            self._run([tool("ip"), "netns", "del", name], check=False)
            shutil.rmtree(ETC_NETNS / name, ignore_errors=True)
        if self.made_etc:
            with contextlib.suppress(OSError):
                ETC_NETNS.rmdir()
        with contextlib.suppress(FileNotFoundError):
            self.control.unlink()


@contextlib.contextmanager
def network(tag: str, workers: int, mtu: int, control: Path) -> Iterator[Network]:
    """A started Network, torn down on any exit (a failed start, Ctrl-C and SIGTERM /
    SIGHUP included)."""

    def interrupted(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {s: signal.signal(s, interrupted) for s in (signal.SIGTERM, signal.SIGHUP)}
    net = Network(tag, workers, control)
    try:
        net.start(mtu)
        yield net
    finally:
        net.close()
        for s, handler in previous.items():
            signal.signal(s, handler)


def wait_ready(proc: subprocess.Popen, what: str, timeout: float = 60) -> None:
    """Waits for `proc` to print its 'ready' line (RuntimeError after `timeout` s)."""
    readable, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if readable else ""
    if line.strip() != "ready":
        raise RuntimeError(f"{what} did not start (exit {proc.poll()}): {line.strip()!r}")


# --------------------------------------------------------------------------------------
# Running.


def python_env(dump_dir: Path | None = None, platform: str = "cpu") -> dict[str, str]:
    """A worker's environment: one device per process, the platform, HLO dumps if asked."""
    flags = "--xla_force_host_platform_device_count=1"
    if dump_dir is not None:
        flags += (
            f" --xla_dump_to={dump_dir} --xla_dump_hlo_as_text"
            " --xla_dump_hlo_module_re=.*(diloco_round|sync_step).*"
        )
    path = os.pathsep.join([str(ROOT), str(HERE)])
    # No persistent compilation cache: a hit would skip the compile, and with it the dump.
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    return {**env, "XLA_FLAGS": flags, "JAX_PLATFORMS": platform, "PYTHONPATH": path}


def probe_link(net: Network, link: LinkSpec, port: int) -> dict[str, float]:
    """The link as packets see it: round trip of a 1-byte message, rate of a bulk transfer
    from worker 0 to worker 1."""
    probe = [sys.executable, str(WORKER), "probe", "--host", worker_address(1), "--port", str(port)]
    server = net.spawn(1, [*probe, "--serve"], stdout=subprocess.PIPE, text=True)
    wait_ready(server, "link probe")
    size = max(256 << 10, int(link.rate / 8 * 0.5))  # about half a second of data
    client = net.spawn(0, [*probe, "--bytes", str(size)], stdout=subprocess.PIPE, text=True)
    out, _ = client.communicate(timeout=120)
    server.wait(timeout=30)
    return json.loads(out)


def method_specs(names: list[str], rounds: int, dp_steps: int, inner: int | None) -> list[dict]:
    """What each worker runs per method: its kind, H, options and rounds per link."""
    specs = []
    for name in names:
        _, kind, steps, options = METHODS[name]
        spec = {"name": name, "kind": kind, "inner_steps": steps, "options": options}
        if kind == "sync":
            specs.append(spec | {"inner_steps": 1, "rounds_per_block": dp_steps})
            continue
        if inner is not None:  # Streaming needs H a multiple of its P
            p = options.get("fragments", 1)
            spec["inner_steps"] = max(p, inner // p * p)
        specs.append(spec | {"rounds_per_block": rounds})
    return specs


def run_workers(
    net: Network | None, args: Any, config: dict, workdir: Path, timeout: float
) -> dict[str, Any]:
    """Starts the M training processes (each in its namespace of `net`, or one here for a
    multi-host run) and returns process 0's results."""
    local = net is not None
    ids = range(args.workers) if local else [args.process_id]
    num = args.workers if local else args.num_processes
    coordinator = f"{worker_address(0)}:{COORDINATOR_PORT}" if local else args.coordinator
    procs = []
    for k in ids:
        cfg = dict(config, hlo_dir=config["hlo_dir"] if k == 0 else None)
        argv = [sys.executable, str(WORKER), "train", "--coordinator", coordinator]
        argv += ["--num-processes", str(num), "--process-id", str(k), "--config", json.dumps(cfg)]
        argv += ["--out", str(workdir / f"worker-{k}.json")]
        env = python_env(Path(config["hlo_dir"]) if k == 0 else None, config["platform"])
        log = open(workdir / f"worker-{k}.log", "w")  # noqa: SIM115 (closed with the run)
        kwargs = dict(env=env, stdout=log, stderr=subprocess.STDOUT)
        if local:
            procs.append((net.spawn(k, argv, **kwargs), log))
        else:
            procs.append((subprocess.Popen(argv, preexec_fn=die_with_parent, **kwargs), log))
    deadline = time.monotonic() + timeout
    try:
        for proc, _ in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"training processes ran past --timeout {timeout:.0f} s") from None
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
            log.close()
    for k, (proc, _) in zip(ids, procs, strict=True):
        if proc.returncode != 0:
            tail = (workdir / f"worker-{k}.log").read_text()[-3000:]
            raise RuntimeError(f"worker {k} exited with {proc.returncode}:\n{tail}")
    return json.loads((workdir / f"worker-{ids[0]}.json").read_text())


# --------------------------------------------------------------------------------------
# Measured against predicted.


def schedule(phases: int, cycles: int) -> list[int]:
    """Block order over the phases, forwards then backwards (0 1 2 3 3 2 1 0 ...), so every
    phase's blocks sit at the same mean time: a drift in the machine's load hits the
    unshaped rounds and each link's alike."""
    order: list[int] = []
    for c in range(cycles):
        order += list(range(phases)) if c % 2 == 0 else list(reversed(range(phases)))
    return order


def phase_gaps(run: dict, phase: str) -> list[float]:
    """Seconds per round of `run` (a worker's record of one method) on `phase`'s link.

    Entry i's time is when `train_diloco` recorded round i, after dispatching round i + 1.
    XLA's CPU client runs a program with collectives inside its dispatch, so entry i is
    written as round i + 1 ends (where dispatch is asynchronous, as round i ends): either
    way consecutive entries are one round apart, except the last, which follows the one
    before at once (nothing is left to dispatch). Block k owns entries k B .. k B + B - 1
    (B rounds a block); its link went on after entry k B - 1, so the gap after that entry
    may straddle the switch and is dropped, and so is the run's last gap. The first entry,
    which includes compilation, only starts the clock."""
    per, p = run["rounds_per_block"], run["phases"].index(phase)
    ends = run["round_end_s"]
    gaps = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    return [
        g
        for k, q in enumerate(run["schedule"])
        if q == p
        for g in gaps[k * per : k * per + per - 1]
    ]


def round_seconds(run: dict, phase: str) -> float:
    """Median of `phase_gaps`."""
    gaps = phase_gaps(run, phase)
    if not gaps:
        raise ValueError("need at least 2 rounds per link to time one")
    return statistics.median(gaps)


def rows_for(method: str, run: dict, links: list[LinkSpec], context: dict) -> list[dict]:
    """One row per link of `method`: measured, compute and predicted round seconds."""
    from diloco_jax import hlo, netsim

    label = METHODS[method][0]
    spec = next(s for s in context["specs"] if s["name"] == method)
    inner = spec["inner_steps"]
    compute = round_seconds(run, "none")
    text = Path(run["hlo"]).read_text() if run.get("hlo") else None
    collectives = hlo.collectives(text) if text else None
    wire = hlo.wire_bytes(text, context["workers"]) if text else None
    tokens = context["workers"] * context["tokens_per_step"] * inner
    rows = []
    for link in links:
        measured = round_seconds(run, link.name)
        row = {
            "link": link.name,
            "rate_bits_per_s": link.rate,
            "delay_s": link.delay,
            "loss": link.loss,
            "method": method,
            "label": label,
            "inner_steps": inner,
            "measured_round_s": measured,
            "compute_round_s": compute,
            "round_s_all": [round(g, 4) for g in phase_gaps(run, link.name)],
            "compute_round_s_all": [round(g, 4) for g in phase_gaps(run, "none")],
            "measured_tokens_per_s": tokens / measured,
        }
        if collectives is not None:
            net = netsim.Link(link.rate, link.delay, context["mtu"])
            comm = netsim.program_seconds(collectives, net, context["workers"])
            predicted = compute + comm
            row |= {
                "predicted_round_s": predicted,
                "predicted_comm_s": comm,
                "predicted_tokens_per_s": tokens / predicted,
                "error": measured / predicted - 1,
                # The earlier model: one latency per exchange, the wire bytes at the rate.
                "one_latency_round_s": netsim.round_seconds(
                    compute / inner, inner, wire, link.rate, link.delay
                ),
                "wire_bytes": wire,
                "gloo_calls": _calls(collectives),
            }
            row["without"] = ablations(collectives, net, compute, context["workers"])
            if method in OVERLAPPING:  # what GPU/TPU async collectives could hide: modelled
                row["modelled_overlap_round_s"] = max(compute, comm)
        rows.append(row)
    return rows


def ablations(collectives: list, link: Any, compute: float, workers: int) -> dict[str, float]:
    """The predicted round with one effect of the model left out at a time: what each is
    worth against the measurement (the README's 'effects the model includes')."""
    from diloco_jax import netsim

    no_rendezvous = netsim.Transport("no-rendezvous", rendezvous=False)
    whole = sum(  # a combined collective as one call of all its bytes
        netsim.collective_seconds(
            c.op, c.operand_bytes, len(c.replica_groups[0]) if c.replica_groups else workers, link
        )
        for c in collectives
    )
    bare = netsim.Link(link.rate, link.delay, mtu=1 << 40)  # headers cost nothing
    return {
        "rendezvous": compute + netsim.program_seconds(collectives, link, workers, no_rendezvous),
        "per_operand_calls": compute + whole,
        "header_bytes": compute + netsim.program_seconds(collectives, bare, workers),
    }


def collectives_text(run: dict) -> str:
    return Path(run["hlo"]).read_text()


def _calls(collectives: list) -> int:
    """gloo calls a round makes: one per operand, an all-to-all's operands one call."""
    return sum(1 if c.op == "all-to-all" else len(c.operand_shapes) for c in collectives)


def overlap_report(runs: dict, rows: list[dict]) -> dict[str, Any] | None:
    """Whether an eager round's exchange ran under its inner steps, per link: the seconds
    it hid (its compute plus its predicted exchange, minus what it measured) as a fraction
    of what it could hide (the smaller of the two; 1: fully overlapped, 0: in sequence);
    and the collectives of its compiled round that do not depend on the inner loop (those
    XLA may overlap with it)."""
    if "eager" not in runs or not runs["eager"].get("hlo"):
        return None
    from diloco_jax import hlo

    text = collectives_text(runs["eager"])
    report: dict[str, Any] = {
        "collectives_independent_of_inner_loop": [
            c.name for c in hlo.collectives(text) if not hlo.depends_on(text, c.name, "while")
        ],
        "links": {},
    }
    for row in rows:
        if row["method"] != "eager" or "predicted_comm_s" not in row:
            continue
        compute, comm = row["compute_round_s"], row["predicted_comm_s"]
        hidden = compute + comm - row["measured_round_s"]
        report["links"][row["link"]] = {
            "hidden_s": hidden,
            "hideable_s": min(compute, comm),
            "hidden_fraction": hidden / min(compute, comm) if min(compute, comm) > 0 else None,
        }
    return report


# --------------------------------------------------------------------------------------
# Reporting.


def add_speedups(rows: list[dict]) -> None:
    """Each row's measured (and predicted) tokens/s over data parallelism's on its link."""
    dp = {r["link"]: r for r in rows if r["method"] == "dp"}
    for r in rows:
        base = dp.get(r["link"])
        if base is None:
            continue
        r["speedup_vs_dp"] = r["measured_tokens_per_s"] / base["measured_tokens_per_s"]
        if "predicted_tokens_per_s" in r and "predicted_tokens_per_s" in base:
            r["predicted_speedup_vs_dp"] = (
                r["predicted_tokens_per_s"] / base["predicted_tokens_per_s"]
            )


def markdown(rows: list[dict]) -> str:
    """The measured-against-predicted table, grouped by link, fastest first; eager rows say
    the overlap was not measured here (their modelled-overlap figure is GPU/TPU's case)."""
    head = (
        "| link | method | H | gloo calls | compute s | measured s | predicted s | error | "
        "one-latency model s | tokens/s measured (vs DP) | tokens/s predicted |"
    )
    lines = [head, "|" + "---|" * 11]
    order = sorted(rows, key=lambda r: -r.get("rate_bits_per_s", 0))
    for r in order:
        speedup = f" ({r['speedup_vs_dp']:.1f}x)" if "speedup_vs_dp" in r else ""
        measured = f"{r['measured_tokens_per_s']:,.0f}{speedup}"
        if "predicted_round_s" not in r:
            lines.append(
                f"| {r['link']} | {r['label']} | {r['inner_steps']} | | | "
                f"{r['measured_round_s']:.2f} | | | | {measured} | |"
            )
            continue
        label = r["label"]
        if "modelled_overlap_round_s" in r:
            label += f" ¹ (modelled overlap: {r['modelled_overlap_round_s']:.2f} s)"
        old = r["one_latency_round_s"]
        lines.append(
            f"| {r['link']} | {label} | {r['inner_steps']} | {r['gloo_calls']} | "
            f"{r['compute_round_s']:.2f} | {r['measured_round_s']:.2f} | "
            f"{r['predicted_round_s']:.2f} | {r['error']:+.0%} | "
            f"{old:.2f} ({r['measured_round_s'] / old - 1:+.0%}) | {measured} | "
            f"{r['predicted_tokens_per_s']:,.0f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Tokens/s against link rate per method: measured (filled) and predicted (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, method in enumerate(dict.fromkeys(r["method"] for r in rows)):
        mine = sorted(
            (r for r in rows if r["method"] == method), key=lambda r: r["rate_bits_per_s"]
        )
        rates = [r["rate_bits_per_s"] / 1e6 for r in mine]
        ax.plot(
            rates,
            [r["measured_tokens_per_s"] for r in mine],
            "o-",
            color=f"C{i}",
            label=mine[0]["label"],
        )
        if all("predicted_tokens_per_s" in r for r in mine):
            ax.plot(
                rates, [r["predicted_tokens_per_s"] for r in mine], "x--", color=f"C{i}", alpha=0.7
            )
    ax.plot([], [], "ko-", label="measured")
    ax.plot([], [], "kx--", alpha=0.7, label="predicted (netsim)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    links = {r["rate_bits_per_s"] / 1e6: r["link"] for r in rows}
    ax.set_xticks(list(links), list(links.values()))
    ax.minorticks_off()
    ax.set_xlabel("link: rate per worker : one-way delay")
    ax.set_ylabel("tokens / s (all workers)")
    ax.set_title("Measured over a shaped link (x: netsim's prediction)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _git(*argv: str) -> str | None:
    done = subprocess.run(["git", *argv], capture_output=True, text=True, cwd=ROOT)
    return done.stdout.strip() if done.returncode == 0 else None


# --------------------------------------------------------------------------------------
# Main.


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="micro model, H=10, 2 links")
    parser.add_argument("--links", default=None, help=f"default {DEFAULT_LINKS}; 'none'")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--preset", default=None, help="LM preset (default tiny; quick: micro)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2, help="M processes, one device each")
    parser.add_argument(
        "--rounds", type=int, default=None, help="per link and cycle; default 4 (quick 3)"
    )
    parser.add_argument("--dp-steps", type=int, default=None, help="the same; default 4 (quick 3)")
    parser.add_argument(
        "--cycles", type=int, default=None, help="passes over the links; default 2 (quick 1)"
    )
    parser.add_argument("--inner-steps", type=int, default=None, help="override every H")
    parser.add_argument("--mtu", type=int, default=1500)
    parser.add_argument("--delay-impl", default="auto", choices=["auto", "netem", "relay"])
    parser.add_argument("--timeout", type=float, default=None, help="seconds for all runs")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--plot", type=Path, default=None, help="default: --out with .png")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--workdir", type=Path, default=None, help="keep logs and HLO here")
    parser.add_argument(
        "--reanalyze", type=Path, default=None, help="no run: redo the tables from a --workdir"
    )
    parser.add_argument("--coordinator", default=None, help="multi-host: HOST:PORT of process 0")
    parser.add_argument("--num-processes", type=int, default=None)
    parser.add_argument("--process-id", type=int, default=None)
    parser.add_argument("--platform", default="cpu", help="multi-host: cpu (gloo), gpu, tpu")
    args = parser.parse_args(argv)
    args.links = args.links or (QUICK_LINKS if args.quick else DEFAULT_LINKS)
    args.preset = args.preset or ("micro" if args.quick else "tiny")
    args.rounds = args.rounds or (3 if args.quick else 4)
    args.dp_steps = args.dp_steps or (3 if args.quick else 4)
    args.cycles = args.cycles or (1 if args.quick else 2)
    if not 2 <= args.workers <= MAX_WORKERS:
        parser.error(f"--workers must be in [2, {MAX_WORKERS}] (a link joins two processes)")
    if min(args.rounds, args.dp_steps) < 2:
        parser.error("--rounds and --dp-steps must be >= 2 (a block's first gap is dropped)")
    if args.quick and args.inner_steps is None:
        args.inner_steps = 10
    args.timeout = args.timeout or (600 if args.quick else 2400)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {list(METHODS)}")
    cluster = [args.coordinator, args.num_processes, args.process_id]
    if any(v is not None for v in cluster) and not all(v is not None for v in cluster):
        parser.error("--coordinator, --num-processes and --process-id go together")
    if args.coordinator and args.links != "none":
        parser.error("a multi-host run measures the real link: use --links none")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # tc and ip run by name (here and in the workers).
    os.environ["PATH"] = os.pathsep.join([os.environ.get("PATH", ""), *SBIN])
    links = [] if args.links == "none" else [parse_link(t) for t in args.links.split(",")]
    if args.coordinator is None and args.reanalyze is None:
        problem = requirements_problem()
        if problem:
            print(f"link.py: {problem}; run as root on Linux with them installed", file=sys.stderr)
            return 2
    start = time.monotonic()
    specs = method_specs(args.methods, args.rounds, args.dp_steps, args.inner_steps)
    if args.coordinator is None and args.reanalyze is None:
        for what in sweep_stale():
            print(f"link.py: removed {what}, left by a link.py that is gone", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix=f"djlink{os.getpid()}-") as tmp:
        workdir = Path(args.reanalyze or args.workdir or tmp)
        if args.reanalyze is None:
            workdir.mkdir(parents=True, exist_ok=True)
            meta = measure(args, links, specs, workdir)
            meta["wall_seconds"] = time.monotonic() - start
            (workdir / "run.json").write_text(json.dumps(meta, indent=2))
        else:  # the analysis again, on a kept --workdir
            meta = json.loads((workdir / "run.json").read_text())
        payload = analyze(args, links, specs, workdir, meta)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(markdown(payload["rows"]))
    for name, o in (payload["overlap"] or {}).get("links", {}).items():
        print(f"eager on {name}: hid {o['hidden_s']:.2f} s of a possible {o['hideable_s']:.2f} s")
    if links and not args.no_plot:
        plot(payload["rows"], args.plot or args.out.with_suffix(".png"))
    print(f"\nwrote {args.out}; the run took {meta['wall_seconds']:.0f} s", file=sys.stderr)
    return 0


def measure(args: Any, links: list[LinkSpec], specs: list[dict], workdir: Path) -> dict:
    """Runs the workers (shaped here, or on a cluster's real link); returns what the analysis
    needs besides their outputs, which stay in `workdir`."""
    run_config = {
        "platform": args.platform if args.coordinator else "cpu",
        "preset": args.preset,
        "batch_size": args.batch_size,
        "methods": specs,
        "hlo_dir": str(workdir / "hlo"),
    }
    meta = {
        "command": " ".join(["python", "benchmarks/link.py", *sys.argv[1:]]),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "library_modified": bool(_git("status", "--porcelain", "--", "diloco_jax")),
        "load_average_1m_start": os.getloadavg()[0],
    }
    if args.coordinator is not None:
        run_config |= {"phases": [{"name": "none", "commands": []}], "schedule": [0] * args.cycles}
        run_workers(None, args, run_config, workdir, args.timeout)
        meta |= {"probes": {}, "delay_impl": "none", "namespace": None}
        meta["worker_json"] = f"worker-{args.process_id}.json"
    else:
        probes, delay_impl, name = run_shaped(args, links, run_config, workdir)
        meta |= {"probes": probes, "delay_impl": delay_impl, "namespace": name}
        meta["worker_json"] = "worker-0.json"
    meta["load_average_1m_end"] = os.getloadavg()[0]
    return meta


def analyze(
    args: Any, links: list[LinkSpec], specs: list[dict], workdir: Path, meta: dict
) -> dict[str, Any]:
    """The JSON payload: one row per (link, method), the overlap report, provenance."""
    from diloco_jax.lm import model

    runs = json.loads((workdir / meta["worker_json"]).read_text())["methods"]
    config = model.get_config(args.preset)
    workers = args.workers if args.coordinator is None else args.num_processes
    context = {
        "specs": specs,
        "workers": workers,
        "tokens_per_step": args.batch_size * config.seq_len,
        "mtu": args.mtu,
    }
    rows = []
    for method in args.methods:
        if links:
            rows += rows_for(method, runs[method], links, context)
        else:
            rows.append(cluster_row(method, runs[method], context))
    add_speedups(rows)
    return {
        "benchmark": "link",
        **{k: v for k, v in meta.items() if k not in ("probes", "worker_json")},
        "preset": args.preset,
        "batch_size": args.batch_size,
        "workers": workers,
        "seq_len": config.seq_len,
        "mtu": args.mtu,
        "link_probes": meta["probes"],
        "overlap": overlap_report(runs, rows) if links else None,
        "cpu_count": os.cpu_count(),
        "rows": rows,
    }


def cluster_row(method: str, run: dict, context: dict) -> dict:
    """A multi-host run's row: the measured round on the real link (nothing to predict from:
    no unshaped baseline)."""
    label, _, _, _ = METHODS[method]
    spec = next(s for s in context["specs"] if s["name"] == method)
    measured = round_seconds(run, "none")
    tokens = context["workers"] * context["tokens_per_step"] * spec["inner_steps"]
    return {
        "link": "none",
        "method": method,
        "label": label,
        "inner_steps": spec["inner_steps"],
        "measured_round_s": measured,
        "measured_tokens_per_s": tokens / measured,
        "round_s_all": [round(g, 4) for g in phase_gaps(run, "none")],
    }


def run_shaped(
    args: Any, links: list[LinkSpec], run_config: dict, workdir: Path
) -> tuple[dict, str, str]:
    """The single-host run: the workers' namespaces, their links (probed), the workers; torn
    down after."""
    tag = f"djlink{os.getpid()}"
    control = Path(tempfile.gettempdir()) / f"{tag}.sock"  # short: a UNIX socket's path
    with network(tag, args.workers, args.mtu, control) as net:
        netem = net.has_netem() if args.delay_impl != "relay" else False
        if args.delay_impl == "netem" and not netem:
            raise SystemExit("link.py: --delay-impl netem, but this kernel has no netem qdisc")

        def phase(name: str, link: LinkSpec | None) -> dict:
            commands = link_commands(link, net.names, net.device, netem)
            relay = relay_setting(link, netem)
            return {"name": name, "commands": commands, "relay": relay, "control": str(control)}

        phases = [phase("none", None)]
        probes = {}
        for q, link in enumerate(links):
            phases.append(phase(link.name, link))
            switch_link(phases[-1])
            probes[link.name] = probe_link(net, link, 48000 + q)
        switch_link(phases[0])
        run_config |= {"phases": phases, "schedule": schedule(len(phases), args.cycles)}
        run_workers(net, args, run_config, workdir, args.timeout)
    return probes, "netem" if netem else "relay", tag


if __name__ == "__main__":
    sys.exit(main())
