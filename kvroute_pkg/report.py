"""Comparison tables and charts for policy runs (demo and benchmarks)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLUMNS = (
    ("policy", "policy", "{}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"),
    ("e2e_p50_ms", "e2e p50 ms", "{:.0f}"),
    ("cached_token_ratio", "cached tokens", "{:.1%}"),
    ("throughput_rps", "req/s", "{:.2f}"),
    ("errors", "errors", "{}"),
)


def model_time_row(summary: dict[str, Any], time_scale: float) -> dict[str, Any]:
    """Convert a replay summary's real seconds into the simulated hardware's milliseconds."""
    row = dict(summary)
    scale = 1000.0 / time_scale
    for key in ("ttft_p50", "ttft_p90", "ttft_p99", "e2e_p50", "e2e_p99"):
        value = summary.get(f"{key}_s")
        row[f"{key}_ms"] = value * scale if value is not None else float("nan")
    row["throughput_rps"] = summary.get("throughput_rps", 0.0) * time_scale
    return row


def table(
    rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]] = COLUMNS, baseline: str | None = None
) -> str:
    """A plain-text table; with ``baseline``, a column of TTFT p50 ratios against that policy."""
    cols = list(columns)
    base = next((r for r in rows if r.get("policy") == baseline), None)
    if base is not None:
        for r in rows:
            ref = base["ttft_p50_ms"]
            r["vs_baseline"] = r["ttft_p50_ms"] / ref if ref else float("nan")
        cols.append(("vs_baseline", f"p50 vs {baseline}", "{:.2f}x"))
    cells = [[title for _, title, _ in cols]]
    for r in rows:
        cells.append([fmt.format(r.get(key, "")) if r.get(key) is not None else "-" for key, _, fmt in cols])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = []
    for n, row in enumerate(cells):
        pairs = enumerate(zip(row, widths, strict=True))
        padded = (cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in pairs)
        lines.append("  ".join(padded))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def pyplot() -> Any | None:
    """matplotlib's pyplot on the file-only Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(plt: Any, fig: Any, path: Path, title: str | None = None, dpi: int = 110) -> Path:
    """Title, lay out, write (creating the folder) and close a figure: every chart ends this way."""
    if title is not None:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def chart(rows: Sequence[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Bar chart of TTFT p50/p99 and cached-token share per policy. None when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return None
    names = [r["policy"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = range(len(names))
    ax1.bar([i - 0.2 for i in x], [r["ttft_p50_ms"] for r in rows], width=0.4, label="p50", color="#4C72B0")
    ax1.bar([i + 0.2 for i in x], [r["ttft_p99_ms"] for r in rows], width=0.4, label="p99", color="#DD8452")
    ax1.set_xticks(list(x), names, rotation=20)
    ax1.set_ylabel("time to first token (ms, simulated hardware)")
    ax1.set_title("TTFT (lower is better)")
    ax1.legend()
    ax2.bar(list(x), [100 * r["cached_token_ratio"] for r in rows], color="#55A868")
    ax2.set_xticks(list(x), names, rotation=20)
    ax2.set_ylabel("% of prompt tokens served from cache")
    ax2.set_title("cache reuse (higher is better)")
    return save_figure(plt, fig, path, title)
