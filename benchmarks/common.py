"""Shared pieces of the benchmarks: workloads (LM presets and a plain MLP), interleaved timing,
compiled-memory statistics, peak FLOP/s by device kind, markdown tables and JSON results.

Every script imports this file as `common` (it sits next to them, so `python benchmarks/X.py`
finds it). Nothing here depends on timing thresholds; the scripts decide what to report.
"""

import dataclasses
import functools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from diloco_jax.lm import data as data_lib
from diloco_jax.lm import experiment
from diloco_jax.lm import mfu as mfu_lib
from diloco_jax.lm import model as model_lib
from diloco_jax.sampler import Sampler

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TOKEN_STREAM_LENGTH = 1 << 18  # synthetic byte stream the in-graph sampler draws windows from

# ---------------------------------------------------------------------------------------
# Workloads.


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model, its loss and a way to make batches of a fixed per-worker batch size.

    flops_per_example: training FLOPs (forward + backward) of one example (for an LM one
      sequence of `seq_len` tokens); examples_to_tokens turns examples into tokens.
    """

    name: str
    loss_fn: Callable[[Any, Any], jax.Array]
    params: Any
    batch_size: int
    make_batch: Callable[[np.random.Generator, tuple[int, ...]], dict[str, np.ndarray]]
    flops_per_example: float
    tokens_per_example: int
    sampler_fn: Callable[[int], Sampler] | None = None

    def host_batches(self, lead: tuple[int, ...], seed: int = 0) -> dict[str, jax.Array]:
        """A device batch with leaves [*lead, B, ...] (e.g. lead = (M, H) for one round)."""
        batch = self.make_batch(np.random.default_rng(seed), lead + (self.batch_size,))
        return jax.tree.map(jnp.asarray, batch)

    def sampler(self, num_workers: int) -> Sampler:
        if self.sampler_fn is None:
            raise ValueError(f"workload {self.name!r} has no in-graph sampler")
        return self.sampler_fn(num_workers)


def _lm_batch(seq_len: int, rng: np.random.Generator, lead: tuple[int, ...]) -> dict:
    windows = rng.integers(1, data_lib.VOCAB_SIZE, size=lead + (seq_len + 1,), dtype=np.int32)
    return {"inputs": windows[..., :-1], "targets": windows[..., 1:]}


def lm_sampler(batch_size: int, seq_len: int, num_workers: int) -> Sampler:
    """In-graph iid windows of a synthetic token stream, built the way `experiment.make_sampler`
    builds them (every worker samples the whole stream with its own key)."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, data_lib.VOCAB_SIZE, size=TOKEN_STREAM_LENGTH, dtype=np.int32)
    arrays = {
        "tokens": jnp.asarray(tokens),
        "starts": jnp.zeros((num_workers,), jnp.int32),
        "lengths": jnp.full((num_workers,), TOKEN_STREAM_LENGTH, jnp.int32),
        "key": jax.random.key(0),
    }
    return Sampler(arrays, functools.partial(experiment.sample_windows, batch_size, seq_len))


def lm_workload(
    preset: str, batch_size: int, dtype: str = "float32", **model_overrides: Any
) -> Workload:
    """The decoder LM preset `preset` of `diloco_jax.lm.model`, batch_size sequences a step,
    computing in `dtype` (parameters in float32 unless `param_dtype` is among the overrides,
    which are ModelConfig fields)."""
    config = model_lib.get_config(preset, dtype=dtype, **model_overrides)
    seq_len = config.seq_len
    name = preset if dtype == "float32" else f"{preset}-{dtype}"
    if config.param_dtype != "float32":
        name += f"-params-{config.param_dtype}"
    return Workload(
        name=name,
        loss_fn=model_lib.make_loss_fn(config),
        params=model_lib.init_params(config, jax.random.key(0)),
        batch_size=batch_size,
        make_batch=functools.partial(_lm_batch, seq_len),
        flops_per_example=model_lib.flops_per_token(config) * seq_len,
        tokens_per_example=seq_len,
        sampler_fn=functools.partial(lm_sampler, batch_size, seq_len),
    )


MLP_WIDTHS = (64, 256, 256, 10)  # input, hidden, hidden, classes


def _mlp_loss(params: dict, batch: dict) -> jax.Array:
    x = batch["x"]
    for i in range(len(MLP_WIDTHS) - 2):
        x = jax.nn.relu(x @ params[f"w{i}"] + params[f"b{i}"])
    last = len(MLP_WIDTHS) - 2
    logits = x @ params[f"w{last}"] + params[f"b{last}"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _mlp_params() -> dict:
    rng = np.random.default_rng(0)
    params = {}
    for i, (d_in, d_out) in enumerate(zip(MLP_WIDTHS[:-1], MLP_WIDTHS[1:], strict=True)):
        w = rng.normal(scale=d_in**-0.5, size=(d_in, d_out))
        params[f"w{i}"] = jnp.asarray(w, jnp.float32)
        params[f"b{i}"] = jnp.zeros((d_out,), jnp.float32)
    return params


def _mlp_batch(rng: np.random.Generator, lead: tuple[int, ...]) -> dict:
    return {
        "x": rng.normal(size=lead + (MLP_WIDTHS[0],)).astype(np.float32),
        "y": rng.integers(0, MLP_WIDTHS[-1], size=lead, dtype=np.int32),
    }


def mlp_workload(batch_size: int) -> Workload:
    """A plain 3-layer ReLU MLP classifier on Gaussian inputs (no flax)."""
    matmul = sum(a * b for a, b in zip(MLP_WIDTHS[:-1], MLP_WIDTHS[1:], strict=True))
    return Workload(
        name="mlp",
        loss_fn=_mlp_loss,
        params=_mlp_params(),
        batch_size=batch_size,
        make_batch=_mlp_batch,
        flops_per_example=6.0 * matmul,
        tokens_per_example=1,
    )


# ---------------------------------------------------------------------------------------
# Timing.


def block(tree: Any) -> Any:
    return jax.block_until_ready(tree)


_START = time.perf_counter()


def progress(message: str) -> None:
    """One line to stderr with the seconds since start: partial results survive a killed run
    (tables are printed at the end) and show where time goes (accelerator compiles are slow)."""
    print(f"[{time.perf_counter() - _START:7.1f} s] {message}", file=sys.stderr, flush=True)


class Elapsed(float):
    """Seconds a run measured itself (e.g. between callbacks), returned instead of arrays:
    `time_once` takes it in place of the call's wall time."""


def time_once(run: Callable[[], Any]) -> float:
    """Seconds for `run()` including waiting for every array it returns, or the `Elapsed` it
    returns."""
    start = time.perf_counter()
    out = block(run())
    stop = time.perf_counter()
    return float(out) if isinstance(out, Elapsed) else stop - start


def interleaved(runs: dict[str, Callable[[], Any]], reps: int) -> dict[str, list[float]]:
    """Times every run once per repetition, alternating the order (A B, B A, A B, ...) so
    slow drifts in machine load hit all candidates alike. Returns seconds per run."""
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names if rep % 2 == 0 else reversed(names):
            times[name].append(time_once(runs[name]))
    return times


def median_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """Median over repetitions of the per-repetition ratio (pairs timed back to back)."""
    return statistics.median(a / b for a, b in zip(numerator, denominator, strict=True))


def spread(ratios: Sequence[float]) -> str:
    """'min..max' of a sequence, for showing how noisy a ratio is."""
    return f"{min(ratios):.3f}..{max(ratios):.3f}"


# ---------------------------------------------------------------------------------------
# Compiled programs.

MEMORY_FIELDS = (
    "temp_size_in_bytes",
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "generated_code_size_in_bytes",
    "peak_memory_in_bytes",
)


def memory_stats(compiled: Any) -> dict[str, int]:
    """The fields of `compiled.memory_analysis()` that exist in this jax version, plus
    "total" = temp + argument + output - alias + generated code (bytes)."""
    analysis = compiled.memory_analysis()
    stats = {f: int(getattr(analysis, f)) for f in MEMORY_FIELDS if hasattr(analysis, f)}
    stats["total"] = (
        stats["temp_size_in_bytes"]
        + stats["argument_size_in_bytes"]
        + stats["output_size_in_bytes"]
        - stats.get("alias_size_in_bytes", 0)
        + stats.get("generated_code_size_in_bytes", 0)
    )
    return stats


# What XLA's GPU compiler needs to know of an NVIDIA H200 to compile for one that is not here
# (`se::GpuTargetConfigProto` as text; NVIDIA's published figures: 132 SMs, compute
# capability 9.0, 143,771 MiB of HBM3e at 4.8 TB/s, 50 MiB of L2).
H200_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 4800000000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 150754820096
  shared_memory_per_block_optin: 232448 cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 9 }
device_description_str: "NVIDIA H200"
"""
TARGETS = ("cpu", "h200")


def target_devices(target: str, count: int) -> list:
    """`count` devices to compile for: this process's CPU devices ("cpu"), or NVIDIA H200s of
    one host that need not be present ("h200": XLA's GPU compiler run ahead of time, without
    a GPU; it needs JAX's CUDA plugin, `pip install "jax[cuda12]==<jax's version>"`, and
    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 set before jax is imported). Programs are lowered and
    compiled for them (`jit(...).lower(...).compile()`), never run."""
    if target == "cpu":
        return jax.devices()[:count]
    if target != "h200":
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="cuda", target_config=H200_TARGET_CONFIG, topology=f"1x1x{count}"
    )
    return list(topology.devices)


_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")
_WHILE_BODY = re.compile(r"\bwhile\(.*?\bbody=%([\w.\-]+)")
_OP = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = (.*)$")


def _op_name(rhs: str) -> str | None:
    """The opcode of an HLO instruction's right-hand side `TYPE opcode(operands), ...`."""
    if rhs.startswith("("):  # a tuple type: skip to its matching parenthesis
        depth = 0
        for i, ch in enumerate(rhs):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                rhs = rhs[i + 1 :].lstrip()
                break
    else:
        rhs = rhs.split(" ", 1)[1] if " " in rhs else ""
    match = re.match(r"([\w\-]+)\(", rhs)
    return match.group(1) if match else None


def hlo_computations(text: str) -> dict[str, list[str]]:
    """Optimized HLO text -> {computation name: its instruction lines}."""
    computations: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header and line.rstrip().endswith("{"):
            name = header.group(1)
            computations[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            computations[name].append(line)
    return computations


def _ops(lines: list[str]) -> Counter:
    ops: Counter = Counter()
    for line in lines:
        match = _OP.match(line)
        if match and (op := _op_name(match.group(1))) is not None:
            ops[op] += 1
    return ops


def while_body_ops(compiled: Any) -> Counter:
    """Opcode counts of the instructions in the bodies of every while loop of a compiled
    program (kernels the loop launches each iteration; fused subcomputations not expanded)."""
    text = compiled.as_text()
    computations = hlo_computations(text)
    ops: Counter = Counter()
    for body in set(_WHILE_BODY.findall(text)):
        ops += _ops(computations.get(body, []))
    return ops


def entry_ops(compiled: Any) -> Counter:
    """Opcode counts of the entry computation of a compiled program (a while loop counts as
    one op; its body is not expanded)."""
    text = compiled.as_text()
    entry = re.search(r"^ENTRY %([\w.\-]+) ", text, re.MULTILINE)
    return _ops(hlo_computations(text)[entry.group(1)]) if entry else Counter()


def cost(compiled: Any) -> dict[str, float]:
    """XLA's static cost estimate of a compiled program: flops, bytes accessed."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list):  # older jax returned one dict per program
        analysis = analysis[0]
    return {k: float(analysis.get(k, 0.0)) for k in ("flops", "bytes accessed")}


def profiled(run: Callable[[], Any], directory: str | os.PathLike) -> Path:
    """Runs `run` once under `jax.profiler.trace` (C++ events only) and returns the newest
    `.xplane.pb` written under `directory` (readable by TensorBoard / xprof / Perfetto)."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with jax.profiler.trace(str(directory), profiler_options=options):
        block(run())
    return max(Path(directory).rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)


def top_device_ops(xplane: str | os.PathLike, n: int = 12) -> list[tuple[str, float, float]]:
    """The `n` ops with the most accelerator time in a trace: (name, ms, share of the total),
    summed over each "/device:..." plane's "XLA Ops" line, or where a raw trace has none, its
    per-stream kernel lines ("Stream #..."; XLA names kernels after their fusions). Empty for
    CPU traces (XLA's CPU ops run on host threads, with no device plane)."""
    profile = jax.profiler.ProfileData.from_file(str(xplane))
    totals: Counter = Counter()
    for plane in profile.planes:
        if not plane.name.startswith("/device:"):
            continue
        lines = list(plane.lines)
        ops = [line for line in lines if line.name == "XLA Ops"]
        for line in ops or [line for line in lines if line.name.startswith("Stream")]:
            for event in line.events:
                totals[event.name] += event.duration_ns
    whole = sum(totals.values())
    return [(name, ns / 1e6, ns / whole) for name, ns in totals.most_common(n)]


# ---------------------------------------------------------------------------------------
# Peak FLOP/s for MFU: the table and the CPU matmul yardstick live in diloco_jax.lm.mfu (the
# CLI reports MFU too); the scripts call them through here.

PEAK_FLOPS = mfu_lib.PEAK_FLOPS


def peak_flops(device: Any, dtype: str) -> float | None:
    """Peak FLOP/s of one `device` computing in `dtype`: the datasheet figure for listed
    accelerators, the measured large-matmul FLOP/s on a CPU, None otherwise."""
    return mfu_lib.peak_flops(dtype, device=device)


# ---------------------------------------------------------------------------------------
# Reporting.


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


@functools.cache
def environment() -> dict[str, Any]:
    """Where a result comes from: versions, device, load, and the library's git commit (with
    whether diloco_jax/ had uncommitted changes), since the library changes under its users.
    Taken once, at the first call (scripts call it first thing, via `header`)."""
    device = jax.devices()[0]
    # A copied tree (e.g. on a rented accelerator) names its commit here: its .git, if any,
    # may not be the one the files come from.
    named = os.environ.get("DILOCO_JAX_COMMIT")
    return {
        "git_commit": named or _git("rev-parse", "--short", "HEAD"),
        "library_modified": not named
        and bool(_git("status", "--porcelain", "--", "../diloco_jax")),
        "jax": jax.__version__,
        "platform": device.platform,
        "device_kind": device.device_kind,
        "num_devices": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "allocator": allocator(),
    }


def allocator() -> str:
    """The malloc this process runs on: a preloaded mimalloc / jemalloc / tcmalloc, else the C
    library's ("libc"). On XLA's CPU runtime it matters: temporaries are allocated afresh at
    every execution (benchmarks/README.md, "device_round.py")."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "libc"
    for name in ("mimalloc", "jemalloc", "tcmalloc"):
        if f"lib{name}" in maps:
            return name
    return "libc"


def mimalloc_library() -> Path | None:
    """The shared library of the `cmeel-mimalloc` package (the dev extra), if installed."""
    import sysconfig

    lib = Path(sysconfig.get_paths()["purelib"]) / "cmeel.prefix" / "lib" / "libmimalloc.so"
    return lib if lib.exists() else None


def header() -> str:
    """One line naming the environment, printed above a script's tables."""
    env = environment()
    commit = env["git_commit"] or "unknown"
    if env["library_modified"]:
        commit += " + uncommitted diloco_jax changes"
    return (
        f"diloco-jax {commit}; jax {env['jax']}; {env['num_devices']} x {env['device_kind']} "
        f"({env['platform']}); {env['cpu_count']} CPUs; 1-min load {env['load_average_1m']}; "
        f"malloc {env['allocator']}"
    )


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(name: str, payload: dict[str, Any]) -> Path:
    """Writes benchmarks/results/NAME.json (with the environment) and returns its path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    end = {"load_average_1m_end": round(os.getloadavg()[0], 2)}
    record = {"benchmark": name, "environment": {**environment(), **end}, **payload}
    path.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n")
    return path


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
