"""What a worker's death costs two of the candidates the elastic syncer was chosen against,
measured on localhost (docs/faults.md, "Why a gRPC syncer"; benchmarks/README.md):

- jax: one `jax.distributed` cluster of two CPU processes (gloo collectives), each gathering
  the other's number every 0.2 s. Process 1 is SIGKILLed: how long the survivor takes to
  notice, and how it ends (its exit status, its first error line). Then again with process 1
  started anew at once: what its first collective and the survivor do. With JAX's default
  heartbeat timeout and with 3 s.
- torchft: its Lighthouse (`torchft_lighthouse`) and four replica processes; each runs a 1 s
  phase, then asks the Lighthouse for a quorum (its client's `quorum`), heartbeating every
  100 ms meanwhile. Replica 1 is SIGKILLed mid-phase (detect: the kill -> the survivors' first
  quorum without it), then started anew (its start -> its first quorum, whose step it takes),
  then the Lighthouse is SIGKILLed and started anew on its port (the kill -> the next quorum of
  all four; whether its quorum ids start over). Heartbeat timeouts 1 s and 3 s, as
  elastic_faults.py measures the syncer.

The two need different environments: `jax` the project's own, `torchft` one with PyTorch and
torchft (neither a dependency of diloco-jax):

    .venv/bin/python benchmarks/elastic_candidates.py jax
    python3.11 -m venv /tmp/tft && /tmp/tft/bin/pip install torch==2.13.0 torchft==0.2.0 numpy
    /tmp/tft/bin/python benchmarks/elastic_candidates.py torchft

Each writes its own key of benchmarks/results/elastic_candidates.json and keeps the other's.
Every process it starts is ended before it returns.
"""

import argparse
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "elastic_candidates.json"
JAX_STEP_S = 0.2
TORCHFT_PHASE_S = 1.0
TORCHFT_REPLICAS = 4
LIMIT_S = 240.0  # the longest any one wait may take


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def records(path: Path) -> list[dict]:
    """The JSON lines a child printed (its other output skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut by a kill
    return out


def fatal_line(path: Path) -> str | None:
    """A child's fatal log line (glog's F severity: JAX ending the process), if any."""
    for line in path.read_text(errors="replace").splitlines():
        if re.match(r"F\d{4} ", line):
            return line.split("] ", 1)[-1].strip()[:400]
    return None


def wait_for(predicate, what: str, limit: float = LIMIT_S) -> float:
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {limit:.0f} s waiting for {what}")
        time.sleep(0.02)
    return time.time()


class Children:
    """Child processes of this script, each writing stdout and stderr to its own file."""

    def __init__(self, folder: Path):
        self.folder, self.procs = folder, {}

    def spawn(self, name: str, argv: list[str]) -> float:
        log = open(self.folder / f"{name}.log", "ab")  # noqa: SIM115 (the child keeps it)
        started = time.time()
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        return started

    def log(self, name: str) -> Path:
        return self.folder / f"{name}.log"

    def kill(self, name: str) -> float:
        self.procs[name].send_signal(signal.SIGKILL)
        killed = time.time()
        self.procs[name].wait()
        return killed

    def end(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


# --- jax -------------------------------------------------------------------------------------


def jax_process(port: int, process_id: int, heartbeat: int | None) -> None:
    """One process of the two-process cluster: a cross-process gather every JAX_STEP_S."""
    import numpy as np
    from jax.experimental import multihost_utils

    from diloco_jax import distributed

    distributed.initialize(f"127.0.0.1:{port}", 2, process_id, platform="cpu",
                           heartbeat_timeout=heartbeat)  # fmt: skip
    print(json.dumps({"event": "joined", "time": time.time()}), flush=True)
    step = 0
    while True:
        try:
            numbers = multihost_utils.process_allgather(np.int32(process_id))
        except Exception as error:  # try again, as a program that survives a death would
            print(json.dumps({"event": "error", "time": time.time(), "error": str(error)[:300]}),
                  flush=True)  # fmt: skip
        else:
            print(json.dumps({"step": step, "time": time.time(), "numbers": numbers.tolist()}),
                  flush=True)  # fmt: skip
            step += 1
        time.sleep(JAX_STEP_S)


def jax_trial(folder: Path, heartbeat: int | None, restart: bool) -> dict:
    children, port = Children(folder), free_port()
    argv = [sys.executable, __file__, "_jax-process", "--port", str(port)]
    if heartbeat is not None:
        argv += ["--heartbeat", str(heartbeat)]
    try:
        for i in (0, 1):
            children.spawn(f"process-{i}", [*argv, "--process-id", str(i)])
        wait_for(lambda: len(records(children.log("process-0"))) >= 6, "five gathers")
        killed = children.kill("process-1")
        if restart:
            children.spawn("process-1-again", [*argv, "--process-id", "1"])
        survivor = children.procs["process-0"]
        ended = None
        try:
            ended = wait_for(lambda: survivor.poll() is not None, "the survivor's end")
        except TimeoutError:
            pass
        mine = [r for r in records(children.log("process-0")) if r["time"] > killed]
        errors = [r for r in mine if r.get("event") == "error"]
        row = {
            "heartbeat_timeout_s": heartbeat,
            "restarted": restart,
            "survivor_gathers_after_kill": sum("step" in r for r in mine),
            "survivor_first_error_s": round(errors[0]["time"] - killed, 2) if errors else None,
            "survivor_first_error": errors[0]["error"] if errors else None,
            "survivor_failed_retries": len(errors),
            "survivor_ended_s": None if ended is None else round(ended - killed, 2),
            "survivor_exit": survivor.poll(),  # negative: the signal that ended it
            "survivor_fatal": fatal_line(children.log("process-0")),
        }
        if restart:
            again = children.procs["process-1-again"]
            if again.poll() is None:
                try:
                    wait_for(lambda: again.poll() is not None, "the restarted process", 30)
                except TimeoutError:
                    pass
            mine = records(children.log("process-1-again"))
            row.update(
                restarted_joined=any(r.get("event") == "joined" for r in mine),
                restarted_gathers=sum("step" in r for r in mine),
                restarted_exit=again.poll(),  # None: still running (hung) when given up
                restarted_fatal=fatal_line(children.log("process-1-again")),
            )
        return row
    finally:
        children.end()


def run_jax(folder: Path) -> dict:
    import jax

    rows = []
    for heartbeat in (None, 3):
        for restart in (False, True):
            sub = folder / f"jax-{heartbeat}-{restart}"
            sub.mkdir()
            rows.append(jax_trial(sub, heartbeat, restart))
            print(json.dumps(rows[-1]), flush=True)
    return {"jax": jax.__version__, "jaxlib": metadata.version("jaxlib"), "runs": rows}


# --- torchft ---------------------------------------------------------------------------------


def torchft_replica(address: str, replica: int) -> None:
    """One replica group of one process: heartbeats every 100 ms (its own client, its own
    thread), and a quorum after each TORCHFT_PHASE_S phase, taking the quorum's highest step
    (torchft's Manager heals a replica behind the others the same way, from that step)."""
    from torchft.coordination import LighthouseClient

    me = f"replica-{replica}"

    def client():
        while True:
            try:
                return LighthouseClient(address, connect_timeout=timedelta(seconds=1))
            except Exception:  # the Lighthouse not (yet, again) listening
                time.sleep(0.1)

    def heartbeats():
        beat = client()
        while True:
            try:
                beat.heartbeat(me, timeout=timedelta(seconds=1))
            except Exception:
                beat = client()
            time.sleep(0.1)

    print(json.dumps({"event": "started", "time": time.time()}), flush=True)
    threading.Thread(target=heartbeats, daemon=True).start()
    asks, step = client(), 0
    while True:
        time.sleep(TORCHFT_PHASE_S)  # the inner phase
        while True:
            try:
                quorum = asks.quorum(replica_id=me, timeout=timedelta(seconds=60), address=me,
                                     store_address=me, step=step, world_size=1,
                                     shrink_only=False)  # fmt: skip
                break
            except Exception as error:
                print(json.dumps({"event": "error", "time": time.time(), "error": str(error)}),
                      flush=True)  # fmt: skip
                time.sleep(0.1)
                asks = client()
        members = sorted(int(p.replica_id.split("-")[1]) for p in quorum.participants)
        step = max(p.step for p in quorum.participants) + 1
        print(json.dumps({"time": time.time(), "quorum_id": quorum.quorum_id,
                          "members": members, "step": step}), flush=True)  # fmt: skip


def torchft_trial(folder: Path, heartbeat_ms: int) -> dict:
    children, port = Children(folder), free_port()
    lighthouse = [str(Path(sys.executable).with_name("torchft_lighthouse")),
                  "--bind", f"127.0.0.1:{port}", "--min_replicas", "2",
                  "--heartbeat_timeout_ms", str(heartbeat_ms), "--join_timeout_ms", "60000",
                  "--quorum_tick_ms", "100"]  # fmt: skip
    replica = [sys.executable, __file__, "_torchft-replica", "--address",
               f"http://127.0.0.1:{port}", "--replica"]  # fmt: skip

    def quorums(r: int | str) -> list[dict]:
        return [x for x in records(children.log(f"replica-{r}")) if "quorum_id" in x]

    def next_quorum_of(r: int, after: float, members=None) -> dict:
        def found():
            return [q for q in quorums(r) if q["time"] > after
                    and (members is None or q["members"] == members)]  # fmt: skip

        wait_for(lambda: bool(found()), f"replica {r}'s quorum of {members}")
        return found()[0]

    everyone = list(range(TORCHFT_REPLICAS))
    try:
        children.spawn("lighthouse", lighthouse)
        for r in everyone:
            children.spawn(f"replica-{r}", [*replica, str(r)])
        wait_for(lambda: sum(q["members"] == everyone for q in quorums(0)) >= 3, "3 quorums")
        last = next_quorum_of(0, time.time())
        time.sleep(0.3)  # into the next phase
        killed = children.kill("replica-1")
        first = next_quorum_of(0, killed)
        survivors = [r for r in everyone if r != 1]
        assert first["members"] == survivors, first
        next_quorum_of(0, next_quorum_of(0, first["time"])["time"])  # two more rounds
        started = children.spawn("replica-1-again", [*replica, "1"])
        booted = wait_for(
            lambda: any(x.get("event") == "started"
                        for x in records(children.log("replica-1-again"))),
            "the restarted replica's start",
        )  # fmt: skip
        back = wait_for(lambda: bool(quorums("1-again")), "the restarted replica's first quorum")
        rejoined = quorums("1-again")[0]
        others = next_quorum_of(0, started, everyone)
        before = next_quorum_of(0, back + TORCHFT_PHASE_S, everyone)
        time.sleep(0.3)
        lighthouse_killed = children.kill("lighthouse")
        children.spawn("lighthouse-again", lighthouse)
        again = next_quorum_of(0, lighthouse_killed, everyone)
        return {
            "heartbeat_timeout_s": heartbeat_ms / 1000,
            "detect_s": round(first["time"] - killed, 3),
            "step_before_kill": last["step"],
            "restarted_start_to_client_s": round(booted - started, 2),
            "restarted_start_to_quorum_s": round(back - started, 2),
            "restarted_first_quorum_of_all": rejoined["members"] == everyone,
            "restarted_took_the_step": rejoined["step"] == others["step"],
            "lighthouse_kill_to_quorum_s": round(again["time"] - lighthouse_killed, 2),
            "quorum_id_before_lighthouse_kill": before["quorum_id"],
            "quorum_id_after": again["quorum_id"],
            "steps_kept": again["step"] > before["step"],
        }
    finally:
        children.end()


def run_torchft(folder: Path) -> dict:
    rows = []
    for heartbeat_ms in (1000, 3000):
        sub = folder / f"torchft-{heartbeat_ms}"
        sub.mkdir()
        rows.append(torchft_trial(sub, heartbeat_ms))
        print(json.dumps(rows[-1]), flush=True)
    return {"torch": metadata.version("torch"), "torchft": metadata.version("torchft"),
            "replicas": TORCHFT_REPLICAS, "phase_s": TORCHFT_PHASE_S, "runs": rows}  # fmt: skip


# --- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["jax", "torchft", "_jax-process", "_torchft-replica"])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--port", type=int)
    parser.add_argument("--process-id", type=int)
    parser.add_argument("--heartbeat", type=int)
    parser.add_argument("--address")
    parser.add_argument("--replica", type=int)
    args = parser.parse_args(argv)
    if args.part == "_jax-process":
        jax_process(args.port, args.process_id, args.heartbeat)
        return 0
    if args.part == "_torchft-replica":
        torchft_replica(args.address, args.replica)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        result = (run_jax if args.part == "jax" else run_torchft)(Path(tmp))
    result.update(machine=f"{platform.machine()}, {os.cpu_count()} CPUs",
                  python=platform.python_version(),
                  measured=datetime.now(UTC).strftime("%Y-%m-%d"))  # fmt: skip
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    previous[args.part] = result
    args.out.write_text(json.dumps(previous, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
