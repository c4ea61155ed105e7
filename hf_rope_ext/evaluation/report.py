"""Reports regenerated from ``results.jsonl``: ``summary.json``, ``results.csv``, ``results.md``, PNG plots.

Every file is written to a temporary name and renamed into place, so a report is never half
written. Documents are pooled by tokens: the perplexity over several documents is
``exp(sum of token losses / number of scored tokens)``; retrieval accuracy pools the trials of
all depths.

``summary.json``::

    {"models": [...], "native_context": 8192,
     "perplexity": [{"mode", "method", "scale", "steps_per_doubling", "model", "dtype", "context_length", "stride",
                     "eval_tokens", "bucket_size", "documents": [...], "ppl", "nll", "tokens",
                     "ranges": [[start, end, ppl], ...]  # buckets pooled to 0, L0/4, L0/2, L0, 2 L0, ...
                     "beyond_native_ppl": ppl of positions [L0, L) or null}, ...],
     "retrieval": [{"task", "method", "scale", "steps_per_doubling", "model", "dtype", "length", "trials", "correct",
                    "accuracy", "by_depth": {"0.1": accuracy, ...}}, ...]}
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
from ..methods import get_method
from ..patching import DEFAULT_STEPS_PER_DOUBLING
from .perplexity import safe_exp
from .runner import EXACT_STEPS, NONE_METHOD, read_results

logger = logging.getLogger(__name__)

__all__ = ["summarize", "write_reports", "markdown_report"]

CSV_FIELDS = (
    "kind", "mode", "task", "method", "scale", "steps_per_doubling", "model", "dtype", "document", "context_length",
    "length", "depth",
    "stride", "eval_tokens", "bucket_size", "ppl", "nll", "tokens", "windows", "trials", "correct", "accuracy",
    "seconds", "reused_from", "buckets",
)  # fmt: skip


def bucket_token_count(start: int, end: int) -> int:
    # Position 0 is never predicted (see perplexity.py).
    return max(end - max(start, 1), 0)


def pool_log_ppl(pairs: Iterable[tuple[float, int]]) -> float:
    """exp of the token-weighted mean of log ppl values."""
    total = count = 0.0
    for ppl, tokens in pairs:
        if tokens:
            total += (math.log(ppl) if ppl > 0 and math.isfinite(ppl) else math.inf) * tokens
            count += tokens
    if not count:
        return float("nan")
    return math.exp(total / count) if math.isfinite(total) and total / count < 700 else float("inf")


def range_edges(native_context: int, context_length: int) -> list[int]:
    """``0, L0/4, L0/2, L0, 2 L0, 4 L0, ...`` cut at ``context_length``."""
    edges = [0] + [native_context // 4, native_context // 2] + [native_context * 2**k for k in range(0, 20)]
    edges = sorted({edge for edge in edges if 0 <= edge < context_length})
    return edges + [context_length]


def pooled_ranges(buckets: Sequence[Sequence[float]], edges: Sequence[int]) -> list[list[float]]:
    """Buckets ``[start, end, ppl]`` pooled by the range ``[edge_i, edge_i+1)`` holding their start;
    each pooled range is reported as ``[first bucket start, last bucket end, ppl]``."""
    groups: dict[int, list[Sequence[float]]] = {}
    for bucket in buckets:
        index = max(i for i in range(len(edges) - 1) if edges[i] <= bucket[0])
        groups.setdefault(index, []).append(bucket)
    pooled = []
    for _, group in sorted(groups.items()):
        ppl = pool_log_ppl((bucket[2], bucket_token_count(bucket[0], bucket[1])) for bucket in group)
        pooled.append([min(bucket[0] for bucket in group), max(bucket[1] for bucket in group), ppl])
    return pooled


def record_state(record: Mapping[str, Any]) -> tuple[str, float | None, int | str | None]:
    return record["method"], record.get("scale"), record.get("steps_per_doubling")


def method_label(method: str, steps: int | str | None = None) -> str:
    """The method name, with its frequency steps where they are not the package default."""
    if steps is None:
        dynamic = method != NONE_METHOD and _known(method) and get_method(method).length_dependent
        return f"{method} (steps unrecorded)" if dynamic else method
    default = EXACT_STEPS if DEFAULT_STEPS_PER_DOUBLING is None else DEFAULT_STEPS_PER_DOUBLING
    if steps == default:
        return method
    return f"{method} (exact length)" if steps == EXACT_STEPS else f"{method} ({steps} steps/doubling)"


def _known(method: str) -> bool:
    try:
        get_method(method)
    except (TypeError, ValueError):
        return False
    return True


def state_label(method: str, scale: float | None, steps: int | str | None = None) -> str:
    label = method_label(method, steps)
    return label if scale is None else f"{label} x{scale:g}"


def summarize(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Pool per-document and per-depth records (see the module docstring)."""
    perplexity: dict[tuple, dict[str, Any]] = {}
    retrieval: dict[tuple, dict[str, Any]] = {}
    natives = {record.get("native_context") for record in records if record.get("native_context")}
    for record in records:
        if record["kind"] == "perplexity":
            key = tuple(record.get(name) for name in ("mode", "method", "scale", "steps_per_doubling", "model", "dtype",
                                                      "context_length", "stride", "eval_tokens",
                                                      "bucket_size"))  # fmt: skip
            entry = perplexity.setdefault(key, {"parts": [], "buckets": {}})
            entry["parts"].append(record)
        elif record["kind"] == "retrieval":
            key = tuple(record.get(name) for name in ("task", "method", "scale", "steps_per_doubling", "model", "dtype",
                                                      "length", "seed", "needle_count", "max_new_tokens"))  # fmt: skip
            retrieval.setdefault(key, {"parts": []})["parts"].append(record)

    ppl_rows = []
    for key, entry in perplexity.items():
        parts = entry["parts"]
        mode, method, scale, steps, model, dtype, length, stride, eval_tokens, bucket_size = key
        tokens = sum(part["tokens"] for part in parts)
        nll = sum(part["nll"] * part["tokens"] for part in parts) / max(tokens, 1)
        row = {"mode": mode, "method": method, "scale": scale, "steps_per_doubling": steps, "model": model,
               "dtype": dtype,
               "context_length": length, "stride": stride, "eval_tokens": eval_tokens, "bucket_size": bucket_size,
               "documents": [part.get("document") for part in parts], "ppl": safe_exp(nll),
               "nll": nll, "tokens": tokens, "ranges": None, "beyond_native_ppl": None}  # fmt: skip
        native = parts[0].get("native_context")
        if mode == "buckets" and native:
            buckets: dict[tuple[int, int], list[tuple[float, int]]] = {}
            for part in parts:
                for start, end, ppl in part["buckets"]:
                    buckets.setdefault((start, end), []).append((ppl, bucket_token_count(start, end)))
            merged = [[start, end, pool_log_ppl(values)] for (start, end), values in sorted(buckets.items())]
            row["buckets"] = merged
            row["ranges"] = pooled_ranges(merged, range_edges(native, length))
            if length > native:
                beyond = [(ppl, bucket_token_count(s, e)) for s, e, ppl in merged if s >= native]
                row["beyond_native_ppl"] = pool_log_ppl(beyond) if beyond else None
        ppl_rows.append(row)

    retrieval_rows = []
    for key, entry in retrieval.items():
        task, method, scale, steps, model, dtype, length, seed, needle_count, max_new_tokens = key
        parts = entry["parts"]
        trials = sum(part["trials"] for part in parts)
        correct = sum(part["correct"] for part in parts)
        by_depth = {}
        for part in sorted(parts, key=lambda part: part["depth"]):
            by_depth[f"{part['depth']:g}"] = part["correct"] / part["trials"]
        retrieval_rows.append({"task": task, "method": method, "scale": scale, "steps_per_doubling": steps,
                               "model": model, "dtype": dtype,
                               "length": length, "seed": seed, "needle_count": needle_count, "trials": trials,
                               "correct": correct, "accuracy": correct / trials if trials else float("nan"),
                               "by_depth": by_depth})  # fmt: skip
    return {
        "models": sorted({record.get("model") for record in records if record.get("model")}),
        "native_context": min(natives) if len(natives) == 1 else sorted(natives) or None,
        "cases": len(records),
        "perplexity": ppl_rows,
        "retrieval": retrieval_rows,
    }


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
    return sorted(seen, key=lambda state: (state[0] != "none", order[state[0]], str(state[2]), state[1] or 0))


def _format_ppl(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{value:.2f}" if value < 1000 else f"{value:.0f}"


def _tokens_label(count: int) -> str:
    return f"{count // 1024}k" if count % 1024 == 0 and count >= 1024 else str(count)


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
            header = ["method"] + [f"L={_tokens_label(length)}" for length in lengths]
            table = []
            for state in _states_in_order(rows):
                values = [cell[(state, length)]["ppl"] if (state, length) in cell else None for length in lengths]
                table.append([state_label(*state)] + [_format_ppl(value) for value in values])
            parts.append(_table(header, table))
            if mode == "buckets":
                beyond = [length for length in lengths if native and isinstance(native, int) and length > native]
                if beyond:
                    parts.append(f"\n### Perplexity of positions beyond the native context ({native} .. L)\n")
                    header = ["method"] + [f"L={_tokens_label(length)}" for length in beyond]
                    table = [[state_label(*state)] + [_format_ppl(cell[(state, length)]["beyond_native_ppl"])
                                                      if (state, length) in cell else "" for length in beyond]
                             for state in _states_in_order(rows)]  # fmt: skip
                    parts.append(_table(header, table))
                longest = max(lengths)
                ranges = next((row["ranges"] for row in rows if row["context_length"] == longest and row["ranges"]),
                              None)  # fmt: skip
                if ranges:
                    parts.append(f"\n### Perplexity by position, one forward of L={_tokens_label(longest)} tokens\n")
                    header = ["method"] + [f"{_tokens_label(lo)}-{_tokens_label(hi)}" for lo, hi, _ in ranges]
                    table = []
                    for state in _states_in_order(rows):
                        row = cell.get((state, longest))
                        if row and row["ranges"]:
                            values = {(lo, hi): ppl for lo, hi, ppl in row["ranges"]}
                            cells = [_format_ppl(values.get((lo, hi))) for lo, hi, _ in ranges]
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
            header = ["method"] + [f"L={_tokens_label(length)}" for length in lengths]
            table = []
            for state in _states_in_order(rows):
                cells = []
                for length in lengths:
                    row = cell.get((state, length))
                    cells.append(f"{row['accuracy']:.0%} ({row['correct']}/{row['trials']})" if row else "")
                table.append([state_label(*state)] + cells)
            parts.append(_table(header, table) + "\n")
    return "\n".join(parts)


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
    header = ["method", "scale"] + [f"ppl {_tokens_label(length)}" for length in ppl_lengths]
    header += [f"ppl beyond {_tokens_label(native)} at {_tokens_label(length)}" for length in beyond_lengths]
    header += [f"{task} {_tokens_label(length)}" for length in retrieval_lengths]
    table = []
    for state in _states_in_order(ppl_rows + retrieval_rows):
        cells = [method_label(state[0], state[2]), "" if state[1] is None else f"{state[1]:g}"]
        cells += [_format_ppl(ppl[(state, length)]["ppl"]) if (state, length) in ppl else "" for length in ppl_lengths]
        cells += [_format_ppl(ppl[(state, length)]["beyond_native_ppl"]) if (state, length) in ppl else ""
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
                    grid[i][j] = row["correct"] / row["trials"]
                    labels[i][j] = f"{row['correct']}/{row['trials']}"
            image = axes.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
            for i in range(len(depths)):
                for j in range(len(lengths)):
                    axes.text(j, i, labels[i][j], ha="center", va="center", fontsize=8)
            axes.set_xticks(range(len(lengths)), [_tokens_label(length) for length in lengths])
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
