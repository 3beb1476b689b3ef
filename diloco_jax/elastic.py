"""Elastic DiLoCo: M independent worker processes and one syncer, where a worker that dies,
stalls or restarts never stops the others (docs/faults.md).

    python -m diloco_jax.elastic run --task mymodule:make_task --out runs/a
    python -m diloco_jax.elastic syncer --task mymodule:make_task --dir runs/a/syncer
    python -m diloco_jax.elastic worker --task mymodule:make_task --worker 2 \\
        --syncer host:port --dir runs/a

`run` launches the syncer and the M workers on this host, with a log per process under
OUT/logs, restarts a worker that dies (`--restart-workers`), and on Ctrl-C, SIGTERM or the
syncer's failure ends every process it started. `syncer` and `worker` start one process each,
for a cluster's own launcher (one worker per host or per device group: each worker is one
JAX program, its mesh its own). A worker over several processes or hosts is a group: start
each of its processes with `--coordinator HOST:PORT --num-processes N --process-id I` (one
`jax.distributed` cluster per worker; `run --processes-per-worker N` does this on one host).

The task (`ElasticTask`, from `module:function`) is the same in every process: the model,
θ_0, the data by (worker, position), M, H, R and the method. The syncer holds θ, the outer
state, the membership and each worker's data position (`diloco_jax.syncer`); the workers
hold their inner optimizer state (`diloco_jax.elastic_worker`). The result is
OUT/syncer/final.msgpack (θ after R syncs; `final_params`), OUT/syncer/history.jsonl
(per sync: who was included, the mean loss, every worker's position; `history`) and each
worker's OUT/workers/worker-m/metrics.jsonl (per inner phase; `worker_metrics`).

A task whose method has a gossip part (NoLoCo, GASLoC) has no global θ: the syncer keeps the
membership alone (`diloco_jax.gossip_syncer`), each worker exchanges with its group straight
from its peers (`diloco_jax.gossip_worker`), and each worker's θ_m after R syncs is in its
folder (`worker_params`).

A task with `algo="async"` runs asynchronous DiLoCo instead (`diloco_jax.arrival_syncer`):
no rounds, each delta applied as it arrives with its age, R server updates; history.jsonl is
then the arrival log, and `train_async(..., arrivals=arrivals(OUT/syncer))` replays it. With
`server=dj.HALoS(...)` the syncer is the global one, and `run` also starts a syncer per region
(`syncer --region R --global-syncer HOST:PORT`, its folder OUT/syncer/region-R), each worker
at its region's (`diloco_jax.halos_syncer`).
"""

import argparse
import contextlib
import heapq
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diloco_jax import allocator, auth, run_lock, wire
from diloco_jax.decoupled import DecoupledDiLoCo
from diloco_jax.decoupled_syncer import checked_for_decoupled
from diloco_jax.elastic_task import Elastic, ElasticTask, load_task
from diloco_jax.gossip_syncer import checked_for_gossip
from diloco_jax.halos import HALoS
from diloco_jax.halos_syncer import checked_for_halos
from diloco_jax.outer import widen

__all__ = [
    "Elastic",
    "ElasticTask",
    "arrivals",
    "final_params",
    "history",
    "main",
    "mean_worker_params",
    "worker_metrics",
    "worker_params",
]

ADDRESS_FILE = "syncer.address"
SECRET_FILE = "secret"


def final_params(directory: str | os.PathLike, task: ElasticTask) -> Any:
    """θ after the run's last sync, from a syncer folder, in the structure of task.params."""
    message = wire.read_file(Path(directory) / "final.msgpack")
    return wire.tree_like(task.params, message["theta"], "final.msgpack")


def worker_params(directory: str | os.PathLike, task: ElasticTask, worker: int) -> Any:
    """A gossip run's (NoLoCo, GASLoC: no global θ) θ_m of worker `worker` after its R syncs,
    from the workers' folder (`worker --dir`, OUT/workers under `run`), in the structure of
    task.params. The mean over the workers is the params the run stands for."""
    message = wire.read_file(Path(directory) / f"worker-{worker}" / "final.msgpack")
    return wire.tree_like(task.params, message["theta"], f"worker {worker}'s final.msgpack")


def mean_worker_params(directory: str | os.PathLike, task: ElasticTask) -> Any:
    """A gossip run's params: the mean over its workers' θ_m (`worker_params`), taken in
    float32 or wider and cast back to each leaf's dtype, as `train_diloco`'s params of such a
    run are (`delay.global_params`)."""
    thetas = [worker_params(directory, task, m) for m in range(task.num_workers)]
    stacked = jax.tree.map(lambda *x: np.stack(x), *thetas)
    return jax.tree.map(lambda x: np.asarray(jnp.mean(widen(x), axis=0).astype(x.dtype)), stacked)


def history(directory: str | os.PathLike) -> list[dict[str, Any]]:
    """The syncer folder's history.jsonl: one dict per sync: round, included (the workers
    whose deltas entered it), participants (the members when it opened), nonfinite, loss
    (the included workers' mean inner loss), positions (every worker's data position after
    it), compute_s (each pushing worker's phase seconds), seconds (opened to closed) and time
    (when it closed, Unix seconds). An async run's (algo "async"): one dict per update:
    round (the update's index), worker, position, steps, start_update, staleness, loss,
    compute_s (its phase's seconds) and steps_s (of those, its inner steps'), started and
    time (when its job started and when it was applied, Unix seconds), positions."""
    return _jsonl(Path(directory) / "history.jsonl")


def arrivals(directory: str | os.PathLike) -> tuple:
    """An async run's arrival log (its syncer folder's history.jsonl) as `AsyncEvent`s in
    update order: update, worker, job (the worker's data position), steps, start and time
    (seconds since the first job started), start_update, staleness; for
    `train_async(..., arrivals=...)`. A Decoupled DiLoCo run's: its merges as
    `decoupled.Merge`s, with where each learner applied each (applied.jsonl); a HALoS run's
    (the global syncer's folder, its regions' folders inside): a `halos_replay.Record`; both
    for `train_async(server=..., arrivals=...)`."""
    from diloco_jax.arrival_syncer import arrival_events

    lines = history(directory)
    if lines and "fragment" in lines[0]:
        return _merges(Path(directory), lines)
    if any(Path(directory).glob("region-*")):
        return _halos_record(Path(directory), lines)
    return arrival_events(lines)


def _halos_record(directory: Path, pushes: list[dict]) -> Any:
    """A HALoS run's `halos_replay.Record`: the regions' arrivals by time, their merges, the
    global syncer's pushes (times in seconds since the first job started)."""
    from diloco_jax import halos_replay
    from diloco_jax.halos_syncer import MERGES_FILE

    regions, merges = [], []
    for folder in sorted(directory.glob("region-*"), key=lambda f: int(f.name.split("-")[1])):
        region = int(folder.name.split("-")[1])
        regions.append(history(folder) if (folder / "history.jsonl").exists() else [])
        if (folder / MERGES_FILE).exists():
            merges += [halos_replay.RegionMerge(region, x["after"], x["version"])
                       for x in _jsonl(folder / MERGES_FILE)]  # fmt: skip
    origin = min((x["started"] for lines in regions for x in lines), default=0.0)
    # By time, each region's own updates in their order whatever its clock did.
    arrivals = tuple(
        halos_replay.Arrival(
            region=x["region"],
            worker=x["worker"],
            job=x["position"],
            steps=x["steps"],
            start=x["start_update"],
            start_merges=x["start_merges"],
            staleness=x["staleness"],
            time=x["time"] - origin,
        )
        for x in heapq.merge(*regions, key=lambda x: x["time"])
    )
    return halos_replay.Record(
        arrivals, tuple(merges),
        tuple(halos_replay.GlobalPush(x["worker"], x["position"], x["staleness"]) for x in pushes),
    )  # fmt: skip


def _merges(directory: Path, lines: list[dict]) -> tuple:
    from diloco_jax.decoupled import Merge
    from diloco_jax.decoupled_syncer import APPLIED_FILE, STARTS_FILE

    def read(name: str) -> list[dict]:
        return _jsonl(directory / name) if (directory / name).exists() else []

    boundary = {(a["update"], a["learner"]): a["boundary"] for a in read(APPLIED_FILE)}
    starts: dict[int, list] = {}
    for s in read(STARTS_FILE):  # a push sent again reports its restart again: once each
        start = (s["learner"], s["step"], s["from_checkpoint"])
        if start not in starts.setdefault(s["version"], []):
            starts[s["version"]].append(start)
    count = len(lines[0]["pushes"])
    return tuple(
        Merge(
            update=x["update"],
            fragment=x["fragment"],
            index=x["sync"],
            step=x["step"],
            time=x["time"],
            merged=tuple(x["merged"]),
            boundaries=tuple(boundary.get((x["update"], m), -1) for m in range(count)),
            total_steps=x["total_steps"],
            pushes=tuple(tuple(n) for n in x["pushes"]),
            restarts=tuple(starts.get(x["update"], ())),
            origins=tuple(None if o is None else tuple(o) for o in x["origins"]),
        )
        for x in lines
    )


def worker_metrics(directory: str | os.PathLike, worker: int) -> list[dict[str, Any]]:
    """Worker `worker`'s metrics from the workers' folder (`worker --dir`, OUT/workers
    under `run`): one dict per inner phase it ran, restarts included: round, position (its
    data position), steps (its inner steps), loss (its mean inner loss), compute_s (the
    phase's seconds: batches and steps) and time (when it ended, Unix seconds). A worker
    group's leader writes them."""
    folder = Path(directory) / f"worker-{worker}"
    leader = folder / "process-0"
    return _jsonl((leader if leader.is_dir() else folder) / "metrics.jsonl")


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _options(args: argparse.Namespace) -> Elastic:
    return Elastic(
        min_workers=args.min_workers,
        join_timeout=args.join_timeout,
        heartbeat_interval=args.heartbeat_interval,
        heartbeat_timeout=args.heartbeat_timeout,
        round_timeout=args.round_timeout,
        grace_seconds=args.grace_seconds,
        quorum_timeout=args.quorum_timeout,
        inner_state=args.inner_state,
        syncer_timeout=args.syncer_timeout,
    )


def _add_options(parser: argparse.ArgumentParser) -> None:
    d = Elastic()
    parser.add_argument("--min-workers", type=int, default=d.min_workers)
    parser.add_argument("--join-timeout", type=float, default=d.join_timeout)
    parser.add_argument("--heartbeat-interval", type=float, default=d.heartbeat_interval)
    parser.add_argument("--heartbeat-timeout", type=float, default=d.heartbeat_timeout)
    parser.add_argument("--round-timeout", type=float, default=None)
    parser.add_argument("--grace-seconds", type=float, default=None)
    parser.add_argument("--quorum-timeout", type=float, default=d.quorum_timeout)
    parser.add_argument("--inner-state", default=d.inner_state, choices=("checkpoint", "fresh"))
    parser.add_argument("--syncer-timeout", type=float, default=d.syncer_timeout)


def _stop_on_signals(stop: threading.Event) -> None:
    def handler(signum, frame):
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _folder(path: str | os.PathLike, flag: str) -> Path:
    """`path` as a folder, created where missing; ValueError naming `flag` if it can't be."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(
            f"{flag} {str(path)!r} can't be created: {error.strerror or error}"
        ) from error
    return folder


def _check_port(port: int, flag: str) -> None:
    # gRPC would wrap a number outside the range into it silently (70000 binds 4464).
    if not 0 <= port <= 65535:
        raise ValueError(f"{flag} must be in [0, 65535], got {port}")


def _check_address(address: str, flag: str = "--syncer") -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{flag} must be HOST:PORT, got {address!r}")
    _check_port(int(port), f"{flag}'s port")


def run_syncer(args: argparse.Namespace) -> int:
    from diloco_jax.arrival_syncer import make_syncer
    from diloco_jax.rpc import serve

    _check_port(args.port, "--port")
    secret = auth.load_secret(args.secret_file)
    task = load_task(args.task)
    options = _options(args).checked(task.num_workers)
    halos = isinstance(task.server, HALoS)
    if (args.region is not None or args.global_syncer is not None) and not halos:
        raise ValueError("--region and --global-syncer are a HALoS task's (server=dj.HALoS)")
    if (args.region is None) != (args.global_syncer is None):
        raise ValueError("--region and --global-syncer go together: a HALoS region's syncer")
    if args.global_syncer is not None:
        _check_address(args.global_syncer, "--global-syncer")
        if not 0 <= args.region < task.server.num_regions:
            raise ValueError(
                f"--region must be in [0, {task.server.num_regions}), got {args.region}"
            )
    directory = _folder(args.dir, "--dir")
    lock = run_lock.acquire(directory, what="--dir")
    if args.region is not None:
        from diloco_jax.halos_syncer import RegionSyncer

        syncer = RegionSyncer(task, options, directory, args.region, args.global_syncer, secret)
        syncer.start_link()
    else:
        syncer = make_syncer(task, options, directory)
    server, port = serve(syncer, args.port, secret, args.host)
    (directory / ADDRESS_FILE).write_text(f"{args.host}:{port}\n")
    logging.getLogger("diloco_jax.syncer").info("serving on %s:%d", args.host, port)
    stop = threading.Event()
    _stop_on_signals(stop)
    clock = threading.Thread(target=syncer.run_clock, args=(stop,), daemon=True)
    clock.start()
    while not stop.wait(0.1) and syncer.done is None:
        pass
    if syncer.done is not None:
        # Let the workers hear the end: each asks within its Next's timeout, or hears it in a
        # heartbeat during its phase (an async worker's); a silent one is dead anyway.
        deadline = time.monotonic() + syncer.options.heartbeat_timeout + 1.0
        while not syncer.all_told() and time.monotonic() < deadline:
            stop.wait(0.05)
        stop.wait(2 * syncer.options.heartbeat_interval)
    stop.set()
    server.stop(grace=1.0).wait()
    syncer.flush()  # the newest checkpoint on disk before the folder is let go
    lock.release()
    if syncer.done == "finished":
        return 0
    if syncer.done is not None:
        print(f"diloco-jax elastic: {syncer.done}", file=sys.stderr)
        return 1
    return 130


def run_worker(args: argparse.Namespace) -> int:
    import grpc

    from diloco_jax.elastic_worker import GROUP_HEARTBEAT_S, Worker, worker_folder
    from diloco_jax.rpc import SyncerLost

    _check_address(args.syncer)
    secret = auth.load_secret(args.secret_file)
    if args.syncer_timeout is not None and not args.syncer_timeout > 0:
        raise ValueError(f"--syncer-timeout must be > 0, got {args.syncer_timeout}")
    if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
        raise ValueError(
            f"--num-processes must be >= 1 and --process-id in [0, --num-processes), got "
            f"{args.num_processes} and {args.process_id}"
        )
    if args.num_processes > 1 or args.coordinator is not None:
        import jax

        from diloco_jax import distributed

        # A worker group is a JAX cluster of its own, formed before the task builds its mesh.
        # On CPU its collectives go through gloo (no effect on other platforms' devices).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        distributed.initialize(
            args.coordinator, args.num_processes, args.process_id,
            heartbeat_timeout=GROUP_HEARTBEAT_S,
        )  # fmt: skip
    task = load_task(args.task)
    if not 0 <= args.worker < task.num_workers:  # before its folder is made
        raise ValueError(f"--worker must be in [0, {task.num_workers}), got {args.worker}")
    one_process = task.method.gossip is not None or isinstance(task.server, DecoupledDiLoCo)
    if one_process and args.num_processes > 1:
        raise ValueError("--num-processes must be 1 for a gossip or Decoupled DiLoCo task: "
                         "its worker is one process")  # fmt: skip
    folder = _folder(worker_folder(args.dir, args.worker), "--dir")
    lock = run_lock.acquire(folder, what=f"worker {args.worker}'s folder")
    if task.method.gossip is not None:
        from diloco_jax.gossip_worker import GossipWorker

        worker = GossipWorker(task, args.worker, args.syncer, Path(args.dir), secret,
                              args.syncer_timeout, args.peer_host)  # fmt: skip
    elif isinstance(task.server, DecoupledDiLoCo):
        from diloco_jax.decoupled_worker import DecoupledLearner

        worker = DecoupledLearner(task, args.worker, args.syncer, Path(args.dir), secret,
                                  args.syncer_timeout)  # fmt: skip
    else:
        worker = Worker(task, args.worker, args.syncer, Path(args.dir), secret,
                        args.syncer_timeout)  # fmt: skip
    try:
        return worker.run()
    except SyncerLost as error:
        print(f"diloco-jax elastic: worker {args.worker}: {error}", file=sys.stderr)
        return 1
    except grpc.RpcError as error:  # the syncer refused a call: a bug or a mismatched task
        print(f"diloco-jax elastic: worker {args.worker}: the syncer answered "
              f"{error.code().name}: {error.details()}", file=sys.stderr)  # fmt: skip
        return 1
    finally:
        lock.release()


def _spawn(argv: list[str], log_path: Path, secret: bytes) -> subprocess.Popen:
    # Several JAX processes share this host's accelerators: none takes 75% of a GPU's memory
    # up front (JAX's default), unless the user said otherwise.
    env = allocator.preloaded({"XLA_PYTHON_CLIENT_PREALLOCATE": "false", **os.environ})
    env[auth.SECRET_ENV] = os.fsdecode(secret)  # the run's: each process proves it
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "diloco_jax.elastic", *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # the launcher ends them itself, whatever the terminal does
        )


def _end(processes: list[subprocess.Popen], timeout: float = 5.0) -> None:
    """SIGTERM to every process still running, SIGKILL to any left after `timeout`."""
    for p in processes:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
    deadline = time.monotonic() + timeout
    for p in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.0, deadline - time.monotonic()))
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait()


def _checked_options(args: argparse.Namespace, task: ElasticTask) -> Elastic:
    """The run's options, checked for the task's runtime (rounds, gossip, Decoupled DiLoCo)."""
    options = _options(args).checked(task.num_workers)
    if task.method.gossip is not None:
        checked_for_gossip(options, task.num_workers)
    if isinstance(task.server, DecoupledDiLoCo):
        checked_for_decoupled(options, task.num_workers)
    if isinstance(task.server, HALoS):
        checked_for_halos(options, task)
    one_process = task.method.gossip is not None or isinstance(task.server, DecoupledDiLoCo)
    if one_process and args.processes_per_worker != 1:
        raise ValueError("--processes-per-worker must be 1 for a gossip task (NoLoCo, GASLoC) "
                         "or Decoupled DiLoCo: its worker is one process")  # fmt: skip
    return options


def launch(args: argparse.Namespace) -> int:
    if not 1 <= args.processes_per_worker <= 1024:
        raise ValueError(
            f"--processes-per-worker must be in [1, 1024], got {args.processes_per_worker}"
        )
    _check_port(args.port, "--port")
    task = load_task(args.task)  # refused here, before any folder or process
    options = _checked_options(args, task)
    given = args.secret_file is not None or os.environ.get(auth.SECRET_ENV)
    secret = auth.load_secret(args.secret_file) if given else None
    out = _folder(args.out, "--out")
    lock = run_lock.acquire(out, what="--out")
    if secret is None:  # the run's own, kept for a restarted launcher or a process of it
        secret = auth.write_secret(out / SECRET_FILE)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    syncer_dir = out / "syncer"
    (syncer_dir / ADDRESS_FILE).unlink(missing_ok=True)
    flags = [
        f"--{k.replace('_', '-')}={v}" for k, v in options.to_message().items() if v is not None
    ]
    syncer = _spawn(
        ["syncer", "--task", args.task, "--dir", str(syncer_dir), "--port", str(args.port),
         *flags], logs / "syncer.log", secret,
    )  # fmt: skip
    processes = [syncer]
    syncers = {"syncer": syncer}  # name -> process: the run ends with them
    stop = threading.Event()
    _stop_on_signals(stop)
    try:
        address = _address(syncer_dir, syncer, stop)
        if address is None:
            return 130 if stop.is_set() else (syncer.poll() or 1)
        addresses = [address] * task.num_workers  # each worker's syncer
        if isinstance(task.server, HALoS):  # a syncer per region under the global one
            regions = _start_regions(args.task, task.server, syncer_dir, address, flags, logs,
                                     secret, stop)  # fmt: skip
            processes += [p for p, _ in regions.values()]
            syncers.update({name: p for name, (p, _) in regions.items()})
            if any(a is None for _, a in regions.values()):
                return 130 if stop.is_set() else 1
            addresses = [regions[f"region-{r}"][1] for r in task.server.regions]
        groups: dict[int, list[subprocess.Popen]] = {}  # worker -> its processes

        def start(m: int) -> None:
            argv = ["worker", "--task", args.task, "--worker", str(m), "--syncer", addresses[m],
                    "--dir", str(out / "workers")]  # fmt: skip
            size = args.processes_per_worker
            if size == 1:
                groups[m] = [_spawn(argv, logs / f"worker-{m}.log", secret)]
            else:  # a JAX cluster of its own, at a fresh port each start
                group = ["--coordinator", f"127.0.0.1:{_free_port()}", "--num-processes",
                         str(size)]  # fmt: skip
                groups[m] = [
                    _spawn(
                        [*argv, *group, "--process-id", str(i)],
                        logs / f"worker-{m}.{i}.log",
                        secret,
                    )  # fmt: skip
                    for i in range(size)
                ]
            processes.extend(groups[m])

        for m in range(task.num_workers):
            start(m)
        beside = (f", {task.server.num_regions} region syncers"
                  if isinstance(task.server, HALoS) else "")  # fmt: skip
        print(f"diloco-jax elastic: syncer at {address}{beside}, {task.num_workers} workers, "
              f"logs in {logs}", flush=True)  # fmt: skip
        return _watch(stop, syncers, groups, start if args.restart_workers else None, logs)
    finally:
        _end(processes)
        lock.release()


def _watch(
    stop: threading.Event, syncers: dict[str, subprocess.Popen],
    groups: dict[int, list[subprocess.Popen]], restart: Any, logs: Path,
) -> int:  # fmt: skip
    """Watches a launched run until it ends; its exit code: 0 once every syncer exited 0, a
    syncer's code if one failed (its line printed), 1 if every worker is gone and some failed,
    130 on a signal. A worker whose process fails is ended (its whole group) and started again
    with `restart(m)` where given."""
    while not stop.wait(0.2):
        for name, p in syncers.items():
            if p.poll():  # its one line (quorum lost, a bad task), on the launcher's console
                print(_last_word(logs / f"{name}.log", p.returncode), file=sys.stderr,
                      flush=True)  # fmt: skip
                return p.returncode
        if all(p.poll() == 0 for p in syncers.values()):
            return 0
        for m, group in list(groups.items()):
            failed = [p.returncode for p in group if p.poll() not in (None, 0)]
            if failed:  # one process down ends its group: they share one fate
                _end(group)
                if restart is not None:
                    print(f"diloco-jax elastic: worker {m} exited with {failed[0]}; "
                          "restarting it", flush=True)  # fmt: skip
                    restart(m)
        codes = [p.poll() for group in groups.values() for p in group]
        if None not in codes and any(codes):  # every worker gone, some failed
            failed = [m for m, group in groups.items() if any(p.returncode for p in group)]
            print(f"diloco-jax elastic: workers {failed} failed (see their logs in "
                  f"{logs}); ending the run", file=sys.stderr, flush=True)  # fmt: skip
            return 1
    return 130


def _start_regions(
    task_spec: str, spec: HALoS, gps_dir: Path, gps: str, flags: list[str], logs: Path,
    secret: bytes, stop: threading.Event,
) -> dict[str, tuple[subprocess.Popen, str | None]]:  # fmt: skip
    """A HALoS run's region syncers, each its own process: "region-r" -> (process, its
    address, None if it exited or a signal came first)."""
    from diloco_jax.halos_syncer import region_folder

    started = {}
    for r in range(spec.num_regions):
        folder = region_folder(gps_dir, r)
        (folder / ADDRESS_FILE).unlink(missing_ok=True)
        started[f"region-{r}"] = (_spawn(
            ["syncer", "--task", task_spec, "--dir", str(folder), "--region", str(r),
             "--global-syncer", gps, *flags], logs / f"region-{r}.log", secret,
        ), folder)  # fmt: skip
    return {name: (p, _address(folder, p, stop)) for name, (p, folder) in started.items()}


def _last_word(log_path: Path, code: int) -> str:
    """The syncer's one line on why it ended (from its log), or where to look."""
    lines = log_path.read_text(errors="replace").splitlines()
    said = [x for x in lines if x.startswith("diloco-jax elastic:")]
    return (
        said[-1] if said else f"diloco-jax elastic: the syncer exited with {code} (see {log_path})"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _address(syncer_dir: Path, syncer: subprocess.Popen, stop: threading.Event) -> str | None:
    """The syncer's "host:port" once it serves; None if it exited or a signal came first."""
    path = syncer_dir / ADDRESS_FILE
    while not stop.wait(0.05):
        if path.exists() and path.read_text().endswith("\n"):
            return path.read_text().strip()
        if syncer.poll() is not None:
            return None
    return None


class _CurrentStderr(logging.StreamHandler):
    """Writes to the sys.stderr of each record's moment, not of the handler's making: `main`
    also runs inside a caller's process (the LM app's --elastic, a test), whose stderr may be
    swapped and closed after the run."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


def _log_to_stderr() -> None:
    """The syncer's and workers' lines on stderr, under the "diloco_jax" logger alone: the
    caller's own logging (the root logger, absl's) is left as it was."""
    logger = logging.getLogger("diloco_jax")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    if not any(isinstance(h, _CurrentStderr) for h in logger.handlers):
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
        logger.addHandler(handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diloco_jax.elastic")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="the syncer and M workers on this host")
    run.add_argument("--task", required=True)
    run.add_argument("--out", required=True)
    run.add_argument("--port", type=int, default=0)
    run.add_argument("--restart-workers", action="store_true")
    run.add_argument("--secret-file", default=None,
                     help="a file holding the run's secret (default: $DILOCO_JAX_SECRET, or "
                     "OUT/secret, made the first time)")  # fmt: skip
    run.add_argument("--processes-per-worker", type=int, default=1,
                     help="N > 1: each worker a JAX cluster of N processes on this host (its "
                     "task's shardings span their devices)")  # fmt: skip
    _add_options(run)
    syncer = sub.add_parser("syncer", help="the syncer alone")
    syncer.add_argument("--task", required=True)
    syncer.add_argument("--dir", required=True)
    syncer.add_argument("--host", default="127.0.0.1")
    syncer.add_argument("--port", type=int, default=0)
    syncer.add_argument(
        "--secret-file",
        default=None,
        help="a file holding the run's secret (default: $DILOCO_JAX_SECRET)",
    )
    syncer.add_argument("--region", type=int, default=None,
                        help="a HALoS task's: this process is region R's syncer (without it, "
                        "the global one)")  # fmt: skip
    syncer.add_argument("--global-syncer", default=None,
                        help="with --region: the global syncer's HOST:PORT")  # fmt: skip
    _add_options(syncer)
    worker = sub.add_parser("worker", help="one worker")
    worker.add_argument("--task", required=True)
    worker.add_argument("--worker", type=int, required=True)
    worker.add_argument("--syncer", required=True, help="the syncer's host:port")
    worker.add_argument("--dir", required=True)
    worker.add_argument("--coordinator", default=None,
                        help="HOST:PORT of the worker group's process 0 (a worker over several "
                        "processes or hosts)")  # fmt: skip
    worker.add_argument("--num-processes", type=int, default=1, help="the group's size")
    worker.add_argument("--process-id", type=int, default=0, help="this process, in the group")
    worker.add_argument(
        "--secret-file",
        default=None,
        help="a file holding the run's secret (default: $DILOCO_JAX_SECRET)",
    )
    worker.add_argument("--peer-host", default="127.0.0.1",
                        help="a gossip task's (NoLoCo, GASLoC): where this worker serves its "
                        "values to its peers (0.0.0.0: every interface, told as this host's "
                        "name)")  # fmt: skip
    worker.add_argument("--syncer-timeout", type=float, default=None,
                        help="seconds to keep retrying an unreachable syncer before exiting 1 "
                        "(default: the syncer's, 60 s until it is reached)")  # fmt: skip
    args = parser.parse_args(argv)
    _log_to_stderr()
    commands = {"run": launch, "syncer": run_syncer, "worker": run_worker}
    try:
        return commands[args.command](args)
    except ValueError as error:  # bad input: one line, exit 2
        print(f"diloco-jax elastic: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    if sys.argv[1:2] in (["syncer"], ["worker"]):  # started on its own: under mimalloc
        allocator.restart_preloaded(sys.argv[1:])
    code = main()
    if not jax.distributed.is_initialized():
        # All the process keeps is written, synced and closed by now. Ending here skips the
        # interpreter's finalization, where a daemon thread (gRPC's poller, a stream's
        # request consumer, the syncer's clock) could abort a run that ended well: exit -6,
        # "FATAL: exception not rethrown". A worker group's processes finalize: JAX ends
        # their cluster at exit.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
