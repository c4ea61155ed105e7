"""Long-context evaluation of RoPE scaling methods with the hf_rope_ext.evaluation library.

Loads the model once, then for every method and scale patches it, measures perplexity against
context length and passkey / needle retrieval, and unpatches it. Results are appended to
``<output_dir>/results.jsonl`` after every case (rerun the same command to resume) and summarised
in ``results.md``, ``results.csv``, ``summary.json`` and PNG plots in the same folder.

Run (CPU, SmolLM2, about 3 minutes on 2 cores)::

    python examples/eval_long_context.py --text-files ../shared/data/books/pg84.txt \\
        --methods none,yarn --scales 2 --ppl-lengths 4096,9216 \\
        --retrieval-tasks passkey --retrieval-lengths 9216 --depths 0.5 --trials 1 \\
        --output-dir outputs/eval_example

The same through the installed command line: ``hf-rope-ext eval --help``.
"""

from __future__ import annotations

import argparse
import logging
import sys

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
from hf_rope_ext.cli import one_line
from hf_rope_ext.data import check_text_file
from hf_rope_ext.evaluation import EvalPlan, run_evaluation
from hf_rope_ext.evaluation.cli import float_list, int_list, load_for_evaluation, name_list
from hf_rope_ext.evaluation.documents import documents_from_files
from hf_rope_ext.evaluation.records import EXACT_STEPS, EvaluationError, check_output_dir, parse_steps_per_doubling
from hf_rope_ext.patching import DEFAULT_STEPS_PER_DOUBLING


def _steps(text: str) -> int | None:
    try:
        return parse_steps_per_doubling(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Dash spellings (--text-files, --ppl-lengths); the underscore ones still parse."""
    parser = argument_parser(__doc__.split("\n\n")[0])
    add_text_files_argument(parser, required=True, help="long text document(s) for perplexity")
    add_output_dir_argument(parser, help="results.jsonl, reports and plots go here")
    add_model_argument(parser)
    # The parsers of hf-rope-ext eval: bad values fail as usage errors, and 4k means 4096 here too.
    add_option(parser, "--methods", type=name_list, default="none,yarn,dynamic-yarn",
               help="comma-separated; none = unpatched")
    add_option(parser, "--scales", type=float_list, default="2", help="comma-separated scales")
    add_option(parser, "--ppl-lengths", type=int_list, default="4096,9216",
               help="comma-separated context lengths, e.g. 4096,9216 or 4k,9k")
    add_option(parser, "--ppl-modes", type=name_list, default="buckets", help="buckets and/or sliding")
    add_option(parser, "--stride", type=int, default=256, help="sliding-window stride")
    add_option(parser, "--retrieval-tasks", type=name_list, default="passkey", help="passkey and/or needle, or empty")
    add_option(parser, "--retrieval-lengths", type=int_list, default="9216", help="comma-separated total lengths")
    add_option(parser, "--depths", type=float_list, default="0.1,0.5,0.9", help="key depths")
    add_option(parser, "--trials", type=int, default=1, help="prompts per length and depth")
    add_option(parser, "--seed", type=int, default=0, help="seed of the random keys")
    # A string default goes through the type, so None (exact lengths) must be spelled as the option takes it.
    default_steps = EXACT_STEPS if DEFAULT_STEPS_PER_DOUBLING is None else str(DEFAULT_STEPS_PER_DOUBLING)
    add_option(parser, "--steps-per-doubling", type=_steps, default=default_steps,
               help=f"frequency steps of length-dependent methods, or 'exact' (default {default_steps})")
    add_device_arguments(parser)
    add_dtype_argument(parser)
    add_attn_implementation_argument(parser, choices=("sdpa", "eager", "flash_attention_2"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    try:
        return _run(args)
    except (ValueError, OSError, ImportError) as error:  # bad input: one line and exit 2, as hf-rope-ext eval
        print(f"error: {one_line(error)}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    plan = EvalPlan(
        methods=args.methods,
        scales=args.scales,
        ppl_lengths=args.ppl_lengths,
        ppl_modes=args.ppl_modes,
        stride=args.stride,
        retrieval_tasks=args.retrieval_tasks,
        retrieval_lengths=args.retrieval_lengths,
        depths=args.depths,
        trials=args.trials,
        seed=args.seed,
        steps_per_doubling=args.steps_per_doubling,
    )
    plan.validate(None)  # fail on bad input before loading the model
    for path in args.text_files:
        try:
            check_text_file(path)
        except FileNotFoundError:
            raise EvaluationError(f"Text file not found: {path}. Pass an existing file with --text-files.") from None
    check_output_dir(args.output_dir)
    try:  # now, not at the first result: a path under a file would fail only after the model loaded
        args.output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OSError(f"Cannot create --output-dir {args.output_dir}: {error.strerror or error}. Pass a folder that "
                      "can be created.") from None
    # a save_patched checkpoint is evaluated from its base RoPE, as `hf-rope-ext eval` does
    model, tokenizer = load_for_evaluation(args.model, dtype=args.dtype, device=args.device,
                                           attn_implementation=args.attn_implementation)  # fmt: skip
    documents = documents_from_files(tokenizer, args.text_files)
    run_evaluation(model, tokenizer, plan, args.output_dir, documents=documents, model_name=model_label(args.model),
                   dtype=args.dtype)  # fmt: skip
    print((args.output_dir / "results.md").read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
