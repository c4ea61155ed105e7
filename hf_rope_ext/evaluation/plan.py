"""What an evaluation run measures (:class:`EvalPlan`), and the checks that refuse a bad plan
before any model is loaded."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from ..methods import list_methods
from ..patching import DEFAULT_STEPS_PER_DOUBLING
from ..spec import PatchSpec, extended_length
from .perplexity import DEFAULT_CHUNK_SIZE
from .records import NONE_METHOD, EvaluationError
from .retrieval import TASKS

logger = logging.getLogger(__name__)

__all__ = ["EvalPlan", "MAX_REACH", "PPL_MODES"]

PPL_MODES = ("buckets", "sliding")


# Lengths up to this many times the largest extended context are measured (extrapolation);
# longer ones are refused as typos.
MAX_REACH = 8


@dataclass
class EvalPlan:
    """What to evaluate. Every list may be empty except ``methods``.

    Attributes:
        methods: registered method names, or ``"none"`` for the unpatched model.
        scales: scales applied to every method except ``"none"``.
        ppl_lengths: context lengths ``L`` for perplexity (one case per length and document).
        ppl_modes: ``"buckets"`` (one forward of ``L`` tokens) and/or ``"sliding"``.
        bucket_size: width of the position buckets (default: a quarter of the native context).
        stride: ``S`` of sliding-window perplexity.
        sliding_tokens: ``N``, document tokens scored by sliding windows (default: the longest
            of ``ppl_lengths``, so the longest window is a single forward).
        retrieval_tasks: ``"passkey"`` and/or ``"needle"``.
        retrieval_lengths: total tokens of prompt plus answer.
        depths: where the asked-for key goes, as a fraction of the filler.
        trials: prompts per (length, depth), with seeded random keys.
        needle_count: keys in a needle prompt (one asked for, the rest distractors).
        max_new_tokens: greedy decoding budget for an answer.
        seed: seed of the keys; the same prompts for every method.
        chunk_size: positions per LM-head call in the loss.
        reuse_identical: copy a case's numbers from a finished case with the same rotary
            frequencies instead of computing them again.
        steps_per_doubling: passed to :func:`hf_rope_ext.patch_model` for length-dependent
            methods (None: the exact length); recorded with every case.
    """

    methods: list[str]
    scales: list[float] = field(default_factory=list)
    ppl_lengths: list[int] = field(default_factory=list)
    ppl_modes: list[str] = field(default_factory=lambda: ["buckets"])
    bucket_size: int | None = None
    stride: int = 256
    sliding_tokens: int | None = None
    retrieval_tasks: list[str] = field(default_factory=list)
    retrieval_lengths: list[int] = field(default_factory=list)
    depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    trials: int = 3
    needle_count: int = 4
    max_new_tokens: int = 8
    seed: int = 0
    chunk_size: int = DEFAULT_CHUNK_SIZE
    reuse_identical: bool = True
    steps_per_doubling: int | None = DEFAULT_STEPS_PER_DOUBLING

    def configurations(self) -> list[tuple[str, float | None]]:
        """``(method, scale)`` pairs in run order: ``none`` first (scale ``None``)."""
        pairs: list[tuple[str, float | None]] = []
        if NONE_METHOD in self.methods:
            pairs.append((NONE_METHOD, None))
        for method in self.methods:
            if method != NONE_METHOD:
                pairs += [(method, float(scale)) for scale in self.scales]
        return pairs

    def validate(self, native_context: int | None) -> None:
        """Raise :class:`EvaluationError` naming the problem and the fix.

        ``native_context`` None skips the one check that needs the model (lengths against its
        native context), so a plan can be checked before the model is loaded.
        """
        if not self.methods:
            raise EvaluationError("No methods given; use e.g. --methods none,yarn,dynamic-yarn.")
        known = list(list_methods())
        # a "+logn" suffix adds log-n attention to any method (see patch_model)
        unknown = [method for method in self.methods if method != NONE_METHOD and method.removesuffix("+logn") not in known]
        if unknown:
            raise EvaluationError(
                f"Unknown method(s) {', '.join(map(repr, unknown))}. Known: {NONE_METHOD} (the unpatched model), "
                f"{', '.join(known)}, each optionally with '+logn'."
            )
        steps = self.steps_per_doubling
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise EvaluationError(
                f"steps_per_doubling must be a positive integer or None (exact length), got {steps!r}."
            )
        # A value listed twice would be computed and counted twice (a cell of 8 prompts for 4 distinct ones).
        for name in ("methods", "scales", "ppl_lengths", "ppl_modes", "retrieval_tasks", "retrieval_lengths",
                     "depths"):  # fmt: skip
            values = getattr(self, name)
            twice = sorted({str(value) for value in values if values.count(value) > 1})
            if twice:
                raise EvaluationError(f"{', '.join(twice)} is listed twice in {name} {values}; list each value once.")
        scaled = [method for method in self.methods if method != NONE_METHOD]
        if scaled and not self.scales:
            raise EvaluationError(f"Methods {scaled} need at least one scale; use e.g. --scales 2,4.")
        for scale in self.scales:
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 1:
                raise EvaluationError(f"Scales must be numbers > 1 (times the native context), got {scale!r}.")
        for name in ("ppl_lengths", "retrieval_lengths"):
            for length in getattr(self, name):
                if isinstance(length, bool) or not isinstance(length, int) or length < 2:  # a loss needs 2 tokens
                    option = "--" + name.replace("_", "-")  # named for both callers: the API and the command line
                    raise EvaluationError(f"{name} ({option}) must be integer token counts of at least 2, got "
                                          f"{length!r}.")  # fmt: skip
        unknown_modes = [mode for mode in self.ppl_modes if mode not in PPL_MODES]
        if unknown_modes:
            raise EvaluationError(f"Unknown perplexity mode(s) {unknown_modes}; use {' and/or '.join(PPL_MODES)}.")
        unknown_tasks = [task for task in self.retrieval_tasks if task not in TASKS]
        if unknown_tasks:
            raise EvaluationError(f"Unknown retrieval task(s) {unknown_tasks}; use {' and/or '.join(TASKS)}.")
        if self.retrieval_tasks and not self.retrieval_lengths:
            raise EvaluationError("Retrieval tasks need --retrieval-lengths (e.g. 8192,16384).")
        if self.ppl_lengths and not self.ppl_modes:
            raise EvaluationError("Perplexity lengths were given but no --ppl-modes.")
        if not self.ppl_lengths and not (self.retrieval_tasks and self.retrieval_lengths):
            raise EvaluationError(
                "Nothing to evaluate: give --ppl-lengths and/or --retrieval-tasks with --retrieval-lengths."
            )
        for depth in self.depths:
            if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0.0 <= depth <= 1.0:
                raise EvaluationError(f"Depths are fractions of the prompt between 0 and 1, got {depth!r}.")
        # The prompts of a depth are seeded by its first 6 digits (retrieval.trial_seed): closer depths would
        # be the same prompts, counted twice.
        seeded = [f"{depth:.6g}" for depth in self.depths]
        same = sorted({text for text in seeded if seeded.count(text) > 1})
        if same:
            raise EvaluationError(f"Depths {self.depths} give the same prompts (depth {', '.join(same)} to 6 digits); "
                                  "list depths that differ in their first 6 digits.")  # fmt: skip
        if self.retrieval_tasks and not self.depths:
            raise EvaluationError("Retrieval needs at least one depth (e.g. --depths 0.1,0.5,0.9).")
        for name in ("trials", "max_new_tokens", "stride", "chunk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EvaluationError(f"{name} must be a positive integer, got {value!r}.")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise EvaluationError(f"seed must be an integer, got {self.seed!r}.")
        if isinstance(self.needle_count, bool) or not isinstance(self.needle_count, int):
            raise EvaluationError(f"needle_count must be an integer, got {self.needle_count!r}.")
        if "needle" in self.retrieval_tasks and not 2 <= self.needle_count <= 20:
            raise EvaluationError(f"needle_count must be between 2 and 20, got {self.needle_count}.")
        for name in ("bucket_size", "sliding_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise EvaluationError(f"{name} must be a positive integer number of tokens or None, got {value!r}.")
        if self.sliding_tokens is not None and "sliding" not in self.ppl_modes:
            raise EvaluationError("sliding_tokens (--sliding-tokens) applies to sliding-window perplexity only; "
                                  "add sliding to --ppl-modes, or leave it out.")  # fmt: skip
        if "sliding" in self.ppl_modes and self.ppl_lengths:
            if self.stride > min(self.ppl_lengths):
                raise EvaluationError(
                    f"stride {self.stride} is longer than the shortest window {min(self.ppl_lengths)}."
                )
            if self.sliding_tokens is not None and self.sliding_tokens < max(self.ppl_lengths):
                raise EvaluationError(
                    f"sliding_tokens={self.sliding_tokens} is shorter than the longest window {max(self.ppl_lengths)}; "
                    "the windows must fit in the scored span."
                )
        lengths = self.ppl_lengths + self.retrieval_lengths
        if scaled and lengths and native_context is not None and max(lengths) <= native_context:
            raise EvaluationError(
                f"Every requested length ({', '.join(map(str, sorted(set(lengths))))}) is within the model's own "
                f"context of {native_context} tokens, so the scaling methods are not compared where they matter. "
                f"Add a length above {native_context} (e.g. {2 * native_context})."
            )
        if native_context is not None:
            self._check_configurations(native_context)
        if self.retrieval_tasks:
            shortest = min(self.retrieval_lengths) - self.max_new_tokens
            if shortest < 128:
                raise EvaluationError(
                    f"Retrieval length {min(self.retrieval_lengths)} leaves {shortest} prompt tokens; use at least "
                    f"{128 + self.max_new_tokens}."
                )

    def check_reach(self, native_context: int) -> None:
        """Lengths beyond the largest extended context (native context x the largest scale) measure
        how the patched models extrapolate past it, as papers plot: a warning says so. Beyond
        :data:`MAX_REACH` times that, a length is taken for a typo (10000000), which would run out of
        memory instead of failing here, and refused. For the commands that take lists of lengths
        (``eval``); library callers may measure anything."""
        lengths = self.ppl_lengths + self.retrieval_lengths
        if not self.scales or not lengths:
            return
        reach = max(extended_length(native_context, scale) for scale in self.scales)
        longest = max(lengths)
        if longest > MAX_REACH * reach:
            raise EvaluationError(
                f"Length {longest} is beyond {MAX_REACH} x {reach} tokens ({reach}: the model's native context of "
                f"{native_context} times the largest scale {max(self.scales):g}); a typo? Use lengths up to "
                f"{MAX_REACH * reach}, or a larger --scales."
            )
        if longest > reach:
            logger.warning(
                "Length %d is beyond %d tokens, the model's native context times the largest scale %g: the patched "
                "models are measured past the context they were extended to.", longest, reach, max(self.scales),
            )

    def _check_configurations(self, native_context: int) -> None:
        """Build the patch of every (method, scale) without a model, so that a pair the patch refuses
        (a method that needs parameters eval cannot pass, a scale under a whole token) fails now,
        not after the configurations before it have run."""
        for method, scale in self.configurations():
            if method == NONE_METHOD:
                continue
            try:
                PatchSpec.for_configuration(method, scale, original_max_length=native_context,
                                            steps_per_doubling=self.steps_per_doubling)  # fmt: skip
            except (TypeError, ValueError) as error:
                raise EvaluationError(f"{method} at scale {scale:g}: {error}") from None

    def required_document_tokens(self) -> int:
        """How many tokens every document needs."""
        needed = max(self.ppl_lengths, default=0) if "buckets" in self.ppl_modes else 0
        if "sliding" in self.ppl_modes and self.ppl_lengths:
            needed = max(needed, self.sliding_tokens or max(self.ppl_lengths))
        return needed
