"""The paper's ablation at small scale: the number of DiLoCo workers M (same steps per worker)."""

from sweep import run_sweep

if __name__ == "__main__":
    run_sweep(
        "workers",
        "DiLoCo: number of workers M (same steps and batch per worker)",
        {f"diloco_M{m}": {"workers": m} for m in (1, 2, 4, 8)},
    )
