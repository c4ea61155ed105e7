"""``hf-rope-ext eval`` and ``hf-rope-ext demo``.

    hf-rope-ext eval --model smollm2 --text-files book.txt --methods none,yarn,dynamic-yarn --scales 2,4 \\
        --ppl-lengths 4096,8192,16384 --retrieval-tasks passkey --retrieval-lengths 8192,16384 \\
        --output-dir outputs/eval
    hf-rope-ext demo --text-files book.txt
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import os
import sys
from pathlib import Path

import torch

from ..arguments import (
    HelpFormatter,
    add_attn_implementation_argument,
    add_data_arguments,
    add_device_arguments,
    add_dtype_argument,
    add_model_argument,
    add_option,
    add_output_dir_argument,
    check_attention_backend,
    check_device,
    given_options,
    model_label,
)
from ..cli import one_line
from ..data import check_dataset, check_text_file
from ..patching import DEFAULT_METHOD, DEFAULT_STEPS_PER_DOUBLING, describe_record
from .plan import EvalPlan
from .records import EvaluationError, check_output_dir, parse_steps_per_doubling, read_results

logger = logging.getLogger(__name__)

ALL_METHODS = "none,linear,ntk,dynamic,yarn,dynamic-yarn"


def int_list(text: str) -> list[int]:
    """Comma-separated token counts, ``4096,8192`` or ``4k,8k`` (argparse ``type``; shared with the examples)."""
    values = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        multiplier = 1024 if item.endswith("k") else 1
        try:
            values.append(int(item.removesuffix("k")) * multiplier)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated integers (e.g. 4096,8192 or 4k,8k), got {text!r}"
            ) from None
    return values


def float_list(text: str) -> list[float]:
    """Comma-separated numbers (argparse ``type``; shared with the examples)."""
    try:
        return [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers (e.g. 2,4), got {text!r}") from None


def _steps(text: str) -> int | None:
    try:
        return parse_steps_per_doubling(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def name_list(text: str) -> list[str]:
    """Comma-separated names (argparse ``type``; shared with the examples)."""
    return [item.strip() for item in text.split(",") if item.strip()]


def _add_model_arguments(parser: argparse.ArgumentParser, output_dir: Path | None = None) -> None:
    # The model and data options every entry point shares (hf_rope_ext.arguments).
    group = parser.add_argument_group("model")
    add_model_argument(group)
    add_device_arguments(group, device_map=True)
    add_dtype_argument(group)
    add_attn_implementation_argument(group, choices=("sdpa", "eager", "flash_attention_2"))
    add_data_arguments(group, text_files_dest="text_file")  # args.text_file: the name the commands below read
    add_option(group, "--num-documents", type=int, default=None, help="texts taken from --dataset (default 1)")
    add_output_dir_argument(group, default=output_dir, help="results.jsonl and the reports go here")
    add_option(group, "--no-progress", action="store_true", help="hide progress bars")


def add_parser(subparsers) -> None:
    """Register the ``eval`` and ``demo`` subcommands."""
    parser = subparsers.add_parser(
        "eval",
        formatter_class=HelpFormatter,
        help="perplexity and passkey/needle retrieval for several methods and scales",
        description="Evaluate RoPE scaling methods on a long-context model. Results are appended to "
        "<output-dir>/results.jsonl after every case; rerunning the same command skips finished cases.",
    )
    _add_model_arguments(parser)
    group = parser.add_argument_group("what to evaluate")
    add_option(group, "--methods", type=name_list, default=name_list(ALL_METHODS),
               help=f"comma-separated; 'none' is the unpatched model (default {ALL_METHODS})")
    add_option(group, "--scales", type=float_list, default=[2.0, 4.0], help="comma-separated scales (default 2,4)")
    add_option(group, "--ppl-lengths", type=int_list, default=[],
               help="context lengths for perplexity, e.g. 4096,8192,16384 or 4k,8k,16k")
    add_option(group, "--ppl-modes", type=name_list, default=["buckets"],
               help="buckets (one forward of L tokens, loss by position) and/or sliding")
    add_option(group, "--bucket-size", type=int, default=None,
               help="position bucket width (default: native context / 4)")
    add_option(group, "--stride", type=int, default=256, help="sliding-window stride S (default 256)")
    add_option(group, "--sliding-tokens", type=int, default=None,
               help="document tokens scored by sliding windows (default: the longest --ppl-lengths)")
    add_option(group, "--retrieval-tasks", type=name_list, default=[], help="passkey and/or needle")
    add_option(group, "--retrieval-lengths", type=int_list, default=[], help="total tokens, prompt plus answer")
    add_option(group, "--depths", type=float_list, default=[0.1, 0.5, 0.9],
               help="key depths, fractions (default 0.1,0.5,0.9)")
    add_option(group, "--trials", type=int, default=3, help="prompts per length and depth (default 3)")
    add_option(group, "--needle-count", type=int, default=None, help="keys per needle prompt (default 4)")
    add_option(group, "--max-new-tokens", type=int, default=8)
    add_option(group, "--seed", type=int, default=0, help="seed of the random keys")
    add_option(group, "--chunk-size", type=int, default=1024, help="positions per LM-head call in the loss")
    add_option(group, "--steps-per-doubling", type=_steps, default=DEFAULT_STEPS_PER_DOUBLING,
               help="frequency steps per doubling of the length for length-dependent methods, or 'exact' "
                    f"(default {DEFAULT_STEPS_PER_DOUBLING or 'exact'}; see patch_model)")
    add_option(group, "--no-reuse", action="store_true",
               help="compute every case, even when a finished case used the same rotary frequencies")
    add_option(group, "--report-only", action="store_true",
               help="only regenerate the reports from results.jsonl (takes --output-dir alone)")
    parser.set_defaults(handler=run_eval_command, unused_by_report_only=_options_besides(parser, "output_dir",
                                                                                         "report_only"))

    parser = subparsers.add_parser(
        "demo",
        formatter_class=HelpFormatter,
        help="perplexity beyond the native context and a passkey, before and after patch_model",
        description="Shows on a real model (SmolLM2 by default) what patch_model changes: perplexity beyond the "
        "native context and passkey retrieval beyond it, unpatched against patched. About 8 minutes on 2 CPU "
        "cores; on a GPU it picks longer lengths.",
    )
    _add_model_arguments(parser, output_dir=Path("outputs/demo"))
    group = parser.add_argument_group("demo")
    group.add_argument("--method", default=DEFAULT_METHOD,
                       help=f"method of the patched model (default {DEFAULT_METHOD})")
    group.add_argument("--scale", type=float, default=None,
                       help="scale of the patched model (default 2 on CPU, 4 on GPU)")
    group.add_argument("--ppl-length", type=int, default=None, help="tokens of the perplexity forward")
    group.add_argument("--passkey-length", type=int, default=None,
                       help="tokens of the passkey prompts, answer included")
    parser.set_defaults(handler=run_demo_command)


def _options_besides(parser: argparse.ArgumentParser, *kept: str) -> dict[str, tuple[str, object]]:
    """``{dest: (option, default)}`` of ``parser``'s options but ``kept``. A value option (made by
    add_option) was given when :func:`given_options` lists it, whatever its value; a flag
    (``store_true``) when its value differs from its default."""
    return {action.dest: (max(action.option_strings, key=len), action.default)
            for action in parser._actions  # argparse lists its options nowhere public
            if action.option_strings and action.dest not in (*kept, "help")}  # fmt: skip


# ----------------------------------------------------------------------------------------------


def _check_environment(args: argparse.Namespace) -> None:
    if args.device_map is not None and args.device is not None:
        raise EvaluationError("Give --device or --device-map, not both.")
    check_attention_backend(args.attn_implementation, device=args.device)
    args.device = check_device(args.device)  # normalised: "CUDA" -> "cuda"
    if args.device_map is not None and importlib.util.find_spec("accelerate") is None:
        raise EvaluationError("--device-map needs the accelerate package: pip install accelerate")
    for path in args.text_file:
        try:
            check_text_file(path)  # a folder, a device: named; a pipe (<(zcat book.gz)) is read once
        except FileNotFoundError:
            raise EvaluationError(f"Text file not found: {path}. Pass an existing file with --text-files.") from None
    if args.dataset:  # its first row, before the model loads: a wrong --text-field, an unreachable dataset
        check_dataset(args.dataset, args.dataset_split, args.text_field, args.dataset_config)
    if args.num_documents is not None:
        if not args.dataset:
            raise EvaluationError("--num-documents counts texts taken from --dataset; give --dataset, or leave it out.")
        if args.num_documents < 1:
            raise EvaluationError(f"--num-documents must be at least 1, got {args.num_documents}.")
    check_output_dir(args.output_dir)  # a file there would fail only at the first append, after a case ran


_model_label = model_label  # the shared alias map (hf_rope_ext.arguments)


def _native_context(model_name: str) -> int:
    """The model's native context, read from its config before it loads; for a checkpoint saved from
    a patched model (save_patched), that of its base RoPE, from which the configurations are built."""
    from transformers import AutoConfig

    from .. import config_io
    from ..loading import resolve_model_path

    config = AutoConfig.from_pretrained(resolve_model_path(model_name))
    recorded = config_io.verify_record(config)  # an edited record: refused here, before the model loads
    if recorded is not None:
        record = getattr(config, config_io.RECORD_ATTRIBUTE)
        logger.info("%s holds the %s patch; its configurations are evaluated from its base RoPE (native context %d, "
                    "'none' is the base model).", model_name, describe_record(record),
                    recorded.original_max_position_embeddings)  # fmt: skip
        return recorded.original_max_position_embeddings
    value = getattr(config, "max_position_embeddings", None)
    if not isinstance(value, int):
        raise EvaluationError(
            f"{model_name}: its config has no max_position_embeddings, so its native context is unknown."
        )
    return value


def _load(args: argparse.Namespace):
    logger.info("Loading %s (%s, %s attention)...", args.model, args.dtype, args.attn_implementation)
    return load_for_evaluation(args.model, dtype=args.dtype, device=args.device, device_map=args.device_map,
                               attn_implementation=args.attn_implementation, progress=not args.no_progress)


def load_for_evaluation(model_name: str, **load_kwargs):
    """``loading.load_model``, with a checkpoint saved from a patched model (save_patched) loaded as
    hub.load_patched does: its patch is rebuilt, and run_evaluation takes it off to build every
    configuration from the base RoPE (plain loading would leave the patched RoPE in the config)."""
    from transformers import AutoConfig

    from .. import config_io
    from ..hub import restore_patch
    from ..loading import load_model, resolve_model_path

    # Only a checkpoint with a record loads as load_patched does: one that lost its record keeps the
    # construction's warning that it runs without its patch.
    has_record = config_io.read_record(AutoConfig.from_pretrained(resolve_model_path(model_name))) is not None
    with config_io.restoring_patch() if has_record else contextlib.nullcontext():
        model, tokenizer = load_model(model_name, **load_kwargs)
    if config_io.read_record(model.config) is not None:
        restore_patch(model)
    return model, tokenizer


def load_base_model(model_name: str, **load_kwargs):
    """:func:`load_for_evaluation`, with a save_patched checkpoint's patch then taken off: its
    weights at their original RoPE, from which the comparison scripts build every configuration,
    so that ``none`` is these weights unpatched, as in ``hf-rope-ext eval`` (plain loading left the
    patched RoPE in the config, which ``none`` recorded as the unpatched model)."""
    from ..patching import get_patch_info, unpatch_model

    model, tokenizer = load_for_evaluation(model_name, **load_kwargs)
    spec = get_patch_info(model)
    if spec is not None:
        unpatch_model(model)
        logger.info("%s was saved with the %s x%g patch; its configurations are built from its original RoPE "
                    "('none' is its weights unpatched; its own patch is the configuration %r at scale %g).",
                    model_name, spec.method, spec.scale, spec.method, spec.scale)  # fmt: skip
    return model, tokenizer


def _model_name(model: str) -> str:
    """The model's name in the records: a local folder's path normalised (``./ckpt/`` -> ``ckpt``),
    a Hub id or alias as :func:`model_label` gives it."""
    from ..loading import expand_home

    label = _model_label(model)  # an alias first, as resolve_model_path reads it
    if label == model and Path(expand_home(model)).is_dir():
        return os.path.normpath(expand_home(model))
    return label


def _documents(args: argparse.Namespace, tokenizer, min_tokens: int) -> dict[str, torch.Tensor]:
    from .documents import documents_from_dataset, documents_from_files

    documents = documents_from_files(tokenizer, args.text_file)
    if args.dataset:
        documents.update(documents_from_dataset(tokenizer, args.dataset, split=args.dataset_split,
                                                text_field=args.text_field, config=args.dataset_config,
                                                count=args.num_documents or 1, min_tokens=min_tokens))  # fmt: skip
    return documents


def _guarded(function, args: argparse.Namespace) -> int:
    """Bad input -> one clear line on stderr and exit code 2; Ctrl-C -> what was saved."""
    try:
        return function(args)
    # EvaluationError is a ValueError; patch_model and the loaders raise ValueError with a clear message too.
    # OSError: a missing file or folder, or no connection to the Hub.
    except (ValueError, OSError, ImportError) as error:
        print(f"error: {one_line(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: finished cases are kept in {args.output_dir / 'results.jsonl'}; "
            "run the same command again to continue.",
            file=sys.stderr,
        )
        return 130


def run_eval_command(args: argparse.Namespace) -> int:
    return _guarded(_run_eval, args)


def _run_eval(args: argparse.Namespace) -> int:
    from .report import write_reports
    from .documents import check_documents
    from .runner import run_evaluation

    if args.report_only:
        given = [option for dest, (option, default) in args.unused_by_report_only.items()
                 if dest in given_options(args) or getattr(args, dest) != default]  # fmt: skip
        if given:  # an evaluation option with --report-only would be silently ignored
            raise EvaluationError(f"--report-only only regenerates the reports of --output-dir and takes no other "
                                  f"option; leave out {', '.join(given)} (or --report-only, to evaluate).")
        if not (args.output_dir / "results.jsonl").is_file():
            raise EvaluationError(f"No results.jsonl in {args.output_dir}; nothing to report.")
        check_output_dir(args.output_dir, append=False)  # a report that cannot be written: named before any work
        write_reports(args.output_dir)
        print((args.output_dir / "results.md").read_text(encoding="utf-8"))
        return 0
    _check_environment(args)
    if args.needle_count is not None and "needle" not in args.retrieval_tasks:
        raise EvaluationError("--needle-count applies to the needle task only; add needle to --retrieval-tasks, or "
                              "leave it out.")  # fmt: skip
    plan = EvalPlan(
        methods=args.methods, scales=args.scales, ppl_lengths=args.ppl_lengths, ppl_modes=args.ppl_modes,
        bucket_size=args.bucket_size, stride=args.stride, sliding_tokens=args.sliding_tokens,
        retrieval_tasks=args.retrieval_tasks, retrieval_lengths=args.retrieval_lengths, depths=args.depths,
        trials=args.trials, needle_count=4 if args.needle_count is None else args.needle_count,
        max_new_tokens=args.max_new_tokens, seed=args.seed,
        chunk_size=args.chunk_size, reuse_identical=not args.no_reuse, steps_per_doubling=args.steps_per_doubling,
    )  # fmt: skip
    plan.validate(None)
    if plan.required_document_tokens() and not (args.text_file or args.dataset):
        raise EvaluationError("Perplexity needs documents: pass --text-files FILE (or --dataset NAME).")
    native_context = _native_context(args.model)
    plan.validate(native_context)  # before the model is loaded: bad input fails fast
    plan.check_reach(native_context)
    read_results(args.output_dir)  # so does an edited record
    model, tokenizer = _load(args)
    documents = _documents(args, tokenizer, plan.required_document_tokens())
    check_documents(plan, documents)
    run_evaluation(model, tokenizer, plan, args.output_dir, documents=documents, model_name=_model_name(args.model),
                   dtype=args.dtype, native_context=native_context, progress=not args.no_progress)  # fmt: skip
    print((args.output_dir / "results.md").read_text(encoding="utf-8"))
    print(f"Results: {args.output_dir / 'results.jsonl'}; reports and plots in {args.output_dir}/")
    return 0


def run_demo_command(args: argparse.Namespace) -> int:
    return _guarded(_run_demo, args)


def _run_demo(args: argparse.Namespace) -> int:
    import time

    from .demo import check_one_document, demo_plan, demo_settings, demo_table
    from .documents import check_documents
    from .runner import run_evaluation

    _check_environment(args)
    if not (args.text_file or args.dataset):
        raise EvaluationError(
            "The demo needs a long text (over 10k tokens) for perplexity: pass --text-files FILE, e.g. a Project "
            "Gutenberg book, or --dataset emozilla/pg19-test on a machine with Hub access."
        )
    check_one_document(args.text_file, args.dataset, args.num_documents)
    on_gpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda") or (
        args.device_map is not None and torch.cuda.is_available()
    )
    native_context = _native_context(args.model)
    if native_context < 2:  # else the plan would refuse a --ppl-length that was never given
        raise EvaluationError(f"{args.model}: its native context (max_position_embeddings) is {native_context} "
                              "token(s); the demo needs a model with at least 2.")
    settings = demo_settings(native_context, on_gpu, method=args.method, scale=args.scale,
                             ppl_length=args.ppl_length, passkey_length=args.passkey_length)  # fmt: skip
    plan = demo_plan(settings)
    plan.validate(native_context)
    started = time.perf_counter()
    model, tokenizer = _load(args)
    documents = _documents(args, tokenizer, plan.required_document_tokens())
    check_documents(plan, documents, length_flags="--ppl-length")
    print(
        f"Demo on {_model_name(args.model)} (native context {native_context} tokens), {args.dtype} on "
        f"{'GPU' if on_gpu else 'CPU'}: unpatched, then patch_model(model, scale={settings.scale:g}, "
        f"method={settings.method!r}). Perplexity over {settings.ppl_length} tokens of {next(iter(documents))}; "
        f"passkey at {', '.join(map(str, settings.passkey_lengths))} tokens.",
        flush=True,
    )
    records = run_evaluation(model, tokenizer, plan, args.output_dir, documents=documents,
                             model_name=_model_name(args.model), dtype=args.dtype, native_context=native_context,
                             progress=not args.no_progress)  # fmt: skip
    print()
    print(demo_table(records, settings, native_context))
    print(f"\n{time.perf_counter() - started:.0f} s. Results and plots: {args.output_dir}/")
    return 0
