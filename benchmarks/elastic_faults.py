"""How fast an elastic run (`diloco_jax.elastic`) notices and heals a fault, on localhost: a
syncer and M worker processes training benchmarks/elastic_lm.py's task, a worker SIGKILLed
in its inner phase and restarted once the syncer has left it out, then the syncer SIGKILLed
and restarted. Timed from the syncer's log and history (wall clock, ms) against the moment
each signal was sent. See benchmarks/README.md, "elastic_faults.py".

    .venv/bin/python benchmarks/elastic_faults.py [--workers 4] [--rounds 24] [--inner-steps 25]
        [--heartbeat-timeouts 1,3] [--out benchmarks/results/elastic_faults.json]

Per heartbeat timeout T, one run:
- detect: SIGKILL of worker 1 -> the syncer's "worker 1 removed" line;
- first sync: SIGKILL -> the close of the survivors' first sync after it;
- startup: the restarted worker's process start -> its join (Python, JAX, the task, connect);
- rejoin: its join -> the close of the first sync that includes it again (it waits for the
  next round to open, then runs a whole inner phase);
- syncer: SIGKILL of the syncer -> its restart -> the first sync it closes after (the workers
  reconnect and push their deltas of that round again).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from diloco_jax.auth import new_secret

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_OUT = HERE / "results" / "elastic_faults.json"
TASK = "elastic_lm:task"


def log_time(text: str, needle: str, nth: int = 1) -> float | None:
    """Wall-clock time of the nth log line holding `needle` (logging's asctime, local)."""
    seen = 0
    for line in text.splitlines():
        if needle in line:
            seen += 1
            if seen == nth:
                stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
                return stamp.timestamp()
    return None


class Run:
    def __init__(self, out: Path, env: dict[str, str], timeout: float):
        self.out, self.env, self.procs = out, env, {}
        self.port = 0
        self.flags = ["--heartbeat-timeout", str(timeout), "--heartbeat-interval", "0.25"]

    def spawn(self, name: str, argv: list[str]) -> float:
        log = open(self.out / f"{name}.log", "ab")  # noqa: SIM115 (the process keeps it)
        started = time.time()
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "diloco_jax.elastic", *argv],
            stdout=log, stderr=subprocess.STDOUT, env=self.env,
        )  # fmt: skip
        return started

    def syncer(self) -> float:
        started = self.spawn("syncer", ["syncer", "--task", TASK, "--dir", str(self.out / "s"),
                                        "--port", str(self.port), *self.flags])  # fmt: skip
        address = self.out / "s" / "syncer.address"
        while not (address.exists() and address.read_text().endswith("\n")):
            time.sleep(0.02)
        self.port = int(address.read_text().strip().rsplit(":", 1)[1])
        return started

    def worker(self, m: int) -> float:
        return self.spawn(f"worker-{m}", ["worker", "--task", TASK, "--worker", str(m),
                                          "--syncer", f"127.0.0.1:{self.port}",
                                          "--dir", str(self.out / "w")])  # fmt: skip

    def syncs(self) -> list[dict]:
        path = self.out / "s" / "history.jsonl"
        if not path.exists():
            return []
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]

    def wait_syncs(self, count: int, limit: float = 600) -> None:
        deadline = time.monotonic() + limit
        while len(self.syncs()) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {count} syncs within {limit} s")
            time.sleep(0.02)

    def log(self, name: str) -> str:
        return (self.out / f"{name}.log").read_text(errors="replace")

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def one_run(args: argparse.Namespace, timeout: float, workdir: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]),
               XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu",
               DILOCO_JAX_SECRET=new_secret().decode(),
               ELASTIC_WORKERS=str(args.workers), ELASTIC_ROUNDS=str(args.rounds),
               ELASTIC_INNER_STEPS=str(args.inner_steps))  # fmt: skip
    run = Run(workdir, env, timeout)
    try:
        run.syncer()
        for m in range(args.workers):
            run.worker(m)
        run.wait_syncs(4)  # round 4 open: the workers are in their inner phase
        run.procs["worker-1"].kill()
        killed = time.time()
        run.wait_syncs(5)
        while log_time(run.log("syncer"), "worker 1 removed") is None:
            time.sleep(0.02)
        restarted = run.worker(1)
        while True:
            syncs = run.syncs()
            back = [s for s in syncs[5:] if 1 in s["included"]]
            if back:
                break
            time.sleep(0.05)
        run.wait_syncs(len(syncs) + 2)
        steady = run.syncs()
        run.procs["syncer"].kill()
        run.procs["syncer"].wait()
        syncer_killed = time.time()
        count = len(steady)
        syncer_started = run.syncer()
        run.wait_syncs(count + 1)
        for name, p in run.procs.items():
            code = p.wait(600)
            if code not in (0, -9):
                raise RuntimeError(f"{name} exited with {code}:\n{run.log(name)[-2000:]}")
        syncs = run.syncs()
        log = run.log("syncer")
        rounds = [b["time"] - a["time"] for a, b in zip(syncs[1:4], syncs[2:5], strict=True)]
        return {
            "heartbeat_timeout_s": timeout,
            "round_s": round(statistics.median(rounds), 3),
            "detect_s": round(log_time(log, "worker 1 removed") - killed, 3),
            "first_sync_after_death_s": round(syncs[4]["time"] - killed, 3),
            "startup_s": round(log_time(log, "worker 1 joined", 2) - restarted, 3),
            "rejoin_s": round(back[0]["time"] - log_time(log, "worker 1 joined", 2), 3),
            "syncer_restart_to_serving_s": round(
                log_time(log, "serving on", 2) - syncer_started, 3
            ),
            "syncer_kill_to_next_sync_s": round(syncs[count]["time"] - syncer_killed, 3),
            "left_out_syncs": [s["round"] for s in syncs if 1 not in s["included"]],
            "syncs": len(syncs),
        }
    finally:
        run.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--inner-steps", type=int, default=25)
    parser.add_argument("--heartbeat-timeouts", default="1,3")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    started = time.time()
    rows = []
    for timeout in (float(x) for x in args.heartbeat_timeouts.split(",")):
        with tempfile.TemporaryDirectory(prefix="djelastic-") as workdir:
            rows.append(one_run(args, timeout, Path(workdir)))
            print(json.dumps(rows[-1]), flush=True)
    result = {
        "benchmark": "elastic_faults",
        "command": "python benchmarks/elastic_faults.py " + " ".join(argv or sys.argv[1:]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "workers": args.workers, "inner_steps": args.inner_steps, "preset": "tiny",
        "batch_size": 8, "cpu_count": os.cpu_count(), "machine": platform.machine(),
        "wall_seconds": round(time.time() - started, 1), "rows": rows,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
