"""Does the compiled DiLoCo round grow with H (inner steps per round)?

For H = 10, 100, 1000 it lowers and compiles `jax.jit(diloco_round, donate_argnums=0)` for an
LM preset with M workers (vmap backend, one device) and reports the compiled program's memory
(`compiled.memory_analysis()`: temp, argument, output, alias, generated code, peak where the
backend reports them) and the time to trace + lower and to compile. Two ways to feed data:

- "sampler": a `Sampler` (built like `experiment.make_sampler`) draws each inner step's batch inside
  the round's scan; the round's arguments are the state and the token stream, whatever H is.
- "host": the round takes host-built batches, leaves [M, H, B, L]; arguments grow with H.

Target: with the sampler, H=1000 / H=10 <= 1.2 for memory and compile time. Memory figures
are deterministic; compile times are medians of per-repetition ratios (H values interleaved).

  python benchmarks/scaling_h.py [--quick]
"""

import argparse
import functools
import statistics
import time
from typing import Any

import common
import jax
import numpy as np

import diloco_jax as dj

TARGET = 1.2
NUM_WORKERS = 4
H_VALUES = (10, 100, 1000)
MODES = ("sampler", "host")


def round_fn(w: common.Workload, num_workers: int, inner_steps: int) -> Any:
    """The jitted round train.py dispatches (state donated)."""
    fn = functools.partial(
        dj.diloco_round,
        w.loss_fn,
        inner_optimizer=dj.default_inner_optimizer(),
        outer_optimizer=dj.default_outer_optimizer(),
        backend="vmap",
        num_workers=num_workers,
        inner_steps=inner_steps,
    )
    return jax.jit(fn, donate_argnums=0)


def abstract_state(w: common.Workload, num_workers: int) -> Any:
    inner, outer = dj.default_inner_optimizer(), dj.default_outer_optimizer()
    return jax.eval_shape(
        lambda p: dj.init_state(p, num_workers, inner_optimizer=inner, outer_optimizer=outer),
        w.params,
    )


def abstract_host_batches(w: common.Workload, num_workers: int, inner_steps: int) -> Any:
    """ShapeDtypeStructs of one round's host batches, [M, H, B, ...] (nothing allocated)."""
    one = w.make_batch(np.random.default_rng(0), (1,))
    lead = (num_workers, inner_steps, w.batch_size)
    return {k: jax.ShapeDtypeStruct(lead + v.shape[1:], v.dtype) for k, v in one.items()}


def compile_round(w: common.Workload, mode: str, inner_steps: int, data: Any) -> dict[str, Any]:
    """Lowers and compiles one round; returns times (s) and memory statistics (bytes)."""
    fn = round_fn(w, NUM_WORKERS, inner_steps)
    state = abstract_state(w, NUM_WORKERS)
    if mode == "host":
        data = abstract_host_batches(w, NUM_WORKERS, inner_steps)
    start = time.perf_counter()
    lowered = fn.lower(state, data)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    done = time.perf_counter()
    return {
        "lower_s": lowered_at - start,
        "compile_s": done - lowered_at,
        "memory": common.memory_stats(compiled),
    }


def measure(w: common.Workload, reps: int) -> dict[str, dict[int, list[dict]]]:
    """results[mode][H] = one entry per repetition; each repetition compiles every (mode, H),
    the order alternating between repetitions."""
    sampler = w.sampler(NUM_WORKERS)
    runs = [(mode, h) for mode in MODES for h in H_VALUES]
    results: dict[str, dict[int, list[dict]]] = {m: {h: [] for h in H_VALUES} for m in MODES}
    for rep in range(reps):
        for mode, h in runs if rep % 2 == 0 else reversed(runs):
            results[mode][h].append(compile_round(w, mode, h, sampler))
            e = results[mode][h][-1]
            common.progress(f"{mode} H={h}: compile {e['compile_s']:.2f} s, {e['memory']}")
    return results


def summarize(results: dict[str, dict[int, list[dict]]]) -> list[dict[str, Any]]:
    """Per mode: each H's figures and the H_max / H_min ratios."""
    lo, hi = H_VALUES[0], H_VALUES[-1]
    rows = []
    for mode, by_h in results.items():
        for h, entries in by_h.items():
            memory = entries[0]["memory"]  # deterministic: identical in every repetition
            rows.append(
                {
                    "mode": mode,
                    "H": h,
                    "memory": memory,
                    "lower_s": statistics.median(e["lower_s"] for e in entries),
                    "compile_s": statistics.median(e["compile_s"] for e in entries),
                }
            )
        ratio = {
            key: by_h[hi][0]["memory"][key] / max(by_h[lo][0]["memory"][key], 1)
            for key in by_h[lo][0]["memory"]
        }
        for t in ("lower_s", "compile_s"):
            ratio[t] = statistics.median(
                a[t] / b[t] for a, b in zip(by_h[hi], by_h[lo], strict=True)
            )
            # fastest / fastest: interference from other jobs only ever adds time
            ratio[f"{t}_min"] = min(e[t] for e in by_h[hi]) / min(e[t] for e in by_h[lo])
        rows.append({"mode": mode, "H": f"{hi}/{lo}", "ratio": ratio})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    headers = ["data", "H", "temp", "argument", "output", "alias", "peak", "total",
               "lower s", "compile s"]  # fmt: skip
    keys = ["temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
            "alias_size_in_bytes", "peak_memory_in_bytes", "total"]  # fmt: skip
    body = []
    for r in rows:
        if "ratio" in r:
            cells = [f"**{r['ratio'].get(k, float('nan')):.3f}**" for k in keys]
            times = [f"**{r['ratio']['lower_s']:.2f}**", f"**{r['ratio']['compile_s']:.2f}**"]
            body.append([r["mode"], f"ratio {r['H']}"] + cells + times)
        else:
            cells = [
                common.human_bytes(r["memory"][k]) if k in r["memory"] else "n/a" for k in keys
            ]
            body.append(
                [r["mode"], r["H"]] + cells + [f"{r['lower_s']:.2f}", f"{r['compile_s']:.2f}"]
            )
    return common.markdown_table(headers, body)


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether the sampler round meets the target for memory (temp, total) and compile time."""
    (ratio,) = [r["ratio"] for r in rows if r["mode"] == "sampler" and "ratio" in r]
    checks = {
        "temp memory": ratio["temp_size_in_bytes"],
        "total memory": ratio["total"],
        "compile time (median of per-repetition ratios)": ratio["compile_s"],
        "compile time (fastest / fastest)": ratio["compile_s_min"],
    }
    return {k: {"ratio": v, "target": TARGET, "met": v <= TARGET} for k, v in checks.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="micro preset, one repetition")
    parser.add_argument("--preset", default=None, help="LM preset (default tiny; micro quick)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--reps", type=int, default=None, help="compiles per (data, H)")
    args = parser.parse_args()
    print(common.header() + "\n")
    preset = args.preset or ("micro" if args.quick else "tiny")
    reps = args.reps or (1 if args.quick else 5)
    w = common.lm_workload(preset, args.batch_size)
    rows = summarize(measure(w, reps))
    checks = verdict(rows)
    print(f"Compiled DiLoCo round vs H: preset {preset}, M={NUM_WORKERS}, B={args.batch_size}, ")
    print(f"vmap backend; times are medians of {reps} compile(s)\n")
    print(table(rows))
    print()
    print(
        common.markdown_table(
            ["sampler round, H=1000 / H=10", "ratio", "target", "met"],
            [[k, f"{v['ratio']:.3f}", f"<= {TARGET}", "yes" if v["met"] else "NO"]
             for k, v in checks.items()],
        )
    )  # fmt: skip
    payload = {
        "quick": args.quick,
        "preset": preset,
        "num_workers": NUM_WORKERS,
        "batch_size": args.batch_size,
        "reps": reps,
        "rows": rows,
        "checks": checks,
    }
    print(f"\nwrote {common.write_results('scaling_h', payload)}")


if __name__ == "__main__":
    main()
