"""The README results table: none / linear / ntk / dynamic / yarn / dynamic-yarn / the default on SmolLM2.

Perplexity of the first L tokens of a long document (one forward per length) at 4k / 8k / 16k /
32k tokens, perplexity of the positions beyond the native context (8k), and passkey retrieval at
8k / 16k / 32k tokens (key at depths 0.1 / 0.5 / 0.9), at scales 2 and 4. Then checks the goals:
the default method against the best of the other methods beyond the native context at 2x (16k,
scale 2) and 4x (32k, scale 4), and every method's perplexity inside the native context (4k, 8k)
against the unpatched model (goal: within 0.5%).

Cases whose rotary frequencies equal those of a finished case are not computed twice (the
length-dependent methods inside the native context are the unpatched model; dynamic-yarn's
frequencies depend on the length only, not on the configured scale).

Full run (about 4-5 hours on an idle 2-core CPU, more when it is shared; most of it is the 32k
forwards: one takes about 4-6 minutes; resumable: rerun the same command after an interruption)::

    python examples/run_results_table.py --text-files ../shared/data/books/pg84.txt \\
        --output-dir outputs/results_table

A quick slice (4-5 minutes on an idle 2-core CPU)::

    python examples/run_results_table.py --text-files ../shared/data/books/pg84.txt \\
        --output-dir outputs/results_table_slice_final --methods none,yarn,dynamic-yarn --scales 2 \\
        --ppl-lengths 4096,8192,12288 --retrieval-lengths ""

Note: at exactly 2x and 4x the native context, dynamic-yarn uses the frequencies of yarn at
scale 2 and 4 (its scale is length / native context), so those cells are equal by construction;
lengths in between (e.g. ``--ppl-lengths 4096,8192,12288,16384,24576,32768``) show where they differ.

Prints the table in markdown and writes every report of ``hf-rope-ext eval`` under ``--output-dir``.
The underscore spellings of earlier versions (``--text_file``, ``--ppl_lengths``, ...) still parse.
"""

from __future__ import annotations

import argparse
import logging
import math

from hf_rope_ext import DEFAULT_METHOD
from hf_rope_ext.cli import one_line
from hf_rope_ext.evaluation import EvalPlan, run_evaluation
from hf_rope_ext.evaluation.cli import _native_context, float_list, int_list, load_for_evaluation, name_list
from hf_rope_ext.evaluation.report import comparison_table, state_label, summarize
from hf_rope_ext.evaluation.documents import documents_from_files
from hf_rope_ext.evaluation.records import check_output_dir, parse_steps_per_doubling
from hf_rope_ext.arguments import (
    add_attn_implementation_argument,
    add_device_arguments,
    add_dtype_argument,
    add_model_argument,
    add_option,
    add_output_dir_argument,
    add_text_files_argument,
    argument_parser,
    model_label,
)
from hf_rope_ext.patching import DEFAULT_STEPS_PER_DOUBLING


def _steps(text: str) -> int | None:
    try:
        return parse_steps_per_doubling(text)
    except ValueError as error:  # argparse drops a ValueError's message, not an ArgumentTypeError's
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argument_parser(__doc__.split("\n\n")[0])
    add_text_files_argument(parser, required=True, help="one long document (over 32k tokens)")
    add_output_dir_argument(parser, help="the reports of hf-rope-ext eval go here")
    add_model_argument(parser)
    # the list parsers of hf-rope-ext eval: the same spellings (4k) and one-line errors
    add_option(parser, "--methods", type=name_list,
               default=name_list(f"none,linear,ntk,dynamic,yarn,dynamic-yarn,{DEFAULT_METHOD}"))
    add_option(parser, "--scales", type=float_list, default=[2.0, 4.0])
    add_option(parser, "--ppl-lengths", type=int_list, default=[4096, 8192, 16384, 32768])
    add_option(parser, "--retrieval-lengths", type=int_list, default=[8192, 16384, 32768])
    add_option(parser, "--depths", type=float_list, default=[0.1, 0.5, 0.9])
    add_option(parser, "--trials", type=int, default=1, help="passkeys per length and depth")
    add_option(parser, "--seed", type=int, default=0)
    add_option(parser, "--steps-per-doubling", type=_steps, default=DEFAULT_STEPS_PER_DOUBLING,
               help="frequency steps of the length-dependent methods, or 'exact' (default: the package's)")
    add_device_arguments(parser)
    add_dtype_argument(parser)
    add_attn_implementation_argument(parser, choices=("sdpa", "eager", "flash_attention_2"))
    return parser


def parse_args(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    if len(args.text_files) != 1:
        parser.error(f"give one document with --text-files, got {len(args.text_files)}")
    (args.text_file,) = args.text_files
    return args


def _comparable(value) -> bool:
    return value is not None and math.isfinite(value)


def goal_checks(summary: dict, native: int) -> list[str]:
    """Sentences comparing the default method with the others, from the pooled results."""
    rows = {(row["method"], row["scale"], row["context_length"]): row
            for row in summary["perplexity"] if row["mode"] == "buckets"}  # fmt: skip
    lines = []
    for scale, length in ((2.0, 2 * native), (4.0, 4 * native)):
        ours = rows.get((DEFAULT_METHOD, scale, length))
        # None: a record of an earlier version whose bucket spans the native context; NaN/inf: a broken
        # forward. Neither is a number to compare (min() would keep a NaN that comes first).
        others = {method: row["beyond_native_ppl"] for (method, s, l), row in rows.items()
                  if s == scale and l == length and method != DEFAULT_METHOD and _comparable(row["beyond_native_ppl"])}
        if ours is None or not _comparable(ours["beyond_native_ppl"]) or not others:
            continue
        best = min(others, key=others.get)
        if ours["beyond_native_ppl"] == others[best]:
            # e.g. dynamic-yarn at exactly s * native tokens has the frequencies of yarn at scale s
            verdict = "equals"
        else:
            verdict = "beats" if ours["beyond_native_ppl"] < others[best] else "does NOT beat"
        lines.append(f"At {length} tokens, scale {scale:g}: {DEFAULT_METHOD} {ours['beyond_native_ppl']:.2f} beyond "
                     f"{native} {verdict} the best other method, {best} {others[best]:.2f}.")  # fmt: skip
    for length in sorted({key[2] for key in rows if key[2] <= native}):
        baseline = rows.get(("none", None, length))
        if baseline is None:
            continue
        for (method, scale, l), row in sorted(rows.items(), key=lambda item: (item[0][0], item[0][1] or 0)):
            if l == length and method != "none":
                change = row["ppl"] / baseline["ppl"] - 1
                mark = "within" if abs(change) <= 0.005 else "OUTSIDE"
                label = state_label(method, scale, row["steps_per_doubling"])
                lines.append(f"At {length} tokens: {label} {row['ppl']:.3f} vs unpatched "
                             f"{baseline['ppl']:.3f} ({change:+.2%}, {mark} 0.5%).")  # fmt: skip
    return lines


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parse_args(parser=parser)
    try:
        run(args)
    except (ValueError, OSError, TypeError) as error:  # bad input (lengths, a short text, no model): one line
        parser.error(one_line(error))


def run(args: argparse.Namespace) -> None:
    plan = EvalPlan(
        methods=args.methods,
        scales=args.scales,
        ppl_lengths=args.ppl_lengths,
        ppl_modes=["buckets"],
        retrieval_tasks=["passkey"] if args.retrieval_lengths else [],
        retrieval_lengths=args.retrieval_lengths,
        depths=args.depths,
        trials=args.trials,
        seed=args.seed,
        steps_per_doubling=args.steps_per_doubling,
    )
    plan.validate(None)
    if not args.text_file.is_file():
        raise FileNotFoundError(f"Text file not found: {args.text_file}. Pass an existing file with --text-files.")
    check_output_dir(args.output_dir)
    native = _native_context(args.model)
    plan.validate(native)  # every check that needs the model's context, before it loads
    plan.check_reach(native)
    model, tokenizer = load_for_evaluation(args.model, dtype=args.dtype, device=args.device,
                                           attn_implementation=args.attn_implementation)  # fmt: skip
    documents = documents_from_files(tokenizer, [args.text_file])
    name = model_label(args.model)
    records = run_evaluation(model, tokenizer, plan, args.output_dir, documents=documents, model_name=name,
                             dtype=args.dtype, native_context=native)  # fmt: skip
    # The records of this run's cases only: the folder may also hold results of other models, dtypes, frequency
    # steps and documents, which pooled in would be shown as this document's numbers.
    summary = summarize(records)
    summary["native_context"] = native  # of this model, also in a folder shared with others
    depths = ",".join(f"{depth:g}" for depth in args.depths)
    retrieval = f", passkey retrieved / tried (depths {depths})" if args.retrieval_lengths else ""
    print(f"\n{name}, {args.dtype}, document {args.text_file.name}: perplexity of the first L tokens "
          f"(one forward){retrieval}.\n")  # fmt: skip
    print(comparison_table(summary))
    for line in goal_checks(summary, native):
        print(line)


if __name__ == "__main__":
    main()
