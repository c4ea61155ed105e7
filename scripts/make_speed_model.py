"""A random-weight checkpoint with SmolLM2-135M's shapes, for speed runs where no model can be
carried (the forward time does not depend on the weights; perplexities from it mean nothing).

    python scripts/make_speed_model.py FOLDER        # then: examples/benchmark_speed.py --model FOLDER ...

30 layers, hidden size 576, 9 query heads on 3 key heads of size 64, MLP 1536, vocabulary 49152,
native context 8192, rope_theta 1e5, bf16; with a word-level tokenizer (benchmark_speed.py needs
one, and feeds random token ids).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_rope_ext.arguments import ArgumentParser
from hf_rope_ext.files import atomic_directory


def main() -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="where to write the checkpoint (must not exist)")
    args = parser.parse_args()
    if args.folder.exists():
        parser.error(f"{args.folder} exists; give a new folder")
    try:
        # built beside the target and renamed into place: an interrupted run leaves no half checkpoint
        with atomic_directory(args.folder) as staging:
            write_checkpoint(staging)
    except OSError as error:
        parser.error(f"cannot write {args.folder}: {error.strerror or error} ({error.filename or args.folder})")
    except ValueError as error:  # the path's parent is a file, and the like (atomic_directory's checks)
        parser.error(str(error))


def write_checkpoint(folder: Path) -> None:
    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    vocabulary = {"<unk>": 0, **{f"w{i}": i for i in range(1, 1000)}}
    word_level = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="<unk>", eos_token="<unk>").save_pretrained(folder)


if __name__ == "__main__":
    main()
