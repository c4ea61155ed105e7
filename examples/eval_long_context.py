"""Long-context evaluation of RoPE scaling methods with the hf_rope_ext.evaluation library.

Loads the model once, then for every method and scale patches it, measures perplexity against
context length and passkey / needle retrieval, and unpatches it. Results are appended to
``<output_dir>/results.jsonl`` after every case (rerun the same command to resume) and summarised
in ``results.md``, ``results.csv``, ``summary.json`` and PNG plots in the same folder.

Run (CPU, SmolLM2, about 3 minutes on 2 cores)::

    python examples/eval_long_context.py --text_file ../shared/data/books/pg84.txt \\
        --methods none,yarn --scales 2 --ppl_lengths 4096,9216 \\
        --retrieval_tasks passkey --retrieval_lengths 9216 --depths 0.5 --trials 1 \\
        --output_dir outputs/eval_example

The same through the installed command line: ``hf-rope-ext eval --help``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from transformers import HfArgumentParser

from hf_rope_ext.evaluation import EvalPlan, run_evaluation
from hf_rope_ext.evaluation.runner import documents_from_files, parse_steps_per_doubling
from hf_rope_ext.loading import SMOLLM2_ALIASES, SMOLLM2_HUB_ID, load_model
from hf_rope_ext.patching import DEFAULT_STEPS_PER_DOUBLING


def _split(text: str, kind=str) -> list:
    return [kind(item) for item in text.split(",") if item.strip()]


@dataclass
class Arguments:
    text_file: list[str] = field(metadata={"help": "long text document(s) for perplexity"})
    output_dir: str = field(metadata={"help": "results.jsonl, reports and plots go here"})
    model: str = field(default="smollm2", metadata={"help": "'smollm2', a folder or a Hub id"})
    methods: str = field(default="none,yarn,dynamic-yarn", metadata={"help": "comma-separated; none = unpatched"})
    scales: str = field(default="2", metadata={"help": "comma-separated scales"})
    ppl_lengths: str = field(default="4096,9216", metadata={"help": "comma-separated context lengths"})
    ppl_modes: str = field(default="buckets", metadata={"help": "buckets and/or sliding"})
    stride: int = field(default=256, metadata={"help": "sliding-window stride"})
    retrieval_tasks: str = field(default="passkey", metadata={"help": "passkey and/or needle, or empty"})
    retrieval_lengths: str = field(default="9216", metadata={"help": "comma-separated total lengths"})
    depths: str = field(default="0.1,0.5,0.9", metadata={"help": "key depths"})
    trials: int = field(default=1, metadata={"help": "prompts per length and depth"})
    seed: int = field(default=0, metadata={"help": "seed of the random keys"})
    steps_per_doubling: str = field(default=str(DEFAULT_STEPS_PER_DOUBLING),
                                    metadata={"help": "frequency steps of length-dependent methods, or 'exact'"})
    device: str | None = field(default=None, metadata={"help": "cpu, cuda, ... (default: cuda if available)"})
    dtype: str = field(default="fp32", metadata={"help": "fp32, bf16 or fp16"})
    attn_implementation: str = field(default="sdpa", metadata={"help": "sdpa, eager or flash_attention_2"})


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    (args,) = HfArgumentParser(Arguments).parse_args_into_dataclasses()
    plan = EvalPlan(
        methods=_split(args.methods),
        scales=_split(args.scales, float),
        ppl_lengths=_split(args.ppl_lengths, int),
        ppl_modes=_split(args.ppl_modes),
        stride=args.stride,
        retrieval_tasks=_split(args.retrieval_tasks),
        retrieval_lengths=_split(args.retrieval_lengths, int),
        depths=_split(args.depths, float),
        trials=args.trials,
        seed=args.seed,
        steps_per_doubling=parse_steps_per_doubling(args.steps_per_doubling),
    )
    plan.validate(None)  # fail on bad input before loading the model
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device,
                                  attn_implementation=args.attn_implementation)  # fmt: skip
    documents = documents_from_files(tokenizer, args.text_file)
    name = SMOLLM2_HUB_ID if args.model.lower() in SMOLLM2_ALIASES else args.model
    run_evaluation(model, tokenizer, plan, args.output_dir, documents=documents, model_name=name, dtype=args.dtype)
    with open(f"{args.output_dir}/results.md", encoding="utf-8") as report:
        print(report.read())


if __name__ == "__main__":
    main()
