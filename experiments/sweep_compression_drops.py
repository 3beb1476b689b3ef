"""Compressed outer gradients under communication drops: does a lossy exchange compound the
loss from dropped deltas? Each worker's delta is dropped with probability p each round (it
carries on from its own params); the rest travel compressed (a dropped worker keeps its
error-feedback residual: it sent nothing)."""

from sweep import run_sweep

if __name__ == "__main__":
    run_sweep(
        "compression_drops",
        "DiLoCo: compressed deltas under drop probability p",
        {
            f"diloco_{spec.split(',')[0]}_drop_{p:g}": {"compression": spec, "drop_probability": p}
            for spec in ("none", "int8", "int4,ef=1")
            for p in (0.0, 0.3)
        },
    )
