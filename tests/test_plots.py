"""The comparison's figures (`diloco_jax.lm.plots`) on made-up histories: one colour per run in
both figures, legends beside the data, axes with units and readable ticks, each line from the
warm start's point."""

import matplotlib.colors
import matplotlib.pyplot as plt
import pytest

from diloco_jax.lm import plots

RUNS = ("diloco", "sync_1worker", "sync_data_parallel")
WARM = 5.0


def _histories():
    """Three evaluations a run; DiLoCo sends 10 kB a round, data parallelism 40 kB, one worker
    nothing (bytes up to 120 kB: a narrow log range, as a short run has)."""
    sends = {"diloco": 10_000, "sync_1worker": 0, "sync_data_parallel": 40_000}
    return {
        name: [
            {"tokens_per_worker": 300_000 * r, "bytes_communicated": sends[name] * r,
             "eval_loss": WARM - 0.1 * r - 0.01 * i}
            for r in (1, 2, 3)
        ]
        for i, name in enumerate(RUNS)
    }  # fmt: skip


def _legend_colors(fig) -> dict[str, str]:
    """Run name (the label's first word) -> the hex colour its legend entry is drawn in."""
    (legend,) = fig.legends
    return {
        text.get_text().split()[0]: matplotlib.colors.to_hex(handle.get_color())
        for text, handle in zip(legend.get_texts(), legend.legend_handles, strict=True)
    }


@pytest.fixture(scope="module")
def figures():
    kw = dict(warm_start_loss=WARM)
    figs = [
        plots.eval_vs_tokens_figure(_histories(), **kw),
        plots.eval_vs_bytes_figure(_histories(), **kw),
    ]
    for fig in figs:
        fig.canvas.draw()
    yield figs
    for fig in figs:
        plt.close(fig)


def test_each_run_has_one_colour_in_every_figure(figures):
    tokens, by_bytes = (_legend_colors(fig) for fig in figures)
    assert tokens == by_bytes
    assert set(tokens) == {*RUNS, "warm"}
    assert len(set(tokens.values())) == len(tokens)  # no two runs alike
    assert tokens["warm"] == "#000000"


def test_legends_hide_no_data_and_every_label_fits(figures):
    for fig in figures:
        renderer = fig.canvas.get_renderer()
        (ax,) = fig.axes
        (legend,) = fig.legends
        plot_area, box = ax.get_window_extent(renderer), legend.get_window_extent(renderer)
        assert not plot_area.overlaps(box)
        assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1)


def test_axes_say_their_units_and_ticks_are_readable(figures):
    tokens, by_bytes = (fig.axes[0] for fig in figures)
    assert tokens.get_xlabel() == "tokens per worker"
    assert by_bytes.get_xlabel() == "payload bytes sent per worker (log scale)"
    for ax in figures[0].axes + figures[1].axes:
        assert ax.get_ylabel() == "eval loss (nats / byte)"
    labels = [t for t in tokens.get_xticklabels() if t.get_text()]
    assert "600k" in [t.get_text() for t in labels]  # engineering notation, not 600000
    shown = [t.get_text() for t in by_bytes.get_xticklabels() if t.get_text()]
    # On the narrow log range, labels at 1, 2 and 5 of each decade, in bytes: at least two.
    assert len(shown) >= 2 and all(t.endswith("B") and "^" not in t for t in shown)
    renderer = figures[1].canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in by_bytes.get_xticklabels() if t.get_text()]
    assert not any(a.overlaps(b) for a, b in zip(boxes, boxes[1:], strict=False))


def test_every_line_starts_at_the_warm_start(figures):
    ax = figures[0].axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    for name in RUNS:
        assert (lines[name].get_xdata()[0], lines[name].get_ydata()[0]) == (0, WARM)
    assert list(lines["warm start"].get_xdata()) == [0]
    bytes_lines = {line.get_label(): line for line in figures[1].axes[0].get_lines()}
    assert list(bytes_lines["warm start (0 B)"].get_ydata()) == [WARM, WARM]
