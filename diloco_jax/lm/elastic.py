"""`diloco-jax train --elastic`: the LM app's DiLoCo (or, with --algo async, asynchronous
DiLoCo's) run on the elastic runtime (`diloco_jax.elastic`, docs/faults.md): a syncer and M
worker processes on this host, where a worker that dies, stalls or restarts never stops the
others. An async run takes M x R server updates (each job H inner steps, or DyLU's count
with --dynamic-steps), worker m's job at data position p reading the windows below; with
--server halos,...: M x R / K global updates (a region pushes every K of its updates), a
syncer per region under the global one.

The command pretrains in its own process (the shared warm start), writes θ_0 and the command
line to OUT/elastic, and launches the run; every process then builds the same task from them
(`task`, through the DILOCO_JAX_LM_ELASTIC variable). Worker m's inner phase at data position
p reads `phase_windows(cfg, tokens, starts, lengths, m, p)`: H x B random windows of its
shard (`cfg.sharding`), keyed by (seed, m, p) only, so a phase run again after a death reads
the same tokens. At the end the command evaluates the final θ on the held-out batches.
"""

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from diloco_jax import wire
from diloco_jax.elastic_task import ElasticTask
from diloco_jax.halos import HALoS

ENV = "DILOCO_JAX_LM_ELASTIC"  # the path of OUT/elastic/task.json
SPEC_FILE = "task.json"
THETA_FILE = "theta0.msgpack"


def phase_windows(
    cfg: Any, tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray, worker: int,
    position: int,
) -> dict[str, np.ndarray]:  # fmt: skip
    """Worker `worker`'s batches of its `position`-th inner phase: {"inputs", "targets"}, int32
    [H, B, L], windows of L + 1 tokens drawn uniformly from its shard [starts[m], starts[m] +
    lengths[m]) of `tokens`, keyed by (cfg.seed, worker, position)."""
    rng = np.random.default_rng([cfg.seed, worker, position])
    length = cfg.seq_len + 1
    offsets = rng.integers(0, lengths[worker] - length + 1, size=(cfg.inner_steps, cfg.batch_size))
    windows = tokens[starts[worker] + offsets[..., None] + np.arange(length)].astype(np.int32)
    return {"inputs": windows[..., :-1], "targets": windows[..., 1:]}


class _Windows:
    """`batches` of the task: the corpus is loaded at the first call (the syncer never makes
    one), then every phase's windows come from its tokens."""

    def __init__(self, cfg: Any):
        self.cfg, self.shards = cfg, None

    def __call__(self, worker: int, position: int) -> dict[str, np.ndarray]:
        if self.shards is None:
            from diloco_jax.lm import data as data_lib
            from diloco_jax.lm import experiment

            corpus = experiment.load_corpus(self.cfg)
            starts, lengths = data_lib.worker_shards(
                corpus.doc_starts, len(corpus.train_tokens), self.cfg.workers,
                self.cfg.sharding, self.cfg.seq_len,
            )  # fmt: skip
            self.shards = (corpus.train_tokens, starts, lengths)
        return phase_windows(self.cfg, *self.shards, worker, position)


def write_spec(folder: Path, argv: list[str], theta: Any) -> Path:
    """Writes the run's command line and θ_0 (the pretrained params) into `folder`; returns
    the spec file's path, for DILOCO_JAX_LM_ELASTIC."""
    folder.mkdir(parents=True, exist_ok=True)
    wire.write_file(folder / THETA_FILE, {"theta": wire.leaves(theta)})
    spec = folder / SPEC_FILE
    spec.write_text(json.dumps({"argv": list(argv), "theta": THETA_FILE}))
    return spec


def task() -> ElasticTask:
    """The run's task, in every process of it: the command line's config, the model, θ_0
    from the spec's folder, the windows by (worker, position), the config's method and algo
    (diloco: R syncs; async: M x R updates)."""
    from diloco_jax.lm import args, experiment
    from diloco_jax.lm import config as config_lib
    from diloco_jax.lm import model as model_lib

    spec_path = Path(os.environ[ENV])
    spec = json.loads(spec_path.read_text())
    run = args.parse(spec["argv"])
    cfg, algo = run.cfg, run.algo or "diloco"
    model_cfg, params, _ = experiment.init_model(cfg)
    message = wire.read_file(spec_path.parent / spec["theta"])
    params = wire.tree_like(params, message["theta"], "the pretrained θ_0")
    server = config_lib.server_of(cfg)
    if isinstance(server, HALoS):  # global updates: M x R LPS updates, a push every K
        num_rounds = max(1, cfg.rounds * cfg.workers // server.local_updates)
    elif server is not None:  # Decoupled DiLoCo: as many merges as R rounds of every fragment
        num_rounds = cfg.rounds * server.fragments
    else:
        num_rounds = cfg.rounds if algo == "diloco" else cfg.rounds * cfg.workers
    return ElasticTask(
        loss_fn=model_lib.make_loss_fn(model_cfg),
        params=params,
        batches=_Windows(cfg),
        num_workers=cfg.workers,
        inner_steps=cfg.inner_steps,
        num_rounds=num_rounds,
        method=config_lib.method(cfg),
        algo=algo,
        dynamic_steps=cfg.dynamic_steps,
        server=server,
    )


def train_elastic(
    cfg: Any, corpus: Any, out: Path, argv: list[str], min_workers: int,
    restart_workers: bool, progress: bool = True, algo: str = "diloco",
) -> int:  # fmt: skip
    """`diloco-jax train --elastic`: the warm start here, then the elastic run in OUT/elastic
    (its syncer, worker folders and a log per process), then the final θ's evaluation.
    Writes OUT/config.json, OUT/metrics.jsonl (the pretrain's records, then one per sync:
    round, the included workers' mean inner loss, who was included, its seconds; async: one
    per update: update, worker, steps, staleness, the job's mean inner loss) and
    OUT/summary.json. Returns the exit code: the launcher's (1: the run ended early, its
    line printed; 130: Ctrl-C or SIGTERM), else 0."""
    import math
    import time

    import jax

    from diloco_jax import elastic as runtime
    from diloco_jax.lm import experiment
    from diloco_jax.lm.runlog import RunLog, write_json, write_jsonl

    started = time.perf_counter()
    write_json(out / "config.json", experiment.config_record(cfg, corpus, algo=algo,
                                                             elastic=True))  # fmt: skip
    metrics = out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    aux = experiment.aux_names(cfg)
    with RunLog(metrics, cfg.pretrain_steps, "pretrain M=1", progress, None, aux) as log:
        params, pre_history = experiment.pretrain(cfg, corpus, on_record=log)
    folder = out / "elastic"
    os.environ[ENV] = str(write_spec(folder, argv, params).resolve())  # the processes' task
    flags = ["run", "--task", f"{__name__}:task", "--out", str(folder), "--min-workers",
             str(min_workers), *(["--restart-workers"] if restart_workers else [])]  # fmt: skip
    code = runtime.main(flags)
    if code != 0:
        return code
    run_task = task()
    gossip = run_task.method.gossip is not None
    if gossip:  # no global θ: the mean of the workers' own, as train_diloco's params
        theta = runtime.mean_worker_params(folder / "workers", run_task)
    else:
        theta = runtime.final_params(folder / "syncer", run_task)
    eval_fn = jax.jit(experiment.make_eval_fn(run_task.loss_fn, corpus))
    eval_loss = float(eval_fn(theta)["eval_loss"])
    summary = {
        "algo": algo,
        "elastic": True,
        "final_eval_loss": eval_loss,
        "final_eval_ppl": math.exp(eval_loss),
        "final_eval_bpb": experiment.bits_per_byte(eval_loss, corpus.eval_bytes_per_token),
    }
    if gossip:
        records, counts, said = _gossip_records(cfg, folder / "workers")
    elif isinstance(run_task.server, HALoS):
        records, counts, said = _region_records(folder / "syncer")
    elif run_task.server is not None:
        records, counts, said = _merge_records(runtime.history(folder / "syncer"))
    else:
        lines = runtime.history(folder / "syncer")
        records, counts, said = (_sync_records if algo == "diloco" else _update_records)(cfg, lines)
    write_jsonl(metrics, pre_history + records)
    summary.update(counts, wall_seconds=time.perf_counter() - started)
    write_json(out / "summary.json", summary)
    print(f"{algo} (elastic): eval loss {eval_loss:.4f} (ppl {summary['final_eval_ppl']:.3f}), "
          f"{said}, {summary['wall_seconds']:.0f}s -> {out}")  # fmt: skip
    return 0


def _sync_records(cfg: Any, syncs: list[dict]) -> tuple[list[dict], dict[str, int], str]:
    """A DiLoCo run's metrics lines (one per sync), counts for its summary, and its line."""
    records = [
        {"run": "diloco", "round": s["round"], "step": (s["round"] + 1) * cfg.inner_steps,
         "loss": s["loss"], "included": s["included"], "seconds": s["seconds"]}
        for s in syncs
    ]  # fmt: skip
    full = sum(len(s["included"]) == cfg.workers for s in syncs)
    counts = {"rounds": len(syncs), "syncs_with_every_worker": full}
    return records, counts, f"{full} of {len(syncs)} syncs with every worker"


def _gossip_records(cfg: Any, workers: Path) -> tuple[list[dict], dict[str, int], str]:
    """A gossip run's metrics lines (one per sync: the workers' mean inner loss, each
    worker's last phase of it where a restart ran it twice), counts, and its line."""
    from diloco_jax import elastic as runtime

    losses: dict[int, dict[int, float]] = {}  # round -> worker -> loss
    for m in range(cfg.workers):
        for line in runtime.worker_metrics(workers, m):
            losses.setdefault(line["round"], {})[m] = line["loss"]
    records = [
        {"run": "diloco", "round": r, "step": (r + 1) * cfg.inner_steps,
         "loss": float(np.mean(list(losses[r].values()))), "included": sorted(losses[r])}
        for r in sorted(losses)
    ]  # fmt: skip
    counts = {"rounds": len(records), "syncs_with_every_worker": len(records)}
    return records, counts, f"{len(records)} syncs, each worker with its group"


def _merge_records(merges: list[dict]) -> tuple[list[dict], dict[str, int], str]:
    """A Decoupled DiLoCo run's metrics lines (one per merge), counts, and its line."""
    records = [
        {"run": "async", "update": x["update"], "fragment": x["fragment"],
         "merged": x["merged"], "late": x["late"], "loss": x["loss"]}
        for x in merges
    ]  # fmt: skip
    late = sum(x["late"] for x in merges)
    counts = {"updates": len(merges), "late_pushes": late}
    return records, counts, f"{len(merges)} merges, {late} late pushes"


def _region_records(gps_dir: Path) -> tuple[list[dict], dict[str, int], str]:
    """A HALoS run's metrics lines (one per region update, by time), counts, and its line."""
    from diloco_jax import elastic as runtime

    updates = sorted(
        (x for folder in gps_dir.glob("region-*") for x in runtime.history(folder)),
        key=lambda x: x["time"],
    )
    records = [
        {"run": "async", "update": i, "region": u["region"], "worker": u["worker"],
         "steps": u["steps"], "staleness": u["staleness"], "loss": u["loss"]}
        for i, u in enumerate(updates)
    ]  # fmt: skip
    pushes = len(runtime.history(gps_dir))
    counts = {"updates": len(updates), "global_updates": pushes}
    return records, counts, f"{len(updates)} region updates, {pushes} global updates"


def _update_records(cfg: Any, updates: list[dict]) -> tuple[list[dict], dict[str, int], str]:
    """An async run's metrics lines (one per update), counts for its summary, its line."""
    records = [
        {"run": "async", "update": u["round"], "worker": u["worker"], "steps": u["steps"],
         "staleness": u["staleness"], "loss": u["loss"]}
        for u in updates
    ]  # fmt: skip
    steps = sum(u["steps"] for u in updates)
    counts = {"updates": len(updates), "inner_steps": steps}
    return records, counts, f"{len(updates)} updates of {steps} inner steps in all"
