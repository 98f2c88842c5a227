"""`FP8Monitor.plot`: the curves of a monitor's records, by matplotlib."""

_LABELS = {"amax": "amax", "scale": "scale", "saturation": "saturated (%)", "underflow": "underflow (%)",
           "sqnr_db": "SQNR (dB)", "nonfinite": "non-finite elements"}


def plot(monitor, stats, roles, layers=None, path=None):
    """See `FP8Monitor.plot`."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError(
            "FP8Monitor.plot needs matplotlib: pip install \"keras-fp8[plot]\" (or matplotlib)."
        ) from error
    layers = monitor.layer_names if layers is None else list(layers)
    if not layers:
        raise ValueError("FP8Monitor.plot: no layer to draw (nothing measured yet, or `layers` is empty).")
    fig, axes = plt.subplots(len(stats), len(roles), figsize=(4.2 * len(roles), 2.3 * len(stats)),
                             sharex=True, squeeze=False)
    for i, stat in enumerate(stats):
        for j, role in enumerate(roles):
            ax = axes[i][j]
            for name in layers:
                steps, values = monitor.series(name, role, stat)
                if stat in ("saturation", "underflow"):
                    values = 100 * values
                ax.plot(steps, values, marker=".", markersize=3, linewidth=1, label=name)
            if stat in ("amax", "scale"):
                ax.set_yscale("log")
            if i == 0:
                ax.set_title(role)
            if j == 0:
                ax.set_ylabel(_LABELS[stat])
            if i == len(stats) - 1:
                ax.set_xlabel("step")
            ax.grid(True, alpha=0.3)
    handles, names = axes[0][0].get_legend_handles_labels()
    # As many legend columns as the figure's width holds, the rows above the panels.
    width_chars = 14 * len(roles)
    columns = max(1, min(len(names), width_chars // (max(len(n) for n in names) + 6)))
    rows = -(-len(names) // columns)
    fig.legend(handles, names, loc="upper center", ncol=columns, frameon=False)
    height = fig.get_figheight()
    fig.tight_layout(rect=(0, 0, 1, 1 - (0.28 * rows + 0.15) / height))
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig
