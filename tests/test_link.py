"""benchmarks/link.py: link specs, shaping commands and round timing by hand; and, where the
machine allows it (root, ip and tc, tun devices, network namespaces), a tiny run over a
shaped link and its cleanup, on normal exit and on SIGTERM."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import link  # noqa: E402  (benchmarks/ is not a package)

RUN_TIMEOUT_S = 170


def test_parse_link():
    spec = link.parse_link("100mbit:20ms")
    assert (spec.rate, spec.delay, spec.loss) == (100e6, 0.02, 0.0)
    spec = link.parse_link("1.5gbit:250us:0.1%")
    assert spec.rate == pytest.approx(1.5e9)
    assert spec.delay == pytest.approx(250e-6)
    assert spec.loss == pytest.approx(0.001)
    for bad in ("100mbit", "fast:20ms", "100mbit:20", "100mbit:20ms:2", "0mbit:1ms"):
        with pytest.raises(ValueError):
            link.parse_link(bad)


def test_link_commands_shape_every_worker_uplink():
    spec = link.parse_link("10mbit:50ms:1%")
    names = ["djlink7-0", "djlink7-1"]
    netem = link.link_commands(spec, names, "djlink", netem=True)
    # Per worker: remove, an HTB root, its class at the rate, a leaf.
    assert [c[:3] for c in netem] == [["tc", "-n", n] for n in names for _ in range(4)]
    classes = [c for c in netem if c[3:5] == ["class", "add"]]
    assert [c[c.index("rate") + 1] for c in classes] == ["10000000bit"] * 2
    assert [c[c.index("ceil") + 1] for c in classes] == ["10000000bit"] * 2
    leaves = [c for c in netem if "netem" in c]
    assert len(leaves) == 2 and all(c[c.index("dev") + 1] == "djlink" for c in leaves)
    assert leaves[0][-6:] == ["delay", "50000us", "limit", "100000", "loss", "1%"]
    assert link.relay_setting(spec, netem=True) == (0.0, 0.0)  # netem holds the delay
    relayed = link.link_commands(spec, names, "djlink", netem=False)
    assert not any("netem" in c for c in relayed)
    assert [c[-3:] for c in relayed if "pfifo" in c] == [["pfifo", "limit", "100000"]] * 2
    assert link.relay_setting(spec, netem=False) == (0.05, 0.01)
    # No link: only the removals (allowed to fail when nothing is there), no delay.
    none = link.link_commands(None, names, "djlink", netem=False)
    assert none == [netem[0], netem[4]]
    assert link.relay_setting(None, netem=False) == (0.0, 0.0)


def test_a_machine_that_cannot_shape_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setenv("PATH", os.environ["PATH"])  # main() adds the sbin directories
    monkeypatch.setattr(link.os, "geteuid", lambda: 1000)
    assert link.requirements_problem() == "needs root (network namespaces, tun devices and tc)"
    assert link.main(["--links", "10mbit:20ms"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("link.py: needs root")
    monkeypatch.setattr(link.os, "geteuid", lambda: 0)
    monkeypatch.setattr(link, "tool", lambda name: None if name == "tc" else "/bin/true")
    assert link.requirements_problem() == "needs tc (package iproute2)"
    monkeypatch.setattr(link, "tool", lambda name: "/bin/true")
    monkeypatch.setattr(link.os.path, "exists", lambda path: path != "/dev/net/tun")
    assert link.requirements_problem() == "needs tun devices (/dev/net/tun)"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--methods", "dp,nope"], "unknown methods"),
        (["--rounds", "1"], "must be >= 2"),
        (["--workers", "1"], "--workers must be in [2, 254]"),
        (["--workers", "255"], "--workers must be in [2, 254]"),
        (["--coordinator", "h:1"], "go together"),
        (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "0"], "--links none"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        link.parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_method_specs_keep_streaming_h_a_multiple_of_p():
    specs = {s["name"]: s for s in link.method_specs(list(link.METHODS), 4, 6, None)}
    assert specs["dp"]["inner_steps"] == 1 and specs["dp"]["rounds_per_block"] == 6
    assert specs["diloco"]["inner_steps"] == 25 and specs["streaming"]["inner_steps"] == 24
    short = {s["name"]: s for s in link.method_specs(["streaming", "eager"], 3, 3, 10)}
    assert short["streaming"]["inner_steps"] == 8 and short["eager"]["inner_steps"] == 10


def test_schedule_goes_forwards_then_backwards():
    assert link.schedule(3, 1) == [0, 1, 2]
    assert link.schedule(3, 3) == [0, 1, 2, 2, 1, 0, 0, 1, 2]


def test_phase_gaps_drop_the_switch_and_the_last_gap():
    # Blocks of 3 rounds on phases none, slow, slow, none: 13 entries. Unshaped rounds take
    # 1 s, slow ones 5 s; the gap after a block's last entry straddles a switch (3 s), and
    # the last gap is the dispatch artefact (0.1 s).
    ends = [0, 1, 2, 5, 10, 15, 20, 25, 30, 33, 34, 35, 35.1]
    run = {"round_end_s": ends, "phases": ["none", "slow"], "schedule": [0, 1, 1, 0]}
    run["rounds_per_block"] = 3
    assert link.phase_gaps(run, "none") == [1, 1, 1, 1]
    assert link.phase_gaps(run, "slow") == [5, 5, 5, 5]
    assert link.round_seconds(run, "slow") == 5


def _cannot_shape() -> str | None:
    if sys.platform != "linux":
        return "network namespaces are Linux-only"
    return link.requirements_problem()


def _namespaces() -> list[str]:
    listed = subprocess.run([link.tool("ip"), "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]


def _left_behind(tag: str) -> list[str]:
    """What a run tagged `tag` left: its namespaces, /etc/netns files, relay socket, devices."""
    mine = [n for n in _namespaces() if n.startswith(f"{tag}-")]
    etc = [str(p) for p in Path("/etc/netns").glob(f"{tag}-*")]
    sock = Path(link.tempfile.gettempdir()) / f"{tag}.sock"
    links = subprocess.run([link.tool("ip"), "-o", "link"], capture_output=True, text=True)
    prefix = link.tun_prefix(int(tag.removeprefix("djlink")))
    tuns = [line for line in links.stdout.splitlines() if f": {prefix}" in line]
    return mine + etc + ([str(sock)] if sock.exists() else []) + tuns


def _command(out: Path, *extra: str) -> list[str]:
    """One 10 Mbit/s, 20 ms link; data parallelism and DiLoCo (H = 4) on the micro model,
    two rounds each unshaped and shaped."""
    return [
        sys.executable,
        str(ROOT / "benchmarks" / "link.py"),
        *("--links", "10mbit:20ms", "--methods", "dp,diloco", "--preset", "micro"),
        *("--inner-steps", "4", "--rounds", "2", "--dp-steps", "2", "--cycles", "1"),
        *("--batch-size", "4", "--no-plot", "--out", str(out), *extra),
    ]


@pytest.mark.slow
def test_tiny_run_over_a_shaped_link(tmp_path):
    problem = _cannot_shape()
    if problem:
        pytest.skip(f"cannot shape a link here: {problem}")
    out = tmp_path / "link.json"
    done = subprocess.run(
        _command(out, "--timeout", str(RUN_TIMEOUT_S - 20)),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["delay_impl"] in ("relay", "netem")
    assert _left_behind(result["namespace"]) == []
    probe = result["link_probes"]["10mbit:20ms"]
    assert 0.03 < probe["rtt_s"] < 0.2  # two one-way delays of 20 ms
    assert {r["method"] for r in result["rows"]} == {"dp", "diloco"}
    for row in result["rows"]:
        for field in (
            "link",
            "rate_bits_per_s",
            "delay_s",
            "method",
            "measured_round_s",
            "predicted_round_s",
            "compute_round_s",
            "inner_steps",
        ):
            assert field in row, field
        assert row["rate_bits_per_s"] == 10e6 and row["delay_s"] == 0.02
        # Every round waits for the link: several 40 ms round trips at least.
        assert row["measured_round_s"] > row["compute_round_s"] + 0.1
        assert row["predicted_round_s"] > row["compute_round_s"]


@pytest.mark.slow
def test_sigterm_tears_the_namespace_down(tmp_path):
    problem = _cannot_shape()
    if problem:
        pytest.skip(f"cannot shape a link here: {problem}")
    proc = subprocess.Popen(
        _command(tmp_path / "link.json"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    tag = f"djlink{proc.pid}"
    try:
        deadline = time.monotonic() + 60
        while f"{tag}-1" not in _namespaces():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the namespace never appeared"
            time.sleep(0.2)
        time.sleep(3)  # the relay and the probes are up; the workers are starting
        assert proc.poll() is None, "link.py ended before the signal"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _left_behind(tag) == []
    assert os.path.exists(tmp_path) and not (tmp_path / "link.json").exists()


@pytest.mark.slow
def test_cluster_mode_measures_the_real_link_without_shaping(tmp_path):
    # Two "hosts" on this one: each process started as on its own host, --links none.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "benchmarks" / "link.py"),
                *("--links", "none", "--coordinator", f"127.0.0.1:{port}"),
                *("--num-processes", "2", "--process-id", str(i), "--methods", "diloco"),
                *("--preset", "micro", "--inner-steps", "2", "--rounds", "3", "--cycles", "1"),
                *("--batch-size", "2", "--out", str(tmp_path / f"host{i}.json")),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        errors = [p.communicate(timeout=RUN_TIMEOUT_S)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for e in errors]
    for i in range(2):
        result = json.loads((tmp_path / f"host{i}.json").read_text())
        assert result["namespace"] is None and result["delay_impl"] == "none"
        (row,) = result["rows"]
        assert (row["link"], row["method"], row["inner_steps"]) == ("none", "diloco", 2)
        assert len(row["round_s_all"]) == 2  # 3 rounds after the first (compile), less the last
        assert row["measured_round_s"] > 0
        assert row["measured_tokens_per_s"] == pytest.approx(
            2 * 2 * 32 * 2 / row["measured_round_s"]  # M B L H: micro has L = 32
        )


def test_the_relay_takes_only_well_formed_settings():
    import link_worker

    assert link_worker.parse_relay_setting(b"0.02 0.001") == (0.02, 0.001)
    assert link_worker.parse_relay_setting(repr(0.1).encode() + b" 0.0") == (0.1, 0.0)
    for bad in (b"", b"0.02", b"0.02 0 1", b"fast slow", b"\xff\xfe", b"nan 0", b"0 1", b"-1 0"):
        assert link_worker.parse_relay_setting(bad) is None, bad


NETWORK_THEN_SLEEP = """
import os, sys, time
sys.path.insert(0, {benchmarks!r})
import link
tag = f"djlink{{os.getpid()}}"
with link.network(tag, 2, 1500, link.Path(link.tempfile.gettempdir()) / f"{{tag}}.sock") as net:
    print(net.processes[0].pid, flush=True)
    time.sleep(300)
"""
MALFORMED = [b"", b"garbage", b"0.01", b"1 2 3", b"\xff\xfe", b"nan 0", b"0.01 1.5"]


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_killed_run_leaves_only_what_the_next_start_sweeps():
    """Issue 40, finding 7: link.py killed with SIGKILL left its namespaces, /etc/netns
    entries, relay socket and a root SCHED_FIFO relay running, and nothing swept them; a
    malformed datagram crashed the relay. Now: the relay shrugs off malformed settings, dies
    with its parent, and `sweep_stale` (which every start runs) removes the rest."""
    problem = _cannot_shape()
    if problem:
        pytest.skip(f"cannot make namespaces here: {problem}")
    script = NETWORK_THEN_SLEEP.format(benchmarks=str(ROOT / "benchmarks"))
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    tag = f"djlink{proc.pid}"
    try:
        relay = int(proc.stdout.readline())
        control = Path(link.tempfile.gettempdir()) / f"{tag}.sock"
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            for datagram in [*MALFORMED, b"0.001 0"]:
                sock.sendto(datagram, str(control))
        time.sleep(0.5)
        assert _running(relay), "a malformed setting ended the relay"
        proc.kill()  # SIGKILL: link.py gets no chance to clean up
        proc.wait()
        deadline = time.monotonic() + 10
        while _running(relay) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(relay), "the relay outlived link.py"
        ignored = proc.stderr.read().decode().count("relay: ignored a malformed setting")
        assert ignored == len(MALFORMED)
        assert {f"{tag}-0", f"{tag}-1"} <= set(_namespaces())  # left behind by the kill
        removed = link.sweep_stale()
        assert {f"namespace {tag}-0", f"namespace {tag}-1"} <= set(removed)
        assert _left_behind(tag) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        link.sweep_stale()
