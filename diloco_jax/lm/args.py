"""The `diloco-jax` command line: its flags, and `parse` (argv -> a checked `Invocation`,
without touching the disk or the accelerator). `diloco_jax.lm.cli` runs what it parses;
`diloco_jax.lm.elastic` parses the same argv in each process of an elastic run."""

import argparse
import contextlib
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from diloco_jax import limits
from diloco_jax.halos import HALoS
from diloco_jax.lm import config
from diloco_jax.lm.config import (
    AGE_GATED_OPTIMIZERS,
    ALGOS,
    DTYPES,
    INNER_OPTIMIZERS,
    OUTER_OPTIMIZERS,
    PRESETS,
    SHARDINGS,
    ConfigError,
)

PROG = "diloco-jax"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        fail(message)


def fail(message: str) -> NoReturn:
    print(f"{PROG}: error: {message}".replace("\n", " "), file=sys.stderr)
    sys.exit(2)


def _shared_flags(p: argparse.ArgumentParser) -> None:
    """Every run command's flags."""
    for add in (_run_flags, _optimizer_flags, _model_flags, _method_flags, _placement_flags,
                _output_flags):  # fmt: skip
        add(p)


def _run_flags(p: argparse.ArgumentParser) -> None:
    """Flags of the run's size and data."""
    p.add_argument(
        "--preset",
        default="default",
        choices=sorted(PRESETS),
        help="base configuration (default: %(default)s)",
    )
    p.add_argument("--workers", type=int, help="M, number of DiLoCo / data-parallel workers")
    p.add_argument("--inner-steps", type=int, help="H, inner steps per round")
    p.add_argument("--rounds", type=int, help="R, communication rounds (steps = H x R)")
    p.add_argument("--data", help="bundled | stdlib | text:PATH | hf:NAME[:CONFIG[:SPLIT]]")
    p.add_argument(
        "--tokenizer",
        help="bytes (default) | bpe:VOCAB, byte-level BPE trained on the train split (cached)",
    )
    p.add_argument("--sharding", choices=SHARDINGS, help="worker data regime")


def _optimizer_flags(p: argparse.ArgumentParser) -> None:
    """Flags of the inner and outer optimizers."""
    p.add_argument("--inner-lr", type=float, help="inner AdamW peak learning rate")
    p.add_argument(
        "--inner-optimizer",
        choices=INNER_OPTIMIZERS,
        help="adamw, or muon (MuLoCo: Muon on the hidden matrices, AdamW on the rest)",
    )
    p.add_argument("--muon-lr", type=float, help="Muon's peak learning rate (default 0.02)")
    p.add_argument("--outer-lr", type=float, help="outer learning rate")
    p.add_argument("--outer-optimizer", choices=OUTER_OPTIMIZERS)
    p.add_argument("--outer-momentum", type=float, help="outer (delayed) Nesterov momentum")
    p.add_argument(
        "--age-decay",
        type=float,
        help="cgad / adam_decay: the age gate's decay per outer update of a delta's age",
    )
    p.add_argument("--age-cutoff", type=float, help="cgad: the age at which its gate reaches 0")


def _model_flags(p: argparse.ArgumentParser) -> None:
    """Flags of the model and its numerics."""
    p.add_argument("--model", help="model preset (micro, tiny, small, 60m, 150m, 400m, 1b, ...)")
    p.add_argument("--batch-size", type=int, help="sequences per worker per step")
    p.add_argument("--seq-len", type=int, help="tokens per sequence")
    p.add_argument("--dtype", choices=DTYPES, help="compute dtype (default float32)")
    p.add_argument(
        "--param-dtype",
        choices=DTYPES,
        help="dtype of parameters, gradients and optimizer state (default float32)",
    )
    p.add_argument(
        "--attention",
        choices=("auto", "xla", "cudnn"),
        help="attention kernel: auto = cudnn on an NVIDIA GPU with bfloat16, else xla",
    )
    p.add_argument(
        "--embedding",
        choices=("auto", "gather", "onehot"),
        help="token embedding: auto = onehot matmul on accelerators, gather on CPU",
    )
    p.add_argument(
        "--remat",
        action="store_true",
        default=None,
        help="recompute each block's activations in the backward pass (less memory)",
    )
    p.add_argument(
        "--shard-activations",
        action="store_true",
        default=None,
        help="with --mesh: split the residual stream's batch over fsdp (FSDP proper)",
    )


def _method_flags(p: argparse.ArgumentParser) -> None:
    """Flags of the data cap and the method's parts (warm start, compression, weights, delay,
    DES-LOC, gossip, Streaming)."""
    p.add_argument("--max-bytes", type=int, help="read at most this many bytes of data")
    p.add_argument("--pretrain-steps", type=int, help="shared 1-worker warm start (0: none)")
    p.add_argument("--compression", help="DiLoCo deltas as none|bf16|int8|int4|sparseloco|...")
    p.add_argument("--drop-probability", type=float, help="simulated drops of worker deltas")
    p.add_argument(
        "--outer-delay", type=int, help="apply each round's mean D rounds late (0, 1 or 2)"
    )
    p.add_argument("--outer-clip", type=float, help="EDiT: clip the mean delta's norm to this")
    p.add_argument(
        "--outer-state-dtype",
        help="store the outer optimizer's state in this dtype, e.g. bfloat16 (half the "
        "momentum's bytes; lossy)",
    )
    p.add_argument(
        "--weighting",
        choices=("uniform", "norm_softmax"),
        help="EDiT: norm_softmax weighs each worker's delta by exp(-norm / T) in the mean",
    )
    p.add_argument("--temperature", type=float, help="EDiT: T of --weighting norm_softmax (1)")
    p.add_argument(
        "--anomaly-skip",
        action="store_true",
        default=None,
        help="EDiT: leave out a worker whose delta norm is an EWMA z-score outlier",
    )
    p.add_argument("--state-sync", help="DES-LOC: average inner state fields, e.g. mu=75,nu=150")
    p.add_argument(
        "--gossip-group-size",
        type=int,
        help="NoLoCo: each worker averages with a random group of this many (a power of 2)",
    )
    p.add_argument(
        "--gasloc",
        help="GASLoC instead of NoLoCo, e.g. alpha=1,gamma=0.5 (groups of --gossip-group-size)",
    )
    p.add_argument("--fragments", type=int, help="Streaming DiLoCo: sync P fragments in turn")
    p.add_argument("--overlap-steps", type=int, help="Streaming DiLoCo: tau")
    p.add_argument("--merge-alpha", type=float, help="Streaming DiLoCo: alpha")
    p.add_argument(
        "--eager",
        action="store_true",
        default=None,
        help="eager outer updates: each worker's fresh delta stands in for its stale share",
    )


def _placement_flags(p: argparse.ArgumentParser) -> None:
    """Flags of the seed, the backend and where the state lives."""
    p.add_argument("--seed", type=int)
    p.add_argument("--backend", help="auto | vmap | sequential | shard_map | pmap")
    p.add_argument(
        "--mesh",
        help="a device mesh, e.g. workers=2,fsdp=2,tensor=2: the workers axis holds the M "
        "workers, fsdp and tensor shard each worker's params (and every non-worker axis its "
        "batch) over jax.devices()[:product]",
    )
    p.add_argument(
        "--shard-outer-over-workers",
        action="store_true",
        default=None,
        help="ZeRO-1: split DiLoCo's outer optimizer state over the workers (1/M per device)",
    )
    p.add_argument(
        "--outer-state-memory",
        choices=("device", "pinned_host"),
        help="where θ and the outer state live between syncs (pinned_host: host memory)",
    )


def _output_flags(p: argparse.ArgumentParser) -> None:
    """Flags of where the run writes."""
    p.add_argument("--out", help="output folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--tensorboard",
        action="store_true",
        help="also write TensorBoard event files, one folder per run, under OUT/tensorboard/",
    )


def _distributed_flags(p: argparse.ArgumentParser) -> None:
    """Multi-process runs (see diloco_jax.distributed): all three flags, or none (then the
    DILOCO_* / JAX environment, if any, decides). Process 0 writes OUT; process I > 0 writes
    its own logs into OUT/process-I; checkpoints are shared in OUT/checkpoints."""
    p.add_argument("--coordinator", help="HOST:PORT of process 0 for a multi-process run")
    p.add_argument("--num-processes", type=int, help="processes in a multi-process run")
    p.add_argument("--process-id", type=int, help="this process's id, 0..N-1")
    p.add_argument(
        "--connect-timeout",
        type=float,
        help="seconds to wait for the coordinator and every process to join (default 300)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="DiLoCo language-model experiments in JAX.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = sub.add_parser("train", help="one run of DiLoCo or the synchronous baseline")
    train.add_argument("--algo", choices=ALGOS, default="diloco")
    train.add_argument(
        "--step-seconds",
        type=_seconds_list,
        help="--algo async: simulated seconds per inner step of each worker, e.g. 0.58,0.75",
    )
    train.add_argument(
        "--dynamic-steps",
        action="store_true",
        default=None,
        help="--algo async: DyLU, slower workers take proportionally fewer steps per job",
    )
    train.add_argument(
        "--server",
        help="--algo async: another server, NAME[,field=value...], e.g. "
        "decoupled,quorum=2,grace_seconds=12.5 or halos,regions=0/0/1/1,local_updates=2 "
        "(docs/decoupled.md, docs/halos.md)",
    )
    train.add_argument("--dn-buffer", type=int, help="delayed_nesterov: buffer N (default M)")
    train.add_argument("--dn-c", type=float, help="delayed_nesterov: c (default 0)")
    train.add_argument(
        "--checkpoint-every",
        type=int,
        help="checkpoint every K rounds (async: K x M updates) into OUT/checkpoints; "
        "rerunning resumes from there",
    )
    train.add_argument(
        "--elastic",
        action="store_true",
        help="--algo diloco or async as a syncer and M worker processes on this host, where a "
        "worker that dies, stalls or restarts never stops the others (docs/faults.md); async: "
        "M x R server updates, DyLU with --dynamic-steps from the workers' measured speeds",
    )
    train.add_argument("--min-workers", type=int, help="--elastic: the quorum of each sync")
    train.add_argument(
        "--restart-workers", action="store_true", help="--elastic: restart a worker that dies"
    )
    _shared_flags(train)
    _distributed_flags(train)
    compare = sub.add_parser(
        "compare", help="DiLoCo vs sync_1worker vs sync_data_parallel, with summary and plots"
    )
    _shared_flags(compare)
    return parser


def _seconds_list(text: str) -> tuple[float, ...]:
    """'a,b,c' -> (a, b, c) as floats (checked further by the config)."""
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers, got {text!r}") from None


_ASYNC_FLAGS = ("step_seconds", "dynamic_steps", "server")
_DILOCO_FLAGS = (
    "compression",
    "drop_probability",
    "outer_delay",
    "eager",
    "outer_clip",
    "outer_state_dtype",
    "weighting",
    "temperature",
    "anomaly_skip",
    "state_sync",
    "gossip_group_size",
    "gasloc",
    "fragments",
    "overlap_steps",
    "merge_alpha",
    "shard_outer_over_workers",
    "outer_state_memory",
)
_CONFIG_FLAGS = (
    "preset",
    "workers",
    "inner_steps",
    "rounds",
    "data",
    "tokenizer",
    "sharding",
    "inner_lr",
    "inner_optimizer",
    "muon_lr",
    "outer_lr",
    "outer_optimizer",
    "outer_momentum",
    "model",
    "batch_size",
    "seq_len",
    "dtype",
    "param_dtype",
    "attention",
    "embedding",
    "remat",
    "shard_activations",
    "max_bytes",
    "pretrain_steps",
    *_DILOCO_FLAGS,
    "seed",
    "backend",
    *_ASYNC_FLAGS,
    "dn_buffer",
    "dn_c",
    "age_decay",
    "age_cutoff",
)


def _out_dir(value: str | None, default: str) -> Path:
    """The output folder, checked before anything runs (nothing is written): named (not the
    empty string, which would be the working folder), not a file, its nearest existing
    folder writable."""
    if value is not None and not value.strip():
        raise ConfigError(f"--out must name a folder, got {value!r}")
    out = Path(value if value is not None else default)
    try:
        if "\x00" in str(out):
            raise ValueError("embedded null byte")
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out {shown(out)} exists and is not a folder")
        parent = next((p for p in [out, *out.parents] if p.exists()), Path("."))
    except (OSError, ValueError) as e:  # e.g. a NUL byte, a name too long
        raise ConfigError(f"--out {value!r} is not a usable path: {e}") from None
    if not parent.is_dir():
        raise ConfigError(f"--out {shown(out)}: {shown(parent)} is not a folder")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"--out {shown(out)}: {shown(parent)} is not writable")
    return out


def shown(path: Path) -> str:
    """A path for a one-line message: as typed, or quoted with escapes when it holds a
    newline or another unprintable character."""
    text = str(path)
    return text if text.isprintable() else repr(text)


def create_out(out: Path) -> Path:
    """Creates the output folder before anything runs; a path the system refuses (e.g.
    /proc/x/y) is a ConfigError naming --out, so the command fails with one line."""
    missing = [p for p in [out, *out.parents] if not p.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as e:
        for folder in missing:  # leave nothing behind: remove what this call created
            with contextlib.suppress(OSError):
                folder.rmdir()
        reason = getattr(e, "strerror", None) or e
        raise ConfigError(f"--out {shown(out)}: can't create the folder: {reason}") from None
    if not os.access(out, os.W_OK):
        raise ConfigError(f"--out {shown(out)} is not writable")
    return out


@dataclasses.dataclass(frozen=True)
class Invocation:
    """A checked command line: what to run, with which config, into which folder."""

    command: str
    cfg: Any
    out: Path
    algo: str | None
    checkpoint_every: int | None
    progress: bool
    distributed: tuple[str, int, int] | None = None
    tensorboard: bool = False
    connect_timeout: float = 300.0
    elastic: tuple[int, bool] | None = None  # --elastic: (min_workers, restart_workers)


def parse(argv: list[str] | None = None) -> Invocation:
    """Parses and validates a command line without touching the disk or the accelerator.
    Raises ConfigError for a bad value; argparse errors exit with code 2 (one line)."""
    args = build_parser().parse_args(argv)
    overrides = {k: getattr(args, k, None) for k in _CONFIG_FLAGS if k != "preset"}
    if args.mesh is not None:
        overrides["mesh"] = config.parse_mesh(args.mesh)
    cfg = config.make_config(args.preset, **overrides)
    algo = getattr(args, "algo", None)
    if algo != "async" and any(getattr(args, k, None) is not None for k in _ASYNC_FLAGS):
        raise ConfigError("--step-seconds, --dynamic-steps and --server need --algo async")
    if algo in ("sync", "async"):  # options of DiLoCo's round that these runs don't have
        for k in _DILOCO_FLAGS:
            if getattr(args, k, None) not in (None, False):
                raise ConfigError(f"--{k.replace('_', '-')} needs --algo diloco, got {algo}")
    if cfg.outer_optimizer in ("delayed_nesterov", "heloco") and algo != "async":
        raise ConfigError(
            f"--outer-optimizer {cfg.outer_optimizer} needs --algo async (it applies one "
            "arriving delta at a time)"
        )
    if cfg.outer_optimizer in AGE_GATED_OPTIMIZERS and algo != "async" and not cfg.outer_delay:
        raise ConfigError(
            f"--outer-optimizer {cfg.outer_optimizer} gates each delta by its age, which is 0 "
            "without --algo async or --outer-delay: use --outer-optimizer adam"
        )
    if algo == "async" and cfg.backend not in ("auto", "vmap"):
        raise ConfigError(f"--algo async runs on --backend auto or vmap, got {cfg.backend!r}")
    default_out = f"runs/{args.command}" + (f"-{args.algo}" if args.command == "train" else "")
    every = getattr(args, "checkpoint_every", None)
    if every is not None and not 1 <= every <= limits.INT32_MAX:
        raise ConfigError(f"--checkpoint-every must be in [1, {limits.INT32_MAX:,}], got {every}")
    elastic = elastic_args(args, cfg)
    return Invocation(
        command=args.command,
        cfg=cfg,
        out=_out_dir(args.out, default_out),
        algo=getattr(args, "algo", None),
        checkpoint_every=every,
        progress=not args.no_progress,
        distributed=distributed_args(args),
        tensorboard=args.tensorboard,
        connect_timeout=_connect_timeout(getattr(args, "connect_timeout", None)),
        elastic=elastic,
    )


def elastic_args(args: argparse.Namespace, cfg: Any) -> tuple[int, bool] | None:
    """(min_workers, restart_workers) for --elastic, checked; None without it."""
    if not getattr(args, "elastic", False):
        for k in ("min_workers", "restart_workers"):
            if getattr(args, k, None) not in (None, False):
                raise ConfigError(f"--{k.replace('_', '-')} needs --elastic")
        return None
    if args.algo not in ("diloco", "async"):
        raise ConfigError(f"--elastic runs --algo diloco or async, got {args.algo}")
    if getattr(args, "step_seconds", None) is not None:
        raise ConfigError(
            "--elastic runs without --step-seconds: its workers run at their own speeds "
            "(--step-seconds is the simulated clock's)"
        )
    given = [f for f, k in (("--mesh", "mesh"), ("--checkpoint-every", "checkpoint_every"),
             ("--tensorboard", "tensorboard"), ("--coordinator", "coordinator"))
             if getattr(args, k, None) not in (None, False)]  # fmt: skip
    if given:
        raise ConfigError(
            f"--elastic runs without {given[0]}: each worker is its own process on one device, "
            "and the syncer checkpoints every sync"
        )
    from diloco_jax.elastic_task import refusal
    from diloco_jax.method import only_optimizers

    try:
        why = refusal(config.method(cfg))
        if why is None and args.algo == "async":
            only_optimizers(config.method(cfg), "--elastic --algo async",
                            "each arrival applies one worker's whole delta")  # fmt: skip
    except ValueError as e:  # the method's own refusal, as a run without --elastic says it
        raise ConfigError(str(e)) from None
    if why is not None:
        raise ConfigError(f"--elastic can't run this method: {why}")
    min_workers = 1 if args.min_workers is None else args.min_workers
    if not 1 <= min_workers <= cfg.workers:
        raise ConfigError(
            f"--min-workers must be in [1, --workers={cfg.workers}], got {min_workers}"
        )
    server = config.server_of(cfg)
    if isinstance(server, HALoS):
        _check_elastic_halos(server, min_workers)
    elif server is not None and min_workers != 1:
        raise ConfigError(
            "--elastic --server decoupled,... takes its quorum and grace from the server "
            "(quorum=, grace_seconds= or adaptive_grace=): no --min-workers"
        )
    if config.method(cfg).gossip is not None and min_workers not in (1, cfg.workers):
        raise ConfigError(
            f"--min-workers must be --workers={cfg.workers} (or left out) with "
            f"--gossip-group-size or --gasloc: every worker takes part in every sync, got "
            f"{min_workers}"
        )
    return min_workers, args.restart_workers


def _check_elastic_halos(server: HALoS, min_workers: int) -> None:
    """ConfigError naming what --elastic --server halos,... can't take: simulated latencies
    (its hops are the network's), a quorum larger than a region."""
    if server.simulates_latency:
        raise ConfigError("--elastic --server halos,... runs without worker_seconds and "
                          "region_seconds: on processes the hops are the network's")  # fmt: skip
    if min_workers > server.smallest_region:
        raise ConfigError(f"--min-workers must be at most the smallest region's workers "
                          f"({server.smallest_region}) with --server halos,..., got "
                          f"{min_workers}")  # fmt: skip


def _connect_timeout(value: float | None) -> float:
    """--connect-timeout in seconds (default distributed.DEFAULT_TIMEOUT_S), checked."""
    from diloco_jax import distributed

    if value is None:
        return float(distributed.DEFAULT_TIMEOUT_S)
    if not 0 < value <= distributed.MAX_TIMEOUT_S:  # NaN fails too
        raise ConfigError(
            f"--connect-timeout must be in (0, {distributed.MAX_TIMEOUT_S}] seconds, got {value!r}"
        )
    return value


def distributed_args(args: argparse.Namespace) -> tuple[str, int, int] | None:
    """(coordinator, num_processes, process_id) when given (all three or none, checked)."""
    values = [getattr(args, k, None) for k in ("coordinator", "num_processes", "process_id")]
    if all(v is None for v in values):
        return None
    if any(v is None for v in values):
        raise ConfigError("--coordinator, --num-processes and --process-id go together")
    coordinator, num_processes, process_id = values
    if not 1 <= num_processes <= limits.INT32_MAX:
        raise ConfigError(
            f"--num-processes must be in [1, {limits.INT32_MAX:,}], got {num_processes}"
        )
    if not 0 <= process_id < num_processes:
        raise ConfigError(
            f"--process-id must be in [0, --num-processes), got {process_id} of {num_processes}"
        )
    if ":" not in coordinator:
        raise ConfigError(f"--coordinator must be HOST:PORT, got {coordinator!r}")
    return coordinator, num_processes, process_id
