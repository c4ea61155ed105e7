"""Passkey retrieval and a harder multi-needle variant.

**Passkey** (Mohtashami & Jaggi 2023, arXiv 2305.16300; used by Position Interpolation, arXiv
2306.15595, and YaRN, arXiv 2309.00071): an instruction, then the filler "The grass is green. The
sky is blue. The sun is yellow. Here we go. There and back again." repeated, with
"The pass key is 12345. Remember it. 12345 is the pass key." inserted at a given depth, then
"What is the pass key? The pass key is". The model decodes greedily; a trial is correct when the
first run of digits in its output is the key.

**Needle** (harder: several keys, one asked for): ``needle_count`` lines
"The pass key for <name> is <5 digits>. Remember it." at different depths, the asked-for one at
the requested depth and the distractors at random depths, then
"What is the pass key for <name>? The pass key for <name> is".

Prompts are built from token ids, piece by piece, so a prompt has exactly the requested number of
tokens (BOS included). Needles go at the sentence boundary of the filler nearest to
``depth * filler_tokens`` (depth 0: right after the instruction, 1: right before the question);
the last filler sentence is cut to make the length exact. Keys come from a seeded generator, so
every method sees the same prompts.
"""

from __future__ import annotations

import logging
import numbers
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

__all__ = [
    "RetrievalPrompt",
    "RetrievalResult",
    "TASKS",
    "build_prompt",
    "grade",
    "greedy_generate",
    "make_trial",
    "needle_prompt",
    "passkey_prompt",
    "retrieval_accuracy",
]

TASKS = ("passkey", "needle")

INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
FILLER_SENTENCES = (
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.",
)  # fmt: skip
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key? The pass key is"
NEEDLE_LINE = "The pass key for {name} is {key}. Remember it."
NEEDLE_QUESTION = "What is the pass key for {name}? The pass key for {name} is"
NAMES = (
    "Alice", "Bruno", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Julia",
    "Kofi", "Lena", "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq",
)  # fmt: skip


@dataclass(frozen=True)
class RetrievalPrompt:
    """A prompt of exactly ``len(input_ids)`` tokens and the answer expected after it."""

    input_ids: list[int]
    answer: str
    target_start: int  # index of the asked-for needle's first token
    target_depth: float  # filler tokens before that needle / all filler tokens
    needle_starts: tuple[int, ...]  # first token of every needle, in prompt order


@dataclass
class RetrievalResult:
    trials: int = 0
    correct: int = 0
    answers: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return self.correct / self.trials if self.trials else float("nan")


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"])


def _filler(tokenizer, count: int) -> tuple[list[int], list[int]]:
    """At least ``count`` filler tokens, and the token offsets where sentences start (0 included)."""
    sentences = [_encode(tokenizer, " " + sentence) for sentence in FILLER_SENTENCES]
    tokens: list[int] = []
    starts = [0]
    index = 0
    while len(tokens) < count:
        tokens += sentences[index % len(sentences)]
        starts.append(len(tokens))
        index += 1
    return tokens, starts


def build_prompt(
    tokenizer,
    length: int,
    needles: Sequence[tuple[float, str]],
    question: str,
    answer: str,
    *,
    target: int = 0,
    add_bos: bool = True,
) -> RetrievalPrompt:
    """``[BOS] INTRO filler... needle ... filler QUESTION`` with exactly ``length`` tokens.

    Args:
        needles: ``(depth, text)`` pairs; depth in ``[0, 1]`` is the fraction of the filler tokens
            placed before the needle (rounded to the nearest sentence boundary).
        target: index in ``needles`` of the needle the question asks about.
    """
    if not needles:
        raise ValueError("A retrieval prompt needs at least one needle.")
    for depth, _ in needles:
        if not 0.0 <= float(depth) <= 1.0:
            raise ValueError(f"Needle depth must be between 0 and 1 (a fraction of the filler), got {depth}.")
    bos = getattr(tokenizer, "bos_token_id", None)
    head = ([bos] if add_bos and bos is not None else []) + _encode(tokenizer, INTRO)
    needle_ids = [_encode(tokenizer, " " + text) for _, text in needles]
    tail = _encode(tokenizer, " " + question)
    fixed = len(head) + sum(map(len, needle_ids)) + len(tail)
    filler_count = length - fixed
    if filler_count < len(needles):
        raise ValueError(
            f"A prompt of {length} tokens is too short: the instruction, needles and question alone take "
            f"{fixed} tokens. Use a length of at least {fixed + 64}."
        )
    filler, starts = _filler(tokenizer, filler_count)
    filler = filler[:filler_count]
    boundaries = [start for start in starts if start <= filler_count]
    if boundaries[-1] != filler_count:
        boundaries.append(filler_count)
    placements = []
    for index, (depth, _) in enumerate(needles):
        wanted = float(depth) * filler_count
        offset = min(boundaries, key=lambda start: (abs(start - wanted), start))
        placements.append((offset, index))
    placements.sort()

    ids = list(head)
    needle_starts = [0] * len(needles)
    cursor = 0
    for offset, index in placements:
        ids += filler[cursor:offset]
        needle_starts[index] = len(ids)
        ids += needle_ids[index]
        cursor = offset
    ids += filler[cursor:]
    ids += tail
    if len(ids) != length:  # cannot happen: the filler fills exactly the remaining tokens
        raise RuntimeError(f"Built a prompt of {len(ids)} tokens instead of {length}.")
    target_offset = next(offset for offset, index in placements if index == target)
    return RetrievalPrompt(
        input_ids=ids,
        answer=answer,
        target_start=needle_starts[target],
        target_depth=target_offset / filler_count,
        needle_starts=tuple(sorted(needle_starts)),
    )


def passkey_prompt(tokenizer, length: int, depth: float, key: int | str, *, add_bos: bool = True) -> RetrievalPrompt:
    """The passkey prompt with ``key`` at ``depth``."""
    key = str(key)
    needle = PASSKEY_NEEDLE.format(key=key)
    return build_prompt(tokenizer, length, [(depth, needle)], PASSKEY_QUESTION, key, add_bos=add_bos)


def needle_prompt(
    tokenizer,
    length: int,
    depth: float,
    keys: Sequence[tuple[str, int | str]],
    distractor_depths: Sequence[float],
    *,
    add_bos: bool = True,
) -> RetrievalPrompt:
    """Several ``(name, key)`` needles; the question asks for ``keys[0]``, placed at ``depth``,
    the others at ``distractor_depths``."""
    if len(keys) < 2 or len(distractor_depths) != len(keys) - 1:
        raise ValueError("needle_prompt needs at least two (name, key) pairs and one depth per distractor.")
    names = [name for name, _ in keys]
    if len(set(names)) != len(names):
        raise ValueError(f"Needle names must differ, got {names}.")
    needles = [(depth, NEEDLE_LINE.format(name=names[0], key=keys[0][1]))]
    needles += [(d, NEEDLE_LINE.format(name=name, key=key)) for d, (name, key) in zip(distractor_depths, keys[1:])]
    return build_prompt(
        tokenizer, length, needles, NEEDLE_QUESTION.format(name=names[0]), str(keys[0][1]), add_bos=add_bos
    )


def make_trial(
    task: str,
    tokenizer,
    length: int,
    depth: float,
    rng: random.Random,
    *,
    needle_count: int = 4,
    add_bos: bool = True,
) -> RetrievalPrompt:
    """One prompt of ``task`` with random 5-digit keys (and names, depths of distractors) from ``rng``."""
    if task == "passkey":
        return passkey_prompt(tokenizer, length, depth, rng.randint(10000, 99999), add_bos=add_bos)
    if task == "needle":
        if not 2 <= needle_count <= len(NAMES):
            raise ValueError(f"needle_count must be between 2 and {len(NAMES)}, got {needle_count}.")
        names = rng.sample(NAMES, needle_count)
        keys = rng.sample(range(10000, 100000), needle_count)
        distractors = [rng.random() for _ in range(needle_count - 1)]
        return needle_prompt(tokenizer, length, depth, list(zip(names, keys)), distractors, add_bos=add_bos)
    raise ValueError(f"Unknown retrieval task {task!r}; use one of {', '.join(TASKS)}.")


_DIGITS = re.compile(r"\d+")


def grade(output: str, answer: str) -> bool:
    """Correct when the first run of digits in ``output`` is exactly ``answer``."""
    found = _DIGITS.search(output)
    return found is not None and found.group() == answer


@torch.no_grad()
def greedy_generate(
    model: nn.Module, input_ids: Sequence[int], max_new_tokens: int, *, eos_token_id=None, pad_token_id=None
) -> list[int]:
    """Greedy continuation of one prompt (transformers' ``generate`` with a KV cache)."""
    from transformers import GenerationConfig

    device = model.get_input_embeddings().weight.device
    ids = torch.tensor([list(input_ids)], dtype=torch.long, device=device)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id if pad_token_id is not None else eos_token_id,
    )
    output = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return output[0, ids.shape[1] :].tolist()


def trial_seed(seed: int, task: str, length: int, depth: float) -> str:
    """Seed of a case's key generator: the same keys for every method and scale."""
    return f"{seed}:{task}:{length}:{depth:.6g}"


def retrieval_accuracy(
    model: nn.Module,
    tokenizer,
    task: str,
    length: int,
    depth: float,
    *,
    trials: int,
    seed: int = 0,
    needle_count: int = 4,
    max_new_tokens: int = 8,
    progress: bool = True,
) -> RetrievalResult:
    """Run ``trials`` prompts of ``task`` with ``length`` tokens in all, the answer included.

    The prompt has ``length - max_new_tokens`` tokens, so prompt plus answer fit in ``length``
    (with length-dependent methods this keeps generation at the frequencies of ``length``).
    """
    for name, value, minimum in (("trials", trials, 1), ("max_new_tokens", max_new_tokens, 1), ("length", length, 2),
                                 ("needle_count", needle_count, 2)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed must be an integer, got {seed!r}.")
    if isinstance(depth, bool) or not isinstance(depth, numbers.Real) or not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be a number between 0 and 1 (a fraction of the filler), got {depth!r}.")
    rng = random.Random(trial_seed(seed, task, length, depth))
    result = RetrievalResult()
    eos = getattr(tokenizer, "eos_token_id", None)
    pad = getattr(tokenizer, "pad_token_id", None)
    for _ in tqdm(range(trials), desc=f"{task} L={length} depth={depth:g}", leave=False, disable=not progress):
        prompt = make_trial(task, tokenizer, length - max_new_tokens, depth, rng, needle_count=needle_count)
        new_tokens = greedy_generate(model, prompt.input_ids, max_new_tokens, eos_token_id=eos, pad_token_id=pad)
        text = tokenizer.decode(new_tokens, skip_special_tokens=True)
        result.trials += 1
        result.correct += grade(text, prompt.answer)
        result.answers.append(prompt.answer)
        result.outputs.append(text)
        logger.debug("%s L=%d depth=%g: key %s, output %r", task, length, depth, prompt.answer, text)
    return result
