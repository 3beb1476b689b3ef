"""Streaming DiLoCo's claim at small scale: quality against the bits of the outer gradients
(float32, bf16, fp8 e4m3, int8, int4 and the 4-bit float e3m0; per-block scales), exchanged
by the two-stage quantized all-reduce; int8 and int4 also by the all-gather of every payload
(one quantization instead of two, but wire bytes that grow with M)."""

from sweep import run_sweep

if __name__ == "__main__":
    run_sweep(
        "compression",
        "DiLoCo: outer-gradient precision (bytes per round fall with the bits)",
        {f"diloco_{c}": {"compression": c} for c in ("none", "bf16", "fp8", "int8", "int4", "e3m0")}
        | {f"diloco_{c}_gather": {"compression": f"{c},exchange=gather"} for c in ("int8", "int4")},
    )
