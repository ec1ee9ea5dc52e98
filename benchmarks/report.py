"""What every benchmark here shares: interleaved rounds, medians, ratios, and one table printer
(Markdown for the README, aligned text for a terminal)."""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Sequence


def run_rounds(
    variants: dict[str, Callable[[], float]], repeat: int, unit: str = "msg/s"
) -> dict[str, float]:
    """Run every variant `repeat` times, interleaved (so drift hits them alike); the medians."""
    results: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(repeat):
        for name, run in variants.items():
            rate = run()
            results[name].append(rate)
            print(f"  round {round_ + 1}/{repeat} {name}: {rate:,.0f} {unit}", file=sys.stderr)
    return {name: statistics.median(rates) for name, rates in results.items()}


def ratio_rows(
    medians: dict[str, float], baseline: str, extra: dict[str, str] | None = None
) -> list[list[str]]:
    """[name, rate, ratio to the baseline (, extra)] per variant."""
    base = medians[baseline]
    rows = []
    for name, rate in medians.items():
        row = [name, f"{rate:,.0f}", f"{rate / base:.2f}x"]
        if extra is not None:
            row.append(extra.get(name, ""))
        rows.append(row)
    return rows


def print_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    markdown: bool,
    text_columns: Sequence[int] = (),
) -> None:
    """The first column and text_columns (indexes) left-aligned, the others right-aligned
    (numbers)."""
    left = {0, *text_columns}
    if markdown:
        print("\n| " + " | ".join(headers) + " |")
        print("|" + "|".join(" --- " if i in left else " ---: " for i in range(len(headers))) + "|")
        for row in rows:
            print("| " + " | ".join(row) + " |")
        return
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    print()
    for row in [headers, *rows]:
        cells = [
            str(c).ljust(w) if i in left else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())
