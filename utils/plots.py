"""Figures shared by several lessons, drawn from measured data."""
import matplotlib.pyplot as plt

KIND_COLORS = {"compute": "#4C72B0", "comm": "#DD8452", "wait": "#C44E52", "data": "#55A868",
               "other": "#8C8C8C"}


def plot_timeline(per_rank_spans, ax=None, title=None, labels=True):
    """Draw one row per rank with its spans (from utils.trace.collect()), on a shared time axis.

    `per_rank_spans` is what launch() returned when every rank returned trace.collect(): a list
    (rank order) of lists of span dicts. Time 0 is the earliest span start over all ranks.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.6 + 0.5 * len(per_rank_spans)))
    starts = [s["start"] for spans in per_rank_spans for s in spans]
    if not starts:
        raise ValueError("no spans to draw: did every rank return utils.trace.collect()?")
    t0 = min(starts)
    seen = set()
    for row, spans in enumerate(per_rank_spans):
        for s in spans:
            left, width = (s["start"] - t0) * 1e3, (s["end"] - s["start"]) * 1e3
            label = s["kind"] if s["kind"] not in seen else None
            seen.add(s["kind"])
            ax.barh(row, width, left=left, height=0.6, color=KIND_COLORS[s["kind"]],
                    edgecolor="white", linewidth=0.5, label=label)
            if labels and width > 0:
                ax.text(left + width / 2, row, s["name"], ha="center", va="center", fontsize=7,
                        color="white", clip_on=True)
    ax.set_yticks(range(len(per_rank_spans)), [f"rank {r}" for r in range(len(per_rank_spans))])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.legend(loc="upper right", fontsize=8, ncols=len(seen))
    if title:
        ax.set_title(title)
    return ax
