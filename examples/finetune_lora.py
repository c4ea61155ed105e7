r"""Fine-tune a RoPE model with LoRA to extend its context (PoSE windows optional).

One process (CPU or GPU); SmolLM2-135M-Instruct from 8k to 32k tokens with PoSE windows of
2048 tokens (60 steps took 787 s with yarn on 2 CPU cores, 1332 s with linear on a shared CPU):

    python examples/finetune_lora.py --model smollm2 --output_dir outputs/ft-yarn-x4 \
        --text_files ../shared/data/books/pg1342.txt ../shared/data/books/pg2701.txt \
        --method yarn --scale 4 --pose --window 2048 --lora_rank 16 --lora_alpha 32 --train_norms \
        --max_steps 60 --learning_rate 3e-4 --warmup_steps 5 --save_steps 20 --seed 0

Several processes (DDP; FSDP and DeepSpeed configs are in examples/accelerate_configs/). On a
machine without CUDA this starts CPU processes joined over gloo (`accelerate launch --cpu
--num_processes 2` would start only one, and is refused):

    accelerate launch --config_file examples/accelerate_configs/ddp.yaml examples/finetune_lora.py <same arguments>

Interrupted? Run the same command with --resume: it continues from the newest checkpoint in
<output_dir>/checkpoints at the same step and data position. Everything is written under
--output_dir: checkpoints/, adapter/, merged/ (loads with AutoModelForCausalLM.from_pretrained
after `import hf_rope_ext`), train_log.jsonl and training_summary.json. All arguments:
`python examples/finetune_lora.py --help`.
"""

from __future__ import annotations

import json
import logging
import sys

from transformers import HfArgumentParser

from hf_rope_ext.training import FinetuneConfig, finetune


def build_parser() -> HfArgumentParser:
    parser = HfArgumentParser(FinetuneConfig)
    # HfArgumentParser gives each `--no_X` of a boolean that defaults to True the help of `--X`.
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--no_"):
                action.help = f"turn off --{option.removeprefix('--no_')}"
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    (config,) = parser.parse_args_into_dataclasses(args=argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        summary = finetune(config)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if summary:  # the main process
        keys = ("method", "scale", "target_length", "pose", "steps", "tokens_seen", "tokens_per_second", "final_loss", "wall_time_s")
        print(json.dumps({key: summary[key] for key in keys}, indent=2))
        print(f"Adapter: {config.output_dir}/adapter")
        if summary["merged_dir"]:
            print(f"Merged model: {config.output_dir}/merged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
