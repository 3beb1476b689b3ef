"""Model FLOPs utilization (MFU): the peak FLOP/s a run could reach, and how much it used.

  mfu = model_flops_per_token x tokens_per_second / peak_flops

`model_flops_per_token` is `model.flops_per_token` (6N plus attention, PaLM's estimate), the
work the model needs whatever the implementation does. `peak_flops` is per chip, looked up
by `device_kind` in `PEAK_FLOPS` (dense, no sparsity), times the chips the run uses. CPUs have
no datasheet figure that XLA can reach, so there the peak is the FLOP/s of one large float32
matmul measured in this process (once, then cached): MFU on CPU reads "fraction of what this
machine's matmul kernel does", the same yardstick as the benchmarks.

`DILOCO_JAX_PEAK_FLOPS` (a number of FLOP/s, e.g. `4.5e14`) sets the peak instead: per chip
on an accelerator (for one missing from `PEAK_FLOPS`, or another yardstick), for the whole
host on CPU (no matmul is timed then).
"""

import functools
import os
import time

import jax
import jax.numpy as jnp

_TERA = 1e12
# Dense peak FLOP/s per chip, keyed by `jax.devices()[0].device_kind`. "bf16": bfloat16 (and
# float16) matmuls. "f32": float32 matmuls at JAX's default precision, which on NVIDIA
# Ampere/Hopper lets XLA use TF32 tensor cores (so the TF32 peak is the ceiling) and on TPU
# runs bf16 MXU passes (so the bf16 peak is the ceiling).
# Sources (vendor datasheets; NVIDIA lists sparse figures, halved here for dense):
#   H100 SXM5 / H200: NVIDIA H100 Tensor Core GPU datasheet and NVIDIA H200 datasheet
#     (BF16 1,979 TFLOPS sparse -> 989.5 dense; TF32 989 sparse -> 494.5 dense).
#   H100 PCIe: NVIDIA H100 datasheet (BF16 1,513 sparse -> 756; TF32 756 sparse -> 378).
#   H100 NVL / H200 NVL: the same datasheets (BF16 1,671 sparse -> 835.5; TF32 835 -> 417.5).
#   A100: NVIDIA A100 datasheet (BF16 312 dense; TF32 156 dense).
#   L4: NVIDIA L4 datasheet (BF16 242 sparse -> 121; TF32 120 sparse -> 60).
#   TPU v4 275, v5e ("TPU v5 lite") 197, v5p ("TPU v5") 459, v6e ("TPU v6 lite") 918 bf16
#     TFLOP/s per chip: Google Cloud TPU system architecture pages (cloud.google.com/tpu/docs).
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "NVIDIA H200": {"bf16": 989.5 * _TERA, "f32": 494.5 * _TERA},
    "NVIDIA H100 80GB HBM3": {"bf16": 989.5 * _TERA, "f32": 494.5 * _TERA},
    "NVIDIA H200 NVL": {"bf16": 835.5 * _TERA, "f32": 417.5 * _TERA},
    "NVIDIA H100 NVL": {"bf16": 835.5 * _TERA, "f32": 417.5 * _TERA},
    "NVIDIA H100 PCIe": {"bf16": 756.0 * _TERA, "f32": 378.0 * _TERA},
    "NVIDIA A100-SXM4-80GB": {"bf16": 312.0 * _TERA, "f32": 156.0 * _TERA},
    "NVIDIA A100-SXM4-40GB": {"bf16": 312.0 * _TERA, "f32": 156.0 * _TERA},
    "NVIDIA A100 80GB PCIe": {"bf16": 312.0 * _TERA, "f32": 156.0 * _TERA},
    "NVIDIA L4": {"bf16": 121.0 * _TERA, "f32": 60.0 * _TERA},
    "TPU v4": {"bf16": 275.0 * _TERA, "f32": 275.0 * _TERA},
    "TPU v5 lite": {"bf16": 197.0 * _TERA, "f32": 197.0 * _TERA},
    "TPU v5": {"bf16": 459.0 * _TERA, "f32": 459.0 * _TERA},
    "TPU v6 lite": {"bf16": 918.0 * _TERA, "f32": 918.0 * _TERA},
}
_LOW_PRECISION = ("bfloat16", "float16")
# Side of the square float32 matmul that stands in for a CPU's peak: large enough that the
# kernel runs at its best rate (2048 and 4096 read within 2% of each other on the 2-core
# machine), small enough to time in a fraction of a second.
MATMUL_SIZE = 2048


def table_peak_flops(device_kind: str, dtype: str) -> float | None:
    """Datasheet peak FLOP/s of one chip for compute `dtype` ("float32", "bfloat16",
    "float16"), or None when `device_kind` is not listed exactly (a near-miss name is not
    guessed: e.g. H200 NVL and H200 SXM differ)."""
    entry = PEAK_FLOPS.get(device_kind)
    if entry is None:
        return None
    return entry["bf16" if dtype in _LOW_PRECISION else "f32"]


def time_matmul(size: int = MATMUL_SIZE, reps: int = 5) -> float:
    """FLOP/s of one `size` x `size` float32 matmul on the default device: the fastest of
    `reps` timed calls after a compile and a warm-up call (on a shared machine, interference
    only adds time). Measures afresh at every call; `matmul_flops` caches it."""
    if size < 1 or reps < 1:
        raise ValueError(f"size and reps must be >= 1, got size={size}, reps={reps}")
    a_NxN = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    matmul(a_NxN, a_NxN).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        matmul(a_NxN, a_NxN).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


@functools.cache
def matmul_flops() -> float:
    """`time_matmul()`, measured once per process (about a second on 2 CPU cores)."""
    return time_matmul()


def peak_flops(dtype: str, num_devices: int = 1, device: jax.Device | None = None) -> float | None:
    """Peak FLOP/s of a run computing in `dtype` on `num_devices` chips like `device`
    (default `jax.devices()[0]`): the datasheet figure times the chips; on a CPU the measured
    `matmul_flops()` (once for the host: its "devices" share the same cores); None for an
    accelerator missing from `PEAK_FLOPS`."""
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices must be an integer >= 1, got {num_devices!r}")
    device = jax.devices()[0] if device is None else device
    given = _given_peak()
    if device.platform == "cpu":
        return matmul_flops() if given is None else given
    per_chip = table_peak_flops(device.device_kind, dtype) if given is None else given
    return None if per_chip is None else per_chip * num_devices


PEAK_ENV = "DILOCO_JAX_PEAK_FLOPS"


def _given_peak() -> float | None:
    """`DILOCO_JAX_PEAK_FLOPS` as a number > 0 (None when unset); ValueError naming it."""
    text = os.environ.get(PEAK_ENV)
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"{PEAK_ENV} must be a number of FLOP/s > 0, got {text!r}")
    return value


def mfu(flops_per_token: float, tokens_per_second: float, peak: float | None) -> float | None:
    """Model FLOPs utilization: achieved model FLOP/s over `peak` (None when peak is)."""
    if peak is None:
        return None
    if not peak > 0:
        raise ValueError(f"peak must be > 0 FLOP/s, got {peak!r}")
    return flops_per_token * tokens_per_second / peak
