"""How fast the elastic syncer moves θ and the deltas, against the host's own socket, in one run
(docs/faults.md, "Measured: the sync's speed"; benchmarks/README.md).

The task has a θ of `--mb` MB (one float32 leaf) and almost no compute (H = 1 SGD step on a
loss linear in θ), so a round is the sync: θ to each of the M workers, a delta from each, the
mean, the outer step and the checkpoint. Measured in the same run:

- elastic: `python -m diloco_jax.elastic run` with M workers for `--rounds` rounds; the
  seconds per sync are the median gap between consecutive syncs' history lines (the first
  two left out: compilation);
- socket: one TCP socket on 127.0.0.1 between two processes carrying the same 2·M·|θ| bytes a
  round moves through the syncer (the median of 5 tries);
- torchft (with `--torchft-python PATH`, a Python that has torch and torchft): its DiLoCo
  syncing the same θ between M replicas over gloo (benchmarks/torchft_sync.py).

    .venv/bin/python benchmarks/elastic_sync.py [--mb 100] [--workers 2] [--rounds 8] \
        [--torchft-python /tmp/torchft/bin/python]

Writes benchmarks/results/elastic_sync.json.
"""

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_OUT = HERE / "results" / "elastic_sync.json"
CHUNK = 4 << 20


def make_task():
    """The benchmark's task, sized by ELASTIC_SYNC_MB, ELASTIC_WORKERS and ELASTIC_ROUNDS,
    its deltas compressed as ELASTIC_SYNC_COMPRESSION says (default none)."""
    import jax.numpy as jnp
    import optax

    import diloco_jax as dj
    from diloco_jax.elastic import ElasticTask

    size = int(float(os.environ["ELASTIC_SYNC_MB"]) * 1e6) // 4

    def loss_fn(params, batch):
        return jnp.mean(params["w"]) * batch["x"][0]

    def batches(worker, position):
        return {"x": np.full((1, 1), 1.0 + worker + position, np.float32)}

    return ElasticTask(
        loss_fn=loss_fn,
        params={"w": np.zeros(size, np.float32)},
        batches=batches,
        num_workers=int(os.environ["ELASTIC_WORKERS"]),
        inner_steps=1,
        num_rounds=int(os.environ["ELASTIC_ROUNDS"]),
        method=dj.DiLoCo(
            inner=optax.sgd(0.1),
            outer=optax.sgd(0.7, momentum=0.9, nesterov=True),
            compression=os.environ.get("ELASTIC_SYNC_COMPRESSION", "none"),
        ),
    )


def elastic_seconds(args: argparse.Namespace, workdir: Path) -> list[float]:
    """The gaps between consecutive syncs of one run (seconds)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]),
               XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu",
               ELASTIC_SYNC_MB=str(args.mb), ELASTIC_WORKERS=str(args.workers),
               ELASTIC_ROUNDS=str(args.rounds))  # fmt: skip
    out = workdir / "run"
    argv = [sys.executable, "-m", "diloco_jax.elastic", "run", "--task", "elastic_sync:make_task",
            "--out", str(out), "--heartbeat-timeout", "60"]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"the elastic run failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    times = [json.loads(x)["time"] for x in (out / "syncer" / "history.jsonl").open()]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def _receive(port: int, total: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        buffer, got = bytearray(CHUNK), 0
        while got < total:
            n = s.recv_into(buffer)
            if not n:
                break
            got += n
        s.sendall(b"k")


def socket_seconds(total: int, tries: int = 5) -> list[float]:
    """Seconds one TCP socket on 127.0.0.1 takes to carry `total` bytes to another process."""
    payload = memoryview(np.ones(CHUNK, np.uint8).tobytes())
    seconds = []
    for _ in range(tries):
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            port = server.getsockname()[1]
            code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import elastic_sync as e; e._receive({port}, {total})"  # noqa: E501
            child = subprocess.Popen([sys.executable, "-c", code])
            conn, _ = server.accept()
            with conn:
                start, sent = time.perf_counter(), 0
                while sent < total:
                    n = min(CHUNK, total - sent)
                    conn.sendall(payload[:n])
                    sent += n
                conn.recv(1)
                seconds.append(time.perf_counter() - start)
            child.wait()
    return seconds


def torchft_sync(args: argparse.Namespace) -> dict:
    """benchmarks/torchft_sync.py's line, run by `--torchft-python` on the same task sizes."""
    argv = [args.torchft_python, str(HERE / "torchft_sync.py"), "--mb", str(args.mb),
            "--workers", str(args.workers), "--rounds", str(args.rounds)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"torchft_sync.py failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1,
                        help="measure each this many times, interleaved (the figures are the "
                        "medians over the repeats)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--torchft-python", default=None,
                        help="a Python with torch and torchft: its sync timed too")  # fmt: skip
    args = parser.parse_args()
    total = int(2 * args.workers * args.mb * 1e6)
    syncs, sockets, torchfts = [], [], []
    for _ in range(args.repeats):  # interleaved: the host's load falls on each alike
        with tempfile.TemporaryDirectory() as tmp:
            gaps = elastic_seconds(args, Path(tmp))
        syncs.append({"sync_seconds": round(statistics.median(gaps[2:]), 4),
                      "sync_gaps": [round(x, 4) for x in gaps]})  # fmt: skip
        sockets.append(round(statistics.median(socket_seconds(total)), 4))
        if args.torchft_python:
            torchfts.append(torchft_sync(args))
    sync_s = statistics.median(x["sync_seconds"] for x in syncs)
    sock_s = statistics.median(sockets)
    result = {
        "command": "python benchmarks/elastic_sync.py "
        f"--mb {args.mb:g} --workers {args.workers} --rounds {args.rounds} "
        f"--repeats {args.repeats}",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "theta_mb": args.mb,
        "workers": args.workers,
        "bytes_per_round": total,
        "sync_seconds": sync_s,
        "socket_seconds": sock_s,
        "sync_over_socket": round(sync_s / sock_s, 2),
        "repeats": [{**x, "socket_seconds": y} for x, y in zip(syncs, sockets, strict=True)],
    }
    versus = ""
    if torchfts:
        torchft_s = statistics.median(x["sync_seconds"] for x in torchfts)
        result["command"] += " --torchft-python PATH"
        result.update(torchft_seconds=torchft_s, sync_over_torchft=round(sync_s / torchft_s, 2),
                      torchft=torchfts)  # fmt: skip
        versus = f", torchft {torchft_s:.3f} s"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"sync {sync_s:.3f} s, one socket {sock_s:.3f} s for {total / 1e6:.0f} MB"
          f"{versus}: {sync_s / sock_s:.2f}x the socket -> {args.out}")  # fmt: skip


if __name__ == "__main__":
    main()
