"""The DiLoCo paper's communication-drop ablation at small scale: each worker's delta is
dropped from a round's average with probability p (it carries on from its own params)."""

from sweep import run_sweep

if __name__ == "__main__":
    run_sweep(
        "drops",
        "DiLoCo: probability p of dropping each worker's outer gradient each round",
        {f"diloco_drop_{p:g}": {"drop_probability": p} for p in (0.0, 0.1, 0.3, 0.5)},
    )
