"""The LM at an earlier commit against the working tree's, interleaved in one process.

Loads `diloco_jax/lm/model.py` as it was at `--before` (via `git show`; the file imports only
jax, flax and optax) next to today's, builds the one-worker training step of each (`sync_step`,
AdamW, in-graph data, donated state) for the same preset and batch, and times them in
alternating samples (before, after, after, before, ...), each sample followed by the CPU's
matmul yardstick (`mfu.time_matmul`): load that comes and goes on a shared machine then hits
both models alike. Reports each model's seconds per step and MFU (model FLOPs per token from
today's `model.flops_per_token`, the same formula for both) and after / before time ratios.

  python benchmarks/model_ab.py [--before e0d577d] [--presets tiny,small] [--batch-size 16]
      [--samples 5] [--dtype float32] [--param-dtype float32] [--attention auto]
      [--embedding auto]

`--dtype` / `--param-dtype` etc. apply to today's model; the earlier one (before mixed
precision) stores and computes in `--dtype`.
"""

import argparse
import functools
import importlib.util
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import common
import jax

import diloco_jax as dj
from diloco_jax.lm import mfu as mfu_lib
from diloco_jax.lm import model as model_lib

ROOT = Path(__file__).resolve().parent.parent


def model_at(revision: str) -> Any:
    """diloco_jax/lm/model.py at `revision`, imported as a separate module."""
    source = subprocess.run(
        ["git", "show", f"{revision}:diloco_jax/lm/model.py"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / f"model_{revision}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"model_{revision}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def step_runner(module: Any, config: Any, batch_size: int, steps: int):
    """A callable running `steps` jitted one-worker sync steps of `module`'s model."""
    loss_fn = module.make_loss_fn(config)
    params = module.init_params(config, jax.random.key(0))
    opt = dj.default_inner_optimizer()
    fn = functools.partial(dj.sync.sync_step, loss_fn, optimizer=opt, backend="vmap", num_workers=1)
    step = jax.jit(fn, donate_argnums=0)
    sampler = common.lm_sampler(batch_size, config.seq_len, 1)
    holder = [dj.sync.init_sync_state(params, opt)]

    def run():
        for _ in range(steps):
            holder[0], metrics = step(holder[0], sampler)
        return metrics

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="e0d577d", help="git revision of the old model")
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2, help="steps per timed sample")
    parser.add_argument("--samples", type=int, default=5, help="timed samples per model")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--attention", default="auto", choices=["auto", "xla", "cudnn"])
    parser.add_argument("--embedding", default="auto", choices=["auto", "gather", "onehot"])
    args = parser.parse_args()
    print(common.header() + "\n")
    old = model_at(args.before)
    device = jax.devices()[0]
    rows = []
    for preset in args.presets.split(","):
        after_cfg = model_lib.get_config(
            preset, dtype=args.dtype, param_dtype=args.param_dtype, attention=args.attention,
            embedding=args.embedding,
        )  # fmt: skip
        runs = {
            "before": step_runner(
                old, old.get_config(preset, dtype=args.dtype), args.batch_size, args.steps
            ),
            "after": step_runner(model_lib, after_cfg, args.batch_size, args.steps),
        }
        common.progress(f"{preset}: compiling both models")
        for run in runs.values():
            common.block(run())  # compile + warm-up
        times: dict[str, list[float]] = {name: [] for name in runs}
        peaks: dict[str, list[float | None]] = {name: [] for name in runs}
        for i in range(args.samples):
            for name in ("before", "after") if i % 2 == 0 else ("after", "before"):
                times[name].append(common.time_once(runs[name]))
                cpu = device.platform == "cpu"
                peaks[name].append(
                    mfu_lib.time_matmul() if cpu else common.peak_flops(device, args.dtype)
                )
        flops = args.steps * args.batch_size * after_cfg.seq_len
        flops *= model_lib.flops_per_token(after_cfg)
        row = {"preset": preset, "batch_size": args.batch_size, "steps": args.steps}
        for name in runs:
            row[f"{name}_seconds_per_step"] = statistics.median(times[name]) / args.steps
            if None not in peaks[name]:
                pairs = zip(times[name], peaks[name], strict=True)
                row[f"{name}_mfu"] = statistics.median(flops / t / p for t, p in pairs)
            else:
                row[f"{name}_mfu"] = None
        row["after_over_before"] = common.median_ratio(times["after"], times["before"])
        row["after_over_before_min"] = min(times["after"]) / min(times["before"])
        rows.append(row)
        common.progress(f"{preset}: done")

    print(
        f"Model at {args.before} (before) vs the working tree (after), one-worker sync step, "
        f"{device.device_kind}, compute {args.dtype}, params {args.param_dtype} (after), "
        f"{args.samples} interleaved samples of {args.steps} steps each\n"
    )
    headers = ["preset", "B", "before s/step", "after s/step", "after/before (median)",
               "after/before (fastest)", "before MFU", "after MFU"]  # fmt: skip
    body = [
        [r["preset"], r["batch_size"], f"{r['before_seconds_per_step']:.3f}",
         f"{r['after_seconds_per_step']:.3f}", f"{r['after_over_before']:.3f}",
         f"{r['after_over_before_min']:.3f}", _percent(r["before_mfu"]),
         _percent(r["after_mfu"])]
        for r in rows
    ]  # fmt: skip
    print(common.markdown_table(headers, body))
    payload = {"before": args.before, **vars(args), "rows": rows}
    print(f"\nwrote {common.write_results('model_ab', payload)}")


def _percent(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


if __name__ == "__main__":
    main()
