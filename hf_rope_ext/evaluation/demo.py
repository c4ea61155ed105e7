"""The demo: perplexity beyond the native context and a passkey, before and after ``patch_model``.

On CPU (SmolLM2, native context 8192) it runs, for the unpatched and the patched model (scale 2):
one forward over the first ``1.5 * native`` = 12288 tokens of a document (perplexity of positions
4k-8k, 8k-10k and 10k-12k) and passkey retrieval at 12288 tokens with the key at depths 0.25 and
0.75: six 12k-token forwards in all, about 8 minutes on 2 CPU cores. (SmolLM2 degrades only
gradually past 8192 tokens: on a novel its perplexity at 8k-9k is still near the in-context one,
which is why the perplexity forward is 12k tokens long.) On a GPU the lengths grow to 4x the
native context: perplexity over 32k tokens, passkey at 16k and 32k, five depths, two keys each,
scale 4.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..patching import DEFAULT_METHOD
from .plan import EvalPlan
from .records import NONE_METHOD, EvaluationError, recorded_steps
from .summary import (
    bucket_token_count,
    format_ppl,
    perplexity_rows,
    pool_log_ppl,
    record_state,
    retrieval_rows,
    state_label,
)


@dataclass(frozen=True)
class DemoSettings:
    method: str
    scale: float
    ppl_length: int
    passkey_lengths: tuple[int, ...]
    depths: tuple[float, ...]
    trials: int


def demo_settings(native_context: int, on_gpu: bool, *, method: str = DEFAULT_METHOD, scale: float | None = None,
                  ppl_length: int | None = None, passkey_length: int | None = None) -> DemoSettings:  # fmt: skip
    """Lengths for the hardware: short on CPU (minutes), up to 4x the native context on GPU."""
    if method == NONE_METHOD:
        raise EvaluationError(
            f"The demo always runs the unpatched model ({NONE_METHOD}) as its baseline; choose a method to compare "
            "with it, e.g. --method yarn (default: the package's default)."
        )
    if scale is None:  # not `scale or ...`: a given 0 must reach the plan's check and be refused
        scale = 4.0 if on_gpu else 2.0
    if on_gpu:
        settings = DemoSettings(method, scale, 4 * native_context, (2 * native_context, 4 * native_context),
                                (0.1, 0.3, 0.5, 0.7, 0.9), 2)  # fmt: skip
    else:
        length = native_context + native_context // 2
        settings = DemoSettings(method, scale, length, (length,), (0.25, 0.75), 1)
    if ppl_length is not None:
        if ppl_length <= native_context:  # the table shows positions beyond the native context only
            raise EvaluationError(
                f"--ppl-length {ppl_length} is within the model's native context of {native_context} tokens; the demo "
                f"shows perplexity beyond it. Use more than {native_context} (e.g. {native_context * 3 // 2})."
            )
        settings = DemoSettings(**{**settings.__dict__, "ppl_length": ppl_length})
    if passkey_length is not None:
        if passkey_length <= native_context:  # as for --ppl-length: the demo is about lengths beyond it
            raise EvaluationError(
                f"--passkey-length {passkey_length} is within the model's native context of {native_context} tokens; "
                f"the demo shows retrieval beyond it. Use more than {native_context} (e.g. {native_context * 3 // 2})."
            )
        settings = DemoSettings(**{**settings.__dict__, "passkey_lengths": (passkey_length,)})
    return settings


def check_one_document(text_files: Sequence[str], dataset: str | None, num_documents: int | None) -> None:
    """The demo runs one forward over one document: refuse more (before they are read and tokenized)."""
    given = []
    if text_files:
        given.append(f"--text-files {' '.join(map(str, text_files))}")
    if dataset:
        given.append(f"--dataset {dataset}" + (f" --num-documents {num_documents}" if num_documents else ""))
    count = len(text_files) + ((num_documents or 1) if dataset else 0)
    if count > 1:
        raise EvaluationError(
            f"The demo reads one document, got {count} ({', '.join(given)}); pass one --text-files FILE or --dataset "
            "with --num-documents 1 (hf-rope-ext eval pools several documents)."
        )


def demo_plan(settings: DemoSettings) -> EvalPlan:
    return EvalPlan(
        methods=[NONE_METHOD, settings.method],
        scales=[settings.scale],
        ppl_lengths=[settings.ppl_length],
        ppl_modes=["buckets"],
        retrieval_tasks=["passkey"],
        retrieval_lengths=list(settings.passkey_lengths),
        depths=list(settings.depths),
        trials=settings.trials,
    )


def _range_ppl(buckets: Sequence[Sequence[float]], start: int, end: int) -> float | None:
    """Pooled by tokens over the buckets inside ``[start, end)``; None where there are none."""
    values = [(ppl, bucket_token_count(lo, hi)) for lo, hi, ppl in buckets if lo >= start and hi <= end]
    return pool_log_ppl(values) if values else None


def table_ranges(native_context: int, length: int, bucket_edges: Sequence[int] = ()) -> list[tuple[int, int]]:
    """``[L0/2, L0)``, then beyond ``L0``: steps of ``L0/4`` up to ``2 L0``, doublings after.

    Each edge is moved to the nearest of ``bucket_edges`` (the starts and ends of the stored
    buckets, which split at ``L0``), so that every row pools whole buckets and is labelled with
    the positions they hold (with ``L0`` not a multiple of 4, ``L0/2`` falls inside a bucket).
    """
    edges = [native_context // 2, native_context]
    while edges[-1] < length:
        step = max(native_context // 4, 1) if edges[-1] < 2 * native_context else edges[-1]
        edges.append(min(edges[-1] + step, length))
    if bucket_edges:
        edges = sorted({min(bucket_edges, key=lambda edge: (abs(edge - wanted), edge)) for wanted in edges})
    return list(zip(edges[:-1], edges[1:]))


def demo_table(records: Sequence[Mapping[str, Any]], settings: DemoSettings, native_context: int) -> str:
    """Markdown table: unpatched against patched.

    Records are pooled as results.md pools them (:mod:`.summary`): a case stored twice (a
    results.jsonl written twice over) counts once; a NaN or infinite perplexity reads ``nan`` /
    ``inf``, and an empty cell means not run.
    """
    patched = (settings.method, settings.scale, recorded_steps(settings.method, demo_plan(settings).steps_per_doubling))
    states = [(NONE_METHOD, None, None), patched]
    buckets: dict[tuple, list] = {}
    # The rows pool buckets only for records that name their native context (older ones may not).
    named = [{**record, "native_context": record.get("native_context") or native_context} for record in records]
    for row in perplexity_rows(named):
        if row["mode"] == "buckets" and row["context_length"] == settings.ppl_length and row.get("buckets"):
            buckets.setdefault(record_state(row), []).extend(row["buckets"])
    edges = sorted({edge for held in buckets.values() for start, end, _ in held for edge in (start, end)})
    rows = []
    for start, end in table_ranges(native_context, settings.ppl_length, edges):
        cells = []
        for state in states:
            value = _range_ppl(buckets[state], start, end) if state in buckets else None
            cells.append("" if value is None else format_ppl(value, missing="nan"))
        rows.append([f"perplexity of tokens {start}-{end} (one forward of {settings.ppl_length})"] + cells)
    depths = ", ".join(f"{depth:g}" for depth in settings.depths)
    passkeys = [row for row in retrieval_rows(records) if row["task"] == "passkey"]
    for length in settings.passkey_lengths:
        cells = []
        for state in states:
            mine = [row for row in passkeys if record_state(row) == state and row["length"] == length]
            counted = [row for row in mine if row["trials"] is not None]  # None: no counts stored (by hand)
            cells.append(f"{sum(row['correct'] for row in counted)}/{sum(row['trials'] for row in counted)}"
                         if counted else "")  # fmt: skip
        rows.append([f"passkey retrieved at {length} tokens (depths {depths})"] + cells)
    header = ["", "unpatched", f"patched: {state_label(*states[1])}"]
    lines = ["| " + " | ".join(header) + " |", "|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
