"""Long-context evaluation: perplexity against length, passkey and needle retrieval, reports.

    from hf_rope_ext.evaluation import EvalPlan, run_evaluation
    plan = EvalPlan(methods=["none", "yarn", "dynamic-yarn"], scales=[2, 4], ppl_lengths=[8192, 16384],
                    retrieval_tasks=["passkey"], retrieval_lengths=[16384])
    run_evaluation(model, tokenizer, plan, "outputs/eval", documents={"book": token_ids})

Modules, from the bottom up: :mod:`.records` (the ``results.jsonl`` schema, its reader and the
resumable store) and :mod:`.summary` (pooling, labels, number formats), both free of torch;
:mod:`.perplexity` (bucket and sliding-window perplexity), :mod:`.retrieval` (passkey and needle
prompts, grading); :mod:`.plan` (what to run, checked), :mod:`.documents` (the texts);
:mod:`.report` (tables and plots); :mod:`.runner` (the loop).
"""

from __future__ import annotations

import importlib
from typing import Any

# Names are imported on first use, so that reading results (model cards read .records and
# .summary) does not load torch and the models' code through this package.
_EXPORTS = {
    "BucketPerplexity": "perplexity",
    "SlidingPerplexity": "perplexity",
    "bucket_perplexity": "perplexity",
    "sliding_window_perplexity": "perplexity",
    "token_losses": "perplexity",
    "write_reports": "report",
    "RetrievalPrompt": "retrieval",
    "RetrievalResult": "retrieval",
    "needle_prompt": "retrieval",
    "passkey_prompt": "retrieval",
    "retrieval_accuracy": "retrieval",
    "EvalPlan": "plan",
    "EvaluationError": "records",
    "read_records": "records",
    "read_results": "records",
    "run_evaluation": "runner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
