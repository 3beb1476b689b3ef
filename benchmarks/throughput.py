"""Steady-state training throughput and MFU of the LM presets.

For each preset it times, after compiling and one warm-up call:
- "diloco M=4": `jax.jit(diloco_round, donate_argnums=0)` with H inner steps, vmap backend;
- "sync M=4": `jax.jit(sync_step, donate_argnums=0)`, 4 workers averaging gradients;
- "sync M=1": the same step with one worker.
Data is drawn in the graph by a `Sampler` (as the LM CLI does), so no host input is timed.

`--modes` picks some of them (diloco, sync, sync1).

Reported: tokens/s per worker, achieved FLOP/s of the device (all workers share it, vmap) from
`model.flops_per_token` (PaLM's 6N + 12 L H K T training estimate), and MFU = achieved /
peak FLOP/s, with peak from `diloco_jax.lm.mfu`: the datasheet figure for the device kind, or
on a CPU the FLOP/s of a 2048 x 2048 float32 matmul measured in this process ("n/a" for
unlisted accelerators; `--peak-tflops` overrides). Absolute figures depend on the machine's
load; the environment (incl. load average) is saved with the results.

  python benchmarks/throughput.py [--quick] [--presets micro,mini,tiny,small] [--dtype bfloat16]
      [--modes diloco,sync,sync1] [--profile DIR]
"""

import argparse
import functools
import itertools
import re
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common
import jax

import diloco_jax as dj
from diloco_jax.lm import mfu as mfu_lib

NUM_WORKERS = 4
BATCH_SIZE = 16  # sequences per worker per step (RunConfig's default)
# preset -> inner steps H per round (a timed DiLoCo sample is one round; a sync sample is H
# steps, so both process the same tokens per worker)
INNER_STEPS = {"micro": 20, "mini": 10, "tiny": 4, "small": 2, "60m": 2, "150m": 2, "400m": 2}
CPU_PRESETS = ("micro", "mini", "tiny")
MODES = ("diloco", "sync", "sync1")
ACCELERATOR_PRESETS = ("micro", "mini", "tiny", "small")


def diloco_runner(w: common.Workload, inner_steps: int) -> Callable[[], Any]:
    inner, outer = dj.default_inner_optimizer(), dj.default_outer_optimizer()
    fn = functools.partial(
        dj.diloco_round, w.loss_fn, inner_optimizer=inner, outer_optimizer=outer,
        backend="vmap", num_workers=NUM_WORKERS, inner_steps=inner_steps,
    )  # fmt: skip
    step = jax.jit(fn, donate_argnums=0)
    sampler = w.sampler(NUM_WORKERS)
    holder = [dj.init_state(w.params, NUM_WORKERS, inner_optimizer=inner, outer_optimizer=outer)]

    def run():
        holder[0], metrics = step(holder[0], sampler)
        return metrics

    return run


def sync_runner(w: common.Workload, num_workers: int, steps: int) -> Callable[[], Any]:
    opt = dj.default_inner_optimizer()
    fn = functools.partial(
        dj.sync.sync_step, w.loss_fn, optimizer=opt, backend="vmap", num_workers=num_workers
    )
    step = jax.jit(fn, donate_argnums=0)
    sampler = w.sampler(num_workers)
    holder = [dj.sync.init_sync_state(w.params, opt)]

    def run():
        for _ in range(steps):
            holder[0], metrics = step(holder[0], sampler)
        return metrics

    return run


def runner(mode: str, w: common.Workload, inner_steps: int) -> tuple[str, int, Callable]:
    """(row label, workers, run) for a --modes name."""
    if mode == "diloco":
        label = f"diloco M={NUM_WORKERS} H={inner_steps}"
        return label, NUM_WORKERS, diloco_runner(w, inner_steps)
    if mode == "sync":
        return f"sync M={NUM_WORKERS}", NUM_WORKERS, sync_runner(w, NUM_WORKERS, inner_steps)
    return "sync M=1", 1, sync_runner(w, 1, inner_steps)


def measure(
    w: common.Workload,
    mode: str,
    num_workers: int,
    run: Callable,
    steps: int,
    samples: int,
    peak: Callable[[], float | None],
) -> dict[str, Any]:
    """Times `samples` calls of `run` (each `steps` steps per worker) after a warm-up call,
    each followed by a call of `peak`: the CPU's matmul yardstick is re-measured next to every
    sample, so load that comes and goes on a shared machine hits both, and MFU is the median of
    the per-sample ratios."""
    common.block(run())  # compile + warm-up
    seconds, peaks = [], []
    for _ in range(samples):
        seconds.append(common.time_once(run))
        peaks.append(peak())
    tokens_per_worker = steps * w.batch_size * w.tokens_per_example
    flops = steps * num_workers * w.batch_size * w.flops_per_example
    ratios = [flops / s / p for s, p in zip(seconds, peaks, strict=True) if p is not None]
    mfu = statistics.median(ratios) if len(ratios) == samples else None
    # Fastest sample over the fastest yardstick: on a shared machine interference only adds
    # time, so this reads each at its least disturbed.
    mfu_best = flops / min(seconds) / max(peaks) if mfu is not None else None
    return {
        "preset": w.name,
        "mode": mode,
        "workers": num_workers,
        "batch_size": w.batch_size,
        "steps_per_sample": steps,
        "seconds_per_sample": statistics.median(seconds),
        "tokens_per_s_per_worker": tokens_per_worker / statistics.median(seconds),
        "flops_per_s": flops / statistics.median(seconds),
        "peak_flops": None if None in peaks else statistics.median(peaks),
        "mfu": mfu,
        "mfu_best": mfu_best,
    }


def report_profile(run: Callable, directory: Path) -> None:
    """Traces one more call of `run` and prints where the accelerator's time went."""
    xplane = common.profiled(run, directory)
    ops = common.top_device_ops(xplane)
    lines = [f"trace: {xplane}"]
    if not ops:
        lines.append("(no accelerator ops in the trace: CPU runs have no device plane)")
    lines += [f"{ms:10.3f} ms {share:6.1%}  {name}" for name, ms, share in ops]
    common.progress("\n".join(lines))


def percent(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def table(rows: list[dict[str, Any]]) -> str:
    headers = ["preset", "mode", "B", "steps/sample", "s/sample", "tokens/s per worker",
               "achieved GFLOP/s", "MFU", "MFU best/best"]  # fmt: skip
    body = [
        [r["preset"], r["mode"], r["batch_size"], r["steps_per_sample"],
         f"{r['seconds_per_sample']:.3f}", f"{r['tokens_per_s_per_worker']:,.0f}",
         f"{r['flops_per_s'] / 1e9:.1f}", percent(r["mfu"]), percent(r["mfu_best"])]
        for r in rows
    ]  # fmt: skip
    return common.markdown_table(headers, body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="micro only, fewer samples")
    parser.add_argument("--presets", default=None, help="comma-separated LM presets")
    parser.add_argument(
        "--dtype",
        default="float32",
        help="comma-separated compute dtypes, e.g. float32,bfloat16 (each gets its rows)",
    )
    parser.add_argument(
        "--param-dtype", default="float32", choices=["float32", "bfloat16"],
        help="parameter (master weight) dtype",
    )  # fmt: skip
    parser.add_argument("--attention", default="auto", choices=["auto", "xla", "cudnn"])
    parser.add_argument("--embedding", default="auto", choices=["auto", "gather", "onehot"])
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    parser.add_argument(
        "--modes", default=",".join(MODES), help=f"comma-separated, some of {','.join(MODES)}"
    )
    parser.add_argument("--samples", type=int, default=None, help="timed calls per mode")
    parser.add_argument("--peak-tflops", type=float, default=None, help="override peak")
    parser.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="also trace one more call of each mode into DIR/PRESET_MODE and "
        "print its top accelerator ops",
    )
    args = parser.parse_args()
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES):
        parser.error(f"--modes must be some of {','.join(MODES)}, got {args.modes!r}")
    dtypes = args.dtype.split(",")
    if not set(dtypes) <= {"float32", "bfloat16"}:
        parser.error(f"--dtype must be some of float32,bfloat16, got {args.dtype!r}")
    print(common.header() + "\n")
    device = jax.devices()[0]
    if args.presets:
        presets = tuple(args.presets.split(","))
    elif args.quick:
        presets = ("micro",)
    else:
        presets = CPU_PRESETS if device.platform == "cpu" else ACCELERATOR_PRESETS
    samples = args.samples or (2 if args.quick else 3)

    def peak_fn(dtype: str) -> Callable[[], float | None]:
        if args.peak_tflops is not None:
            return lambda: args.peak_tflops * 1e12
        if device.platform == "cpu":
            return mfu_lib.time_matmul  # re-measured next to every sample
        return lambda: common.peak_flops(device, dtype)

    model_options = dict(
        param_dtype=args.param_dtype, attention=args.attention, embedding=args.embedding
    )
    rows = []
    for preset, dtype in itertools.product(presets, dtypes):
        w = common.lm_workload(preset, args.batch_size, dtype, **model_options)
        H = INNER_STEPS.get(preset, 2)
        for mode, workers, run in (runner(m, w, H) for m in modes):
            common.progress(f"{w.name} {mode}: compiling and timing")
            rows.append(measure(w, mode, workers, run, H, samples, peak_fn(dtype)))
            common.progress("\n" + table(rows[-1:]))
            if args.profile:
                report_profile(run, Path(args.profile) / re.sub(r"\W+", "_", f"{w.name}_{mode}"))

    peaks = [r["peak_flops"] for r in rows if r["peak_flops"] is not None]
    if not peaks:
        peak_text = "n/a (no peak known for this device)"
    elif device.platform == "cpu" and args.peak_tflops is None:
        peak_text = (
            f"{min(peaks) / 1e9:.0f}..{max(peaks) / 1e9:.0f} GFLOP/s (a 2048^2 float32 matmul, "
            "re-measured after every sample; MFU = median of per-sample ratios)"
        )
    else:
        peak_text = f"{peaks[0] / 1e12:.4g} TFLOP/s"
    print(
        f"Throughput on {device.device_kind} ({device.platform}), compute dtype {args.dtype}, "
        f"params {args.param_dtype}, attention {args.attention}, embedding {args.embedding}, "
        f"peak {peak_text}; all workers share one device (vmap); medians of {samples} samples\n"
    )
    print(table(rows))
    payload = {
        "quick": args.quick,
        "dtype": args.dtype,
        **model_options,
        "samples": samples,
        "rows": rows,
    }
    print(f"\nwrote {common.write_results('throughput', payload)}")


if __name__ == "__main__":
    main()
