"""Passkey and needle retrieval for method configurations with their own parameters.

`hf-rope-ext eval` takes method names; this script takes full configurations (method and the
method's parameters), like `compare_configurations.py` does for perplexity. The prompts are the
evaluation tool's (`hf_rope_ext.evaluation.retrieval`, same seeds), so its results compare with
`hf-rope-ext eval` runs at the same length, depth and seed. With `--answer-logprob`, each trial
also records the log-probability of the answer under teacher forcing (one more forward over
prompt and answer), a graded measure of how close a miss or a hit was. Each trial is appended to
`<output-dir>/trials.jsonl` as soon as it ends and each case to `<output-dir>/results.jsonl`;
rerunning the same command skips finished cases and, inside an interrupted case, finished trials
(a 64k prompt takes over half an hour on a CPU); a rerun with a larger ``--trials`` runs only the
new trials.

    python examples/compare_retrieval.py --model smollm2 --length 16384 --scale 2 --depths 0.5 --trials 2 \\
        --output-dir outputs/retrieval_configs --configs "yarn;self-extend:neighbor_window=1024,far_positions=by-parts"
"""

from __future__ import annotations

import json
import logging
import random
import sys
import time
from pathlib import Path

import torch

from hf_rope_ext import patch_model, unpatch_model
from hf_rope_ext.arguments import (
    add_attn_implementation_argument,
    add_dtype_argument,
    add_model_argument,
    add_option,
    add_output_dir_argument,
    argument_parser,
    model_label,
)
from hf_rope_ext.auto import check_configurations, parse_configuration
from hf_rope_ext.cli import one_line
from hf_rope_ext.evaluation.records import (
    append_record,
    check_output_dir,
    check_same_model,
    check_script_results,
    check_stored_fields,
    read_records,
    records_without_cut_line,
)
from hf_rope_ext.evaluation.retrieval import TASKS, grade, greedy_generate, make_trial, trial_seed
from hf_rope_ext.evaluation.runner import model_fingerprint
from hf_rope_ext.files import atomic_write_text
from hf_rope_ext.evaluation.cli import load_base_model
from hf_rope_ext.validation import check_scale, is_real

logger = logging.getLogger("compare_retrieval")

MAX_NEW_TOKENS = 8  # as hf-rope-ext eval: the prompt has length - 8 tokens
MIN_PROMPT_TOKENS = 128  # as hf-rope-ext eval (EvalPlan.validate)


def _floats(text: str, name: str, parser) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        parser.error(f"{name} takes comma-separated numbers, got {text!r}")
    if not values:
        parser.error(f"{name} is empty")
    return values


def _shown_trial(trial) -> bool:
    return isinstance(trial, dict) and "output" in trial and is_real(trial.get("answer_logprob", 0))


# what the table reads from each record, and what it must hold
TABLE_FIELDS = {
    "trials": ("list of trials", lambda value: isinstance(value, list) and all(_shown_trial(t) for t in value)),
    "config": ("configuration name", lambda value: isinstance(value, str)),
    "scale": ("number", is_real),
    "length": ("number of tokens", is_real),
    "task": ("task name", lambda value: isinstance(value, str)),
    "depth": ("number", is_real),
    "correct": ("count of correct trials", is_real),
}


def _stored_trial(stored: dict, answer: str, needs_logprob: bool) -> dict | None:
    """A finished trial read back from trials.jsonl, or None if it is not this prompt's or lacks a field.

    The grade is recomputed from the stored output, so an edited ``correct`` counts for nothing.
    """
    output, seconds = stored.get("output"), stored.get("seconds")
    if stored.get("answer") != answer or not isinstance(output, str) or not isinstance(seconds, (int, float)):
        return None
    trial = {"answer": answer, "output": output, "correct": grade(output, answer), "seconds": float(seconds)}
    if needs_logprob:
        if not isinstance(stored.get("answer_logprob"), (int, float)):
            return None
        trial["answer_logprob"] = float(stored["answer_logprob"])
    return trial


@torch.no_grad()
def answer_logprob(model, prompt_ids: list[int], answer_ids: list[int]) -> float:
    """Sum of log p(answer token | prompt, earlier answer tokens), from one forward."""
    device = model.get_input_embeddings().weight.device
    ids = torch.tensor([prompt_ids + answer_ids], device=device)
    logits = model(ids, logits_to_keep=len(answer_ids) + 1).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return float(sum(logprobs[index, token] for index, token in enumerate(answer_ids)))


def main() -> None:
    parser = argument_parser(__doc__.split("\n")[0])
    try:
        run(parser)
    except (ValueError, OSError, TypeError) as error:  # bad input (a missing model, a broken file): one line
        parser.error(one_line(error))
    except KeyboardInterrupt:  # Ctrl-C: one line, not the traceback of wherever it landed
        print("\ninterrupted: the finished cases are kept in the --output-dir's results.jsonl; rerun the same "
              "command to go on.", file=sys.stderr)
        sys.exit(130)


def run(parser) -> None:
    add_model_argument(parser)
    add_option(parser, "--length", type=int, required=True, help="tokens per prompt, answer included")
    add_option(parser, "--scale", type=float, required=True)
    add_option(parser, "--configs", required=True, help="';'-separated method[:key=value,...]; 'none' = unpatched")
    add_option(parser, "--tasks", default="passkey,needle", help=f"comma-separated, of {', '.join(TASKS)}")
    add_option(parser, "--depths", default="0.1,0.5,0.9", help="comma-separated needle depths in [0, 1]")
    add_option(parser, "--trials", type=int, default=2)
    add_option(parser, "--seed", type=int, default=0)
    parser.add_argument("--answer-logprob", action="store_true", help="also score the answer by teacher forcing")
    add_output_dir_argument(parser, help="results.jsonl and table.md go here")
    add_attn_implementation_argument(parser, choices=("sdpa", "eager", "flash_attention_2"))
    add_dtype_argument(parser)
    args = parser.parse_args()
    specs = [part.strip() for part in args.configs.split(";") if part.strip()]
    if not specs:
        parser.error(f"--configs names no configuration, got {args.configs!r}; give method[:key=value,...] or 'none'")
    try:
        # the syntax is checked before the model loads, the rest once it has
        parsed = [parse_configuration(spec) for spec in specs]
    except ValueError as error:
        parser.error(one_line(error))
    # the scale is written to every row and key, `none` rows too; 1 only for a run of `none` alone
    if not (args.scale == 1 and all(method == "none" for method, _ in parsed)):
        try:
            check_scale(args.scale, "--scale")
        except (ValueError, TypeError) as error:
            parser.error(one_line(error))
    same = [spec for index, spec in enumerate(specs) if parsed[index] in parsed[:index]]
    if same:  # the same prompts twice, and two rows of one configuration
        parser.error(f"--configs lists {same[0]!r} twice (as the same method and parameters); list it once")
    if args.length - MAX_NEW_TOKENS < MIN_PROMPT_TOKENS:
        parser.error(f"--length must be at least {MIN_PROMPT_TOKENS + MAX_NEW_TOKENS} ({MIN_PROMPT_TOKENS} prompt "
                     f"tokens plus {MAX_NEW_TOKENS} answer tokens), got {args.length}")  # fmt: skip
    tasks = [task.strip() for task in args.tasks.split(",") if task.strip()]
    unknown = [task for task in tasks if task not in TASKS]
    if unknown or not tasks:
        parser.error(f"--tasks takes {', '.join(TASKS)}, got {args.tasks!r}")
    depths = _floats(args.depths, "--depths", parser)
    for name, values in (("--tasks", tasks), ("--depths", depths)):
        if len(set(values)) != len(values):  # a case twice would count its prompts twice
            parser.error(f"{name} lists a value twice, got {','.join(map(str, values))}; list each once")
    if any(not 0.0 <= depth <= 1.0 for depth in depths):
        parser.error(f"--depths must lie in [0, 1], got {args.depths!r}")
    if args.trials < 1:
        parser.error(f"--trials must be at least 1, got {args.trials}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    output = Path(args.output_dir)
    check_output_dir(output, reports=False)  # its table is table.md, not eval's reports
    results_path = output / "results.jsonl"
    trials_path = output / "trials.jsonl"
    if trials_path.exists() and not trials_path.is_file():
        parser.error(f"{trials_path} is not a file; remove it or use another --output-dir")
    stored, stored_trials = records_without_cut_line(results_path), records_without_cut_line(trials_path)
    check_script_results(stored, results_path)  # before the model loads
    check_script_results(stored_trials, trials_path)
    check_stored_fields(stored, results_path, TABLE_FIELDS)

    model, tokenizer = load_base_model(args.model, dtype=args.dtype, attn_implementation=args.attn_implementation)
    name, fingerprint = model_label(args.model), model_fingerprint(model)
    # keys do not name the model: results and trials of another one would be taken as done
    check_same_model(stored, results_path, name, args.dtype, fingerprint)
    check_same_model(stored_trials, trials_path, name, args.dtype, fingerprint)
    output.mkdir(parents=True, exist_ok=True)
    done = {record.get("key") for record in stored}
    # a trial is found by its prompt's key (no trial count in it), so a run with more --trials reuses
    # the trials of a shorter one: the prompts are drawn in the same order
    finished_trials = {}
    for record in stored_trials:
        finished_trials[(record.get("prompt_key", record.get("key")), record.get("trial"))] = record
    identity = {"model": name, "model_fingerprint": fingerprint}
    native = int(model.config.max_position_embeddings)
    try:  # every configuration on this model before the first prompt, not after the ones before it
        configurations = check_configurations(model, specs, args.scale, original_max_length=native)
    except ValueError as error:
        parser.error(one_line(error))
    eos = getattr(tokenizer, "eos_token_id", None)
    pad = getattr(tokenizer, "pad_token_id", None)
    for spec, (method, params) in zip(specs, configurations):
        for task in tasks:
            for depth in depths:
                fields = {"config": spec, "scale": args.scale, "length": args.length, "task": task, "depth": depth,
                          "trials": args.trials, "seed": args.seed, "answer_logprob": args.answer_logprob}
                if args.dtype != "fp32":  # fp32 keys stay as they were, so earlier trials are still found
                    fields["dtype"] = args.dtype
                key = json.dumps(fields, sort_keys=True)
                prompt_key = json.dumps({**json.loads(key), "trials": None}, sort_keys=True)
                if key in done:
                    logger.info("%s %s depth %g: already done", spec, task, depth)
                    continue
                if method != "none":
                    patch_model(model, args.scale, method, original_max_length=native, **params)
                try:
                    rng = random.Random(trial_seed(args.seed, task, args.length, depth))
                    start = time.perf_counter()
                    trials = []
                    for number in range(1, args.trials + 1):
                        # every prompt is drawn, finished or not, so the generator stays in step
                        prompt = make_trial(task, tokenizer, args.length - MAX_NEW_TOKENS, depth, rng)
                        stored = finished_trials.get((prompt_key, number), finished_trials.get((key, number)))
                        reused = stored and _stored_trial(stored, prompt.answer, args.answer_logprob)
                        if reused:
                            trials.append(reused)
                            logger.info("%s %s depth %g: trial %d/%d already done", spec, task, depth, number, args.trials)
                            continue
                        if stored is not None:
                            logger.warning("%s: the record of trial %d of %s %s depth %g does not fit this prompt (key %r) "
                                           "or lacks a field; running it again", trials_path, number, spec, task, depth,
                                           prompt.answer)  # fmt: skip
                        trial_start = time.perf_counter()
                        new = greedy_generate(model, prompt.input_ids, MAX_NEW_TOKENS, eos_token_id=eos, pad_token_id=pad)
                        text = tokenizer.decode(new, skip_special_tokens=True)
                        trial = {"answer": prompt.answer, "output": text, "correct": grade(text, prompt.answer)}
                        if args.answer_logprob:
                            answer_ids = tokenizer(" " + prompt.answer, add_special_tokens=False)["input_ids"]
                            trial["answer_logprob"] = answer_logprob(model, prompt.input_ids, answer_ids)
                        trial["seconds"] = time.perf_counter() - trial_start
                        append_record(trials_path, {"key": key, "prompt_key": prompt_key, "trial": number, **trial,
                                                    "dtype": args.dtype, **identity})  # fmt: skip
                        trials.append(trial)
                        # one prompt takes minutes to an hour on a CPU: say where the case stands
                        logger.info("%s %s depth %g: trial %d/%d %r (%.0f s so far)", spec, task, depth, number,
                                    args.trials, text, time.perf_counter() - start)
                    seconds = sum(trial["seconds"] for trial in trials)  # resumed trials keep their own time
                finally:
                    if method != "none":
                        unpatch_model(model)
                record = {"key": key, "config": spec, "scale": args.scale, "length": args.length, "task": task,
                          "depth": depth, "correct": sum(t["correct"] for t in trials), "trials": trials,
                          "seconds": seconds, "dtype": args.dtype, **identity}
                append_record(results_path, record)
                done.add(key)
                logger.info("%s %s depth %g: %d/%d %s (%.0f s)", spec, task, depth, record["correct"], len(trials),
                            [t["output"] for t in trials], seconds)

    lines = ["| config | scale | length | dtype | task | depth | correct | outputs | answer log-prob (mean) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in read_records(results_path):
        scores = [t["answer_logprob"] for t in r["trials"] if "answer_logprob" in t]
        mean = f"{sum(scores) / len(scores):.2f}" if scores else ""
        outputs = "; ".join(repr(t["output"]) for t in r["trials"])
        lines.append(f"| {r['config']} | {r['scale']:g} | {r['length']} | {r.get('dtype', 'fp32')} | {r['task']} | {r['depth']:g} | "
                     f"{r['correct']}/{len(r['trials'])} | {outputs} | {mean} |")
    atomic_write_text(output / "table.md", "\n".join(lines) + "\n")
    logger.info("\n%s", "\n".join(lines))


if __name__ == "__main__":
    main()
