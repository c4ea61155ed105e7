"""Pooling records of ``results.jsonl`` into rows, and the labels and number formats of every table.

Used alike by the evaluation reports (:mod:`.report`, :mod:`.demo`) and by model cards
(:mod:`hf_rope_ext.model_card`), so a number reads the same wherever it is shown. Like
:mod:`.records`, this module imports neither torch nor the rest of the evaluation package.

Documents are pooled by tokens: the perplexity over several documents is
``exp(sum of token losses / number of scored tokens)``; retrieval accuracy pools the trials of
all depths. :func:`summarize` returns (and ``summary.json`` holds)::

    {"models": [...], "native_context": 8192,    # a sorted list where the models' native contexts differ
     "perplexity": [{"mode", "method", "scale", "steps_per_doubling", "model", "dtype", "context_length", "stride",
                     "eval_tokens", "bucket_size", "native_context",  # of this row's model
                     "documents": [...], "ppl", "nll", "tokens",
                     "ranges": [[start, end, ppl], ...]  # buckets pooled to 0, L0/4, L0/2, L0, 2 L0, ...
                     "beyond_native_ppl": ppl of positions [L0, L), or null (L <= L0, or a bucket spans L0)}, ...],
     "retrieval": [{"task", "method", "scale", "steps_per_doubling", "model", "dtype", "length", "trials", "correct",
                    "accuracy", "by_depth": {"0.1": accuracy, ...}}, ...]}

Each document's record counts once per row, and each retrieval prompt once: of records of one
depth (whose prompts come from one seeded generator), the one with the most trials is kept.

In ``summary.json`` a NaN or infinite number (a broken model, an fp16 overflow) is written as
``null`` (JSON has no such numbers); ``results.jsonl`` and the tables keep ``nan`` / ``inf``.

A retrieval group whose records lack ``correct`` and ``trials`` (written by hand) gets the mean of
their ``accuracy`` and ``correct``/``trials`` None.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .records import EXACT_STEPS, NONE_METHOD, is_length_dependent

logger = logging.getLogger(__name__)

__all__ = [
    "format_accuracy",
    "format_ppl",
    "format_scale",
    "format_tokens",
    "method_label",
    "perplexity_rows",
    "pool_log_ppl",
    "retrieval_rows",
    "state_label",
    "summarize",
    "wilson_interval",
]


def safe_exp(nll: float) -> float:
    """``exp(nll)``, or infinity where it would overflow (a broken model's perplexity); NaN stays NaN."""
    if math.isnan(nll):
        return float("nan")
    return math.exp(nll) if nll < 709 else float("inf")


def bucket_token_count(start: int, end: int) -> int:
    # Position 0 is never predicted (see perplexity.py).
    return max(end - max(start, 1), 0)


def pool_log_ppl(pairs: Iterable[tuple[float, int]]) -> float:
    """exp of the token-weighted mean of log ppl values."""
    total = count = 0.0
    for ppl, tokens in pairs:
        if tokens:
            if math.isnan(ppl):  # a NaN loss: the pooled value is unknown, not infinite
                return float("nan")
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


# ----------------------------------------------------------------------------------------------
# Labels and number formats
# ----------------------------------------------------------------------------------------------


def record_state(record: Mapping[str, Any]) -> tuple[str, float | None, int | str | None]:
    return record["method"], record.get("scale"), record.get("steps_per_doubling")


def method_label(method: str, steps: int | str | None = None) -> str:
    """The method name, with its frequency steps where they are not the package default."""
    from ..patching import DEFAULT_STEPS_PER_DOUBLING  # patching imports torch; only the default is needed

    if steps is None:
        dynamic = method != NONE_METHOD and _known_length_dependent(method)
        return f"{method} (steps unrecorded)" if dynamic else method
    default = EXACT_STEPS if DEFAULT_STEPS_PER_DOUBLING is None else DEFAULT_STEPS_PER_DOUBLING
    if steps == default:
        return method
    return f"{method} (exact length)" if steps == EXACT_STEPS else f"{method} ({steps} steps/doubling)"


def _known_length_dependent(method: str) -> bool:
    try:
        return is_length_dependent(method)
    except (TypeError, ValueError):  # not registered in this process
        return False


def state_label(method: str, scale: float | None, steps: int | str | None = None) -> str:
    label = method_label(method, steps)
    return label if scale is None else f"{label} x{format_scale(scale)}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def format_ppl(value: Any, missing: str = "") -> str:
    """A perplexity: two decimals, none from 1000 on; ``missing`` for None or NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return missing
    if not _is_number(value):
        return str(value)
    return f"{value:.2f}" if value < 1000 else f"{value:.0f}"


def format_scale(value: Any, missing: str = "") -> str:
    """A scale: ``4``, ``2.5``; ``missing`` for None (the unpatched model)."""
    if value is None:
        return missing
    return f"{value:g}" if _is_number(value) else str(value)


def format_tokens(value: Any, missing: str = "") -> str:
    """A token count or position: ``16k`` for multiples of 1024, else the number."""
    if value is None:
        return missing
    if not _is_number(value):
        return str(value)
    if float(value).is_integer():
        count = int(value)
        return f"{count // 1024}k" if count >= 1024 and count % 1024 == 0 else str(count)
    return f"{value:g}"


def format_accuracy(value: Any, missing: str = "") -> str:
    """A fraction as a whole percentage: ``70%``."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or not _is_number(value):
        return missing
    return f"{value:.0%}"


def wilson_interval(correct: int, trials: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The Wilson score interval of an accuracy ``correct / trials`` (95% by default).

    Wilson (1927); recommended for small samples by Brown, Cai and DasGupta (2001): with
    ``p = correct / trials``, ``n = trials``,
    ``(p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n)``. Retrieval is scored on a few
    prompts per cell, where 4/6 is as consistent with 30% as with 90%.
    """
    if trials <= 0 or not 0 <= correct <= trials:
        raise ValueError(f"wilson_interval needs 0 <= correct <= trials and trials > 0, got {correct}/{trials}.")
    p, n = correct / trials, trials
    denominator = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, center - half), min(1.0, center + half)


# ----------------------------------------------------------------------------------------------
# The summary
# ----------------------------------------------------------------------------------------------

PERPLEXITY_GROUP = ("mode", "method", "scale", "steps_per_doubling", "model", "dtype", "context_length", "stride",
                    "eval_tokens", "bucket_size")  # fmt: skip
RETRIEVAL_GROUP = ("task", "method", "scale", "steps_per_doubling", "model", "dtype", "length", "seed", "needle_count",
                   "max_new_tokens")  # fmt: skip


def summarize(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Pool per-document and per-depth records (see the module docstring)."""
    natives = {record.get("native_context") for record in records if record.get("native_context")}
    return {
        "models": sorted({record.get("model") for record in records if record.get("model")}),
        "native_context": min(natives) if len(natives) == 1 else sorted(natives) or None,
        "cases": len(records),
        "perplexity": perplexity_rows(records),
        "retrieval": retrieval_rows(records),
    }


def perplexity_rows(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The ``perplexity`` rows of :func:`summarize`: documents pooled by tokens."""
    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    for record in records:
        if record.get("kind") == "perplexity":
            groups.setdefault(tuple(record.get(name) for name in PERPLEXITY_GROUP), []).append(record)
    return [_perplexity_row(key, parts) for key, parts in groups.items()]


def retrieval_rows(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The ``retrieval`` rows of :func:`summarize`: trials pooled over depths."""
    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    for record in records:
        if record.get("kind") == "retrieval":
            groups.setdefault(tuple(record.get(name) for name in RETRIEVAL_GROUP), []).append(record)
    return [_retrieval_row(key, parts) for key, parts in groups.items()]


def _distinct(parts: Sequence[Mapping[str, Any]], identity, what: str) -> list[Mapping[str, Any]]:
    """``parts`` with one record per ``identity(part)``: the one with the most ``trials`` (the
    prompts of a run with fewer trials are the first ones of a run with more, see
    ``retrieval.trial_seed``), else the first. Two runs into one folder, or a rerun with more
    trials, must not count the same tokens or prompts twice."""
    kept: dict[Any, Mapping[str, Any]] = {}
    for part in parts:
        key = identity(part)
        if key in kept:
            logger.warning("results.jsonl holds %s twice (%s); it is counted once.", what, key)
            if _trials(part) <= _trials(kept[key]):
                continue
        kept[key] = part
    return list(kept.values())


def _trials(part: Mapping[str, Any]) -> int:
    return part["trials"] if _is_number(part.get("trials")) else 0


def _perplexity_row(key: tuple, parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    row = dict(zip(PERPLEXITY_GROUP, key))
    # A hand-written record (model cards) that names no document is never taken for another one.
    parts = _distinct(parts, lambda part: (part["document"], part.get("document_sha256")) if part.get("document")
                      else id(part),
                      f"the {row['mode']} perplexity of {state_label(*record_state(row))} at L={row['context_length']} "
                      "of one document")  # fmt: skip
    tokens = sum(part["tokens"] for part in parts)
    nll = sum(part["nll"] * part["tokens"] for part in parts) / max(tokens, 1)
    native, length = parts[0].get("native_context"), row["context_length"]
    row.update({"native_context": native, "documents": sorted({str(part.get("document")) for part in parts}),
                "ppl": safe_exp(nll), "nll": nll, "tokens": tokens, "ranges": None,
                "beyond_native_ppl": None})  # fmt: skip
    if row["mode"] == "buckets" and native:
        buckets: dict[tuple[int, int], list[tuple[float, int]]] = {}
        for part in parts:
            for start, end, ppl in part["buckets"]:
                buckets.setdefault((start, end), []).append((ppl, bucket_token_count(start, end)))
        merged = [[start, end, pool_log_ppl(values)] for (start, end), values in sorted(buckets.items())]
        row["buckets"] = merged
        row["ranges"] = pooled_ranges(merged, range_edges(native, length))
        if length > native:
            row["beyond_native_ppl"] = _beyond_native_ppl(parts, native)
    return row


def _beyond_native_ppl(parts: Sequence[Mapping[str, Any]], native_context: int) -> float | None:
    """The perplexity of exactly the positions ``[native_context, L)`` of buckets-mode records,
    pooled by tokens; None where a record's bucket spans ``native_context`` (its positions on
    either side cannot be told apart; the runner splits its buckets there, so only records of
    earlier versions have such a bucket)."""
    pairs = []
    for part in parts:
        for start, end, ppl in part["buckets"]:
            if start < native_context < end:
                return None
            if start >= native_context:
                pairs.append((ppl, bucket_token_count(start, end)))
    return pool_log_ppl(pairs) if pairs else None


def _counted(part: Mapping[str, Any]) -> bool:
    return isinstance(part.get("correct"), int) and isinstance(part.get("trials"), int)


def _retrieval_row(key: tuple, parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    group = dict(zip(RETRIEVAL_GROUP, key))
    del group["max_new_tokens"]  # part of the group, not shown
    # The prompts of a depth are drawn from a generator seeded by the depth as retrieval.trial_seed writes it.
    parts = _distinct(parts, lambda part: f"depth {part['depth']:.6g}" if _is_number(part.get("depth")) else id(part),
                      f"{group['task']} prompts of {state_label(*record_state(group))} at {group['length']} tokens")
    counted = [part for part in parts if _counted(part)]
    trials = sum(part["trials"] for part in counted) if counted else None
    correct = sum(part["correct"] for part in counted) if counted else None
    if trials:
        accuracy = correct / trials
    else:
        scores = [float(part["accuracy"]) for part in parts if _is_number(part.get("accuracy"))]
        accuracy = sum(scores) / len(scores) if scores else float("nan")
    by_depth = {}
    for part in sorted((part for part in parts if _is_number(part.get("depth"))), key=lambda part: part["depth"]):
        if _counted(part):
            by_depth[f"{part['depth']:g}"] = part["correct"] / part["trials"] if part["trials"] else float("nan")
        elif _is_number(part.get("accuracy")):
            by_depth[f"{part['depth']:g}"] = float(part["accuracy"])
    return {**group, "trials": trials, "correct": correct, "accuracy": accuracy, "by_depth": by_depth}
