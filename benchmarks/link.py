"""Measured on a shaped link: M training processes (JAX's multi-process runtime, gloo CPU
collectives over TCP, one device each) in a network namespace whose loopback has a known
rate and delay; wall-clock per round against `diloco_jax.netsim`'s prediction, for data
parallelism and five DiLoCo methods. See benchmarks/README.md, "link.py".

    sudo .venv/bin/python benchmarks/link.py [--quick] [--links 1gbit:5ms,100mbit:20ms,10mbit:50ms]
        [--methods dp,diloco,streaming,int4,sparseloco,eager] [--preset tiny] [--batch-size 8]
        [--workers 2] [--rounds 4] [--dp-steps 4] [--cycles 2] [--inner-steps H] [--mtu 1500]
        [--delay-impl auto|netem|nfqueue] [--out benchmarks/results/link.json] [--plot PATH]
        [--workdir DIR] [--reanalyze DIR]

    # several hosts, no shaping (the real link between them), on host I of N:
    .venv/bin/python benchmarks/link.py --links none --coordinator HOST:PORT \\
        --num-processes N --process-id I [--platform cpu] [--out PATH]

A link is RATE:DELAY[:LOSS], e.g. 100mbit:20ms or 10mbit:50ms:0.1%. RATE is each worker's
uplink (its packets, TCP/IP headers included; every worker has its own: HTB classes keyed by
the sending process's group id); DELAY is one way (a round trip is 2 x DELAY: each packet
crosses the shaping once). Needs root, `ip` and `tc` (iproute2) and `iptables`. The delay
is netem's where the kernel has it, else a user-space NFQUEUE delay line (link_worker.py).

Each method is one `train_diloco` / `train_sync` call whose rounds run in blocks of
`--rounds` (data parallelism: `--dp-steps` steps, a "round" being one step), block by block
on the unshaped loopback (its compute time) and each link, forwards then backwards
(`--cycles`), process 0 switching the link between blocks; a figure is the median of a
phase's rounds, less the first of each block. The prediction is
`netsim.predict_round_seconds` from the unshaped round time, the link and the collectives of
the compiled round (XLA's HLO dump of the program the run compiled).
"""

import argparse
import contextlib
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER = HERE / "link_worker.py"
DEFAULT_OUT = HERE / "results" / "link.json"
DEFAULT_LINKS = "1gbit:5ms,100mbit:20ms,10mbit:50ms"
QUICK_LINKS = "100mbit:20ms,10mbit:50ms"
TOOLS = ("ip", "tc", "iptables")
SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")
GID_BASE = 46000  # worker k's packets carry group id GID_BASE + k: its HTB class
CLASS_BASE = 10  # worker k's uplink is HTB class 1:(CLASS_BASE + k)
OTHER_CLASS = 99  # packets no worker owns (handshake replies): the same rate
COORDINATOR_PORT = 47001  # a fresh namespace has every port free

# name -> (label, kind, inner steps, train_diloco keyword shorthand)
METHODS: dict[str, tuple[str, str, int, dict[str, Any]]] = {
    "dp": ("data parallel", "sync", 1, {}),
    "diloco": ("DiLoCo", "diloco", 25, {}),
    "streaming": ("Streaming DiLoCo P=4", "diloco", 24, {"fragments": 4}),  # H a multiple of P
    "int4": ("int4 two-stage + EF", "diloco", 25, {"compression": "int4,ef=1"}),
    "sparseloco": ("SparseLoCo", "diloco", 25, {"compression": "sparseloco"}),
    "eager": ("eager d=1", "diloco", 25, {"outer_delay": 1, "eager": True}),
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
# The namespace and its shaping.


def tool(name: str) -> str | None:
    """Path of a system tool, looking in the sbin directories too (not always on PATH)."""
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN))


def requirements_problem() -> str | None:
    """Why this machine can't shape a namespace (one line), or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc and iptables)"
    missing = [t for t in TOOLS if tool(t) is None]
    if missing:
        return f"needs {', '.join(missing)} (packages iproute2, iptables)"
    name = f"djlinkcheck{os.getpid()}"
    made = subprocess.run([tool("ip"), "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run([tool("ip"), "netns", "del", name], capture_output=True)
    return None


def link_commands(link: LinkSpec | None, workers: int, netem: bool, queue: int) -> list[list[str]]:
    """The commands (run inside the namespace) that put `link` on its loopback, after
    removing whatever shaping was there; None: no shaping. An HTB class of `link.rate` per
    worker (and one for packets no worker owns), each with a netem leaf holding the delay,
    or a plain FIFO leaf and the NFQUEUE rule that sends arriving packets to the delay
    line's `queue`."""
    commands = ["tc qdisc del dev lo root".split(), "iptables -t mangle -F PREROUTING".split()]
    if link is None:
        return commands
    commands.append(f"tc qdisc add dev lo root handle 1: htb default {OTHER_CLASS}".split())
    rate = f"{link.rate:.0f}bit"
    for c in [CLASS_BASE + k for k in range(workers)] + [OTHER_CLASS]:
        commands.append(
            f"tc class add dev lo parent 1: classid 1:{c} htb rate {rate} ceil {rate} "
            "quantum 60000".split()
        )
        leaf = f"tc qdisc add dev lo parent 1:{c} handle {c}:".split()
        if netem:
            leaf += f"netem delay {link.delay * 1e6:.0f}us limit 100000".split()
            leaf += ["loss", f"{link.loss * 100:g}%"] if link.loss else []
        else:
            leaf += "pfifo limit 100000".split()
        commands.append(leaf)
    if not netem:  # the delay line holds packets on their way in
        commands.append(
            f"iptables -t mangle -A PREROUTING -i lo -j NFQUEUE --queue-num {queue}".split()
        )
    return commands


def classify_commands(workers: int) -> list[list[str]]:
    """iptables rules giving worker k's packets (its group id) HTB class 1:(CLASS_BASE + k)."""
    return [
        f"iptables -t mangle -A POSTROUTING -o lo -m owner --gid-owner {GID_BASE + k} "
        f"-j CLASSIFY --set-class 1:{CLASS_BASE + k}".split()
        for k in range(workers)
    ]


class Namespace:
    """A network namespace with the loopback up, torn down (its processes, itself, its
    /etc/netns files) by `close`, which `namespace()` calls on any exit."""

    def __init__(self, name: str, mtu: int):
        self.name = name
        self.processes: list[subprocess.Popen] = []
        self.etc = Path("/etc/netns") / name
        self._run([tool("ip"), "netns", "add", name])
        self.exec(["ip", "link", "set", "lo", "up", "mtu", str(mtu)])
        # Long-haul TCP tuning: no slow start after the compute phase's idle link, windows
        # and host queues large enough for the bandwidth-delay product.
        buffers = "4096 131072 67108864"
        self.exec(
            "sysctl -q -w net.ipv4.tcp_slow_start_after_idle=0".split()
            + ["net.ipv4.tcp_limit_output_bytes=67108864"]
            + [f"net.ipv4.tcp_rmem={buffers}", f"net.ipv4.tcp_wmem={buffers}"]
        )
        # `ip netns exec` mounts these over /etc: the host's name must resolve to the
        # loopback, where gloo's listening sockets go, whatever it resolves to outside.
        self.etc.mkdir(parents=True, exist_ok=True)
        hostname = os.uname().nodename
        (self.etc / "hosts").write_text(f"127.0.0.1 localhost {hostname}\n")

    @staticmethod
    def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
        return done

    def prefix(self) -> list[str]:
        return [tool("ip"), "netns", "exec", self.name]

    def exec(self, argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
        return self._run(self.prefix() + argv, check)

    def apply(self, commands: list[list[str]]) -> None:
        for argv in commands:
            optional = argv[:3] == ["tc", "qdisc", "del"] or "-F" in argv
            self.exec(argv, check=not optional)

    def has_netem(self) -> bool:
        probe = self.exec("tc qdisc add dev lo root netem delay 1ms".split(), check=False)
        self.exec("tc qdisc del dev lo root".split(), check=False)
        return probe.returncode == 0

    def spawn(self, argv: list[str], gid: int | None = None, **kwargs: Any) -> subprocess.Popen:
        """Starts `argv` inside the namespace (as group `gid`: its packets' HTB class), in
        its own process group so `close` can end it and its children."""
        proc = subprocess.Popen(
            self.prefix() + argv,
            group=gid,
            extra_groups=[] if gid else None,
            start_new_session=True,
            **kwargs,
        )
        self.processes.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.processes:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
        self._run([tool("ip"), "netns", "del", self.name], check=False)
        shutil.rmtree(self.etc, ignore_errors=True)


@contextlib.contextmanager
def namespace(name: str, mtu: int) -> Iterator[Namespace]:
    """A Namespace, torn down on any exit, Ctrl-C and SIGTERM / SIGHUP included."""

    def interrupted(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {s: signal.signal(s, interrupted) for s in (signal.SIGTERM, signal.SIGHUP)}
    ns = None
    try:
        ns = Namespace(name, mtu)
        yield ns
    finally:
        if ns is not None:
            ns.close()
        else:  # failed half-way through creating it
            subprocess.run([tool("ip"), "netns", "del", name], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
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


def probe_link(ns: Namespace, link: LinkSpec, port: int) -> dict[str, float]:
    """The link as packets see it: round trip of a 1-byte message, rate of a bulk transfer
    from worker 0's group to worker 1's."""
    server = ns.spawn(
        [sys.executable, str(WORKER), "probe", "--port", str(port), "--serve"],
        gid=GID_BASE + 1,
        stdout=subprocess.PIPE,
        text=True,
    )
    wait_ready(server, "link probe")
    size = max(256 << 10, int(link.rate / 8 * 0.5))  # about half a second of data
    client = ns.spawn(
        [sys.executable, str(WORKER), "probe", "--port", str(port), "--bytes", str(size)],
        gid=GID_BASE,
        stdout=subprocess.PIPE,
        text=True,
    )
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
    ns: Namespace | None, args: Any, config: dict, workdir: Path, timeout: float
) -> dict[str, Any]:
    """Starts the M training processes (in `ns`, or here for a multi-host run) and returns
    process 0's results."""
    local = ns is not None
    ids = range(args.workers) if local else [args.process_id]
    num = args.workers if local else args.num_processes
    coordinator = f"127.0.0.1:{COORDINATOR_PORT}" if local else args.coordinator
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
            procs.append((ns.spawn(argv, gid=GID_BASE + k, **kwargs), log))
        else:
            procs.append((subprocess.Popen(argv, **kwargs), log))
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
    ax.set_title("Measured over a shaped loopback (x: netsim's prediction)")
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
    parser.add_argument("--delay-impl", default="auto", choices=["auto", "netem", "nfqueue"])
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
    # tc, ip, iptables and sysctl run by name inside the namespace (and in the workers).
    os.environ["PATH"] = os.pathsep.join([os.environ.get("PATH", ""), *SBIN])
    links = [] if args.links == "none" else [parse_link(t) for t in args.links.split(",")]
    if args.coordinator is None and args.reanalyze is None:
        problem = requirements_problem()
        if problem:
            print(f"link.py: {problem}; run as root on Linux with them installed", file=sys.stderr)
            return 2
    start = time.monotonic()
    specs = method_specs(args.methods, args.rounds, args.dp_steps, args.inner_steps)
    with tempfile.TemporaryDirectory(prefix="djlink") as tmp:
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
    """The single-host run: a namespace, its links (probed), the workers; torn down after."""
    name = f"djlink{os.getpid()}"
    with namespace(name, args.mtu) as ns:
        netem = ns.has_netem() if args.delay_impl != "nfqueue" else False
        if args.delay_impl == "netem" and not netem:
            raise SystemExit("link.py: --delay-impl netem, but this kernel has no netem qdisc")
        ns.apply(classify_commands(args.workers))
        if not netem and links:
            queues = [f"--queue={q + 1}:{x.delay * 1e3:g}:{x.loss:g}" for q, x in enumerate(links)]
            line = ns.spawn(
                [sys.executable, str(WORKER), "delay", *queues], stdout=subprocess.PIPE, text=True
            )
            wait_ready(line, "delay line")
        phases = [{"name": "none", "commands": link_commands(None, args.workers, netem, 0)}]
        probes = {}
        for q, link in enumerate(links):
            commands = link_commands(link, args.workers, netem, q + 1)
            ns.apply(commands)
            probes[link.name] = probe_link(ns, link, 48000 + q)
            phases.append({"name": link.name, "commands": commands})
        ns.apply(phases[0]["commands"])
        run_config |= {"phases": phases, "schedule": schedule(len(phases), args.cycles)}
        run_workers(ns, args, run_config, workdir, args.timeout)
    return probes, "netem" if netem else "nfqueue", name


if __name__ == "__main__":
    sys.exit(main())
