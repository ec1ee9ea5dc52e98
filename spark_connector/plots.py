"""The charts of the analysis jobs (re-exported by spark_connector.jobs): each `*_figure`
builds a matplotlib Figure from collected rows, each `plot_*` writes it as a PNG.

Every chart says its verdict in the title ("CLEAN", "3 gaps in 2 partitions", "no lag"), has
integer partition ticks and units on both axes, and writes its empty state ("no data", "no
lag", "CLEAN") on the chart instead of drawing an empty axis.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

_FAULTS = (("gaps", "gap", "gaps"), ("duplicates", "duplicate", "duplicates"))
_ORDER = ("out_of_order", "out-of-order message", "out-of-order messages")


def _plural(count: int, one: str, many: str) -> str:
    return f"{count:,} {one if count == 1 else many}"


def fault_summary(
    rows: Sequence[Any], key_rows: Sequence[Any] = (), id_rows: Sequence[Any] = ()
) -> str:
    """ "CLEAN", or the faults with the partitions they are in: "3 gaps in 2 partitions,
    1 duplicate in 1 partition"; key faults and repeated message ids follow."""
    parts = []
    for column, one, many in (*_FAULTS, _ORDER):
        per_partition: dict[int, int] = {}
        for r in rows:
            value = int(getattr(r, column) or 0)
            if value:
                per_partition[r.partition] = per_partition.get(r.partition, 0) + value
        total = sum(per_partition.values())
        if total:
            where = _plural(len(per_partition), "partition", "partitions")
            parts.append(f"{_plural(total, one, many)} in {where}")
    repeated = sum(int(r.duplicate_ids or 0) for r in id_rows)
    if repeated:
        parts.append(_plural(repeated, "repeated message id", "repeated message ids"))
    late_keys = sum(1 for r in key_rows if int(r.out_of_order or 0))
    if late_keys:
        parts.append(_plural(late_keys, "key out of order", "keys out of order"))
    split = sum(1 for r in key_rows if int(r.partitions or 0) > 1)
    if split:
        parts.append(_plural(split, "key split over partitions", "keys split over partitions"))
    return ", ".join(parts) if parts else "CLEAN"


def audit_figure(
    rows: Sequence[Any], title: str, key_rows: Sequence[Any] = (), id_rows: Sequence[Any] = ()
) -> Figure:
    """Bars of gaps, duplicates and out-of-order messages per partition."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    verdict = fault_summary(rows, key_rows, id_rows) if rows else "no data"
    ax.set_title(f"{title}: {verdict}")
    partitions = sorted({int(r.partition) for r in rows})
    _partition_axis(ax, partitions)
    _count_axis(ax, "messages")
    if not rows:
        _say(ax, "no data: no messages carry a producer sequence")
    else:
        width = 0.27
        sums = {
            column: [
                sum(int(getattr(r, column) or 0) for r in rows if r.partition == p)
                for p in partitions
            ]
            for column in ("gaps", "duplicates", "out_of_order")
        }
        for i, (column, values) in enumerate(sums.items()):
            ax.bar([p + (i - 1) * width for p in partitions], values, width, label=column)
        if not any(any(values) for values in sums.values()):
            audited = sum(int(r.messages or 0) for r in rows)
            _say(ax, f"CLEAN: {audited:,} messages, no gaps, duplicates or out-of-order ones")
        else:
            ax.legend()
    _from_zero(ax)
    fig.tight_layout()
    return fig


def skew_figure(rows: Sequence[Any], title: str) -> Figure:
    """Messages per partition, with the mean; the title says the largest over the mean."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    partitions = [int(r.partition) for r in rows]
    _partition_axis(ax, partitions)
    _count_axis(ax, "messages")
    counts = [int(r.messages) for r in rows]
    if not rows or not sum(counts):
        ax.set_title(f"{title}: no data")
        _say(ax, "no data: the topic holds no messages")
    else:
        mean = sum(counts) / len(counts)
        ax.set_title(f"{title}: largest partition {max(counts) / mean:.2f}x the mean")
        ax.bar(partitions, counts, 0.8)
        ax.axhline(mean, color="grey", linestyle="--", label=f"mean {mean:,.0f}")
        ax.legend()
    _from_zero(ax)
    fig.tight_layout()
    return fig


def throughput_figure(rows: Sequence[Any], title: str) -> Figure:
    """Messages per second per partition over time (the stream IDs' append time)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.set_ylabel("messages/s")
    ax.set_xlabel("time (append time of the bucket's start)")
    if not rows:
        ax.set_title(f"{title}: no data")
        _say(ax, "no data: the topic holds no messages")
    else:
        peak = max(float(r.messages_per_s) for r in rows)
        ax.set_title(f"{title}: peak {peak:,.0f} messages/s")
        for p in sorted({int(r.partition) for r in rows}):
            series = [r for r in rows if r.partition == p]
            ax.plot(
                [r.bucket_start for r in series],
                [r.messages_per_s for r in series],
                marker=".",
                label=f"partition {p}",
            )
        ax.legend(fontsize="small")
        fig.autofmt_xdate()
    _from_zero(ax)
    fig.tight_layout()
    return fig


def lag_figure(rows: Sequence[Any], title: str) -> Figure:
    """Lag (not yet delivered) per partition, one bar per group."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    partitions = sorted({int(r.partition) for r in rows})
    _partition_axis(ax, partitions)
    _count_axis(ax, "lag (messages not yet delivered)")
    groups = sorted({r.group for r in rows})
    behind = sum(int(r.lag or 0) for r in rows)
    lagging = {r.partition for r in rows if r.lag}
    if not groups:
        ax.set_title(f"{title}: no consumer groups")
        _say(ax, "no data: no consumer group reads this topic")
        _from_zero(ax)
        fig.tight_layout()
        return fig
    verdict = (
        f"{behind:,} messages behind in {len(lagging)} of {len(partitions)} partitions"
        if behind
        else "no lag"
    )
    ax.set_title(f"{title}: {verdict}")
    width = 0.8 / len(groups)
    for i, g in enumerate(groups):
        series = [r for r in rows if r.group == g]
        offset = (i - (len(groups) - 1) / 2) * width
        ax.bar([r.partition + offset for r in series], [r.lag for r in series], width, label=g)
    if behind:
        ax.legend(title="group")
    else:
        _say(ax, "no lag: every group has read every partition to the end")
    _from_zero(ax)
    fig.tight_layout()
    return fig


def plot_audit(
    rows: Sequence[Any],
    path: str | Path,
    title: str,
    key_rows: Sequence[Any] = (),
    id_rows: Sequence[Any] = (),
) -> Path:
    return save(audit_figure(rows, title, key_rows, id_rows), path)


def plot_skew(rows: Sequence[Any], path: str | Path, title: str) -> Path:
    return save(skew_figure(rows, title), path)


def plot_throughput(rows: Sequence[Any], path: str | Path, title: str) -> Path:
    return save(throughput_figure(rows, title), path)


def plot_lag(rows: Sequence[Any], path: str | Path, title: str) -> Path:
    return save(lag_figure(rows, title), path)


def content_figure(result: Any, title: str) -> Figure:
    """Duplicated and missing messages per partition (-1: missing rows without a key)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    rows = [r for r in result.partitions if r.duplicated or r.missing]
    verdict = (
        "CLEAN"
        if result.clean
        else (f"{result.duplicated:,} duplicated, {result.missing:,} missing")
    )
    ax.set_title(f"{title}: {verdict}")
    if not rows:
        _say(ax, "CLEAN: no duplicated or missing content")
        ax.set_axis_off()
        return fig
    partitions = [int(r.partition) for r in rows]
    x = list(range(len(rows)))
    ax.bar([i - 0.2 for i in x], [int(r.duplicated) for r in rows], 0.4, label="duplicated")
    ax.bar([i + 0.2 for i in x], [int(r.missing) for r in rows], 0.4, label="missing")
    ax.set_xticks(x, [str(p) if p >= 0 else "no key" for p in partitions])
    ax.set_xlabel("partition")
    _count_axis(ax, "messages")
    ax.legend()
    fig.tight_layout()
    return fig


def plot_content(result: Any, path: str | Path, title: str) -> Path:
    return save(content_figure(result, title), path)


def _partition_axis(ax: Axes, partitions: Sequence[int]) -> None:
    """One tick per partition, integers only (no 0.5 steps)."""
    ax.set_xlabel("partition")
    ax.set_xticks(list(partitions))
    if partitions:
        ax.set_xlim(min(partitions) - 0.6, max(partitions) + 0.6)


def _count_axis(ax: Axes, label: str) -> None:
    """Whole counts on the y axis."""
    from matplotlib.ticker import MaxNLocator

    ax.set_ylabel(label)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def _from_zero(ax: Axes) -> None:
    """Counts start at 0, and a chart of zeros shows 0..1 (not -0.04..0.04): call once drawn."""
    ax.set_ylim(0, max(ax.get_ylim()[1], 1))


def _say(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=12)


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def save(fig: Figure, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    target = Path(path)
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target
