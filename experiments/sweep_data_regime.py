"""The paper's ablation at small scale: i.i.d. shards against non-i.i.d. (disjoint documents)."""

from sweep import run_sweep

if __name__ == "__main__":
    run_sweep(
        "data_regime",
        "DiLoCo: i.i.d. against non-i.i.d. worker data",
        {f"diloco_{s}": {"sharding": s} for s in ("iid", "non_iid")},
    )
