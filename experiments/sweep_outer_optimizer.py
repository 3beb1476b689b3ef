"""The paper's ablation at small scale: the outer optimizer (each at its default learning rate)."""

from sweep import run_sweep

if __name__ == "__main__":
    run_sweep(
        "outer_optimizer",
        "DiLoCo: outer optimizer (Nesterov 0.7, SGD 1.0 = averaging, Adam 1e-3)",
        {f"diloco_{o}": {"outer_optimizer": o} for o in ("nesterov", "sgd", "adam")},
    )
