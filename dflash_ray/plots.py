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
