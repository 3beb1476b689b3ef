"""The DiLoCo paper's Table 6 at small scale: pruning 0, 25, 50 and 75% of each outer-gradient
leaf's smallest-magnitude entries (sign pruning), the rest sent with a bitmask."""

from sweep import run_sweep

if __name__ == "__main__":
    variants = {"diloco_pruned_0": {"compression": "none"}}
    for pruned in (25, 50, 75):
        variants[f"diloco_pruned_{pruned}"] = {"compression": f"sign_prune:{1 - pruned / 100:g}"}
    run_sweep("sign_prune", "DiLoCo: % of outer gradients pruned", variants)
