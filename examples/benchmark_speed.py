"""Speed of patched models against their baselines, measured in the same run.

1. Forward time of the patched model over the unpatched one, for each static method (or the
   ``--forward-methods`` given), at ``--forward-tokens`` tokens (target: ratio <= 1.02 for
   frequency methods; attention-level methods, measured beyond the native context, <= 1.5).
   On CUDA also the peak memory each case's forwards held (``torch.cuda.max_memory_allocated``).
2. Total ``generate`` time of hf_rope_ext's cache-exact ``dynamic`` against transformers' own
   ``dynamic`` type (frequencies of every length, stale cache) for four shapes: prompts of 1.1,
   1.5 and 1.9 x the original context with 256 new tokens, and a prompt of the original context
   with as many new tokens (target: within 5% for each). ``--original-context`` lets a CPU run
   use a shorter original context than the model's own (8192 for SmolLM2), so that the
   generations stay short; on a GPU use the model's own. For each shape it also counts how many
   times hf_rope_ext recomputed the cached prefix (calls of the first decoder layer with more
   than one token after the prefill).

3. With ``--decode-step-methods`` (attention-level methods): the time of one decode step over a
   cache of ``--decode-step-tokens`` tokens (beyond the native context), patched over unpatched.
   These methods keep the cache at the true positions with the model's own frequencies, so one
   unpatched prefill serves every method; each step starts from a copy of it.

All are timed in alternating rounds (``--forward-repeats``, ``--decode-repeats``) and the best
round of each side is compared, so that drifts in machine load hit both alike. The decode
benchmark also reports the median of the per-round (paired) ratios, with the order of the two
sides swapped every round: on a machine whose speed drifts between rounds it is the steadier
number.

Run (CPU, about 20 minutes)::

    python examples/benchmark_speed.py --model smollm2 --output-dir outputs/benchmark \\
        --forward-tokens 4096 --original-context 1024

Prints a table and writes ``speed.json`` under ``--output-dir`` (``--output_dir`` still parses), a
folder of its own: one that holds an earlier run's ``speed.json`` or ``decode_rounds.json`` is refused.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM

from hf_rope_ext import get_patch_info, patch_model, unpatch_model
from hf_rope_ext.arguments import (
    add_attn_implementation_argument,
    add_device_arguments,
    add_dtype_argument,
    add_model_argument,
    add_option,
    add_output_dir_argument,
    argument_parser,
)
from hf_rope_ext.auto import check_configurations, parse_configuration
from hf_rope_ext.cli import one_line
from hf_rope_ext.compat import cache_argument_name, output_cache
from hf_rope_ext.evaluation.cli import load_base_model, name_list
from hf_rope_ext.evaluation.records import check_output_dir
from hf_rope_ext.files import atomic_write_json
from hf_rope_ext.loading import resolve_model_path
from hf_rope_ext.methods import LOGN_SUFFIX, get_method
from hf_rope_ext.patching import original_context_length
from hf_rope_ext.validation import check_scale

STATIC_METHODS = ("linear", "ntk", "yarn", "llama3")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argument_parser(__doc__.split("\n\n")[0])
    add_model_argument(parser)
    add_output_dir_argument(parser, help="speed.json goes here")
    add_option(parser, "--forward-tokens", type=int, default=4096)
    add_option(parser, "--forward-repeats", type=int, default=5)
    add_option(parser, "--forward-methods", type=name_list, default=",".join(STATIC_METHODS),
               help="comma-separated methods for the forward benchmark, e.g. self-extend,dual-chunk "
                    "(attention-level methods need --forward-tokens beyond the native context to matter)")
    add_option(parser, "--forward-scale", type=float, default=4.0, help="scale of the forward benchmark's patches")
    add_option(parser, "--original-context", type=int, default=None,
               help="original context for the decode benchmark (default: the model's own)")
    add_option(parser, "--scale", type=float, default=4.0)
    add_option(parser, "--steps-per-doubling", type=int, default=None,
               help="for hf_rope_ext's dynamic (default: the package default)")
    add_device_arguments(parser)
    add_dtype_argument(parser)
    add_attn_implementation_argument(parser, choices=("sdpa", "eager", "flash_attention_2"))
    add_option(parser, "--decode-repeats", type=int, default=3,
               help="rounds of the decode benchmark, each timing both models (default 3)")
    add_option(parser, "--decode-new-tokens", type=int, default=256,
               help="new tokens after the prompts of 1.1, 1.5 and 1.9 x the original context")
    add_option(parser, "--decode-step-methods", default=None,
               help="';'-separated attention-level configurations (method[:key=value,...]) for the decode-step "
                    "benchmark, e.g. 'self-extend;dual-chunk;self-extend:far_positions=by-parts'")
    add_option(parser, "--decode-step-tokens", type=int, default=16384,
               help="cache length of the decode-step benchmark (beyond the native context)")
    add_option(parser, "--decode-step-repeats", type=int, default=5)
    add_option(parser, "--seed", type=int, default=0)
    add_option(parser, "--skip-forward", action="store_true")
    add_option(parser, "--skip-decode", action="store_true")
    args = parser.parse_args(argv)
    args.decode_step_methods = [m.strip() for m in (args.decode_step_methods or "").split(";") if m.strip()]
    if args.decode_step_repeats < 1 or args.decode_step_tokens < 1:
        parser.error("--decode-step-repeats and --decode-step-tokens must be at least 1, got "
                     f"{args.decode_step_repeats} and {args.decode_step_tokens}")
    # Checked here, not after the model loaded: min() of no rounds fails only at the end of a benchmark.
    for name in ("forward_tokens", "forward_repeats", "decode_repeats", "decode_new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("original_context", "steps_per_doubling"):  # None: the model's own, the package default
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for option, scale in (("--scale", args.scale), ("--forward-scale", args.forward_scale)):
        try:
            check_scale(scale, option)
        except ValueError as error:
            parser.error(str(error))
    if args.skip_forward and args.skip_decode and not args.decode_step_methods:
        parser.error("--skip-forward and --skip-decode leave nothing to measure; drop one of them or give "
                     "--decode-step-methods")
    if not args.skip_forward and not args.forward_methods:
        parser.error("--forward-methods names no method; give e.g. yarn,ntk, or --skip-forward")
    for method in args.forward_methods:
        try:
            get_method(method)
        except ValueError as error:
            parser.error(f"--forward-methods: {error}")
    for configuration in args.decode_step_methods:  # checked before the model loads
        try:
            method, params = parse_configuration(configuration)
            attention_level = get_method(method).attention is not None
        except ValueError as error:
            parser.error(f"--decode-step-methods: {error}")
        # one unpatched prefill serves every method only if the cache keeps the model's own frequencies
        if not attention_level or params.get("frequencies") is not None:
            parser.error(f"--decode-step-methods takes attention-level methods on the model's own frequencies "
                         f"(self-extend, dual-chunk), got {configuration!r}")
    return args


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def forward_benchmark(model, ids, repeats: int, methods=STATIC_METHODS, scale: float = 4) -> dict:
    device = ids.device

    def forward():
        with torch.no_grad():
            model(ids, use_cache=False, logits_to_keep=1)

    forward()  # warm-up
    # Interleave the cases in every round so drifts in machine load hit all of them alike; the
    # minimum over rounds is the least disturbed measurement.
    times = {name: [] for name in ("none", *methods)}
    peaks = {name: 0 for name in times}  # bytes the CUDA allocator held at most during each case's forwards
    for _ in range(repeats):
        for name in times:
            if name != "none":
                patch_model(model, scale=scale, method=name)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times[name].append(timed(forward, device))
            if device.type == "cuda":
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated(device))
            if name != "none":
                unpatch_model(model)
    baseline = min(times["none"])
    results = {name: {"min_s": min(values), "median_s": statistics.median(values), "ratio": min(values) / baseline}
               for name, values in times.items()}
    if device.type == "cuda":  # the weights included: what the device must hold for this forward
        for name, peak in peaks.items():
            results[name]["peak_gib"] = peak / 2**30

    # The rotary module alone: what the patch adds to each forward, without the noise of the rest.
    positions = torch.arange(ids.shape[1], device=device)[None]
    probe = torch.zeros(1, device=device, dtype=model.dtype)
    rotary_times = {}
    for name in times:
        if name != "none":
            patch_model(model, scale=scale, method=name)
        rotary = model.model.rotary_emb
        rotary(probe, positions)
        rotary_times[name] = min(timed(lambda: rotary(probe, positions), device) for _ in range(20))
        if name != "none":
            unpatch_model(model)
    for name, seconds in rotary_times.items():
        results[name]["rotary_ms"] = seconds * 1000
        results[name]["rotary_extra_share"] = (seconds - rotary_times["none"]) / baseline
    return results


# Prompt length as a multiple of the original context L0, and new tokens: --decode-new-tokens
# (256) after the three longer prompts, L0 after a prompt of L0 (the long shape).
DECODE_SHAPES = ((1.1, "N"), (1.5, "N"), (1.9, "N"), (1.0, "L0"))


def random_ids(vocabulary: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """Random token ids past the first 100 (special tokens sit there), any id of a smaller vocabulary.

    ``vocabulary``: the ids both the tokenizer and the model's embedding know (the smaller of the two)."""
    first = 100 if vocabulary > 101 else 0
    return torch.randint(first, max(first + 1, vocabulary - 1), (1, length), generator=generator)


def decode_benchmark(args, model, vocabulary: int, device, progress_file: Path | None = None) -> dict:
    original = args.original_context or model.config.max_position_embeddings
    generator = torch.Generator().manual_seed(args.seed)
    shapes = []
    for prompt_factor, new in DECODE_SHAPES:
        prompt_length = int(round(prompt_factor * original))
        new_tokens = original if new == "L0" else args.decode_new_tokens
        prompt = random_ids(vocabulary, prompt_length, generator).to(device)
        shapes.append((f"{prompt_factor:g} x L0 + {new_tokens}", prompt, new_tokens))

    # transformers' own dynamic NTK with the same original context and factor.
    config = copy.deepcopy(model.config)
    config.rope_parameters = {"rope_type": "dynamic", "factor": args.scale,
                              "rope_theta": model.config.rope_parameters["rope_theta"]}
    config.max_position_embeddings = original  # where transformers' dynamic scaling starts
    theirs = AutoModelForCausalLM.from_config(config, attn_implementation=args.attn_implementation,
                                              dtype=model.dtype).to(device).eval()
    theirs.load_state_dict(model.state_dict())
    extra = {} if args.steps_per_doubling is None else {"steps_per_doubling": args.steps_per_doubling}
    patch_model(model, scale=args.scale, method="dynamic", original_max_length=original, **extra)
    steps_per_doubling = get_patch_info(model).steps_per_doubling

    def run(m, prompt, new_tokens) -> tuple[float, list[int]]:
        calls = []  # tokens per call of the first decoder layer: the prefill, then 1 per step
        hook = m.model.layers[0].register_forward_pre_hook(lambda module, a: calls.append(a[0].shape[1]))
        try:
            seconds = timed(lambda: m.generate(prompt, do_sample=False, min_new_tokens=new_tokens,
                                               max_new_tokens=new_tokens, pad_token_id=0), device)
        finally:
            hook.remove()
        return seconds, calls

    warm_up = shapes[0][1][:, :64]
    for m in (theirs, model):
        m.generate(warm_up, do_sample=False, max_new_tokens=4, pad_token_id=0)
    results = {}
    try:
        for round_index in tqdm(range(args.decode_repeats), desc="decode rounds", unit="round"):
            # Run the two back to back on every shape in every round, so drifts in machine load
            # hit both alike, and swap which goes first every round (a fixed order would favour
            # one side if the machine speeds up or slows down within a pair).
            for name, prompt, new_tokens in shapes:
                row = results.setdefault(name, {"prompt_tokens": prompt.shape[1], "new_tokens": new_tokens,
                                                "transformers_s": [], "hf_rope_ext_s": []})
                if round_index % 2 == 0:
                    their_seconds, _ = run(theirs, prompt, new_tokens)
                    our_seconds, calls = run(model, prompt, new_tokens)
                else:
                    our_seconds, calls = run(model, prompt, new_tokens)
                    their_seconds, _ = run(theirs, prompt, new_tokens)
                row["transformers_s"].append(their_seconds)
                row["hf_rope_ext_s"].append(our_seconds)
                row["recomputations"] = sum(n > 1 for n in calls[1:])
                # Each finished pair at once, so that an interrupted run still reports what it measured.
                tqdm.write(f"  round {len(row['transformers_s'])}, {name}: transformers {their_seconds:.2f} s, "
                           f"hf_rope_ext {our_seconds:.2f} s, ratio {our_seconds / their_seconds:.3f}, "
                           f"prefix recomputations {row['recomputations']}")
                if progress_file is not None:
                    atomic_write_json(progress_file, results)
    finally:
        unpatch_model(model)
        del theirs
    for row in results.values():
        row["ratio"] = min(row["hf_rope_ext_s"]) / min(row["transformers_s"])
        row["ratio_per_round"] = [ours / theirs for ours, theirs in zip(row["hf_rope_ext_s"], row["transformers_s"])]
        # The median of the paired (same-round) ratios: robust to a round disturbed on one side,
        # where the best-of-each-side ratio compares two different moments of the machine.
        row["paired_ratio"] = statistics.median(row["ratio_per_round"])
    return {"original_context": original, "scale": args.scale, "steps_per_doubling": steps_per_doubling,
            "shapes": results}


def decode_step_benchmark(model, ids, methods, scale: float, repeats: int) -> dict:
    """Seconds of one decode step (the last token of ``ids`` over a cache of the others), per method."""
    device = ids.device
    parameters = inspect.signature(model.forward).parameters
    cache_name = cache_argument_name(parameters)
    if cache_name is None:
        raise ValueError(f"{type(model).__name__}.forward takes no KV cache; the decode-step benchmark needs one.")
    check_configurations(model, methods, scale)  # bad parameters fail now, not after the long prefill
    last = ids[:, -1:]
    position = torch.tensor([[ids.shape[1] - 1]], device=device)

    def prefill():
        with torch.no_grad():
            return output_cache(model(ids[:, :-1], use_cache=True, logits_to_keep=1))

    def step(cache):
        with torch.no_grad():
            model(last, position_ids=position, use_cache=True, logits_to_keep=1, **{cache_name: cache})

    step(prefill())  # warm-up
    times = {name: [] for name in ("none", *methods)}
    for _ in range(repeats):
        for name in times:
            if name != "none":
                method, params = parse_configuration(name)
                patch_model(model, scale=scale, method=method, **params)
            # A fresh, untimed prefill under this patch: the model refuses a cache filled under
            # another patch (or a copy of one), whose states carry other positions.
            cache = prefill()
            times[name].append(timed(lambda: step(cache), device))
            if name != "none":
                unpatch_model(model)
    baseline = min(times["none"])
    return {name: {"min_s": min(values), "median_s": statistics.median(values), "ratio": min(values) / baseline}
            for name, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return _run(args)
    except (ValueError, OSError, ImportError) as error:  # bad input: one line and exit 2, as hf-rope-ext's commands
        print(f"error: {one_line(error)}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    # The folder first: created only at the end, a path under a file would lose the whole benchmark.
    check_output_dir(args.output_dir, append=False, reports=False)  # writes no results.jsonl, no eval reports
    # Each run writes its own report whole: into a folder of an earlier run it would replace that run's results.
    for name in ("speed.json", "decode_rounds.json"):
        if (args.output_dir / name).exists():
            raise ValueError(f"{args.output_dir / name} holds the results of an earlier run; give another "
                             "--output-dir (nothing is overwritten).")
    try:
        args.output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OSError(f"Cannot create --output-dir {args.output_dir}: {error.strerror or error}. Pass a folder that "
                      "can be created.") from None
    torch.manual_seed(args.seed)
    model, tokenizer = load_base_model(args.model, dtype=args.dtype, device=args.device,
                                       attn_implementation=args.attn_implementation)
    # Parameters that only the model can check (its attention implementation, its rotary size), before the forwards.
    if not args.skip_forward:
        check_configurations(model, args.forward_methods, args.forward_scale)
    native = original_context_length(model.config)
    # Inside the native context the attention-level methods and log-n attention change nothing: the
    # ratio would time a no-op.
    unchanged_attention = [] if args.skip_forward else [
        name for name in args.forward_methods if get_method(name).attention is not None or name.endswith(LOGN_SUFFIX)]
    if unchanged_attention and args.forward_tokens <= native:
        raise ValueError(f"--forward-tokens {args.forward_tokens} is within the model's native context of {native} "
                         f"tokens, where the attention of {', '.join(unchanged_attention)} is the unpatched one "
                         f"(the ratio would time a no-op); give more than {native}.")
    if args.decode_step_methods and args.decode_step_tokens <= native:
        raise ValueError(f"--decode-step-tokens {args.decode_step_tokens} is within the model's native context of "
                         f"{native} tokens; give more than {native}.")
    device = next(model.parameters()).device
    report = {"model": resolve_model_path(args.model), "device": str(device), "dtype": str(model.dtype),
              "torch_threads": torch.get_num_threads()}
    vocabulary = min(len(tokenizer), model.config.vocab_size)
    if not args.skip_forward:
        ids = random_ids(vocabulary, args.forward_tokens, torch.Generator().manual_seed(args.seed)).to(device)
        report["forward"] = {"tokens": args.forward_tokens, **forward_benchmark(
            model, ids, args.forward_repeats, args.forward_methods, args.forward_scale)}
        print(f"Forward pass, {args.forward_tokens} tokens, best of {args.forward_repeats} (median):")
        for name, row in report["forward"].items():
            if isinstance(row, dict):
                print(f"  {name:<8} {row['min_s']:8.3f} s ({row['median_s']:.3f})   patched/unpatched {row['ratio']:.3f}"
                      f"   rotary module {row['rotary_ms']:.2f} ms ({row['rotary_extra_share']:+.3%} of the forward)"
                      + (f"   peak GPU memory {row['peak_gib']:.2f} GiB" if "peak_gib" in row else ""))
    step_methods = args.decode_step_methods
    if step_methods:
        ids = random_ids(vocabulary, args.decode_step_tokens + 1, torch.Generator().manual_seed(args.seed)).to(device)
        report["decode_step"] = {"cache_tokens": args.decode_step_tokens, "scale": args.forward_scale,
                                 **decode_step_benchmark(model, ids, step_methods, args.forward_scale,
                                                         args.decode_step_repeats)}
        print(f"One decode step over a cache of {args.decode_step_tokens} tokens, best of {args.decode_step_repeats} "
              "(median):")
        for name, row in report["decode_step"].items():
            if isinstance(row, dict):
                print(f"  {name:<12} {row['min_s'] * 1000:9.1f} ms ({row['median_s'] * 1000:.1f})   "
                      f"patched/unpatched {row['ratio']:.2f}")
    if not args.skip_decode:
        report["decode"] = decode_benchmark(args, model, vocabulary, device, args.output_dir / "decode_rounds.json")
        d = report["decode"]
        print(f"Total generate time, original context {d['original_context']}, hf_rope_ext dynamic "
              f"(steps_per_doubling={d['steps_per_doubling']}) / transformers dynamic, best of {args.decode_repeats} rounds:")
        for name, row in d["shapes"].items():
            print(f"  {name:<20} transformers {min(row['transformers_s']):8.2f} s   hf_rope_ext "
                  f"{min(row['hf_rope_ext_s']):8.2f} s   ratio {row['ratio']:.3f}   paired (median) "
                  f"{row['paired_ratio']:.3f}   per round "
                  + ", ".join(f"{r:.3f}" for r in row["ratio_per_round"])
                  + f"   prefix recomputations {row['recomputations']}")
    atomic_write_json(args.output_dir / "speed.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
