"""`redisq lag TOPIC [GROUP] [--plot lag.png]`: lag per group and partition, and its plot."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import click

from redisq.cli.common import OK, USAGE, connect, connection_options, print_table, say, warn
from redisq.cli.groups import topic_before_group

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# group -> one list of per-partition lags per sample
Series = dict[str, list[list[int]]]


@click.command("lag")
@click.argument("topic")
@click.argument("group_name", metavar="[GROUP]", required=False)
@click.option(
    "--plot",
    metavar="FILE.png",
    type=click.Path(dir_okay=False),
    help="Write a PNG chart (needs matplotlib).",
)
@click.option(
    "--samples", type=click.IntRange(min=1), default=1, show_default=True, help="Samples."
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0),
    default=1.0,
    show_default=True,
    help="Seconds between samples.",
)
@connection_options
@topic_before_group
def lag(topic: str, group_name: str | None, plot: str | None, samples: int, interval: float) -> int:
    """Lag (messages not yet handled) per group and partition of TOPIC."""
    with connect() as broker:
        if group_name is not None:
            groups = [group_name]
            broker.describe_group(topic, group_name)  # TopicNotFound / GroupNotFound first
        else:
            groups = [g for _t, g in broker.list_groups(topic)]  # TopicNotFound first
        series: Series = {g: [] for g in groups}
        config = broker.topic_config(topic)
        partitions = config.partitions
        unit = "messages"  # on a batch topic too: from its counters (DESIGN §14.6)
        for sample in range(samples):
            if sample:
                time.sleep(interval)
            rows = []
            for name in groups:
                d = broker.describe_group(topic, name)
                series[name].append([p.lag or 0 for p in d.partitions])
                for p in d.partitions:
                    rows.append(
                        (
                            name,
                            p.partition,
                            "?" if p.lag is None else p.lag,
                            p.pending,
                            p.owner or "-",
                            p.dead_letters,
                            "yes" if p.blocked_offset else "",
                        )
                    )
            if rows:
                print_table(
                    rows,
                    [
                        "group",
                        "partition",
                        "lag" if unit == "messages" else f"lag ({unit})",
                        "pending",
                        "owner",
                        "dead letters",
                        "blocked",
                    ],
                )
            else:
                say(f"no consumer groups on {topic}")
    if plot:
        try:
            figure = lag_figure(topic, series, interval, partitions, unit)
        except ImportError:
            warn("redisq: --plot needs matplotlib (pip install matplotlib)")
            return USAGE
        save(figure, plot)
        say(f"wrote {plot}")
    return OK


def lag_verdict(series: Series, partitions: int, unit: str = "messages") -> str:
    """ "no lag", "120 messages behind in 2 of 4 partitions" (the last sample; unit "entries"
    on a batch topic), "no data"."""
    if not series:
        return "no consumer groups"
    last = [rows[-1] for rows in series.values() if rows]
    behind = sum(sum(lags) for lags in last)
    lagging = {p for lags in last for p, value in enumerate(lags) if value}
    if not behind:
        return "no lag"
    return f"{behind:,} {unit} behind in {len(lagging)} of {partitions} partitions"


def lag_figure(
    topic: str, series: Series, interval: float, partitions: int, unit: str = "messages"
) -> Figure:
    """Bars per partition and group (one sample) or lines over time (several); a title with
    the verdict, and a written "no lag" / "no consumer groups" instead of an empty chart."""
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(8, 4.5))
    verdict = lag_verdict(series, partitions, unit)
    ax.set_title(f"consumer lag on {topic}: {verdict}")
    ax.set_ylabel(f"lag ({unit})")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    samples = max((len(rows) for rows in series.values()), default=0)
    if samples <= 1:
        width = 0.8 / max(1, len(series))
        for i, (name, rows) in enumerate(series.items()):
            lags = rows[-1] if rows else []
            offset = (i - (len(series) - 1) / 2) * width
            ax.bar([p + offset for p in range(len(lags))], lags, width, label=name)
        ax.set_xlabel("partition")
        ax.set_xticks(range(partitions))
        ax.set_xlim(-0.5, partitions - 0.5)
    else:
        for name, rows in series.items():
            for p in range(len(rows[0])):
                ax.plot(
                    [i * interval for i in range(len(rows))],
                    [r[p] for r in rows],
                    marker=".",
                    label=f"{name} partition {p}",
                )
        ax.set_xlabel("time since the first sample (s)")
    if verdict in ("no lag", "no consumer groups"):
        ax.set_ylim(0, 1)
        text = (
            "no lag: every group has handled every message"
            if verdict == "no lag"
            else f"no data: {topic} has no consumer groups"
        )
        ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=13)
    if series and verdict != "no consumer groups":
        ax.legend(fontsize="small", title="group")
    fig.tight_layout()
    return fig


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def save(figure: Figure, path: str) -> None:
    import matplotlib.pyplot as plt

    figure.savefig(path, dpi=100)
    plt.close(figure)
