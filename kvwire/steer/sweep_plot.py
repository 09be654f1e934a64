"""Drawing a `Sweep` with matplotlib: the probe against strength, the samples in a table below."""
import textwrap


def plot_sweep(result, path, title=None):
    """Write `result` (a `kvwire.steer.Sweep`) to `path` (.png, .svg or .pdf)."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("plotting a sweep needs matplotlib (pip install matplotlib, or kvwire[plot])") from None
    matplotlib.use("Agg", force=False)  # no screen needed
    import matplotlib.pyplot as plt

    rows = len(result.strengths)
    fig = plt.figure(figsize=(9, 3.2 + 0.42 * rows))
    grid = fig.add_gridspec(2, 1, height_ratios=[3.2, 0.42 * rows + 0.3], hspace=0.25)
    ax = fig.add_subplot(grid[0])
    ax.plot(result.strengths, result.values, marker="o", color="#d9822b")
    ax.axvline(0, color="#bbbbbb", lw=0.8, zorder=0)
    ax.set_xlabel("strength")
    ax.set_ylabel(textwrap.fill(result.probe, 36), fontsize=9)
    ax.grid(alpha=0.3)
    ax.set_title(title or f"control vector sweep (blocks {_blocks(result.vector_layers)})", fontsize=11)
    table_ax = fig.add_subplot(grid[1])
    table_ax.axis("off")
    cells = [[f"{s:+.2f}", f"{v:+.2f}", _cell(result.prompt, t)]
             for s, v, t in zip(result.strengths, result.values, result.samples)]
    table = table_ax.table(cellText=cells, colLabels=["strength", "probe", f"sample: {result.prompt} …"],
                           colWidths=[0.1, 0.1, 0.8], loc="upper center", cellLoc="left")
    for (row, col), cell in table.get_celld().items():
        cell.set_text_props(ha="left" if col == 2 else "right")
        cell.PAD = 0.02
    table.auto_set_font_size(False)
    table.set_fontsize(8)
    table.scale(1, 1.3)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _cell(prompt, text, width=80):
    line = "".join(c if c.isprintable() else "·" for c in " ".join(text.split()))  # one row each, printable
    return "…" + line[:width] + ("…" if len(line) > width else "")


def _blocks(layers):
    if not layers:
        return "?"
    return f"{layers[0]}-{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1)) else ",".join(map(str, layers))
