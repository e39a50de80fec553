"""PNG figures for reports (matplotlib without a display)."""

from __future__ import annotations

import io
from contextlib import contextmanager
from typing import Iterator

COLOR = "#3b6ea8"


@contextmanager
def png_figure(ncols: int = 1, figsize: tuple[float, float] = (7, 3.5)) -> Iterator[tuple[object, list, io.BytesIO]]:
    """Yields (figure, axes, buffer); on exit the buffer holds the PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=figsize, dpi=100, squeeze=False)
    buf = io.BytesIO()
    try:
        yield fig, list(axes[0]), buf
        fig.tight_layout()
        fig.savefig(buf, format="png")
    finally:
        plt.close(fig)


def acceptance_png(summary: dict) -> bytes:
    """Where acceptance is lost, the drafter beside n-gram prompt lookup: per draft position, the
    share of blocks that reach it and have it accepted; per prompt source, the acceptance length."""
    drafter, lookup = summary["acceptance_by_position"], summary["ngram_acceptance_by_position"]
    with png_figure(ncols=2, figsize=(11, 3.8)) as (fig, (by_position, by_source), buf):
        for rates, label, color in ((drafter, "drafter", COLOR), (lookup, "prompt lookup", "#c0504d")):
            ks = [k for k, r in enumerate(rates, 1) if r is not None]
            by_position.plot(ks, [rates[k - 1] for k in ks], marker="o", label=label, color=color)
        by_position.set(
            xlabel="draft position", ylabel="accepted | reached", ylim=(0, 1.05), title="acceptance by draft position"
        )
        by_position.legend()
        sources = sorted(summary["tau_per_source"])
        xs = range(len(sources))
        by_source.bar(
            [x - 0.2 for x in xs],
            [summary["tau_per_source"][s] or 0 for s in sources],
            0.4,
            label="drafter",
            color=COLOR,
        )
        by_source.bar(
            [x + 0.2 for x in xs],
            [summary["tau_ngram_per_source"].get(s) or 0 for s in sources],
            0.4,
            label="prompt lookup",
            color="#c0504d",
        )
        by_source.set_xticks(list(xs), sources, rotation=20, ha="right")
        by_source.set(ylabel="acceptance length (tau)", title="by prompt source")
        by_source.legend()
    return buf.getvalue()
