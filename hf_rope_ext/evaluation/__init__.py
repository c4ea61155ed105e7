"""Long-context evaluation: perplexity against length, passkey and needle retrieval, reports.

    from hf_rope_ext.evaluation import EvalPlan, run_evaluation
    plan = EvalPlan(methods=["none", "yarn", "dynamic-yarn"], scales=[2, 4], ppl_lengths=[8192, 16384],
                    retrieval_tasks=["passkey"], retrieval_lengths=[16384])
    run_evaluation(model, tokenizer, plan, "outputs/eval", documents={"book": token_ids})

Definitions: :mod:`.perplexity` (bucket and sliding-window perplexity), :mod:`.retrieval`
(passkey and needle prompts, grading); results-file schema: :mod:`.runner`; reports: :mod:`.report`.
"""

from .perplexity import BucketPerplexity, SlidingPerplexity, bucket_perplexity, sliding_window_perplexity, token_losses
from .report import write_reports
from .retrieval import RetrievalPrompt, RetrievalResult, needle_prompt, passkey_prompt, retrieval_accuracy
from .runner import EvalPlan, EvaluationError, read_results, run_evaluation

__all__ = [
    "BucketPerplexity",
    "EvalPlan",
    "EvaluationError",
    "RetrievalPrompt",
    "RetrievalResult",
    "SlidingPerplexity",
    "bucket_perplexity",
    "needle_prompt",
    "passkey_prompt",
    "read_results",
    "retrieval_accuracy",
    "run_evaluation",
    "sliding_window_perplexity",
    "token_losses",
    "write_reports",
]
