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
from .summary import bucket_token_count, format_ppl, pool_log_ppl, record_state, state_label


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
        settings = DemoSettings(**{**settings.__dict__, "passkey_lengths": (passkey_length,)})
    return settings


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


def _range_ppl(records: Sequence[Mapping[str, Any]], start: int, end: int) -> float | None:
    values = [
        (ppl, bucket_token_count(lo, hi))
        for record in records
        for lo, hi, ppl in record["buckets"]
        if lo >= start and hi <= end
    ]
    return pool_log_ppl(values) if values else None


def table_ranges(native_context: int, length: int) -> list[tuple[int, int]]:
    """``[L0/2, L0)``, then beyond ``L0``: steps of ``L0/4`` up to ``2 L0``, doublings after."""
    edges = [native_context // 2, native_context]
    while edges[-1] < length:
        step = native_context // 4 if edges[-1] < 2 * native_context else edges[-1]
        edges.append(min(edges[-1] + step, length))
    return list(zip(edges[:-1], edges[1:]))


def demo_table(records: Sequence[Mapping[str, Any]], settings: DemoSettings, native_context: int) -> str:
    """Markdown table: unpatched against patched."""
    patched = (settings.method, settings.scale, recorded_steps(settings.method, demo_plan(settings).steps_per_doubling))
    states = [(NONE_METHOD, None, None), patched]
    by_state = {state: [r for r in records if record_state(r) == state] for state in states}
    rows = []
    for start, end in table_ranges(native_context, settings.ppl_length):
        cells = []
        for state in states:
            mine = [r for r in by_state[state]
                    if r["kind"] == "perplexity" and r["context_length"] == settings.ppl_length]  # fmt: skip
            value = _range_ppl(mine, start, end)
            cells.append(format_ppl(value))
        rows.append([f"perplexity of tokens {start}-{end} (one forward of {settings.ppl_length})"] + cells)
    depths = ", ".join(f"{depth:g}" for depth in settings.depths)
    for length in settings.passkey_lengths:
        cells = []
        for state in states:
            mine = [r for r in by_state[state] if r["kind"] == "retrieval" and r["length"] == length]
            cells.append(f"{sum(r['correct'] for r in mine)}/{sum(r['trials'] for r in mine)}" if mine else "")
        rows.append([f"passkey retrieved at {length} tokens (depths {depths})"] + cells)
    header = ["", "unpatched", f"patched: {state_label(*states[1])}"]
    lines = ["| " + " | ".join(header) + " |", "|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
