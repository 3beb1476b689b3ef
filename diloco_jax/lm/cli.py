"""The `diloco-jax` command: `train` (one run) and `compare` (DiLoCo against the synchronous
baselines, the paper's Table 2 at laptop scale). User mistakes print one line, exit code 2,
and nothing is written."""

import contextlib
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from diloco_jax import run_lock
from diloco_jax.lm import config
from diloco_jax.lm.args import (  # noqa: F401 (parse and create_out: cli's public names)
    Invocation,
    create_out,
    fail,
    parse,
    shown,
)
from diloco_jax.lm.config import ConfigError


def main(argv: list[str] | None = None) -> int:
    with contextlib.ExitStack() as held:  # the output folder's lock, for the whole command
        try:
            run = parse(argv)
            if run.distributed is not None or _distributed_env():
                from diloco_jax import distributed

                try:
                    distributed.initialize(*(run.distributed or ()), timeout=run.connect_timeout)
                except (ValueError, ConnectionError) as e:
                    raise ConfigError(f"--coordinator: {e}") from None
            from diloco_jax.lm import experiment

            experiment.check_model(run.cfg)
            experiment.check_mesh(run.cfg)
            experiment.check_memory(run.cfg, _algos(run))
            corpus = experiment.load_corpus(run.cfg)
            create_out(run.out)  # last check before work starts: a bad input writes nothing
            out, shared = _process_out(run.out)
            held.enter_context(lock_out(out))
            fingerprint = None
            if run.command == "train" and run.checkpoint_every is not None:
                identity = run_identity(run.cfg, run.algo, corpus.info)
                fingerprint = check_resumable(run.out, identity)
        except ConfigError as e:
            fail(str(e))
        print(experiment.describe(run.cfg, corpus))
        if run.command == "train" and run.elastic is not None:
            from diloco_jax.lm.elastic import train_elastic

            argv = sys.argv[1:] if argv is None else argv
            return train_elastic(run.cfg, corpus, out, argv, *run.elastic, progress=run.progress,
                                 algo=run.algo or "diloco")  # fmt: skip
        if run.command == "train":
            train_command(
                run.cfg,
                corpus,
                run.algo,
                out,
                run.progress,
                run.checkpoint_every,
                shared,
                tensorboard=run.tensorboard,
                checkpoint_fingerprint=fingerprint,
            )
        else:
            from diloco_jax.lm.compare import compare_command

            compare_command(
                run.cfg, corpus, run.out, progress=run.progress, tensorboard=run.tensorboard
            )
    return 0


def _algos(run: Invocation) -> tuple[str, ...]:
    """The algorithms the command runs (compare: DiLoCo and the synchronous baselines)."""
    return (run.algo,) if run.command == "train" else ("diloco", "sync")


def lock_out(out: Path) -> run_lock.RunLock:
    """This process's output folder, created and locked for the command's life
    (`diloco_jax.run_lock`): a second command into it is a ConfigError (one line, exit 2)
    before it writes anything; the lock goes when the process ends, however it ends."""
    out.mkdir(parents=True, exist_ok=True)
    try:
        return run_lock.acquire(out, what="--out")
    except run_lock.FolderInUse as e:
        raise ConfigError(str(e)) from None


RUN_IDENTITY = "run.json"  # in OUT/checkpoints, written by earlier versions: read, not written
# Config fields a resume may change: where, not what, it trains (checkpoints hold the state
# in the params' shapes whatever its layout), and what a device keeps for the backward pass.
PLACEMENT_FIELDS = (
    "mesh",
    "shard_outer_over_workers",
    "outer_state_memory",
    "remat",
    "shard_activations",
)


def run_identity(cfg: Any, algo: str | None, data_info: dict[str, Any]) -> dict[str, Any]:
    """What makes checkpoints resumable by a rerun: the algorithm, the config but its
    PLACEMENT_FIELDS (another --rounds changes the learning-rate schedule, for one), the
    DiLoCo spec it builds (its stable repr) and the data's sha256. Saved in every checkpoint
    (the trainers' `checkpoint_fingerprint`)."""
    config_fields = json.loads(json.dumps(dataclasses.asdict(cfg)))  # tuples as JSON lists
    identity = {
        "algo": algo,
        "config": {k: v for k, v in config_fields.items() if k not in PLACEMENT_FIELDS},
        "data_sha256": data_info.get("sha256"),
    }
    if algo == "diloco":
        identity["method"] = repr(config.method(cfg))
    return identity


def check_resumable(out: Path, identity: dict[str, Any]) -> dict[str, Any]:
    """A checkpointed train run into an OUT that already holds checkpoints resumes them, so
    it must be the same run: `identity` (`run_identity`) must match the one those
    checkpoints carry (their newest intact metadata; for checkpoints from before that, the
    OUT/checkpoints/run.json or OUT/config.json written with them), except for
    PLACEMENT_FIELDS (a run may resume on another --mesh) and config fields newer than the
    checkpoints. Raises ConfigError naming what differs; an OUT without checkpoints passes.

    Returns the identity the run's checkpoints go on carrying: the saved one (what the run
    was started as), or `identity` for a new run or checkpoints that carry none."""
    saved, carried = _saved_identity(out / "checkpoints")
    if saved is None:
        return identity
    changed = []
    if saved.get("algo") is not None and saved["algo"] != identity["algo"]:
        changed.append(f"algo {saved['algo']!r} -> {identity['algo']!r}")
    old = saved.get("config") if isinstance(saved.get("config"), dict) else {}
    changed += [
        f"{k.replace('_', '-')} {old[k]!r} -> {v!r}"
        for k, v in identity["config"].items()
        # A field newer than the checkpoints is kept; a placement may change (the engine
        # restores a checkpoint onto another mesh: the same run, up to reduction order).
        if k in old and old[k] != v and k not in PLACEMENT_FIELDS
    ]
    if "method" in identity and saved.get("method") not in (None, identity["method"]):
        changed.append(f"method {saved['method']} -> {identity.get('method')}")
    if saved.get("data_sha256") not in (None, identity["data_sha256"]):
        changed.append("data (another sha256)")
    if changed:
        raise ConfigError(
            f"--out {shown(out)} holds checkpoints of another run ({', '.join(changed)}): "
            "rerun the same command to resume, or pick another --out"
        )
    return saved if carried else identity


def _saved_identity(folder: Path) -> tuple[dict[str, Any] | None, bool]:
    """(the identity the checkpoints under `folder` were written with, whether the
    checkpoints carry it themselves); (None, False) without checkpoints."""
    from diloco_jax import checkpoint

    if not folder.is_dir():
        return None, False
    for name in ("run", "pretrain"):
        metadata = checkpoint.latest_metadata(folder / name)
        if metadata is not None and isinstance(metadata.get("run"), dict):
            return metadata["run"], True
    saved = _read_json(folder / RUN_IDENTITY)
    if saved is None:  # checkpoints older than run.json
        legacy = _read_json(folder.parent / "config.json") or {}
        data = legacy.get("data") if isinstance(legacy.get("data"), dict) else {}
        saved = {
            "algo": legacy.get("algo"),
            "config": legacy.get("config"),
            "data_sha256": data.get("sha256"),
        }
    return saved, False


def _read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from `path`, or None when it is missing, unreadable or not an object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _distributed_env() -> bool:
    """Whether DILOCO_COORDINATOR asks for a multi-process run through the environment."""
    return bool(os.environ.get("DILOCO_COORDINATOR"))


def _process_out(out: Path) -> tuple[Path, Path]:
    """(this process's output folder, the shared folder for checkpoints): OUT for process 0
    (and single-process runs), OUT/process-I for process I > 0; checkpoints always in OUT."""
    import jax

    index = jax.process_index()
    return (out if index == 0 else out / f"process-{index}"), out


def train_command(
    cfg,
    corpus,
    algo: str,
    out: Path,
    progress: bool = True,
    checkpoint_every: int | None = None,
    checkpoint_root: Path | None = None,
    tensorboard: bool = False,
    checkpoint_fingerprint: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One run into `out`: config.json first, metrics.jsonl as it trains, summary.json last.

    With `checkpoint_every`, checkpoints go to out/checkpoints/{pretrain,run}; rerunning the
    same command after an interruption resumes there, and metrics.jsonl is rewritten whole at
    the end, so it ends up as an uninterrupted run's. `checkpoint_root` (default `out`) holds
    the checkpoints folder instead: the shared OUT of every process of a multi-process run.
    With `tensorboard`, the pretrain's and the run's scalars also go to out/tensorboard/pretrain
    and out/tensorboard/ALGO (rewritten whole at the end of a checkpointed run, like
    metrics.jsonl). Records, scalars and the progress bar carry the loss's train metrics
    (`experiment.aux_names`, e.g. accuracy) beside the loss. `checkpoint_fingerprint` (the
    `check_resumable` identity) is saved in every checkpoint and must match on resume.
    """
    from diloco_jax.lm import experiment, tblog
    from diloco_jax.lm.runlog import RunLog, write_json, write_jsonl

    tb = lambda name: tblog.run_dir(out, name) if tensorboard else None
    aux = experiment.aux_names(cfg)  # train metrics beside the loss, e.g. accuracy
    run_log = lambda total, desc, name: RunLog(metrics, total, desc, progress, tb(name), aux)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", experiment.config_record(cfg, corpus, algo=algo))
    metrics = out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    root = out if checkpoint_root is None else checkpoint_root
    ckpt = (lambda name: str(root / "checkpoints" / name)) if checkpoint_every else (lambda _: None)
    if checkpoint_every and checkpoint_fingerprint is None:
        checkpoint_fingerprint = run_identity(cfg, algo, corpus.info)
    with run_log(cfg.pretrain_steps, "pretrain M=1", "pretrain") as log:
        params, pre_history = experiment.pretrain(
            cfg,
            corpus,
            on_record=log,
            checkpoint_dir=ckpt("pretrain"),
            checkpoint_fingerprint=checkpoint_fingerprint if checkpoint_every else None,
        )
    with run_log(cfg.total_steps, f"{algo} M={cfg.workers}", algo) as log:
        summary, history = experiment.run(
            cfg,
            corpus,
            algo,
            cfg.workers,
            params=params,
            on_record=log,
            checkpoint_dir=ckpt("run"),
            checkpoint_every=checkpoint_every or 1,
            checkpoint_fingerprint=checkpoint_fingerprint if checkpoint_every else None,
        )
    write_jsonl(metrics, pre_history + history)
    if tensorboard and checkpoint_every:  # a resumed run logged only its last part live
        tblog.write_history(tb("pretrain"), pre_history, aux)
        tblog.write_history(tb(algo), history, aux)
    write_json(out / "summary.json", summary)
    print(
        f"{algo}: eval loss {summary['final_eval_loss']:.4f} "
        f"(ppl {summary['final_eval_ppl']:.3f}), sent {summary['bytes_communicated']:,} "
        f"bytes per worker, {summary['wall_seconds']:.0f}s -> {out}"
    )
    print(mfu_line(algo, summary))
    return summary


def mfu_line(name: str, summary: dict[str, Any]) -> str:
    """'NAME: MFU x% (tokens/s, model TFLOP/s of peak TFLOP/s)' for a run's summary."""
    achieved = summary["model_flops_per_token"] * summary["tokens_per_second"]
    peak = summary["peak_flops"]
    if peak is None:
        return (
            f"{name}: MFU n/a (no peak FLOP/s known for this device), "
            f"{summary['tokens_per_second']:,.0f} tokens/s, {achieved / 1e12:.3g} model TFLOP/s"
        )
    return (
        f"{name}: MFU {100 * summary['mfu']:.3g}% ({summary['tokens_per_second']:,.0f} tokens/s, "
        f"{achieved / 1e12:.3g} model TFLOP/s of {peak / 1e12:.3g} peak; whole run, compiles "
        "and evaluations included)"
    )


if __name__ == "__main__":
    sys.exit(main())
