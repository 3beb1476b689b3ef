"""The paper's ablation at small scale: the number of inner steps H at a fixed step budget."""

from sweep import run_sweep

if __name__ == "__main__":
    budget = 300  # steps per worker, as the quick preset (H=25 x R=12)
    run_sweep(
        "inner_steps",
        "DiLoCo: inner steps H at a fixed budget of 300 steps per worker",
        {f"diloco_H{h}": {"inner_steps": h, "rounds": budget // h} for h in (5, 10, 25, 50, 100)},
    )
