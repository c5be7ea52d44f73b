"""What every figure module shares: pyplot(), matplotlib's pyplot (kernel_trace's pictures use it too), and
figure_and_axes(ax, figsize), the axes a figure function draws on (the caller's, or a new figure's).

Without a display (a server, CI) matplotlib is switched to its file-only Agg backend, unless pyplot is already
loaded or MPLBACKEND is set (Jupyter sets its inline backend itself).
"""

from __future__ import annotations

import os
import sys


def pyplot():
    import matplotlib

    headless = sys.platform.startswith("linux") and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
    if headless and "matplotlib.pyplot" not in sys.modules and not os.environ.get("MPLBACKEND"):
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def figure_and_axes(ax, figsize):
    """(fig, ax) for a figure function's ax=None argument: the caller's ax and the figure it is on, or, when ax is
    None, a new figure of figsize inches with one axes."""
    plt = pyplot()
    if ax is None:
        return plt.subplots(figsize=figsize)
    return ax.figure, ax
