"""Tests for diloco_jax.lm.mfu: peak FLOP/s by device kind, the CPU matmul yardstick, MFU."""

import math
import types

import pytest

from diloco_jax.lm import mfu

# Dense bf16 peaks per chip as the issue lists them (vendor datasheets), FLOP/s.
DATASHEET_BF16 = {
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5": 459e12,  # v5p
    "TPU v6 lite": 918e12,  # v6e
}


@pytest.mark.parametrize("kind, expected", sorted(DATASHEET_BF16.items()))
def test_bf16_peaks_match_the_datasheets(kind, expected):
    assert mfu.table_peak_flops(kind, "bfloat16") == pytest.approx(expected, rel=1e-3)


def test_float32_uses_the_tf32_column_on_nvidia_and_unknown_kinds_are_none():
    # NVIDIA's TF32 dense peak is half its bf16 one; TPUs run float32 matmuls as bf16 passes.
    assert mfu.table_peak_flops("NVIDIA H200", "float32") == pytest.approx(989e12 / 2, rel=1e-3)
    assert mfu.table_peak_flops("TPU v4", "float32") == mfu.table_peak_flops("TPU v4", "bfloat16")
    assert mfu.table_peak_flops("NVIDIA H200 SXM 141GB", "bfloat16") is None  # not guessed


def _device(platform, kind):
    return types.SimpleNamespace(platform=platform, device_kind=kind)


def test_peak_flops_scales_with_chips_and_measures_cpus(monkeypatch):
    monkeypatch.delenv(mfu.PEAK_ENV, raising=False)  # the suite sets one (tests/conftest.py)
    h200 = _device("gpu", "NVIDIA H200")
    assert mfu.peak_flops("bfloat16", 4, h200) == pytest.approx(4 * 989e12, rel=1e-3)
    assert mfu.peak_flops("bfloat16", 1, _device("gpu", "Some Future GPU")) is None
    cpu = _device("cpu", "cpu")
    measured = mfu.peak_flops("float32", 1, cpu)
    assert math.isfinite(measured) and measured > 0
    # Cached once per process, and the host's cores are shared by all its "devices".
    assert mfu.peak_flops("bfloat16", 8, cpu) == measured == mfu.matmul_flops()
    with pytest.raises(ValueError, match="num_devices"):
        mfu.peak_flops("float32", 0, cpu)


def test_a_given_peak_replaces_the_table_and_the_measurement(monkeypatch):
    monkeypatch.setenv(mfu.PEAK_ENV, "2.5e14")
    assert mfu.peak_flops("bfloat16", 4, _device("gpu", "Some Future GPU")) == 4 * 2.5e14
    assert mfu.peak_flops("float32", 8, _device("cpu", "cpu")) == 2.5e14  # the host's
    for bad in ("fast", "0", "-1", "inf", "nan"):
        monkeypatch.setenv(mfu.PEAK_ENV, bad)
        with pytest.raises(ValueError, match=mfu.PEAK_ENV):
            mfu.peak_flops("float32", 1, _device("cpu", "cpu"))


def test_time_matmul_measures_afresh():
    assert mfu.time_matmul(size=64, reps=2) > 0
    with pytest.raises(ValueError, match="size"):
        mfu.time_matmul(size=0)


def test_mfu_is_achieved_model_flops_over_peak():
    # 1e9 FLOPs per token at 100 tokens/s is 1e11 FLOP/s: 10% of 1e12.
    assert mfu.mfu(1e9, 100.0, 1e12) == pytest.approx(0.1)
    assert mfu.mfu(1e9, 100.0, None) is None
    with pytest.raises(ValueError, match="peak"):
        mfu.mfu(1e9, 100.0, 0.0)
