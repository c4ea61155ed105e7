"""Reports regenerated from ``results.jsonl``: ``summary.json``, ``results.csv``, ``results.md``, PNG plots.

Every file is written to a temporary name and renamed into place, so a report is never half
written. The numbers are pooled by :func:`hf_rope_ext.evaluation.summary.summarize` (its
docstring describes ``summary.json``).
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..files import atomic_path, atomic_write_text
from .records import NONE_METHOD, read_results
from .summary import (
    format_accuracy,
    format_ppl,
    format_scale,
    format_tokens,
    method_label,
    record_state,
    state_label,
    summarize,
    wilson_interval,
)

logger = logging.getLogger(__name__)

__all__ = ["summarize", "write_reports", "markdown_report"]

CSV_FIELDS = (
    "kind", "mode", "task", "method", "scale", "steps_per_doubling", "model", "dtype", "document", "context_length",
    "length", "depth",
    "stride", "eval_tokens", "bucket_size", "ppl", "nll", "tokens", "windows", "trials", "correct", "accuracy",
    "seconds", "reused_from", "buckets",
)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Markdown and CSV
# ----------------------------------------------------------------------------------------------


def _states_in_order(rows: Iterable[Mapping[str, Any]]) -> list[tuple[str, float | None, int | str | None]]:
    seen: dict[tuple[str, float | None, int | str | None], None] = {}
    for row in rows:
        seen.setdefault(record_state(row), None)
    # The unpatched model first, then by method order of appearance, steps and scale.
    order: dict[str, int] = {}
    for method, _, _ in seen:
        order.setdefault(method, len(order))
    return sorted(seen, key=lambda state: (state[0] != NONE_METHOD, order[state[0]], str(state[2]), state[1] or 0))


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def markdown_report(summary: Mapping[str, Any]) -> str:
    """Markdown tables of a :func:`summarize` result."""
    parts = ["# Evaluation results\n"]
    models = summary["models"]
    native = summary["native_context"]
    parts.append(f"Model: {', '.join(models) or '?'}; native context: {native} tokens.\n")
    for model in models:
        ppl_rows = [row for row in summary["perplexity"] if row["model"] == model]
        retrieval_rows = [row for row in summary["retrieval"] if row["model"] == model]
        if len(models) > 1:
            parts.append(f"## {model}\n")
        for mode in ("buckets", "sliding"):
            rows = [row for row in ppl_rows if row["mode"] == mode]
            if not rows:
                continue
            lengths = sorted({row["context_length"] for row in rows})
            cell = {(record_state(row), row["context_length"]): row for row in rows}
            documents = sorted({doc for row in rows for doc in row["documents"]})
            if mode == "buckets":
                parts.append(f"### Perplexity of the first L tokens (one forward; documents: {', '.join(documents)})\n")
            else:
                stride, eval_tokens = rows[0]["stride"], rows[0]["eval_tokens"]
                parts.append(f"### Sliding-window perplexity, window L, stride S={stride}, first {eval_tokens} tokens "
                             f"(documents: {', '.join(documents)})\n")  # fmt: skip
            header = ["method"] + [f"L={format_tokens(length)}" for length in lengths]
            table = []
            for state in _states_in_order(rows):
                values = [cell[(state, length)]["ppl"] if (state, length) in cell else None for length in lengths]
                table.append([state_label(*state)] + [format_ppl(value) for value in values])
            parts.append(_table(header, table))
            if mode == "buckets":
                beyond = [length for length in lengths if native and isinstance(native, int) and length > native]
                if beyond:
                    parts.append(f"\n### Perplexity of positions beyond the native context ({native} .. L)\n")
                    header = ["method"] + [f"L={format_tokens(length)}" for length in beyond]
                    table = [[state_label(*state)] + [format_ppl(cell[(state, length)]["beyond_native_ppl"])
                                                      if (state, length) in cell else "" for length in beyond]
                             for state in _states_in_order(rows)]  # fmt: skip
                    parts.append(_table(header, table))
                longest = max(lengths)
                ranges = next((row["ranges"] for row in rows if row["context_length"] == longest and row["ranges"]),
                              None)  # fmt: skip
                if ranges:
                    parts.append(f"\n### Perplexity by position, one forward of L={format_tokens(longest)} tokens\n")
                    header = ["method"] + [f"{format_tokens(lo)}-{format_tokens(hi)}" for lo, hi, _ in ranges]
                    table = []
                    for state in _states_in_order(rows):
                        row = cell.get((state, longest))
                        if row and row["ranges"]:
                            values = {(lo, hi): ppl for lo, hi, ppl in row["ranges"]}
                            cells = [format_ppl(values.get((lo, hi))) for lo, hi, _ in ranges]
                            table.append([state_label(*state)] + cells)
                    parts.append(_table(header, table))
            parts.append("")
        for task in sorted({row["task"] for row in retrieval_rows}):
            rows = [row for row in retrieval_rows if row["task"] == task]
            lengths = sorted({row["length"] for row in rows})
            cell = {(record_state(row), row["length"]): row for row in rows}
            depths = sorted({depth for row in rows for depth in row["by_depth"]}, key=float)
            extra = f", {rows[0]['needle_count']} keys per prompt" if task == "needle" else ""
            parts.append(f"### {task} retrieval accuracy (depths {', '.join(depths)}{extra})\n")
            parts.append("Correct / prompts, and the 95% Wilson interval of the accuracy: a few prompts a cell "
                         "leave it wide.\n")
            header = ["method"] + [f"L={format_tokens(length)}" for length in lengths]
            table = []
            for state in _states_in_order(rows):
                cells = []
                for length in lengths:
                    row = cell.get((state, length))
                    cells.append(_retrieval_cell(row) if row else "")
                table.append([state_label(*state)] + cells)
            parts.append(_table(header, table) + "\n")
    return "\n".join(parts)


def _retrieval_cell(row: Mapping[str, Any]) -> str:
    """``67% (4/6; 30%-90%)``: the accuracy, its counts and their 95% Wilson interval."""
    if row["trials"] is None or not row["trials"]:
        return format_accuracy(row["accuracy"])
    if not 0 <= row["correct"] <= row["trials"]:  # an edited results file: show it, do not fail the report
        logger.warning("%s retrieval of %s at %s tokens: %d correct of %d trials; the counts are inconsistent.",
                       row["task"], state_label(*record_state(row)), row["length"], row["correct"], row["trials"])
        return f"{format_accuracy(row['accuracy'])} ({row['correct']}/{row['trials']}; counts inconsistent)"
    low, high = wilson_interval(row["correct"], row["trials"])
    return f"{format_accuracy(row['accuracy'])} ({row['correct']}/{row['trials']}; {low:.0%}-{high:.0%})"


def comparison_table(summary: Mapping[str, Any], *, task: str = "passkey") -> str:
    """One row per method and scale: perplexity of the first L tokens (buckets mode) for every L,
    perplexity of the positions beyond the native context for every L above it, and ``task``
    retrieval accuracy for every length. Cells missing from the results stay empty."""
    ppl_rows = [row for row in summary["perplexity"] if row["mode"] == "buckets"]
    retrieval_rows = [row for row in summary["retrieval"] if row["task"] == task]
    native = summary["native_context"] if isinstance(summary["native_context"], int) else None
    ppl_lengths = sorted({row["context_length"] for row in ppl_rows})
    beyond_lengths = [length for length in ppl_lengths if native and length > native]
    retrieval_lengths = sorted({row["length"] for row in retrieval_rows})
    ppl = {(record_state(row), row["context_length"]): row for row in ppl_rows}
    found = {(record_state(row), row["length"]): row for row in retrieval_rows}
    header = ["method", "scale"] + [f"ppl {format_tokens(length)}" for length in ppl_lengths]
    header += [f"ppl beyond {format_tokens(native)} at {format_tokens(length)}" for length in beyond_lengths]
    header += [f"{task} {format_tokens(length)}" for length in retrieval_lengths]
    table = []
    for state in _states_in_order(ppl_rows + retrieval_rows):
        cells = [method_label(state[0], state[2]), format_scale(state[1])]
        cells += [format_ppl(ppl[(state, length)]["ppl"]) if (state, length) in ppl else "" for length in ppl_lengths]
        cells += [format_ppl(ppl[(state, length)]["beyond_native_ppl"]) if (state, length) in ppl else ""
                  for length in beyond_lengths]  # fmt: skip
        cells += [f"{found[(state, length)]['correct']}/{found[(state, length)]['trials']}" if (state, length) in found
                  else "" for length in retrieval_lengths]  # fmt: skip
        table.append(cells)
    return _table(header, table)


def csv_report(records: Sequence[Mapping[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for record in records:
        row = dict(record)
        reused = record.get("reused_from")
        row["reused_from"] = (state_label(reused["method"], reused.get("scale"), reused.get("steps_per_doubling"))
                              if reused else "")  # fmt: skip
        row["buckets"] = json.dumps(record["buckets"]) if record.get("buckets") else ""
        writer.writerow(row)
    return buffer.getvalue()


# ----------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------


def _save_figure(figure, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    with atomic_path(path) as temporary:
        figure.savefig(temporary, format="png", dpi=120)


def _scales_for_plot(rows: Sequence[Mapping[str, Any]]) -> list[float | None]:
    scales = sorted({row["scale"] for row in rows if row["scale"] is not None})
    return scales or [None]


def plot_perplexity(summary: Mapping[str, Any], output_dir: Path) -> list[Path]:
    """``perplexity_by_position.png`` (per-bucket curves at the longest L) and
    ``perplexity_vs_length.png`` (ppl of the first L tokens against L), one panel per scale."""
    from matplotlib.figure import Figure

    written = []
    rows = [row for row in summary["perplexity"] if row["mode"] == "buckets" and row.get("buckets")]
    native = summary["native_context"] if isinstance(summary["native_context"], int) else None
    if rows:
        scales = _scales_for_plot(rows)
        figure = Figure(figsize=(6 * len(scales), 4.5), layout="constrained")
        for index, scale in enumerate(scales):
            axes = figure.add_subplot(1, len(scales), index + 1)
            for state in _states_in_order(rows):
                if state[1] not in (None, scale):
                    continue
                mine = [row for row in rows if record_state(row) == state]
                longest = max(mine, key=lambda row: row["context_length"])
                xs = [(start + end) / 2 for start, end, _ in longest["buckets"]]
                ys = [ppl for _, _, ppl in longest["buckets"]]
                axes.plot(xs, ys, marker="o", markersize=3, label=state_label(*state))
            if native:
                axes.axvline(native, color="grey", linestyle="--", linewidth=1, label="native context")
            axes.set_yscale("log")
            axes.set_xlabel("token position (bucket centre)")
            axes.set_ylabel("perplexity")
            axes.set_title("one forward per document" + (f", scale {scale:g}" if scale else ""))
            axes.grid(True, which="both", alpha=0.3)
            axes.legend(fontsize=8)
        path = output_dir / "perplexity_by_position.png"
        _save_figure(figure, path)
        written.append(path)

    rows = [row for row in summary["perplexity"]]
    if rows:
        modes = [mode for mode in ("buckets", "sliding") if any(row["mode"] == mode for row in rows)]
        scales = _scales_for_plot(rows)
        figure = Figure(figsize=(6 * len(scales), 4.5 * len(modes)), layout="constrained")
        for mode_index, mode in enumerate(modes):
            mode_rows = [row for row in rows if row["mode"] == mode]
            for index, scale in enumerate(scales):
                axes = figure.add_subplot(len(modes), len(scales), mode_index * len(scales) + index + 1)
                for state in _states_in_order(mode_rows):
                    if state[1] not in (None, scale):
                        continue
                    mine = sorted((row for row in mode_rows if record_state(row) == state),
                                  key=lambda row: row["context_length"])  # fmt: skip
                    axes.plot([row["context_length"] for row in mine], [row["ppl"] for row in mine], marker="o",
                              label=state_label(*state))  # fmt: skip
                if native:
                    axes.axvline(native, color="grey", linestyle="--", linewidth=1)
                axes.set_xscale("log", base=2)
                axes.set_yscale("log")
                axes.set_xlabel("context length L (tokens)")
                axes.set_ylabel("perplexity")
                title = "first L tokens" if mode == "buckets" else f"sliding window, stride {mode_rows[0]['stride']}"
                axes.set_title(title + (f", scale {scale:g}" if scale else ""))
                axes.grid(True, which="both", alpha=0.3)
                axes.legend(fontsize=8)
        path = output_dir / "perplexity_vs_length.png"
        _save_figure(figure, path)
        written.append(path)
    return written


def plot_retrieval(records: Sequence[Mapping[str, Any]], output_dir: Path) -> list[Path]:
    """``retrieval_<task>.png``: a length x depth accuracy heatmap per method and scale."""
    from matplotlib.figure import Figure

    written = []
    rows = [record for record in records if record["kind"] == "retrieval"]
    for task in sorted({row["task"] for row in rows}):
        task_rows = [row for row in rows if row["task"] == task]
        states = _states_in_order(task_rows)
        lengths = sorted({row["length"] for row in task_rows})
        depths = sorted({row["depth"] for row in task_rows})
        columns = min(len(states), 4)
        lines = math.ceil(len(states) / columns)
        panel_width, panel_height = max(2.6, 0.8 * len(lengths) + 1.0), max(2.2, 0.45 * len(depths) + 1.3)
        figure = Figure(figsize=(panel_width * columns + 1.2, panel_height * lines + 0.5), layout="constrained")
        image = None
        for index, state in enumerate(states):
            axes = figure.add_subplot(lines, columns, index + 1)
            grid = [[math.nan] * len(lengths) for _ in depths]
            labels = [[""] * len(lengths) for _ in depths]
            for row in task_rows:
                if record_state(row) == state:
                    i, j = depths.index(row["depth"]), lengths.index(row["length"])
                    if isinstance(row.get("trials"), int) and row["trials"] > 0:
                        grid[i][j] = row["correct"] / row["trials"]
                        labels[i][j] = f"{row['correct']}/{row['trials']}"
                    else:  # a hand-written record with an accuracy only
                        grid[i][j] = float(row["accuracy"])
                        labels[i][j] = format_accuracy(row["accuracy"])
            image = axes.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
            for i in range(len(depths)):
                for j in range(len(lengths)):
                    axes.text(j, i, labels[i][j], ha="center", va="center", fontsize=8)
            axes.set_xticks(range(len(lengths)), [format_tokens(length) for length in lengths])
            axes.set_yticks(range(len(depths)), [f"{depth:g}" for depth in depths])
            axes.set_xlabel("length")
            axes.set_ylabel("depth")
            axes.set_title(state_label(*state), fontsize=10)
        if image is not None:
            figure.colorbar(image, ax=figure.axes, shrink=0.8, label="fraction of keys retrieved")
        figure.suptitle(f"{task} retrieval")
        path = output_dir / f"retrieval_{task}.png"
        _save_figure(figure, path)
        written.append(path)
    return written


def write_reports(output_dir: str | Path, *, plots: bool = True) -> list[Path]:
    """Regenerate every report from ``<output_dir>/results.jsonl``; returns the files written."""
    output_dir = Path(output_dir)
    records = read_results(output_dir)
    summary = summarize(records)
    written = []
    for name, text in (
        ("summary.json", json.dumps(summary, indent=2) + "\n"),
        ("results.csv", csv_report(records)),
        ("results.md", markdown_report(summary)),
    ):
        atomic_write_text(output_dir / name, text)
        written.append(output_dir / name)
    if plots and records:
        if importlib.util.find_spec("matplotlib") is None:
            logger.warning("matplotlib is not installed, so no PNG plots were written: pip install matplotlib")
        else:
            written += plot_perplexity(summary, output_dir)
            written += plot_retrieval(records, output_dir)
    logger.info("Reports written to %s", output_dir)
    return written
