"""How many sequences per worker fill one accelerator: memory read from compiled programs.

For each LM preset it compiles (never runs) the training programs as the library jits them,
with in-graph data, and reads `compiled.memory_analysis()` (temp + argument + output - alias,
as `common.memory_stats` sums it):

- the sync step with one worker (`sync_step`, AdamW) at B = 1 and 2 sequences, at the preset's
  context L and at L / 2: the difference in B is the memory one sequence adds, and the two
  lengths split it into a part linear in L (activations) and a part quadratic in L (XLA
  attention's [heads, L, L] scores and probabilities, which cuDNN's flash attention never
  materializes);
- the DiLoCo round (`diloco_round`, vmap, H = 2) with M = 1 and 2 workers at B = 1: the
  difference in M is what one more worker on the chip costs (its params, AdamW state and
  delta, plus one sequence's activations).

It then solves for the largest per-worker batch that fits a memory budget (default: 90% of an
H200's 143,771 MiB, i.e. `XLA_PYTHON_CLIENT_MEM_FRACTION=0.9`), for sync M = 1 and DiLoCo
with M = 1, 2, 4, 8 workers sharing the chip, with XLA attention (as compiled here) and with
the quadratic part removed (an estimate for cuDNN flash attention). Memory figures come from
XLA's CPU compiler: a GPU's buffer assignment differs in detail (fusion, layouts), so read
them as estimates and keep a margin.

  python benchmarks/memory.py [--presets 60m,150m] [--dtype bfloat16] [--param-dtype float32]
      [--budget-gib 126.4]
"""

import argparse
import functools
import math
from typing import Any

import common
import jax

import diloco_jax as dj
from diloco_jax.lm import model as model_lib

H200_MIB = 143_771  # what the H200 reported to jax (benchmarks/README.md, H200 figures)
DEFAULT_BUDGET_GIB = 0.9 * H200_MIB / 1024
INNER_STEPS = 2
WORKER_COUNTS = (1, 2, 4, 8)
GIB = 2**30


def sync_total(preset: str, batch: int, seq_len: int, model_options: dict) -> int:
    """Bytes of the compiled one-worker sync step."""
    w = common.lm_workload(preset, batch, seq_len=seq_len, **model_options)
    opt = dj.default_inner_optimizer()
    fn = functools.partial(
        dj.sync.sync_step, w.loss_fn, optimizer=opt, backend="vmap", num_workers=1
    )
    state = jax.eval_shape(lambda p: dj.sync.init_sync_state(p, opt), w.params)
    compiled = jax.jit(fn, donate_argnums=0).lower(state, w.sampler(1)).compile()
    return common.memory_stats(compiled)["total"]


def round_total(preset: str, workers: int, model_options: dict) -> int:
    """Bytes of the compiled DiLoCo round with `workers` workers of batch 1 on one device."""
    w = common.lm_workload(preset, 1, **model_options)
    inner, outer = dj.default_inner_optimizer(), dj.default_outer_optimizer()
    fn = functools.partial(
        dj.diloco_round, w.loss_fn, inner_optimizer=inner, outer_optimizer=outer,
        backend="vmap", num_workers=workers, inner_steps=INNER_STEPS,
    )  # fmt: skip
    state = jax.eval_shape(
        lambda p: dj.init_state(p, workers, inner_optimizer=inner, outer_optimizer=outer), w.params
    )
    compiled = jax.jit(fn, donate_argnums=0).lower(state, w.sampler(workers)).compile()
    return common.memory_stats(compiled)["total"]


def fit(preset: str, model_options: dict) -> dict[str, Any]:
    """The linear model of memory in B and M for one preset (bytes)."""
    seq_len = model_lib.get_config(preset).seq_len
    common.progress(f"{preset}: compiling 4 sync steps and 2 rounds")
    s = {
        (b, t): sync_total(preset, b, t, model_options)
        for b in (1, 2)
        for t in (seq_len, seq_len // 2)
    }
    per_seq = s[2, seq_len] - s[1, seq_len]
    per_half_seq = s[2, seq_len // 2] - s[1, seq_len // 2]
    # per_seq(L) = a L + q L^2 with q L^2 the attention's [H, L, L] buffers: two lengths.
    quadratic = max(0, 2 * (per_seq - 2 * per_half_seq))
    r1, r2 = round_total(preset, 1, model_options), round_total(preset, 2, model_options)
    per_worker_b1 = r2 - r1  # one more worker at B = 1: its state and one sequence
    return {
        "preset": preset,
        "seq_len": seq_len,
        "sync_fixed": s[1, seq_len] - per_seq,
        "per_seq": per_seq,
        "per_seq_attention_scores": quadratic,
        "round_fixed": r1 - per_worker_b1,
        "worker_state": per_worker_b1 - per_seq,
        "compiled": {
            "sync": {f"B={b} L={t}": v for (b, t), v in s.items()},
            "round B=1": {"M=1": r1, "M=2": r2},
        },
    }


def largest_batch(budget: float, fixed: float, per_worker: float, per_seq: float, m: int) -> int:
    """Largest per-worker B with fixed + m (per_worker + B per_seq) <= budget (0: none)."""
    return max(0, math.floor((budget - fixed - m * per_worker) / (m * per_seq)))


def rows_for(f: dict[str, Any], budget: float) -> list[list[Any]]:
    rows = []
    for attention, per_seq in (
        ("xla", f["per_seq"]),
        ("cudnn (est.)", f["per_seq"] - f["per_seq_attention_scores"]),
    ):
        b_sync = largest_batch(budget, f["sync_fixed"], 0, per_seq, 1)
        diloco = [
            largest_batch(budget, f["round_fixed"], f["worker_state"], per_seq, m)
            for m in WORKER_COUNTS
        ]
        rows.append(
            [f["preset"], attention, f"{per_seq / GIB:.3f}", b_sync, *diloco]
        )  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="60m,150m")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--embedding", default="onehot", choices=["gather", "onehot"])
    parser.add_argument("--budget-gib", type=float, default=DEFAULT_BUDGET_GIB)
    args = parser.parse_args()
    print(common.header() + "\n")
    # XLA attention: the only kind a CPU compiles; the quadratic part estimates cuDNN's saving.
    options = dict(
        dtype=args.dtype, param_dtype=args.param_dtype, attention="xla", embedding=args.embedding
    )
    budget = args.budget_gib * GIB
    fits = [fit(preset, options) for preset in args.presets.split(",")]
    print(
        f"Compiled memory (CPU compiler), compute {args.dtype}, params {args.param_dtype}, "
        f"embedding {args.embedding}, AdamW inner / Nesterov outer, in-graph data\n"
    )
    headers = ["preset", "L", "fixed, sync M=1", "fixed, round", "per worker (state)",
               "per sequence", "of which [H, L, L] attention"]  # fmt: skip
    body = [
        [f["preset"], f["seq_len"], common.human_bytes(f["sync_fixed"]),
         common.human_bytes(f["round_fixed"]), common.human_bytes(f["worker_state"]),
         common.human_bytes(f["per_seq"]), common.human_bytes(f["per_seq_attention_scores"])]
        for f in fits
    ]  # fmt: skip
    print(common.markdown_table(headers, body) + "\n")
    print(
        f"Largest per-worker batch (sequences) in {args.budget_gib:.1f} GiB: fixed + M x "
        "(per worker + B x per sequence) <= budget\n"
    )
    headers = ["preset", "attention", "GiB per sequence", "sync M=1"] + [
        f"DiLoCo M={m}" for m in WORKER_COUNTS
    ]
    print(common.markdown_table(headers, [row for f in fits for row in rows_for(f, budget)]))
    payload = {"options": options, "budget_bytes": budget, "fits": fits}
    print(f"\nwrote {common.write_results('memory', payload)}")


if __name__ == "__main__":
    main()
