"""Hiding the outer step behind compute (Kale, Douillard, Donchev 2025): DiLoCo against a
one-step delayed outer update (naive, and with a lowered outer learning rate) and eager
updates with a one- and two-step delay. Each delayed round applies the mean launched d
rounds earlier; eager workers replace their own stale share of it with their fresh delta.
With Streaming DiLoCo's fragments (the paper's Table 3 combines them) each fragment's mean is
applied at its own sync a round later; Streaming DiLoCo without a delay is the reference."""

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
            "streaming_5": {"fragments": 5},
            "eager_1_fragments_5": {"fragments": 5, "outer_delay": 1, "eager": True},
            "eager_1_fragments_5_lr_0.35": {
                "fragments": 5,
                "outer_delay": 1,
                "eager": True,
                "outer_lr": 0.35,
            },
        },
    )
