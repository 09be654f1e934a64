"""Pictures of `evaluate` and `calibrate` results (matplotlib, imported only here)."""


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("plotting needs matplotlib: pip install 'kvwire[plot]'") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    return plt


def plot_evaluation(result, path, title=None):
    """Left: the A/B logit difference against strength, each example faint, the mean bold. Right:
    KL from the unsteered model and the perplexity increase (%) on neutral text."""
    plt = _pyplot()
    s = result.strengths
    order = sorted(range(len(s)), key=s.__getitem__)
    xs = [s[i] for i in order]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for row in result.per_example:
        left.plot(xs, [row[i] for i in order], color="tab:blue", alpha=0.15, linewidth=0.8)
    left.plot(xs, [result.logit_diff[i] for i in order], color="tab:blue", linewidth=2.5, marker="o", label="mean")
    left.axhline(0, color="grey", linewidth=0.8)
    left.set(xlabel="strength", ylabel="log p(positive) - log p(negative)",
             title=f"slope {result.slope_mean:+.3f} ± {result.slope_std:.3f}, "
                   f"{100 * result.anti_steerable:.0f}% anti-steerable")
    left.legend(loc="best")
    right.plot(xs, [result.kl[i] for i in order], color="tab:red", marker="o", label="KL (nats/token)")
    right.set(xlabel="strength", ylabel="KL from unsteered", title=f"side effects ({result.neutral_tokens} tokens)")
    twin = right.twinx()
    twin.plot(xs, [100 * result.ppl_increase[i] for i in order], color="tab:green", marker="s",
              label="perplexity increase (%)")
    twin.set_ylabel("perplexity increase (%)")
    lines = right.get_lines() + twin.get_lines()
    right.legend(lines, [line.get_label() for line in lines], loc="upper center")
    fig.suptitle(title or f"{result.operation} on {result.dataset}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_calibration(report, path, title=None):
    """A heatmap of the logit difference over candidates (rows) x strengths (columns); settings over
    the damage limit are hatched, the chosen one is boxed."""
    plt = _pyplot()
    from matplotlib.patches import Rectangle

    score, allowed = report.logit_diff, report.allowed
    fig, ax = plt.subplots(figsize=(1.2 + 0.6 * len(report.strengths), 1.4 + 0.4 * len(report.candidates)))
    image = ax.imshow(score, cmap="coolwarm", aspect="auto")
    fig.colorbar(image, ax=ax, label="mean logit difference")
    for r, row in enumerate(allowed):
        for c, ok in enumerate(row):
            if not ok:
                ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, hatch="//", edgecolor="grey",
                                       linewidth=0))
    r, c = report.choice_index
    ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=2.5))
    ax.set_xticks(range(len(report.strengths)), [f"{s:g}" for s in report.strengths])
    ax.set_yticks(range(len(report.candidates)), report.candidates)
    ax.set(xlabel="strength", ylabel="layer (site)")
    ax.set_title(title or f"chosen: {report.candidates[r]} at {report.strengths[c]:g} (hatched: over the limit)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
