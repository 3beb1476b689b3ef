"""Hiding the outer step behind compute (Kale, Douillard, Donchev 2025): DiLoCo against a
one-step delayed outer update (naive, and with a lowered outer learning rate) and eager
updates with a one- and two-step delay. Each delayed round applies the mean launched d
rounds earlier; eager workers replace their own stale share of it with their fresh delta.
Streaming DiLoCo's fragments don't combine with a delay in this library (their own
overlap_steps already overlap each fragment's exchange), so the paper's eager + fragments
row is not run."""

from sweep import run_sweep

if __name__ == "__main__":
    run_sweep(
        "overlap",
        "DiLoCo: delayed and eager outer updates",
        {
            "diloco": {},
            "delayed_1": {"outer_delay": 1},
            "delayed_1_lr_0.35": {"outer_delay": 1, "outer_lr": 0.35},
            "eager_1": {"outer_delay": 1, "eager": True},
            "eager_1_lr_0.35": {"outer_delay": 1, "eager": True, "outer_lr": 0.35},
            "eager_2": {"outer_delay": 2, "eager": True},
        },
    )
