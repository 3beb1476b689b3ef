"""Library overhead: diloco-jax's round and sync step against hand-written JAX/optax code.

(a) DiLoCo round. Library: `jax.jit(diloco_round, donate_argnums=0)`, the same with
`exclude_nonfinite=True` (the program `train_diloco` dispatches once per round by default: a
worker whose delta holds a NaN or Inf is left out of the mean), and `train_diloco` itself
(host loop, per round in steady state: from the first round's history entry to the last of
one call, so its per-call setup is left out; the host table reports that). Reference,
written here from scratch: `jax.jit` of `jax.vmap` over workers of a `lax.scan` of an optax
AdamW step, then the mean of the deltas and the optax Nesterov outer update. Same model, same
device batch ([M, H, B, ...]), same M and H, one device.

(b) Sync data-parallel step. Library: `jax.jit(sync_step, donate_argnums=0)` and `train_sync`
per step (steady state, as above). Reference: a jitted step that vmaps `jax.grad` over
workers, averages the gradients and applies one optax AdamW update.

(c) The device path, `device_round.py`'s comparison (M = 2 workers, one per
device: the round on the shard_map backend and on a user mesh, and `train_diloco` on each,
against a hand-written `jit(shard_map(...))` round; target 1.10x). On CPU the script makes 2
host devices for it; the other rows run on the first.

Timings are interleaved (A B C, C B A, ...); a sample runs several rounds/steps back to back
and waits for the result. The headline is the median over samples of library / reference;
"min ratio" (fastest library sample / fastest reference sample) is shown too, since on a
shared machine interference only ever adds time. A noise-free view comes from the compiled
programs: XLA's flop and byte estimates and the kernels each inner step launches.

"reference + metrics" (a diagnostic, never the baseline; skipped by --quick) is the reference
plus what `diloco_round` / `sync_step` also return (per-step losses, their means, the delta
norm); comparing the library with it, timed and compiled, attributes the library's extra work.

  python benchmarks/overhead.py [--quick] [--reps N] [--cases cpu|accelerator]
"""

import os

# Two host devices on CPU, for the device-path rows (one worker per device); the other rows
# run on the first device as before.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    ).strip()

import argparse  # noqa: E402
import functools  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import common  # noqa: E402
import device_round  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402

import diloco_jax as dj  # noqa: E402

ROUND_TARGET = 1.03
SYNC_TARGET = 1.05
NUM_WORKERS = 4
DIAGNOSTIC = "reference + metrics (diagnostic)"
EXCLUDING = "library, exclude_nonfinite"
# HLO ops that launch no kernel of their own on CPU.
FREE_OPS = frozenset({"get-tuple-element", "tuple", "bitcast", "constant", "parameter"})

# name -> (batch size B, inner steps H, rounds per timed sample, sync steps per sample)
CASES: dict[str, tuple[int, int, int, int]] = {
    "mlp": (64, 50, 4, 40),
    "micro": (8, 20, 4, 40),
    "mini": (8, 10, 1, 6),
    "tiny": (4, 5, 1, 3),
}
QUICK_CASES: dict[str, tuple[int, int, int, int]] = {
    "mlp": (64, 20, 2, 20),
    "micro": (8, 10, 2, 20),
}
# On an accelerator CPU-sized programs are all launch latency: bigger batches, longer rounds,
# and the "small" preset (3.2M params).
ACCELERATOR_CASES: dict[str, tuple[int, int, int, int]] = {
    "mlp": (256, 50, 10, 100),
    "micro": (32, 50, 10, 100),
    "tiny": (16, 20, 5, 50),
    "small": (16, 10, 3, 30),
}
QUICK_ACCELERATOR_CASES: dict[str, tuple[int, int, int, int]] = {
    "tiny": ACCELERATOR_CASES["tiny"],
    "small": ACCELERATOR_CASES["small"],
}
QUICK_SYNC = ("mlp", "small")  # --quick times the sync step on the MLP only (compiles are the cost)


# ---------------------------------------------------------------------------------------
# Hand-written references (no diloco_jax code).


def reference_round(
    loss_fn: Callable,
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation,
    with_metrics: bool = False,
) -> Callable:
    """One DiLoCo round: vmap over workers of a scan of AdamW steps, mean delta, Nesterov.

    with_metrics: also return (mean inner loss, per-worker mean loss, norm of the mean delta).
    """

    def worker(params, inner_state, batches_H):
        def step(carry, batch):
            p, s = carry
            if with_metrics:
                loss, grads = jax.value_and_grad(loss_fn)(p, batch)
            else:
                loss, grads = None, jax.grad(loss_fn)(p, batch)
            updates, s = inner.update(grads, s, p)
            return (optax.apply_updates(p, updates), s), loss

        (p, s), losses_H = lax.scan(step, (params, inner_state), batches_H)
        return jax.tree.map(jnp.subtract, params, p), s, losses_H

    def round_fn(params, outer_state, inner_states, batches):
        deltas, inner_states, losses = jax.vmap(worker, in_axes=(None, 0, 0))(
            params, inner_states, batches
        )
        delta = jax.tree.map(lambda d: jnp.mean(d, axis=0), deltas)
        updates, outer_state = outer.update(delta, outer_state, params)
        new = (optax.apply_updates(params, updates), outer_state, inner_states)
        if not with_metrics:
            return new
        return new, (jnp.mean(losses), jnp.mean(losses, axis=1), optax.tree.norm(delta))

    return jax.jit(round_fn, donate_argnums=(0, 1, 2))


def reference_sync_step(
    loss_fn: Callable, optimizer: optax.GradientTransformation, with_metrics: bool = False
) -> Callable:
    """One data-parallel step: per-worker grads (vmap), their mean, one optax update.

    with_metrics: also return (mean loss, per-worker loss), as `sync_step` does.
    """

    def step(params, opt_state, batch):
        if with_metrics:
            losses, grads = jax.vmap(jax.value_and_grad(loss_fn), in_axes=(None, 0))(params, batch)
        else:
            grads = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0))(params, batch)
        grads = jax.tree.map(lambda g: jnp.mean(g, axis=0), grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        new = (optax.apply_updates(params, updates), opt_state)
        return (new, (jnp.mean(losses), losses)) if with_metrics else new

    return jax.jit(step, donate_argnums=(0, 1))


def copy(tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def per_worker(tree: Any) -> Any:
    """M stacked copies of every leaf: [...] -> [M, ...]."""
    return jax.tree.map(lambda x: jnp.stack([x] * NUM_WORKERS), tree)


def library_round(w: common.Workload, inner, outer, exclude_nonfinite: bool = False) -> Callable:
    """`diloco_round` jitted with its state donated, as train.py dispatches it (train_diloco's
    default also sets exclude_nonfinite: a NaN worker is left out of the mean)."""
    round_fn = functools.partial(
        dj.diloco_round, w.loss_fn, inner_optimizer=inner, outer_optimizer=outer, backend="vmap",
        exclude_nonfinite=exclude_nonfinite,
    )  # fmt: skip
    return jax.jit(round_fn, donate_argnums=0)


def library_sync_step(w: common.Workload, opt) -> Callable:
    step = functools.partial(dj.sync.sync_step, w.loss_fn, optimizer=opt, backend="vmap")
    return jax.jit(step, donate_argnums=0)


# ---------------------------------------------------------------------------------------
# Runners: each returns a zero-argument callable doing `count` rounds/steps and returning the
# final state (the caller blocks on it). State is donated, so each runner owns its own copy.
# The jitted programs are compiled ahead of time (`.lower(...).compile()`); calling the
# compiled object runs the same executable a `jax.jit` call would, and the compiled objects
# double as the subjects of the deterministic comparison.


def looped(fn: Callable, carry: list, extra: Any, count: int, unpack: Callable) -> Callable:
    """A runner calling `carry = unpack(fn(*carry, extra))` `count` times."""

    def run():
        for _ in range(count):
            carry[:] = unpack(fn(*carry, extra))
        return carry

    common.block(run())  # first execution, outside any timing
    return run


def round_programs(w: common.Workload, inner, outer, batches, with_metrics: bool) -> dict[str, Any]:
    """Compiled rounds for the same inputs: the library's, the reference's, and (with_metrics)
    the reference that also computes the library's metrics."""
    params = w.params
    ref_args = (params, outer.init(params), per_worker(inner.init(params)), batches)
    lib_args = (
        dj.init_state(params, NUM_WORKERS, inner_optimizer=inner, outer_optimizer=outer),
        batches,
    )
    programs = {
        "library": library_round(w, inner, outer).lower(*lib_args).compile(),
        "reference": reference_round(w.loss_fn, inner, outer).lower(*ref_args).compile(),
        EXCLUDING: library_round(w, inner, outer, True).lower(*lib_args).compile(),
    }
    if with_metrics:
        lowered = reference_round(w.loss_fn, inner, outer, True).lower(*ref_args)
        programs["reference + metrics"] = lowered.compile()
    return programs


def reference_round_runner(program, w, inner, outer, batches, count, metrics=False) -> Callable:
    params = copy(w.params)
    carry = [params, outer.init(params), per_worker(inner.init(params))]
    unpack = (lambda out: out[0]) if metrics else (lambda out: out)
    return looped(program, carry, batches, count, unpack)


def library_round_runner(program, w, inner, outer, batches, count) -> Callable:
    carry = [dj.init_state(w.params, NUM_WORKERS, inner_optimizer=inner, outer_optimizer=outer)]
    return looped(program, carry, batches, count, lambda out: out[:1])


def steady_state(train: Callable[[int, Callable], Any], count: int) -> Callable:
    """A runner timing `train(n, callback)` (a `train_diloco` / `train_sync` call of n rounds
    or steps) in steady state: one call of count + 1, timed from the first history entry to
    the last (each is recorded once its round has finished, while the next one runs), so the
    call's setup is left out (the host table has it)."""

    def run():
        stamps = []
        train(count + 1, lambda _: stamps.append(time.perf_counter()))
        return common.Elapsed(stamps[-1] - stamps[0])

    run()  # compiles once; later calls hit train.py's jit cache
    return run


def train_diloco_runner(w, inner, outer, batches, count, H) -> Callable:
    return steady_state(
        lambda n, callback: dj.train_diloco(
            w.loss_fn, w.params, [batches] * n, num_rounds=n, num_workers=NUM_WORKERS,
            inner_steps=H, inner_optimizer=inner, outer_optimizer=outer, backend="vmap",
            callback=callback,
        ),
        count,
    )  # fmt: skip


def step_programs(w: common.Workload, opt, batch, with_metrics: bool) -> dict[str, Any]:
    """Compiled sync steps for the same inputs, as `round_programs`."""
    params = w.params
    ref_args = (params, opt.init(params), batch)
    lib_args = (dj.sync.init_sync_state(params, opt), batch)
    programs = {
        "library": library_sync_step(w, opt).lower(*lib_args).compile(),
        "reference": reference_sync_step(w.loss_fn, opt).lower(*ref_args).compile(),
    }
    if with_metrics:
        lowered = reference_sync_step(w.loss_fn, opt, True).lower(*ref_args)
        programs["reference + metrics"] = lowered.compile()
    return programs


def reference_step_runner(program, w, opt, batch, count, metrics=False) -> Callable:
    params = copy(w.params)
    unpack = (lambda out: out[0]) if metrics else (lambda out: out)
    return looped(program, [params, opt.init(params)], batch, count, unpack)


def library_step_runner(program, w, opt, batch, count) -> Callable:
    carry = [dj.sync.init_sync_state(w.params, opt)]
    return looped(program, carry, batch, count, lambda out: out[:1])


def train_sync_runner(w, opt, batch, count) -> Callable:
    return steady_state(
        lambda n, callback: dj.train_sync(
            w.loss_fn, w.params, [batch] * n, num_steps=n, num_workers=NUM_WORKERS,
            optimizer=opt, backend="vmap", callback=callback,
        ),
        count,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------
# Measurements.


def workload(name: str, batch_size: int) -> common.Workload:
    if name == "mlp":
        return common.mlp_workload(batch_size)
    return common.lm_workload(name, batch_size)


def ratio_rows(what: str, name: str, times: dict[str, list[float]], per: int, target: float):
    """One row per non-reference variant: its time relative to "reference"."""
    ref = times["reference"]
    rows = []
    for variant in (k for k in times if k != "reference"):
        ratios = [a / b for a, b in zip(times[variant], ref, strict=True)]
        median = statistics.median(ratios)
        rows.append(
            {
                "comparison": what,
                "workload": name,
                "variant": variant,
                "median_ratio": median,
                "spread": common.spread(ratios),
                "min_ratio": min(times[variant]) / min(ref),
                "target": target,
                "met": None if variant == DIAGNOSTIC else median <= target,
                "reference_ms": 1e3 * statistics.median(ref) / per,
                "variant_ms": 1e3 * statistics.median(times[variant]) / per,
                "samples": len(ratios),
            }
        )
    return rows


def device_path_rows(reps: int) -> list[dict[str, Any]]:
    """`device_round.py`'s comparison as rows of this table: the round with one worker per
    device (M = 2, shard_map backend and a user mesh, and `train_diloco` on each) against the
    hand-written `jit(shard_map(...))` round (the device round's 1.10x target). [] with
    fewer than 2 devices."""
    if len(jax.devices()) < device_round.M:
        common.progress(f"device path: skipped (needs {device_round.M} devices)")
        return []
    common.progress("device path (MLP 512-2048-512, one worker per device)")
    times, bases = device_round.measure(reps, device_round.H)
    what = f"round M={device_round.M} H={device_round.H}, a worker per device"
    rows = []
    for variant, ts in times.items():
        if variant == device_round.REFERENCE:
            continue
        base = statistics.median(bases[variant])
        ratios = [t / base for t in ts]
        diagnostic = variant in device_round.DIAGNOSTICS
        rows.append(
            {
                "comparison": what,
                "workload": "mlp512",
                "variant": variant,
                "median_ratio": statistics.median(ts) / base,
                "spread": common.spread(ratios),
                "min_ratio": min(ts) / min(bases[variant]),
                "target": device_round.TARGET,
                "met": None if diagnostic else statistics.median(ts) / base <= device_round.TARGET,
                "reference_ms": 1e3 * base,
                "variant_ms": 1e3 * statistics.median(ts),
                "samples": len(ts),
            }
        )
    return rows


def kernels(ops: dict[str, int]) -> int:
    return sum(n for op, n in ops.items() if op not in FREE_OPS)


def compiled_work(programs: dict[str, Any], in_loop: bool) -> dict[str, dict[str, Any]]:
    """Deterministic facts about compiled programs (no timing involved): XLA's flop and byte
    estimates and the kernels launched per inner step (in_loop) or per call."""
    out = {}
    for key, compiled in programs.items():
        ops = common.while_body_ops(compiled) if in_loop else common.entry_ops(compiled)
        out[key] = {**common.cost(compiled), "kernels": kernels(ops), "ops": dict(ops)}
    return out


def measure_rounds(name: str, case: tuple[int, int, int, int], reps: int, attribute: bool):
    """(timing rows, compiled-work facts) for the DiLoCo round of one workload."""
    batch_size, H, count, _ = case
    w = workload(name, batch_size)
    inner, outer = dj.default_inner_optimizer(), dj.default_outer_optimizer()
    batches = w.host_batches((NUM_WORKERS, H))
    common.progress(f"{name} round: compiling")
    programs = round_programs(w, inner, outer, batches, attribute)
    common.progress(f"{name} round: compiled; timing")
    args = (w, inner, outer, batches, count)
    runs = {
        "reference": reference_round_runner(programs["reference"], *args),
        "diloco_round (jit, donated)": library_round_runner(programs["library"], *args),
        "diloco_round, exclude_nonfinite": library_round_runner(programs[EXCLUDING], *args),
        "train_diloco (host loop, steady state)": train_diloco_runner(*args, H),
    }
    if attribute:
        program = programs["reference + metrics"]
        runs[DIAGNOSTIC] = reference_round_runner(program, *args, metrics=True)
    times = common.interleaved(runs, reps)
    what = f"round M={NUM_WORKERS} H={H} B={batch_size}, {count}/sample"
    rows = ratio_rows(what, name, times, count, ROUND_TARGET)
    common.progress("\n" + ratio_table(rows))
    return rows, compiled_work(programs, True)


def measure_steps(name: str, case: tuple[int, int, int, int], reps: int, attribute: bool):
    """(timing rows, compiled-work facts) for the sync step of one workload."""
    batch_size, _, _, count = case
    w = workload(name, batch_size)
    opt = dj.default_inner_optimizer()
    batch = w.host_batches((NUM_WORKERS,))
    common.progress(f"{name} sync step: compiling")
    programs = step_programs(w, opt, batch, attribute)
    common.progress(f"{name} sync step: compiled; timing")
    runs = {
        "reference": reference_step_runner(programs["reference"], w, opt, batch, count),
        "sync_step (jit, donated)": library_step_runner(programs["library"], w, opt, batch, count),
        "train_sync (host loop, steady state)": train_sync_runner(w, opt, batch, count),
    }
    if attribute:
        program = programs["reference + metrics"]
        runs[DIAGNOSTIC] = reference_step_runner(program, w, opt, batch, count, metrics=True)
    times = common.interleaved(runs, reps)
    what = f"sync step M={NUM_WORKERS} B={batch_size}, {count}/sample"
    rows = ratio_rows(what, name, times, count, SYNC_TARGET)
    common.progress("\n" + ratio_table(rows))
    return rows, compiled_work(programs, False)


def _linear_loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def host_loop_cost(reps: int, iterations: int = 200) -> list[dict[str, Any]]:
    """Host time per round/step of `train_diloco` / `train_sync` beyond the dispatches: both
    loops vs a bare loop of jitted calls, on a 3-parameter model whose compute is ~nothing,
    plus each function's fixed cost per call (0 rounds: init, placement, jit-cache lookup),
    also for the "small" LM preset (3.2M params) and its `init_state` alone."""
    params, opt = {"w": jnp.zeros(3)}, optax.sgd(0.1)
    step_batch = {"x": jnp.ones((NUM_WORKERS, 2, 3)), "y": jnp.ones((NUM_WORKERS, 2))}
    round_batch = jax.tree.map(lambda x: jnp.stack([x] * 2, axis=1), step_batch)  # H = 2
    loss_fn = _linear_loss
    dil = dict(num_workers=NUM_WORKERS, inner_steps=2, inner_optimizer=opt, outer_optimizer=opt,
               backend="vmap")  # fmt: skip
    syn = dict(num_workers=NUM_WORKERS, optimizer=opt, backend="vmap")
    round_fn = jax.jit(
        functools.partial(
            dj.diloco_round, loss_fn, inner_optimizer=opt, outer_optimizer=opt, backend="vmap"
        ),
        donate_argnums=0,
    )
    step_fn = jax.jit(functools.partial(dj.sync.sync_step, loss_fn, optimizer=opt, backend="vmap"),
                      donate_argnums=0)  # fmt: skip

    def bare(fn, state, batch):
        def run():
            carry = [state()]
            for _ in range(iterations):
                carry[0], _ = fn(carry[0], batch)
            return carry[0]

        return run

    runs = {
        "jit(diloco_round) loop": bare(
            round_fn,
            lambda: dj.init_state(params, NUM_WORKERS, inner_optimizer=opt, outer_optimizer=opt),
            round_batch,
        ),
        "train_diloco": lambda: (
            dj.train_diloco(
                loss_fn, params, [round_batch] * iterations, num_rounds=iterations, **dil
            ).state
        ),
        "jit(sync_step) loop": bare(
            step_fn, lambda: dj.sync.init_sync_state(params, opt), step_batch
        ),
        "train_sync": lambda: (
            dj.train_sync(
                loss_fn, params, [step_batch] * iterations, num_steps=iterations, **syn
            ).state
        ),
        "train_diloco, 0 rounds": lambda: (
            dj.train_diloco(loss_fn, params, [], num_rounds=0, **dil).state
        ),
        "train_sync, 0 steps": lambda: dj.train_sync(loss_fn, params, [], num_steps=0, **syn).state,
    }
    # Per-call setup grows with the model: init_state's eager ops over M stacked copies.
    small = common.lm_workload("small", 16)
    inner, outer = dj.default_inner_optimizer(), dj.default_outer_optimizer()
    runs["init_state (small preset, M=4), 0 rounds"] = lambda: dj.init_state(
        small.params, NUM_WORKERS, inner_optimizer=inner, outer_optimizer=outer
    )
    runs["train_diloco (small preset, M=4), 0 rounds"] = lambda: dj.train_diloco(
        small.loss_fn, small.params, [], num_rounds=0, num_workers=NUM_WORKERS, inner_steps=2,
        inner_optimizer=inner, outer_optimizer=outer, backend="vmap",
    ).state  # fmt: skip
    for run in runs.values():
        common.block(run())  # compile
    times = common.interleaved(runs, reps)
    rows = []
    for name, ts in times.items():
        per = 1 if "0 " in name else iterations
        rows.append({"loop": name, "us_per_iteration": 1e6 * statistics.median(ts) / per,
                     "min_us": 1e6 * min(ts) / per, "per_call": per == 1})  # fmt: skip
    return rows


def host_table(rows: list[dict[str, Any]]) -> str:
    body = [
        [r["loop"], "per call" if r["per_call"] else "per round/step",
         f"{r['us_per_iteration']:.0f}", f"{r['min_us']:.0f}"]
        for r in rows
    ]  # fmt: skip
    return common.markdown_table(["loop", "cost", "median us", "min us"], body)


def ratio_table(rows: list[dict]) -> str:
    headers = ["comparison", "workload", "variant", "median ratio", "min..max", "min ratio",
               "target", "met", "ref ms", "variant ms"]  # fmt: skip
    body = [
        [r["comparison"], r["workload"], r["variant"], f"{r['median_ratio']:.3f}", r["spread"],
         f"{r['min_ratio']:.3f}",
         "-" if r["met"] is None else f"<= {r['target']:.2f}",
         "-" if r["met"] is None else ("yes" if r["met"] else "NO"),
         f"{r['reference_ms']:.2f}", f"{r['variant_ms']:.2f}"]
        for r in rows
    ]  # fmt: skip
    return common.markdown_table(headers, body)


def work_table(work: dict[str, dict[str, Any]]) -> str:
    headers = ["program", "flops lib/ref", "bytes lib/ref", "bytes lib/(ref+metrics)",
               "kernels lib / ref / ref+metrics", "bytes excl/lib"]  # fmt: skip
    body = []
    for name, w in work.items():
        lib, ref = w["library"], w["reference"]
        refm, excl = w.get("reference + metrics"), w.get(EXCLUDING)
        body.append([
            name,
            f"{lib['flops'] / ref['flops']:.4f}",
            f"{lib['bytes accessed'] / ref['bytes accessed']:.4f}",
            f"{lib['bytes accessed'] / refm['bytes accessed']:.4f}" if refm else "-",
            f"{lib['kernels']} / {ref['kernels']} / {refm['kernels'] if refm else '-'}",
            f"{excl['bytes accessed'] / lib['bytes accessed']:.4f}" if excl else "-",
        ])  # fmt: skip
    return common.markdown_table(headers, body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="2 round workloads, 1 sync workload (mlp/micro, or tiny/small)",
    )
    parser.add_argument("--reps", type=int, default=None, help="timed samples per variant")
    parser.add_argument(
        "--cases",
        choices=["cpu", "accelerator"],
        default=None,
        help="workload sizes (default: by the platform of jax.devices()[0])",
    )
    args = parser.parse_args()
    print(common.header() + "\n")
    sizes = args.cases or ("cpu" if jax.devices()[0].platform == "cpu" else "accelerator")
    table = {
        ("cpu", False): CASES,
        ("cpu", True): QUICK_CASES,
        ("accelerator", False): ACCELERATOR_CASES,
        ("accelerator", True): QUICK_ACCELERATOR_CASES,
    }
    cases = table[sizes, args.quick]
    sync_cases = {k: v for k, v in cases.items() if not args.quick or k in QUICK_SYNC}
    reps = args.reps or (5 if args.quick else 9)
    attribute = not args.quick  # compile the "reference + metrics" programs too
    rows, work = [], {}
    for name, case in cases.items():
        timing, work[f"{name} round (per inner step)"] = measure_rounds(name, case, reps, attribute)
        rows += timing
    for name, case in sync_cases.items():
        timing, work[f"{name} sync step (per call)"] = measure_steps(name, case, reps, attribute)
        rows += timing
    rows += device_path_rows(reps)
    print("Timing (ratio = variant / hand-written reference; median over interleaved samples)\n")
    print(ratio_table(rows))
    print("\nCompiled programs, library vs reference (deterministic: XLA's cost analysis, and")
    print("the kernels launched per inner step of the round's while loop / per sync step)\n")
    print(work_table(work))
    common.progress("host loop cost")
    host = host_loop_cost(reps)
    print(
        "\nHost loop cost (a 3-parameter model, so the device work is ~0; M=4, H=2; per-call\n"
        "rows also for the small LM preset)\n"
    )
    print(host_table(host))
    payload = {"quick": args.quick, "reps": reps, "rows": rows, "compiled_work": work,
               "host_loop": host}  # fmt: skip
    print(f"\nwrote {common.write_results('overhead', payload)}")


if __name__ == "__main__":
    main()
