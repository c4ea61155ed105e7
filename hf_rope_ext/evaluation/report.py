"""Reports regenerated from ``results.jsonl``: ``summary.json``, ``results.csv``, ``results.md``, PNG plots.

Every file is written to a temporary name and renamed into place, so a report is never half
written. The numbers are pooled by :func:`hf_rope_ext.evaluation.summary.summarize` (its
docstring describes ``summary.json``).
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import io
import json
import logging
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..files import atomic_path, atomic_write_text
from .records import NONE_METHOD, RESULTS_FILE, read_results
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


# Settings besides the model state and the length that tell rows apart (the rest of each kind's
# group in summary.py): each value set gets its own table, so no cell shows another setting's number.
PPL_TABLE_SETTINGS = ("dtype", "stride", "eval_tokens", "bucket_size", "documents")
RETRIEVAL_TABLE_SETTINGS = ("dtype", "seed", "needle_count", "max_new_tokens")
# The curves of a plot and the rows of comparison_table are not split by model (a table is): with it.
PPL_SERIES_SETTINGS = ("model",) + PPL_TABLE_SETTINGS
RETRIEVAL_SERIES_SETTINGS = ("model",) + RETRIEVAL_TABLE_SETTINGS
_SETTING_LABELS = {
    "dtype": lambda value: f"dtype {value}",
    "bucket_size": lambda value: f"buckets of {value} tokens",
    "seed": lambda value: f"seed {value}",
    "max_new_tokens": lambda value: f"answers of up to {value} tokens",
}


def _setting(row: Mapping[str, Any], names: Sequence[str]) -> tuple:
    return tuple(tuple(row[name]) if isinstance(row.get(name), list) else row.get(name) for name in names)


def _tables(rows: Sequence[Mapping[str, Any]], names: Sequence[str]) -> list[list[Mapping[str, Any]]]:
    """``rows`` split by their values of the settings ``names``, in order of appearance."""
    tables: dict[tuple, list[Mapping[str, Any]]] = {}
    for row in rows:
        tables.setdefault(_setting(row, names), []).append(row)
    return list(tables.values())


def _varying_note(rows: Sequence[Mapping[str, Any]], all_rows: Sequence[Mapping[str, Any]]) -> str:
    """``"; dtype bf16"``: the labelled settings of ``rows`` whose values differ within ``all_rows``."""
    notes = [label(rows[0].get(name)) for name, label in _SETTING_LABELS.items()
             if len({repr(row.get(name)) for row in all_rows}) > 1]  # fmt: skip
    return "".join(f"; {note}" for note in notes)


def markdown_report(summary: Mapping[str, Any]) -> str:
    """Markdown tables of a :func:`summarize` result: one table per mode (task) and setting (dtype,
    documents, stride, bucket size, seed, ...), so rows of different settings are never compared."""
    parts = ["# Evaluation results\n"]
    models = summary["models"]
    if len(models) > 1:  # each model's native context is in its own section
        parts.append(f"Models: {', '.join(models)}; native context: {_native_text(summary['native_context'])}.\n")
    else:
        parts.append(f"Model: {', '.join(models) or '?'}; native context: {summary['native_context']} tokens.\n")
    for model in models:
        ppl_rows = [row for row in summary["perplexity"] if row["model"] == model]
        retrieval_rows = [row for row in summary["retrieval"] if row["model"] == model]
        if len(models) > 1:
            parts.append(f"## {model}\n")
            parts.append(f"Native context: {_native_text(_native_context(ppl_rows))}.\n")
        for mode in ("buckets", "sliding"):
            mode_rows = [row for row in ppl_rows if row["mode"] == mode]
            for rows in _tables(mode_rows, PPL_TABLE_SETTINGS):
                parts += _perplexity_tables(mode, rows, _varying_note(rows, mode_rows), _native_context(rows))
        for task in sorted({row["task"] for row in retrieval_rows}):
            task_rows = [row for row in retrieval_rows if row["task"] == task]
            for rows in _tables(task_rows, RETRIEVAL_TABLE_SETTINGS):
                parts.append(_retrieval_table(task, rows, _varying_note(rows, task_rows)))
    return "\n".join(parts)


def _native_context(rows: Sequence[Mapping[str, Any]]) -> int | list[int] | None:
    """The native context of ``rows`` (each row has its model's), a sorted list where they differ."""
    natives = sorted({row["native_context"] for row in rows if isinstance(row.get("native_context"), int)})
    return natives[0] if len(natives) == 1 else natives or None


def _native_text(native: int | list[int] | None) -> str:
    if isinstance(native, list):
        return f"{', '.join(map(str, native))} tokens"
    return "?" if native is None else f"{native} tokens"


def _perplexity_tables(mode: str, rows: Sequence[Mapping[str, Any]], note: str, native: Any) -> list[str]:
    parts = []
    lengths = sorted({row["context_length"] for row in rows})
    cell = {(record_state(row), row["context_length"]): row for row in rows}
    documents = ", ".join(rows[0]["documents"])
    if mode == "buckets":
        parts.append(f"### Perplexity of the first L tokens (one forward; documents: {documents}{note})\n")
    else:
        stride, eval_tokens = rows[0]["stride"], rows[0]["eval_tokens"]
        parts.append(f"### Sliding-window perplexity, window L, stride S={stride}, first {eval_tokens} tokens "
                     f"(documents: {documents}{note})\n")  # fmt: skip
    header = ["method"] + [f"L={format_tokens(length)}" for length in lengths]
    table = []
    for state in _states_in_order(rows):
        table.append([state_label(*state)] + [format_ppl(cell[(state, length)]["ppl"], missing="nan")
                                              if (state, length) in cell else "" for length in lengths])
    parts.append(_table(header, table))
    if mode == "buckets":
        beyond = [length for length in lengths if native and isinstance(native, int) and length > native]
        if beyond:
            parts.append(f"\n### Perplexity of positions beyond the native context ({native} .. L; "
                         f"documents: {documents}{note})\n")  # fmt: skip
            table = [[state_label(*state)] + [_beyond_cell(cell.get((state, length))) for length in beyond]
                     for state in _states_in_order(rows)]  # fmt: skip
            parts.append(_table(["method"] + [f"L={format_tokens(length)}" for length in beyond], table))
            if any(row["beyond_native_ppl"] is None for (_, length), row in cell.items() if length in beyond):
                parts.append(f"\n{_SPANS_NATIVE}: a position bucket of these results spans position {native}, so "
                             "the positions beyond it cannot be told apart; evaluate again into a new folder.\n")
        longest = max(lengths)
        # One table per bucket layout: results written before the buckets were split at the native
        # context have other edges, and a row must never lose its cells to another's header.
        layouts: dict[tuple, list] = {}
        for state in _states_in_order(rows):
            row = cell.get((state, longest))
            if row and row["ranges"]:
                layouts.setdefault(tuple((lo, hi) for lo, hi, _ in row["ranges"]), []).append((state, row))
        for number, (edges, layout_rows) in enumerate(layouts.items(), 1):
            layout = f"; bucket layout {number} of {len(layouts)}" if len(layouts) > 1 else ""
            parts.append(f"\n### Perplexity by position, one forward of L={format_tokens(longest)} tokens "
                         f"(documents: {documents}{note}{layout})\n")  # fmt: skip
            header = ["method"] + [f"{format_tokens(lo)}-{format_tokens(hi)}" for lo, hi in edges]
            table = [[state_label(*state)] + [format_ppl(ppl, missing="nan") for _, _, ppl in row["ranges"]]
                     for state, row in layout_rows]  # fmt: skip
            parts.append(_table(header, table))
    parts.append("")
    return parts


_SPANS_NATIVE = "n/a"


def _beyond_cell(row: Mapping[str, Any] | None) -> str:
    if row is None:
        return ""
    value = row["beyond_native_ppl"]
    return _SPANS_NATIVE if value is None else format_ppl(value, missing="nan")


def _retrieval_table(task: str, rows: Sequence[Mapping[str, Any]], note: str) -> str:
    lengths = sorted({row["length"] for row in rows})
    cell = {(record_state(row), row["length"]): row for row in rows}
    depths = sorted({depth for row in rows for depth in row["by_depth"]}, key=float)
    extra = f", {rows[0]['needle_count']} keys per prompt" if task == "needle" else ""
    parts = [f"### {task} retrieval accuracy (depths {', '.join(depths)}{extra}{note})\n",
             "Correct / prompts, and the 95% Wilson interval of the accuracy: a few prompts a cell leave it wide.\n"]
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
    # One row per model state: rows of several settings would overwrite each other's cells.
    for rows, names in ((ppl_rows, PPL_SERIES_SETTINGS), (retrieval_rows, RETRIEVAL_SERIES_SETTINGS)):
        for name in names:
            values = {repr(_setting(row, [name])[0]) for row in rows}
            if len(values) > 1:
                raise ValueError(f"comparison_table shows one setting, but these results hold several {name} values "
                                 f"({', '.join(sorted(values))}); keep the rows of one {name} in the summary first.")
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
        # "nan" for a broken forward, "n/a" where old buckets span the native context, "" where not run
        cells += [format_ppl(ppl[(state, length)]["ppl"], missing="nan") if (state, length) in ppl else ""
                  for length in ppl_lengths]  # fmt: skip
        cells += [_beyond_cell(ppl[(state, length)]) if (state, length) in ppl else "" for length in beyond_lengths]
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


def _series(rows: Sequence[Mapping[str, Any]], names: Sequence[str]) -> list[tuple[tuple, str, list]]:
    """``(state, label, rows)`` per model state and setting ``names``: one curve or panel each,
    labelled with the settings that differ between them, so no curve mixes two settings."""
    varying = [name for name in names if len({repr(_setting(row, [name])[0]) for row in rows}) > 1]
    series = []
    for state in _states_in_order(rows):
        for group in _tables([row for row in rows if record_state(row) == state], names):
            values = _setting(group[0], varying)
            note = "".join(f", {name} {', '.join(map(str, value)) if isinstance(value, tuple) else value}"
                           for name, value in zip(varying, values))  # fmt: skip
            series.append((state, state_label(*state) + note, group))
    return series


def _plottable(xs: Sequence[float], ys: Sequence[float]) -> tuple[list[float], list[float]]:
    """The points with a finite positive perplexity: a NaN or infinite one (a broken model) has no
    place on a log axis; the tables show it."""
    points = [(x, y) for x, y in zip(xs, ys) if isinstance(y, (int, float)) and math.isfinite(y) and y > 0]
    return [x for x, _ in points], [y for _, y in points]


def _log_axis(axes, plotted: bool) -> None:
    if plotted:
        axes.set_yscale("log")
    else:
        axes.text(0.5, 0.5, "no finite perplexity", ha="center", va="center", transform=axes.transAxes)


def _native_lines(axes, rows: Sequence[Mapping[str, Any]], labelled: bool = False) -> None:
    """A dashed line at the native context of each model of ``rows`` (named where they differ)."""
    by_native: dict[int, set[str]] = {}
    for row in rows:
        if isinstance(row.get("native_context"), int):
            by_native.setdefault(row["native_context"], set()).add(str(row["model"]))
    for native, models in sorted(by_native.items()):
        label = "native context" + (f" ({', '.join(sorted(models))})" if len(by_native) > 1 else "")
        axes.axvline(native, color="grey", linestyle="--", linewidth=1, label=label if labelled else None)


def plot_perplexity(summary: Mapping[str, Any], output_dir: Path) -> list[Path]:
    """``perplexity_by_position.png`` (per-bucket curves at the longest L) and
    ``perplexity_vs_length.png`` (ppl of the first L tokens against L), one panel per scale."""
    from matplotlib.figure import Figure

    written = []
    rows = [row for row in summary["perplexity"] if row["mode"] == "buckets" and row.get("buckets")]
    if rows:
        scales = _scales_for_plot(rows)
        figure = Figure(figsize=(6 * len(scales), 4.5), layout="constrained")
        for index, scale in enumerate(scales):
            axes = figure.add_subplot(1, len(scales), index + 1)
            plotted = False
            for state, label, mine in _series(rows, PPL_SERIES_SETTINGS):
                if state[1] not in (None, scale):
                    continue
                longest = max(mine, key=lambda row: row["context_length"])
                xs, ys = _plottable([(start + end) / 2 for start, end, _ in longest["buckets"]],
                                    [ppl for _, _, ppl in longest["buckets"]])  # fmt: skip
                if xs:
                    axes.plot(xs, ys, marker="o", markersize=3, label=label)
                    plotted = True
            _native_lines(axes, rows, labelled=True)
            _log_axis(axes, plotted)
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
                plotted = False
                for state, label, mine in _series(mode_rows, PPL_SERIES_SETTINGS):
                    if state[1] not in (None, scale):
                        continue
                    mine = sorted(mine, key=lambda row: row["context_length"])
                    xs, ys = _plottable([row["context_length"] for row in mine], [row["ppl"] for row in mine])
                    if xs:
                        axes.plot(xs, ys, marker="o", label=label)
                        plotted = True
                _native_lines(axes, mode_rows)
                axes.set_xscale("log", base=2)
                _log_axis(axes, plotted)
                axes.set_xlabel("context length L (tokens)")
                axes.set_ylabel("perplexity")
                strides = sorted({row["stride"] for row in mode_rows})
                stride_text = ", ".join(map(str, strides))
                title = "first L tokens" if mode == "buckets" else f"sliding window, stride {stride_text}"
                axes.set_title(title + (f", scale {scale:g}" if scale else ""))
                axes.grid(True, which="both", alpha=0.3)
                if plotted:
                    axes.legend(fontsize=8)
        path = output_dir / "perplexity_vs_length.png"
        _save_figure(figure, path)
        written.append(path)
    return written


def plot_retrieval(records: Sequence[Mapping[str, Any]], output_dir: Path) -> list[Path]:
    """``retrieval_<task>.png``: a length x depth accuracy heatmap per method, scale and setting."""
    from matplotlib.figure import Figure

    written = []
    rows = [record for record in records if record["kind"] == "retrieval"]
    for task in sorted({row["task"] for row in rows}):
        task_rows = [row for row in rows if row["task"] == task]
        panels = _series(task_rows, RETRIEVAL_SERIES_SETTINGS)
        lengths = sorted({row["length"] for row in task_rows})
        depths = sorted({row["depth"] for row in task_rows})
        columns = min(len(panels), 4)
        lines = math.ceil(len(panels) / columns)
        panel_width, panel_height = max(2.6, 0.8 * len(lengths) + 1.0), max(2.2, 0.45 * len(depths) + 1.3)
        figure = Figure(figsize=(panel_width * columns + 1.2, panel_height * lines + 0.5), layout="constrained")
        image = None
        for index, (_, label, mine) in enumerate(panels):
            axes = figure.add_subplot(lines, columns, index + 1)
            grid = [[math.nan] * len(lengths) for _ in depths]
            labels = [[""] * len(lengths) for _ in depths]
            shown: dict[tuple[int, int], int] = {}
            for row in mine:
                i, j = depths.index(row["depth"]), lengths.index(row["length"])
                trials = row["trials"] if isinstance(row.get("trials"), int) else 0
                if shown.get((i, j), -1) >= trials:  # the same prompts again: the run with most trials holds them all
                    continue
                shown[(i, j)] = trials
                if trials > 0:
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
            axes.set_title(label, fontsize=10)
        if image is not None:
            figure.colorbar(image, ax=figure.axes, shrink=0.8, label="fraction of keys retrieved")
        figure.suptitle(f"{task} retrieval")
        path = output_dir / f"retrieval_{task}.png"
        _save_figure(figure, path)
        written.append(path)
    return written


def _finite_or_null(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by None: JSON has no such numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {key: _finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(item) for item in value]
    return value


def write_reports(output_dir: str | Path, *, plots: bool = True) -> list[Path]:
    """Regenerate every report from ``<output_dir>/results.jsonl``; returns the files written.

    A report that cannot be written raises ``OSError`` naming it (not the temporary file it is
    written to first); results.jsonl is never touched here. Callers check the folder before any
    work with :func:`hf_rope_ext.evaluation.records.check_output_dir`."""
    output_dir = Path(output_dir)
    records = read_results(output_dir)
    summary = summarize(records)
    written = []
    for name, text in (
        ("summary.json", json.dumps(_finite_or_null(summary), indent=2, allow_nan=False) + "\n"),
        ("results.csv", csv_report(records)),
        ("results.md", markdown_report(summary)),
    ):
        with _naming_failures(output_dir / name, output_dir):
            atomic_write_text(output_dir / name, text)
        written.append(output_dir / name)
    if plots and records:
        if importlib.util.find_spec("matplotlib") is None:
            logger.warning("matplotlib is not installed, so no PNG plots were written: pip install matplotlib")
        else:
            with _naming_failures("a PNG plot", output_dir):
                written += plot_perplexity(summary, output_dir)
                written += plot_retrieval(records, output_dir)
    logger.info("Reports written to %s", output_dir)
    return written


@contextlib.contextmanager
def _naming_failures(report: Path | str, output_dir: Path) -> Iterator[None]:
    """An OSError of writing ``report`` names it and what to do, not the temporary file it went to."""
    try:
        yield
    except OSError as error:
        raise OSError(f"{report} could not be written ({error.strerror or error}); the finished cases are kept in "
                      f"{output_dir / RESULTS_FILE}: fix {output_dir} and run hf-rope-ext eval --report-only "
                      f"--output-dir {output_dir}.") from None
