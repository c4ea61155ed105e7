"""hf_rope_ext.evaluation: chunked loss, bucket and sliding-window perplexity, retrieval prompts,
the resumable runner, reports and the command line. Tiny random models, plus one real-model test."""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import stat
import time
from pathlib import Path

import pytest
import torch
from conftest import ORIGINAL_CONTEXT, make_model, random_ids, save_tiny_llama, smollm2_tokenizer
from test_examples import replacing_options
from torch import nn

from hf_rope_ext import DEFAULT_METHOD, get_patch_info, patch_model, unpatch_model
from hf_rope_ext.cli import main as cli_main
from hf_rope_ext.evaluation import (
    EvalPlan,
    EvaluationError,
    bucket_perplexity,
    needle_prompt,
    passkey_prompt,
    read_results,
    retrieval_accuracy,
    run_evaluation,
    sliding_window_perplexity,
    token_losses,
    write_reports,
)
from hf_rope_ext.evaluation import retrieval
from hf_rope_ext.evaluation.perplexity import buckets_of_losses
from hf_rope_ext.evaluation.summary import format_ppl, wilson_interval

SHARED_BOOK = Path(__file__).resolve().parents[2] / "shared" / "data" / "books" / "pg84.txt"


def reference_losses(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """l_t = -log p(x_t | x_<t) for t = 1..n-1 from the model's own full logits, in float64."""
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0].double()
    return -torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[1:, None])[:, 0]


class CharTokenizer:
    """One token per printable ASCII character (ids 3..97), BOS 1, EOS 2: fits the tiny models' vocab of 128."""

    bos_token_id = 1
    eos_token_id = 2
    pad_token_id = 0

    def __call__(self, text, add_special_tokens=False, return_attention_mask=False):
        return {"input_ids": [ord(char) - 29 for char in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i + 29) for i in ids if i >= 3)


# ----------------------------------------------------------------------------------------------
# Chunked loss and perplexity
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 7, 1000])
def test_chunked_loss_equals_full_logits_loss(family, chunk_size):
    model = make_model(family)
    ids = random_ids(45)[0]
    expected = reference_losses(model, ids)
    losses = token_losses(model, ids, chunk_size=chunk_size)
    assert losses.shape == (44,)
    torch.testing.assert_close(losses.double(), expected, atol=1e-5, rtol=1e-5)
    # Scoring from a later position gives the tail of the same losses.
    tail = token_losses(model, ids, first_target=30, chunk_size=chunk_size)
    torch.testing.assert_close(tail.double(), expected[29:], atol=1e-5, rtol=1e-5)


def test_token_losses_of_a_model_in_training_mode_are_measured_without_dropout():
    """A model left in training mode (dropout on) is scored in eval mode, as its eval-mode logits
    give, and every module gets its own mode back."""
    model = make_model("llama", attention_dropout=0.5)
    patch_model(model, 2, "yarn")
    ids = random_ids(50)[0]
    expected = reference_losses(model, ids)  # eval mode: the model's own logits, float64 cross-entropy
    model.train()
    model.model.layers[0].eval()  # mixed modes come back as they were
    torch.testing.assert_close(token_losses(model, ids, chunk_size=7).double(), expected, atol=1e-5, rtol=1e-5)
    assert model.training and model.model.layers[1].training and not model.model.layers[0].training


def test_chunked_loss_of_an_accelerate_offloaded_model():
    """Offloaded weights sit on the meta device; the input goes where accelerate runs the model."""
    from accelerate import cpu_offload

    model = make_model("llama")
    patch_model(model, 4, "yarn")
    ids = random_ids(3 * ORIGINAL_CONTEXT)[0]
    expected = reference_losses(model, ids)  # before offloading: the plain model's own logits
    cpu_offload(model, execution_device=torch.device("cpu"))
    assert model.get_input_embeddings().weight.device.type == "meta"
    torch.testing.assert_close(token_losses(model, ids, chunk_size=7).double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_the_fingerprint_of_an_offloaded_model_reads_its_offloaded_weights(tied):
    """Two models of one shape, offloaded, are told apart; a model offloaded has the fingerprint it
    had in memory (tied embeddings too, which offloading unties); one whose weights were never
    loaded (meta, no offloaded copy) is refused."""
    from accelerate import cpu_offload, init_empty_weights

    from hf_rope_ext.evaluation.runner import model_fingerprint

    first, second = (make_model("llama", seed=seed, tie_word_embeddings=tied) for seed in (0, 1))
    in_memory = model_fingerprint(first), model_fingerprint(second)
    assert in_memory[0] != in_memory[1]
    for model in (first, second):
        cpu_offload(model, execution_device=torch.device("cpu"))
    assert (model_fingerprint(first), model_fingerprint(second)) == in_memory
    with init_empty_weights():
        empty = make_model("llama")
    with pytest.raises(ValueError, match="on the meta device with no offloaded copy.*load its weights first"):
        model_fingerprint(empty)


def test_an_offloaded_model_whose_config_ties_a_head_it_replaced_keeps_that_head_in_its_fingerprint():
    """A config that declares the tie, and a model whose lm_head is a parameter of its own: the head
    enters the fingerprint offloaded as in memory, so two such models that differ only there differ."""
    from accelerate import cpu_offload

    from hf_rope_ext.evaluation.runner import model_fingerprint

    models = [make_model("llama", tie_word_embeddings=True) for _ in range(2)]
    for seed, model in enumerate(models):
        model.lm_head.weight = torch.nn.Parameter(torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(seed)))
    in_memory = [model_fingerprint(model) for model in models]
    assert in_memory[0] != in_memory[1]
    for model in models:
        cpu_offload(model, execution_device=torch.device("cpu"))
    assert [model_fingerprint(model) for model in models] == in_memory


def test_chunked_loss_on_patched_length_dependent_model():
    # Beyond the native context a length-dependent method must see the whole length in one forward.
    model = make_model("llama")
    patch_model(model, 4, "dynamic-yarn")
    ids = random_ids(3 * ORIGINAL_CONTEXT)[0]
    losses = token_losses(model, ids, chunk_size=5).double()
    torch.testing.assert_close(losses, reference_losses(model, ids), atol=1e-5, rtol=1e-5)


def test_bucket_perplexity_matches_direct_computation():
    model = make_model("qwen2")
    documents = [random_ids(60, seed=1)[0], random_ids(70, seed=2)[0]]
    length, boundaries = 48, [0, 10, 32, 48]
    result = bucket_perplexity(model, documents, length, boundaries=boundaries, chunk_size=8)
    losses = [reference_losses(model, document[:length]) for document in documents]  # losses[i] is l_{i+1}
    for index, (start, end) in enumerate(zip(boundaries[:-1], boundaries[1:])):
        pooled = torch.cat([doc_losses[max(start, 1) - 1 : end - 1] for doc_losses in losses])
        assert result.token_counts[index] == pooled.numel()
        assert math.isclose(result.bucket_ppls()[index][2], math.exp(pooled.mean().item()), rel_tol=1e-5)
    assert math.isclose(result.ppl, math.exp(torch.cat(losses).mean().item()), rel_tol=1e-5)
    assert result.tokens == 2 * (length - 1)


def test_buckets_of_losses_pools_each_token_once_by_its_position():
    # Token t (t >= 1) has loss l_t = losses[t - 1] and belongs to the bucket holding position t.
    losses = [0.5 + 0.01 * t for t in range(1, 20)]  # l_1 .. l_19 of a 20-token document
    result = buckets_of_losses(losses, [0, 1, 7, 20])
    expected = {0: [], 1: list(range(1, 7)), 2: list(range(7, 20))}
    assert result.token_counts == [len(expected[b]) for b in range(3)]
    for bucket, positions in expected.items():
        assert math.isclose(result.nll_sums[bucket], sum(0.5 + 0.01 * t for t in positions), rel_tol=1e-12)
    assert math.isclose(result.bucket_ppls()[2][2], math.exp(sum(0.5 + 0.01 * t for t in range(7, 20)) / 13))
    assert result.tokens == 19 and result.context_length == 20


@pytest.mark.parametrize("boundaries", [[0, 5, 19], [1, 20], [0, 7, 7, 20], [0, 21]])
def test_buckets_of_losses_rejects_boundaries_that_do_not_cover_the_document(boundaries):
    with pytest.raises(ValueError, match="boundaries must rise strictly from 0 to 20"):
        buckets_of_losses([1.0] * 19, boundaries)


def naive_sliding_window(model, ids: torch.Tensor, window: int, stride: int, bos: int | None):
    """Direct reading of the definition: windows every `stride` tokens, the last one ending at N,
    each scoring the tokens not scored before, with full logits."""
    body, prefix = (ids[1:], ids[:1]) if bos is not None and ids[0] == bos else (ids, ids[:0])
    room = window - len(prefix)
    total, count, scored_until = 0.0, 0, 0
    begin = 0
    while scored_until < len(body):
        end = min(begin + room, len(body))
        start = end - room
        tokens = torch.cat((prefix, body[start:end]))
        losses = reference_losses(model, tokens)  # losses[j] scores tokens[j + 1]
        for j in range(len(tokens) - 1):
            position_in_body = start + j + 1 - len(prefix)
            if position_in_body >= scored_until:
                total += losses[j].item()
                count += 1
        scored_until = end
        begin += stride
    return total, count


@pytest.mark.parametrize(
    "bos, window, stride, tokens",
    [(bos, *case) for bos in (None, 1) for case in ((16, 4, 50), (20, 7, 61), (24, 5, 24), (16, 15, 46))]
    + [(None, 16, 16, 48)],
)
def test_sliding_window_matches_naive_loop(bos, window, stride, tokens):
    model = make_model("llama")
    ids = random_ids(tokens, seed=3)[0]
    if bos is not None:
        ids[0] = bos
    result = sliding_window_perplexity(model, [ids], window, stride=stride, bos_token_id=bos, progress=False)
    total, count = naive_sliding_window(model, ids, window, stride, bos)
    assert result.tokens == count
    if bos is not None or stride < window:
        assert count == tokens - 1  # every token but the first scored exactly once
    else:  # disjoint windows without BOS: no window can predict its own first token
        assert count == tokens - tokens // window
    assert math.isclose(result.nll_sum, total, rel_tol=1e-5)
    assert math.isclose(result.ppl, math.exp(total / count), rel_tol=1e-5)


def test_sliding_window_with_one_window_equals_bucket_perplexity():
    model = make_model("mistral")
    ids = random_ids(40)[0]
    sliding = sliding_window_perplexity(model, [ids], 40, stride=8, progress=False)
    buckets = bucket_perplexity(model, [ids], 40)
    assert sliding.windows == 1 and math.isclose(sliding.ppl, buckets.ppl, rel_tol=1e-6)


def test_perplexity_rejects_short_documents_and_bad_settings():
    model = make_model("llama")
    with pytest.raises(ValueError, match="fewer than the requested context length of 64"):
        bucket_perplexity(model, [random_ids(40)[0]], 64)
    with pytest.raises(ValueError, match="stride must be between 1 and the window length"):
        sliding_window_perplexity(model, [random_ids(40)[0]], 16, stride=17, progress=False)
    with pytest.raises(ValueError, match="fewer than the requested context length"):
        sliding_window_perplexity(model, [random_ids(40)[0]], 16, max_tokens=50, progress=False)
    with_bos = random_ids(40)[0]
    with_bos[0] = 1
    with pytest.raises(ValueError, match="at most 15 when every window starts with BOS"):
        sliding_window_perplexity(model, [with_bos], 16, stride=16, bos_token_id=1, progress=False)


# ----------------------------------------------------------------------------------------------
# Retrieval prompts
# ----------------------------------------------------------------------------------------------


@pytest.fixture(params=["chars", "smollm2"], scope="module")
def tokenizer(request):
    return CharTokenizer() if request.param == "chars" else smollm2_tokenizer()


def _encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _find(sequence, part, start=0):
    for index in range(start, len(sequence) - len(part) + 1):
        if sequence[index : index + len(part)] == part:
            return index
    return -1


@pytest.mark.parametrize("length", [400, 1000, 4099])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_passkey_prompt_has_the_length_and_the_key_at_the_depth(tokenizer, length, depth):
    prompt = passkey_prompt(tokenizer, length, depth, 48213)
    ids = prompt.input_ids
    assert len(ids) == length
    head = [tokenizer.bos_token_id] + _encode(tokenizer, retrieval.INTRO)
    needle = _encode(tokenizer, " The pass key is 48213. Remember it. 48213 is the pass key.")
    question = _encode(tokenizer, " What is the pass key? The pass key is")
    assert ids[: len(head)] == head and ids[-len(question) :] == question
    start = _find(ids, needle)
    assert start == prompt.target_start and _find(ids, needle, start + 1) == -1
    # Depth = filler tokens before the needle / all filler tokens, to within one filler sentence.
    filler_total = length - len(head) - len(needle) - len(question)
    filler_before = start - len(head)
    longest_sentence = max(len(_encode(tokenizer, " " + s)) for s in retrieval.FILLER_SENTENCES)
    assert abs(filler_before / filler_total - depth) <= longest_sentence / filler_total
    # The haystack is the usual filler text.
    text = tokenizer.decode(ids[len(head) : start])
    if filler_before > 50:
        assert "The grass is green. The sky is blue. The sun is yellow." in text


def test_needle_prompt_places_target_and_distractors(tokenizer):
    keys = [("Alice", 11111), ("Bruno", 22222), ("Chen", 33333)]
    prompt = needle_prompt(tokenizer, 3000, 0.3, keys, [0.8, 0.05])
    ids = prompt.input_ids
    assert len(ids) == 3000 and prompt.answer == "11111"
    starts = {}
    for name, key in keys:
        line = _encode(tokenizer, f" The pass key for {name} is {key}. Remember it.")
        starts[name] = _find(ids, line)
        assert starts[name] >= 0 and _find(ids, line, starts[name] + 1) == -1
    assert starts["Chen"] < starts["Alice"] < starts["Bruno"]  # depths 0.05 < 0.3 < 0.8
    assert prompt.target_start == starts["Alice"]
    assert ids[-len(_encode(tokenizer, " What is the pass key for Alice? The pass key for Alice is")) :] == _encode(
        tokenizer, " What is the pass key for Alice? The pass key for Alice is"
    )
    assert abs(prompt.target_depth - 0.3) < 0.01


def test_prompt_too_short_and_bad_depth_are_rejected():
    tokenizer = CharTokenizer()
    with pytest.raises(ValueError, match="too short"):
        passkey_prompt(tokenizer, 100, 0.5, 12345)
    with pytest.raises(ValueError, match="between 0 and 1"):
        passkey_prompt(tokenizer, 1000, 1.5, 12345)


def test_grade_reads_the_first_number():
    assert retrieval.grade(" 12345. Remember", "12345")
    assert not retrieval.grade(" 54321 or 12345", "12345")
    assert not retrieval.grade(" The grass is green.", "12345")
    assert not retrieval.grade(" 123456", "12345")


class KeyReader(nn.Module):
    """A stand-in LM whose greedy answer is the digits after the first 'is ' of the needle line for
    the asked name (or of the passkey line): a model that retrieves perfectly."""

    def __init__(self, tokenizer):
        super().__init__()
        self.tokenizer = tokenizer
        self.embed = nn.Embedding(128, 4)
        self.prompts = []

    def get_input_embeddings(self):
        return self.embed

    def generate(self, ids, attention_mask=None, generation_config=None):
        text = self.tokenizer.decode(ids[0].tolist())
        self.prompts.append(len(ids[0]))
        asked = text.rsplit("What is the pass key", 1)[1]
        name = asked.split("for ", 1)[1].split("?")[0] if asked.startswith(" for") else None
        marker = f"The pass key for {name} is " if name else "The pass key is "
        key = text.split(marker, 1)[1][:5]
        answer = torch.tensor([_encode(self.tokenizer, f" {key}.")])
        return torch.cat((ids, answer[:, : generation_config.max_new_tokens]), dim=1)


@pytest.mark.parametrize("task", ["passkey", "needle"])
def test_retrieval_accuracy_counts_correct_answers_with_seeded_keys(task):
    tokenizer = CharTokenizer()
    reader = KeyReader(tokenizer)
    first = retrieval_accuracy(reader, tokenizer, task, 1200, 0.5, trials=4, seed=7, max_new_tokens=8, progress=False)
    assert (first.trials, first.correct) == (4, 4)
    assert reader.prompts == [1192] * 4  # prompt + answer budget = the requested length
    assert len(set(first.answers)) == 4 and all(len(key) == 5 for key in first.answers)
    again = retrieval_accuracy(reader, tokenizer, task, 1200, 0.5, trials=4, seed=7, progress=False)
    other = retrieval_accuracy(reader, tokenizer, task, 1200, 0.5, trials=4, seed=8, progress=False)
    assert again.answers == first.answers and other.answers != first.answers


# ----------------------------------------------------------------------------------------------
# Runner: resumption, reuse, bad input
# ----------------------------------------------------------------------------------------------


class CallCounter:
    def __init__(self, model, fail_after: int | None = None):
        self.calls = 0
        self.fail_after = fail_after
        model.get_decoder().register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise KeyboardInterrupt


def _plan(**overrides):
    settings = dict(
        methods=["none", "yarn", "dynamic-yarn"], scales=[2.0, 4.0], ppl_lengths=[24, 64], ppl_modes=["buckets"],
        bucket_size=8, retrieval_tasks=[], chunk_size=16,
    )
    settings.update(overrides)
    return EvalPlan(**settings)


def test_rerun_skips_finished_cases(tmp_path):
    model = make_model("llama")
    documents = {"doc": random_ids(80)[0]}
    counter = CallCounter(model)
    records = run_evaluation(model, CharTokenizer(), _plan(), tmp_path, documents=documents, progress=False)
    # none, yarn x2, yarn x4, dynamic-yarn x2, dynamic-yarn x4 at two lengths
    assert len(records) == 10 and len(read_results(tmp_path)) == 10
    first_calls = counter.calls
    assert first_calls > 0
    again = run_evaluation(model, CharTokenizer(), _plan(), tmp_path, documents=documents, progress=False)
    assert counter.calls == first_calls  # nothing recomputed
    assert len(read_results(tmp_path)) == 10 and [r["ppl"] for r in again] == [r["ppl"] for r in records]
    assert get_patch_info(model) is None


def test_interrupted_run_keeps_finished_cases_and_resumes(tmp_path):
    documents = {"doc": random_ids(80)[0]}
    plan = _plan(reuse_identical=False)
    model = make_model("llama")
    counter = CallCounter(model, fail_after=3)  # the first forward also checks the LM head: 2 calls per case
    with pytest.raises(KeyboardInterrupt):
        run_evaluation(model, CharTokenizer(), plan, tmp_path, documents=documents, progress=False)
    assert get_patch_info(model) is None  # restored even though the run broke off
    saved = read_results(tmp_path)
    assert 1 <= len(saved) < 10
    assert (tmp_path / "results.md").is_file()  # reports are written for what is done
    counter.fail_after = None
    counter.calls = 0
    records = run_evaluation(model, CharTokenizer(), plan, tmp_path, documents=documents, progress=False)
    assert len(records) == 10 and counter.calls == 10 - len(saved)  # one forward per remaining case

    # Same numbers as an uninterrupted run in a fresh folder.
    fresh = run_evaluation(make_model("llama"), CharTokenizer(), plan, tmp_path / "fresh", documents=documents,
                           progress=False)  # fmt: skip
    key = lambda r: (r["method"], r["scale"], r["context_length"])  # noqa: E731
    assert {key(r): r["ppl"] for r in records} == pytest.approx({key(r): r["ppl"] for r in fresh}, rel=1e-9)


def test_truncated_last_line_is_dropped_and_recomputed(tmp_path):
    model = make_model("llama")
    documents = {"doc": random_ids(80)[0]}
    plan = _plan(methods=["none"], scales=[], ppl_lengths=[24, 64])
    run_evaluation(model, CharTokenizer(), plan, tmp_path, documents=documents, progress=False)
    results = tmp_path / "results.jsonl"
    lines = results.read_text().splitlines()
    results.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])  # a write cut short
    counter = CallCounter(model)
    records = run_evaluation(model, CharTokenizer(), plan, tmp_path, documents=documents, progress=False)
    assert counter.calls == 1 and len(records) == 2
    assert all(json.loads(line) for line in results.read_text().splitlines())


def test_cut_off_results_file_reads_the_same_for_the_evaluation_and_the_model_card(tmp_path, caplog):
    """What Ctrl-C leaves in results.jsonl: the card skips the cut line with a warning naming it, and
    sees the records the evaluation resumes from."""
    pytest.importorskip("huggingface_hub")
    pytest.importorskip("jinja2")
    from hf_rope_ext.hub import save_patched
    from hf_rope_ext.model_card import load_eval_results

    model = make_model("llama")
    patch_model(model, 2.0, "yarn")
    checkpoint = save_patched(model, tmp_path / "checkpoint")
    unpatch_model(model)
    documents = {"doc": random_ids(80)[0]}
    plan = _plan(methods=["none", "yarn"], scales=[2.0], ppl_lengths=[24, 64], reuse_identical=False)
    output = tmp_path / "eval"
    run_evaluation(model, CharTokenizer(), plan, output, documents=documents, progress=False, write_report=False)
    results = output / "results.jsonl"
    lines = results.read_text().splitlines()
    assert len(lines) == 4
    results.write_text("\n".join(lines[:3]) + "\n" + lines[3][: len(lines[3]) // 2])  # a write cut short
    complete = [json.loads(line) for line in lines[:3]]

    with caplog.at_level(logging.WARNING):
        assert cli_main(["card", "--model-dir", str(checkpoint), "--base-model", "org/tiny-base", "--eval-dir",
                         str(output), "--output", str(tmp_path / "README.md")]) == 0  # fmt: skip
    assert f"{results}:4 is incomplete" in caplog.text
    assert f"| yarn | 2 | doc | buckets | 24 | — | {complete[2]['ppl']:.2f} |" in (tmp_path / "README.md").read_text()
    assert results.read_text().splitlines()[3] == lines[3][: len(lines[3]) // 2]  # the card only reads
    card_records, _ = load_eval_results(output)
    assert card_records == complete == read_results(output)

    counter = CallCounter(model)
    resumed = run_evaluation(model, CharTokenizer(), plan, output, documents=documents, progress=False)
    assert counter.calls == 1 and resumed[:3] == complete  # only the cut case runs again
    assert resumed[3]["ppl"] == pytest.approx(json.loads(lines[3])["ppl"], rel=1e-9)


def test_a_bad_line_that_is_not_the_cut_off_end_is_refused(tmp_path):
    results = tmp_path / "results.jsonl"
    record = json.dumps(_record("none", None, "a", 16, [[0, 16, 5.0]]))
    for text, line in ((f"{record}\n{{not json\n{record}\n", 2), (f"{record}\n{{not json\n", 2), ("[1, 2]\n", 1)):
        results.write_text(text)
        with pytest.raises(EvaluationError, match=f"results.jsonl:{line} "):
            read_results(tmp_path)


def test_results_file_without_final_newline_is_appended_on_a_fresh_line(tmp_path):
    model = make_model("llama")
    documents = {"doc": random_ids(80)[0]}
    run_evaluation(model, CharTokenizer(), _plan(methods=["none"], scales=[], ppl_lengths=[24]), tmp_path,
                   documents=documents, progress=False)  # fmt: skip
    results = tmp_path / "results.jsonl"
    written = results.read_text()
    results.write_text(written.rstrip("\n"))  # as an editor that strips the final newline leaves it
    run_evaluation(model, CharTokenizer(), _plan(methods=["none"], scales=[], ppl_lengths=[24, 64]), tmp_path,
                   documents=documents, progress=False)  # fmt: skip
    lines = results.read_text().splitlines()
    assert lines[0] == written.rstrip("\n")  # nothing already written is lost
    assert [json.loads(line)["context_length"] for line in lines] == [24, 64]
    assert len(read_results(tmp_path)) == 2  # and a later run reads every line


def test_documents_and_models_are_identified_by_content_not_name(tmp_path, caplog):
    model = make_model("llama")
    plan = _plan(methods=["none"], scales=[], ppl_lengths=[24])
    with caplog.at_level(logging.INFO, logger="hf_rope_ext.evaluation.runner"):
        first = run_evaluation(model, CharTokenizer(), plan, tmp_path, documents={"book": random_ids(80, seed=1)[0]},
                               model_name="my-model", progress=False)  # fmt: skip
    assert "documents by a hash of their tokens" in caplog.text
    # Another text saved under the same name: refused, not reported with the old text's numbers.
    with pytest.raises(EvaluationError, match="document named 'book' with other content"):
        run_evaluation(model, CharTokenizer(), plan, tmp_path, documents={"book": random_ids(80, seed=2)[0]},
                       model_name="my-model", progress=False)  # fmt: skip
    # Another checkpoint under the same name (other weights): refused too.
    with pytest.raises(EvaluationError, match="model named 'my-model' .* config or weights differ"):
        run_evaluation(make_model("llama", seed=5), CharTokenizer(), plan, tmp_path,
                       documents={"book": random_ids(80, seed=1)[0]}, model_name="my-model", progress=False)
    assert len(read_results(tmp_path)) == 1
    # The same text under another name is a new document; the same model and text resume.
    again = run_evaluation(model, CharTokenizer(), plan, tmp_path, documents={"book": random_ids(80, seed=1)[0]},
                           model_name="my-model", progress=False)  # fmt: skip
    assert again == first
    fresh = run_evaluation(model, CharTokenizer(), plan, tmp_path / "other",
                           documents={"book": random_ids(80, seed=2)[0]}, model_name="my-model", progress=False)
    assert fresh[0]["ppl"] != first[0]["ppl"]


def test_results_and_reports_get_the_users_umask_permissions(tmp_path):
    previous = os.umask(0o022)
    try:
        run_evaluation(make_model("llama"), CharTokenizer(), _plan(methods=["none"], scales=[], ppl_lengths=[24]),
                       tmp_path, documents={"doc": random_ids(80)[0]}, progress=False)  # fmt: skip
    finally:
        os.umask(previous)
    written = [path for path in tmp_path.iterdir() if path.is_file()]
    assert {"results.jsonl", "results.md"} <= {path.name for path in written}
    assert {path.name: stat.S_IMODE(path.stat().st_mode) for path in written} == {path.name: 0o644 for path in written}


def test_identical_cases_are_reused_and_equal_a_fresh_computation(tmp_path):
    documents = {"doc": random_ids(80)[0]}
    model = make_model("llama")
    counter = CallCounter(model)
    records = run_evaluation(model, CharTokenizer(), _plan(), tmp_path / "reuse", documents=documents, progress=False)
    reused = {(r["method"], r["scale"], r["context_length"]): r["reused_from"] for r in records}
    # Inside the native context (24 <= 32) dynamic-yarn is the original model. At 64 = 2 x 32 tokens
    # its scale is 64 / 32 = 2 whatever the configured scale: static yarn at scale 2.
    unpatched = {"method": "none", "scale": None, "steps_per_doubling": None}
    yarn_x2 = {"method": "yarn", "scale": 2.0, "steps_per_doubling": None}
    assert reused[("dynamic-yarn", 2.0, 24)] == unpatched and reused[("dynamic-yarn", 4.0, 24)] == unpatched
    assert reused[("dynamic-yarn", 2.0, 64)] == yarn_x2 and reused[("dynamic-yarn", 4.0, 64)] == yarn_x2
    assert reused[("yarn", 4.0, 64)] is None and reused[("yarn", 2.0, 24)] is None
    assert counter.calls == 2 + 2 + 4  # head check; none at two lengths, yarn x2 and x4 at two lengths

    fresh = run_evaluation(make_model("llama"), CharTokenizer(), _plan(reuse_identical=False), tmp_path / "fresh",
                           documents=documents, progress=False)  # fmt: skip
    key = lambda r: (r["method"], r["scale"], r["context_length"])  # noqa: E731
    assert {key(r): r["ppl"] for r in records} == {key(r): r["ppl"] for r in fresh}


def test_frequency_steps_are_part_of_a_case(tmp_path):
    """Results of one frequency grid are never taken for another's, nor old records without one."""
    documents = {"doc": random_ids(80)[0]}
    model = make_model("llama")

    def plan(steps):
        return _plan(methods=["dynamic-yarn"], scales=[2.0], ppl_lengths=[48], steps_per_doubling=steps)

    counter = CallCounter(model)
    fine = run_evaluation(model, CharTokenizer(), plan(4), tmp_path, documents=documents, progress=False)
    assert fine[0]["steps_per_doubling"] == 4
    calls = counter.calls
    default = run_evaluation(model, CharTokenizer(), plan(1), tmp_path, documents=documents, progress=False)
    assert counter.calls == calls + 1  # computed, not taken from the 4-step record
    assert default[0]["steps_per_doubling"] == 1 and default[0]["reused_from"] is None
    # 48 tokens past a native 32: the 1-step grid uses the frequencies of 64 tokens, the 4-step grid those of 54.
    reference = make_model("llama")
    expected = {}
    for steps in (1, 4):
        patch_model(reference, scale=2.0, method="dynamic-yarn", steps_per_doubling=steps)
        with torch.no_grad():
            logits = reference(documents["doc"][None, :48]).logits[0, :-1].double()
        unpatch_model(reference)
        expected[steps] = math.exp(torch.nn.functional.cross_entropy(logits, documents["doc"][1:48]).item())
    assert expected[1] != pytest.approx(expected[4], rel=1e-6)
    assert default[0]["ppl"] == pytest.approx(expected[1], rel=1e-5)
    assert fine[0]["ppl"] == pytest.approx(expected[4], rel=1e-5)
    markdown = (tmp_path / "results.md").read_text()
    # Neither is the default (exact lengths): both name their steps.
    assert "dynamic-yarn (1 steps/doubling) x2" in markdown and "dynamic-yarn (4 steps/doubling) x2" in markdown

    # A record written before steps were recorded does not count as done for a length-dependent method.
    results = tmp_path / "results.jsonl"
    old = [json.loads(line) for line in results.read_text().splitlines()]
    for record in old:
        record.pop("steps_per_doubling")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "results.jsonl").write_text("".join(json.dumps(record) + "\n" for record in old[:1]))
    counter.calls = 0
    run_evaluation(model, CharTokenizer(), plan(4), tmp_path / "old", documents=documents, progress=False,
                   write_report=False)  # fmt: skip
    records = read_results(tmp_path / "old")
    assert len(records) == 2 and records[1]["steps_per_doubling"] == 4
    assert records[1]["ppl"] == pytest.approx(expected[4], rel=1e-5)

    with pytest.raises(EvaluationError, match="steps_per_doubling"):
        run_evaluation(model, CharTokenizer(), plan(0), tmp_path, documents=documents, progress=False)


def test_runner_retrieval_cases_record_the_schema(tmp_path):
    tokenizer = CharTokenizer()
    model = make_model("llama")
    plan = EvalPlan(methods=["none", "linear"], scales=[2.0], retrieval_tasks=["passkey", "needle"],
                    retrieval_lengths=[400], depths=[0.2, 0.8], trials=2, needle_count=3, max_new_tokens=4)  # fmt: skip
    records = run_evaluation(model, tokenizer, plan, tmp_path, native_context=256, progress=False)
    assert len(records) == 2 * 2 * 2
    for record in records:
        assert record["kind"] == "retrieval" and record["trials"] == 2 and record["length"] == 400
        assert record["accuracy"] == record["correct"] / 2 and len(record["answers"]) == len(record["outputs"]) == 2
        assert record["needle_count"] == (3 if record["task"] == "needle" else None)
    # The same keys for both model states.
    by_state = {}
    for record in records:
        by_state.setdefault((record["task"], record["depth"]), []).append(record["answers"])
    assert all(answers[0] == answers[1] for answers in by_state.values())


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"methods": ["none", "yarnn"]}, "Unknown method.*'yarnn'.*Known: none"),
        ({"scales": [0.5]}, "Scales must be numbers > 1"),
        ({"scales": []}, "need at least one scale"),
        ({"ppl_lengths": [16, 32]}, "within the model's own context of 32 tokens"),
        ({"ppl_modes": ["buckets", "windows"]}, "Unknown perplexity mode"),
        ({"retrieval_tasks": ["passkey"], "retrieval_lengths": []}, "need --retrieval-lengths"),
        ({"ppl_lengths": [], "retrieval_tasks": []}, "Nothing to evaluate"),
        ({"depths": [1.5], "retrieval_tasks": ["passkey"], "retrieval_lengths": [512]}, "between 0 and 1"),
        # a pair the patch refuses, found before the configurations ahead of it run
        ({"methods": ["none", "yarn", "longrope"]}, "longrope at scale 2: .*needs parameter.*long_factor"),
        ({"scales": [2.0, 1.001]}, "yarn at scale 1.001: .*less than half a token"),
        # a value listed twice would be computed and counted twice
        ({"ppl_lengths": [24, 64, 64]}, "64 is listed twice in ppl_lengths"),
        ({"scales": [2.0, 2]}, "2.0 is listed twice in scales"),
        ({"ppl_modes": ["buckets", "buckets"]}, "buckets is listed twice in ppl_modes"),
        ({"retrieval_tasks": ["passkey", "passkey"], "retrieval_lengths": [64]}, "passkey is listed twice"),
        ({"retrieval_tasks": ["passkey"], "retrieval_lengths": [136, 136]}, "136 is listed twice in retrieval_lengths"),
        ({"retrieval_tasks": ["passkey"], "retrieval_lengths": [136], "depths": [0.5, 0.5]},
         "0.5 is listed twice in depths"),
        # an option that would be ignored
        ({"sliding_tokens": 100}, "applies to sliding-window perplexity only"),
    ],
)
def test_bad_plans_get_clear_errors(overrides, message):
    with pytest.raises(EvaluationError, match=message):
        _plan(**overrides).validate(ORIGINAL_CONTEXT)


def test_short_document_is_rejected_before_any_work(tmp_path):
    model = make_model("llama")
    counter = CallCounter(model)
    with pytest.raises(EvaluationError, match=r"shorter than the 64 tokens requested: doc \(50 tokens\)"):
        run_evaluation(model, CharTokenizer(), _plan(), tmp_path, documents={"doc": random_ids(50)[0]}, progress=False)
    assert counter.calls == 0 and not (tmp_path / "results.jsonl").exists()


# ----------------------------------------------------------------------------------------------
# Reports
# ----------------------------------------------------------------------------------------------


def _record(method, scale, document, length, buckets, **extra):
    tokens = sum(end - max(start, 1) for start, end, _ in buckets)
    nll = sum(math.log(ppl) * (end - max(start, 1)) for start, end, ppl in buckets) / tokens
    return {"kind": "perplexity", "mode": "buckets", "method": method, "scale": scale, "model": "m", "dtype": "fp32",
            "document": document, "context_length": length, "stride": None, "eval_tokens": None, "bucket_size": 4,
            "buckets": buckets, "ppl": math.exp(nll), "nll": nll, "tokens": tokens, "native_context": 8,
            "rope_fingerprint": "x", "seconds": 1.0, "reused_from": None, **extra}  # fmt: skip


def _retrieval_record(depth, correct, outputs):
    """A passkey record of 2 trials at 16 tokens, as the runner writes it."""
    return {"kind": "retrieval", "task": "passkey", "method": "none", "scale": None, "model": "m", "dtype": "fp32",
            "length": 16, "depth": depth, "trials": 2, "seed": 0, "needle_count": None, "max_new_tokens": 8,
            "correct": correct, "accuracy": correct / 2, "answers": ["1", "2"], "outputs": outputs,
            "reused_from": None}  # fmt: skip


def test_reports_pool_documents_and_write_every_file(tmp_path):
    records = [
        _record("none", None, "a", 16, [[0, 4, 10.0], [4, 8, 8.0], [8, 12, 90.0], [12, 16, 120.0]]),
        _record("none", None, "b", 16, [[0, 4, 12.0], [4, 8, 6.0], [8, 12, 70.0], [12, 16, 100.0]]),
        _record("yarn", 2.0, "a", 16, [[0, 4, 11.0], [4, 8, 8.5], [8, 12, 9.0], [12, 16, 9.5]]),
        _record("yarn", 2.0, "b", 16, [[0, 4, 13.0], [4, 8, 6.5], [8, 12, 7.0], [12, 16, 7.5]]),
        _retrieval_record(depth=0.1, correct=1, outputs=["1", "3"]),
        _retrieval_record(depth=0.9, correct=0, outputs=["4", "3"]),
    ]  # fmt: skip
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    written = write_reports(tmp_path)
    names = {path.name for path in written}
    assert {"summary.json", "results.csv", "results.md", "perplexity_by_position.png", "perplexity_vs_length.png",
            "retrieval_passkey.png"} <= names  # fmt: skip
    for name in ("perplexity_by_position.png", "perplexity_vs_length.png", "retrieval_passkey.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    summary = json.loads((tmp_path / "summary.json").read_text())
    none = next(row for row in summary["perplexity"] if row["method"] == "none")
    # Pooled by tokens: bucket [0, 4) scores 3 tokens per document, the others 4.
    logs = [(10, 3), (8, 4), (90, 4), (120, 4), (12, 3), (6, 4), (70, 4), (100, 4)]
    expected = math.exp(sum(math.log(p) * n for p, n in logs) / sum(n for _, n in logs))
    assert none["ppl"] == pytest.approx(expected, rel=1e-9) and none["tokens"] == 30
    beyond = math.exp((4 * (math.log(90) + math.log(120) + math.log(70) + math.log(100))) / 16)
    assert none["beyond_native_ppl"] == pytest.approx(beyond, rel=1e-9)
    passkey = summary["retrieval"][0]
    assert (passkey["trials"], passkey["correct"], passkey["by_depth"]) == (4, 1, {"0.1": 0.5, "0.9": 0.0})

    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    # yarn x2 on document a, from its buckets: 3 tokens in [0, 4), 4 in each other bucket.
    yarn_a = math.exp((3 * math.log(11.0) + 4 * (math.log(8.5) + math.log(9.0) + math.log(9.5))) / 15)
    assert len(rows) == 6 and rows[0]["method"] == "none" and float(rows[2]["ppl"]) == pytest.approx(yarn_a)
    markdown = (tmp_path / "results.md").read_text()
    yarn = [(11, 3), (8.5, 4), (9, 4), (9.5, 4), (13, 3), (6.5, 4), (7, 4), (7.5, 4)]
    yarn_pooled = math.exp(sum(math.log(p) * n for p, n in yarn) / sum(n for _, n in yarn))
    assert f"| none | {expected:.2f} |" in markdown and f"| yarn x2 | {yarn_pooled:.2f} |" in markdown
    assert "| none | 25% (1/4; 5%-70%) |" in markdown  # Wilson 95% for 1/4: 0.046-0.699
    assert f"| none | {beyond:.2f} |" in markdown  # the table of positions beyond the native context


@pytest.mark.parametrize("correct, trials", [(0, 2), (1, 4), (4, 6), (5, 6), (6, 6), (37, 100)])
def test_wilson_interval_bounds_solve_the_score_test(correct, trials):
    """Each bound p0 of the Wilson interval is where the score statistic
    (p - p0) / sqrt(p0 (1 - p0) / n) equals -+1.96 (or 0 / 1 at an edge)."""
    low, high = wilson_interval(correct, trials)
    p, z = correct / trials, 1.959963984540054
    for bound, sign in ((low, 1), (high, -1)):
        if bound in (0.0, 1.0):
            assert (bound == 0.0 and correct == 0) or (bound == 1.0 and correct == trials)
            continue
        assert (p - bound) / math.sqrt(bound * (1 - bound) / trials) == pytest.approx(sign * z, rel=1e-9)
    assert low <= p <= high


def test_report_of_an_edited_retrieval_record_shows_inconsistent_counts(tmp_path, caplog):
    """More correct answers than trials (a hand-edited results.jsonl): the report is still written
    and names the cell, instead of failing on the interval."""
    record = _retrieval_record(depth=0.1, correct=5, outputs=["1", "3"])
    (tmp_path / "results.jsonl").write_text(json.dumps(record) + "\n")
    with caplog.at_level("WARNING", logger="hf_rope_ext.evaluation.report"):
        write_reports(tmp_path)
    assert "| none | 250% (5/2; counts inconsistent) |" in (tmp_path / "results.md").read_text()
    assert any("counts are inconsistent" in r.getMessage() for r in caplog.records)


def test_wilson_interval_of_four_in_six_and_bad_counts():
    assert wilson_interval(4, 6) == pytest.approx((0.3000, 0.9032), abs=1e-4)  # by hand: center 0.6016, half 0.3016
    for correct, trials in ((1, 0), (-1, 4), (5, 4)):
        with pytest.raises(ValueError, match="0 <= correct <= trials"):
            wilson_interval(correct, trials)


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def test_cli_reports_bad_input_without_traceback(tmp_path, capsys):
    code = cli_main(["eval", "--text-file", str(tmp_path / "missing.txt"), "--ppl-lengths", "16k",
                     "--output-dir", str(tmp_path)])  # fmt: skip
    assert code == 2
    assert "Text file not found" in capsys.readouterr().err
    book = tmp_path / "book.txt"
    book.write_text("word " * 100)
    code = cli_main(["eval", "--text-file", str(book), "--methods", "none,yarm", "--ppl-lengths", "16k",
                     "--output-dir", str(tmp_path)])  # fmt: skip
    assert code == 2 and "Unknown method(s) 'yarm'" in capsys.readouterr().err
    code = cli_main(["eval", "--text-file", str(book), "--attn-implementation", "flash_attention_2",
                     "--ppl-lengths", "16k", "--output-dir", str(tmp_path)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and ("flash-attn" in err or "CUDA" in err)
    code = cli_main(["demo", "--output-dir", str(tmp_path)])
    assert code == 2 and "--text-file" in capsys.readouterr().err
    code = cli_main(["eval", "--report-only", "--output-dir", str(tmp_path / "empty")])
    assert code == 2 and "No results.jsonl" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A tiny random Llama (native context 256) saved with the SmolLM2 tokenizer, for the commands."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"), native_context=256)


def test_eval_and_demo_commands_end_to_end(tiny_checkpoint, tmp_path, capsys):
    book = tmp_path / "book.txt"
    book.write_text(" ".join(f"Line {i} of a long and winding story." for i in range(400)))
    output = tmp_path / "eval"
    command = ["eval", "--model", str(tiny_checkpoint), "--device", "cpu", "--text-file", str(book),
               "--methods", "none,yarn,dynamic-yarn", "--scales", "2", "--ppl-lengths", "128,384",
               "--ppl-modes", "buckets,sliding", "--stride", "64", "--retrieval-tasks", "passkey,needle",
               "--retrieval-lengths", "512", "--depths", "0.5", "--trials", "2", "--output-dir", str(output),
               "--no-progress"]  # fmt: skip
    assert cli_main(command) == 0
    printed = capsys.readouterr().out
    assert "### Perplexity of the first L tokens" in printed and "### passkey retrieval accuracy" in printed
    records = read_results(output)
    # 3 states x (2 lengths x 2 modes + 2 tasks x 1 length x 1 depth)
    assert len(records) == 3 * (4 + 2)
    sliding = [r for r in records
               if r.get("mode") == "sliding" and r["method"] == "none" and r["context_length"] == 128]  # fmt: skip
    assert sliding[0]["windows"] == 1 + math.ceil((384 - 128) / 64) and sliding[0]["stride"] == 64
    assert {"summary.json", "results.csv", "results.md", "perplexity_by_position.png", "retrieval_passkey.png",
            "retrieval_needle.png"} <= {path.name for path in output.iterdir()}  # fmt: skip
    before = (output / "results.jsonl").read_text()
    assert cli_main(command) == 0  # a rerun finds everything done
    assert (output / "results.jsonl").read_text() == before

    demo_dir = tmp_path / "demo"
    assert cli_main(["demo", "--model", str(tiny_checkpoint), "--device", "cpu", "--text-file", str(book),
                     "--output-dir", str(demo_dir), "--no-progress"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "| perplexity of tokens 128-256 (one forward of 384) |" in printed
    assert "| passkey retrieved at 384 tokens (depths 0.25, 0.75) |" in printed
    assert f"patched: {DEFAULT_METHOD} x2" in printed


def test_auto_command_prints_the_table_and_the_call(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_ROPE_EXT_CACHE", str(tmp_path / "cache"))
    book = tmp_path / "book.txt"
    book.write_text(" ".join(f"Line {i} of a long and winding story." for i in range(200)))
    command = ["auto", "--model", str(tiny_checkpoint), "--device", "cpu", "--text-files", str(book), "--scale", "2",
               "--candidates", "yarn;self-extend:neighbor_window=64"]  # fmt: skip
    assert cli_main(command) == 0
    printed = capsys.readouterr().out
    assert "calibration 512 tokens" in printed and "| self-extend:neighbor_window=64" in printed
    assert "best: " in printed and "patch_model(model, scale=2, method=" in printed
    assert cli_main([*command, "--json"]) == 0
    choice = json.loads(capsys.readouterr().out)
    assert choice["from_cache"] and choice["length"] == 512 and choice["chosen"] in printed
    assert cli_main([*command[:-1], "yarn;no-such-method"]) == 2
    assert "Unknown RoPE method 'no-such-method'" in capsys.readouterr().err
    assert cli_main([*command, "--length", "100"]) == 2
    assert "longer than the native context of 256 tokens" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# The real model
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_model_loss_beyond_native_context_unpatched_vs_patched():
    """SmolLM2 (native context 8192) on 2048 tokens of a novel: the first 1024 tokens at positions
    0..1023, the next 1024 at positions 15360..16383, the end of a 16k context (as PoSE lays out
    positions), so the second half sits beyond the native context and attends across 14k-16k
    tokens. The unpatched model's loss there is far above the patched model's, which stays near
    the loss of the same tokens at ordinary positions.

    Why not one real 9k-token forward: on this novel the unpatched model degrades only gradually
    past 8192 (measured: ppl 30.1 unpatched vs 30.1 patched at 8192-9215, 97 vs about 30 only near
    12k), so a convincing contrast would need two 12k+ forwards, minutes of CPU; the demo and the
    results table measure real long inputs.
    """
    if not SHARED_BOOK.is_file():
        pytest.skip(f"{SHARED_BOOK} not found")
    from hf_rope_ext.data import read_text, tokenize
    from hf_rope_ext.loading import load_model

    try:
        model, tokenizer = load_model("smollm2", device="cpu")
    except (FileNotFoundError, ImportError) as error:
        pytest.skip(f"SmolLM2 unavailable: {error}")
    native = model.config.max_position_embeddings
    assert native == 8192
    ids = tokenize(tokenizer, read_text(SHARED_BOOK))[:2048]
    far = torch.cat((torch.arange(1024), torch.arange(2 * native - 1024, 2 * native)))

    def ppl_of_second_half(positions=None):
        losses = token_losses(model, ids, first_target=1024, position_ids=positions)
        return math.exp(losses.double().mean().item())

    started = time.perf_counter()
    near = ppl_of_second_half()
    none_far = ppl_of_second_half(far)
    patch_model(model, 2, DEFAULT_METHOD)
    try:
        patched_far = ppl_of_second_half(far)
    finally:
        unpatch_model(model)
    print(f"\nppl of tokens 1024-2047 at positions 1024-2047: {near:.2f}; at 15360-16383: unpatched {none_far:.2f}, "
          f"{DEFAULT_METHOD} x2 {patched_far:.2f} ({time.perf_counter() - started:.1f} s)")  # fmt: skip
    assert none_far > 10 * patched_far  # the unpatched model breaks down beyond its context
    assert patched_far < 1.5 * near  # the patched one stays close to its in-context loss


def test_steps_per_doubling_on_the_command_line():
    from hf_rope_ext.evaluation.records import parse_steps_per_doubling

    assert parse_steps_per_doubling("exact") is None and parse_steps_per_doubling("4") == 4
    for bad in ("0", "-2", "two", "1.5"):
        with pytest.raises(ValueError, match="positive integer or 'exact'"):
            parse_steps_per_doubling(bad)
    with pytest.raises(SystemExit):
        cli_main(["eval", "--methods", "dynamic", "--steps-per-doubling", "0", "--output-dir", "unused"])


def _example_module(name: str, script: str = "compare_retrieval.py"):
    """An example script (default compare_retrieval.py) as a fresh module (its own globals, so
    monkeypatching stays per test)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "examples" / script
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compare_retrieval_example_matches_the_library_and_resumes(tiny_checkpoint, tmp_path, monkeypatch):
    """examples/compare_retrieval.py: the evaluation tool's prompts and greedy outputs for configurations with
    parameters, and a teacher-forced answer log-probability equal to a float64 log-softmax of the full logits."""
    import random
    import sys

    from hf_rope_ext import patch_model, unpatch_model
    from hf_rope_ext.evaluation.retrieval import make_trial, retrieval_accuracy, trial_seed
    from hf_rope_ext.loading import load_model

    module = _example_module("compare_retrieval")
    output = tmp_path / "out"
    configs = "yarn;self-extend:neighbor_window=64,far_positions=by-parts"
    argv = ["compare_retrieval.py", "--model", str(tiny_checkpoint), "--length", "512", "--scale", "2", "--configs",
            configs, "--tasks", "passkey", "--depths", "0.5", "--trials", "2", "--answer-logprob", "--output-dir",
            str(output)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    module.main()
    records = [json.loads(line) for line in (output / "results.jsonl").read_text().splitlines()]
    assert [r["config"] for r in records] == ["yarn", "self-extend:neighbor_window=64,far_positions=by-parts"]

    model, tokenizer = load_model(str(tiny_checkpoint), device="cpu")
    for record, (method, params) in zip(records, [("yarn", {}), ("self-extend", {"neighbor_window": 64, "far_positions": "by-parts"})]):
        patch_model(model, 2, method, **params)
        expected = retrieval_accuracy(model, tokenizer, "passkey", 512, 0.5, trials=2, progress=False)
        assert [t["output"] for t in record["trials"]] == expected.outputs
        assert record["correct"] == expected.correct
        rng = random.Random(trial_seed(0, "passkey", 512, 0.5))
        for trial in record["trials"]:
            prompt = make_trial("passkey", tokenizer, 504, 0.5, rng)
            answer = tokenizer(" " + prompt.answer, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logits = model(torch.tensor([prompt.input_ids + answer])).logits[0].double()
            logprobs = torch.log_softmax(logits, dim=-1)
            reference = sum(float(logprobs[len(prompt.input_ids) - 1 + k, token]) for k, token in enumerate(answer))
            assert trial["answer"] == prompt.answer
            assert trial["answer_logprob"] == pytest.approx(reference, abs=1e-3)
        unpatch_model(model)

    before = (output / "results.jsonl").read_text()
    module.main()  # a rerun finds every case done
    assert (output / "results.jsonl").read_text() == before
    assert "| yarn | 2 | 512 | fp32 | passkey | 0.5 |" in (output / "table.md").read_text()


def test_compare_retrieval_example_resumes_inside_a_case(tiny_checkpoint, tmp_path, monkeypatch):
    """A run stopped after the first trial of a case keeps that trial: the rerun generates only the
    second prompt, and the case equals an uninterrupted run (the library's outputs for the same patch)."""
    import sys

    from hf_rope_ext import patch_model
    from hf_rope_ext.evaluation.retrieval import retrieval_accuracy
    from hf_rope_ext.loading import load_model

    module = _example_module("compare_retrieval_resume")
    output = tmp_path / "out"
    argv = ["compare_retrieval.py", "--model", str(tiny_checkpoint), "--length", "512", "--scale", "2", "--configs",
            "self-extend:neighbor_window=64", "--tasks", "passkey", "--depths", "0.5", "--trials", "2",
            "--output-dir", str(output)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    real_generate = module.greedy_generate
    prompts = []

    def stopped_at_second(model, input_ids, *args, **kwargs):
        prompts.append(list(input_ids))
        if len(prompts) == 2:
            raise KeyboardInterrupt  # Ctrl-C during the second prompt
        return real_generate(model, input_ids, *args, **kwargs)

    monkeypatch.setattr(module, "greedy_generate", stopped_at_second)
    with pytest.raises(SystemExit) as stopped:  # Ctrl-C: one line and exit 130
        module.main()
    assert stopped.value.code == 130
    assert not (output / "results.jsonl").exists()
    (first,) = [json.loads(line) for line in (output / "trials.jsonl").read_text().splitlines()]
    assert first["trial"] == 1

    def counted(model, input_ids, *args, **kwargs):
        prompts.append(list(input_ids))
        return real_generate(model, input_ids, *args, **kwargs)

    monkeypatch.setattr(module, "greedy_generate", counted)
    module.main()
    assert len(prompts) == 3 and prompts[2] == prompts[1]  # only the interrupted prompt ran again
    (record,) = [json.loads(line) for line in (output / "results.jsonl").read_text().splitlines()]
    model, tokenizer = load_model(str(tiny_checkpoint), device="cpu")
    patch_model(model, 2, "self-extend", neighbor_window=64)
    expected = retrieval_accuracy(model, tokenizer, "passkey", 512, 0.5, trials=2, progress=False)
    assert [t["output"] for t in record["trials"]] == expected.outputs
    assert [t["answer"] for t in record["trials"]] == expected.answers
    assert record["correct"] == expected.correct

    # An edited trial record that no longer fits its prompt is run again, not trusted; a second
    # record cut off by an interrupted write is dropped and run again, and leaves no broken line.
    lines = (output / "trials.jsonl").read_text().splitlines()
    edited = dict(json.loads(lines[0]), answer="00000")
    (output / "trials.jsonl").write_text(json.dumps(edited) + "\n" + lines[1][: len(lines[1]) // 2])
    (output / "results.jsonl").unlink()
    module.main()
    assert len(prompts) == 5  # both trials generated again
    (again,) = [json.loads(line) for line in (output / "results.jsonl").read_text().splitlines()]
    assert [t["output"] for t in again["trials"]] == expected.outputs
    assert all(json.loads(line) for line in (output / "trials.jsonl").read_text().splitlines())


def test_compare_retrieval_example_runs_only_the_new_trials_when_trials_grow(tiny_checkpoint, tmp_path, monkeypatch):
    """A rerun with a larger --trials reuses the finished trials (same prompts, drawn in the same order)
    and generates only the new ones; the case equals the library's run with that many trials."""
    import sys

    from hf_rope_ext import patch_model
    from hf_rope_ext.evaluation.retrieval import retrieval_accuracy
    from hf_rope_ext.loading import load_model

    module = _example_module("compare_retrieval_grow")
    output = tmp_path / "out"
    argv = ["compare_retrieval.py", "--model", str(tiny_checkpoint), "--length", "512", "--scale", "2", "--configs",
            "yarn", "--tasks", "passkey", "--depths", "0.5", "--output-dir", str(output)]  # fmt: skip
    real_generate = module.greedy_generate
    prompts = []

    def counted(model, input_ids, *args, **kwargs):
        prompts.append(list(input_ids))
        return real_generate(model, input_ids, *args, **kwargs)

    monkeypatch.setattr(module, "greedy_generate", counted)
    monkeypatch.setattr(sys, "argv", argv + ["--trials", "1"])
    module.main()
    monkeypatch.setattr(sys, "argv", argv + ["--trials", "3"])
    module.main()
    assert len(prompts) == 3  # one prompt, then only the two new ones
    assert prompts[0] not in prompts[1:]
    records = [json.loads(line) for line in (output / "results.jsonl").read_text().splitlines()]
    assert [len(record["trials"]) for record in records] == [1, 3]
    model, tokenizer = load_model(str(tiny_checkpoint), device="cpu")
    patch_model(model, 2, "yarn")
    expected = retrieval_accuracy(model, tokenizer, "passkey", 512, 0.5, trials=3, progress=False)
    assert [t["output"] for t in records[1]["trials"]] == expected.outputs
    assert [t["answer"] for t in records[1]["trials"]] == expected.answers
    assert records[0]["trials"][0] == records[1]["trials"][0]


def test_compare_configurations_example_matches_the_library_per_dtype(tiny_checkpoint, tmp_path, monkeypatch):
    """examples/compare_configurations.py: each range's perplexity is exp of the mean token loss of one
    forward (a float64 log-softmax of the full logits), fp32 and bf16 runs are kept apart, and a rerun
    skips finished configurations."""
    import math
    import sys

    from hf_rope_ext import patch_model, unpatch_model
    from hf_rope_ext.data import read_text, tokenize
    from hf_rope_ext.loading import load_model

    module = _example_module("compare_configurations", "compare_configurations.py")
    text = tmp_path / "doc.txt"
    text.write_text(" ".join(f"Line {i} of a long story about the sea and the ship." for i in range(120)))
    output = tmp_path / "out"

    def run(dtype):
        monkeypatch.setattr(sys, "argv", [
            "compare_configurations.py", "--model", str(tiny_checkpoint), "--text-files", str(text), "--length", "512",
            "--scale", "2", "--configs", "yarn;self-extend:neighbor_window=64", "--dtype", dtype,
            "--output-dir", str(output)])  # fmt: skip
        module.main()

    run("fp32")
    run("bf16")
    records = [json.loads(line) for line in (output / "results.jsonl").read_text().splitlines()]
    assert [(r["config"], r["dtype"]) for r in records] == [
        ("yarn", "fp32"), ("self-extend:neighbor_window=64", "fp32"),
        ("yarn", "bf16"), ("self-extend:neighbor_window=64", "bf16")]  # fmt: skip
    assert records[0]["edges"] == [0, 128, 256, 512]
    for dtype, torch_dtype, tolerance in (("fp32", torch.float32, 1e-4), ("bf16", torch.bfloat16, 1e-3)):
        model, tokenizer = load_model(str(tiny_checkpoint), dtype=dtype, device="cpu")
        ids = tokenize(tokenizer, read_text(text))[:512]
        for record, (method, params) in zip([r for r in records if r["dtype"] == dtype],
                                            [("yarn", {}), ("self-extend", {"neighbor_window": 64})]):
            patch_model(model, 2, method, **params)
            with torch.no_grad():
                logits = model(ids[None]).logits[0].double()
            unpatch_model(model)
            losses = -torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None])[:, 0]
            # position p's loss predicts token p + 1; ranges are of predicted positions
            expected = [math.exp(float(losses[max(a - 1, 0) : b - 1].mean())) for a, b in ((0, 128), (128, 256), (256, 512))]
            assert record["ppl"] == pytest.approx(expected, rel=tolerance)
        assert model.dtype == torch_dtype
    before = (output / "results.jsonl").read_text()
    run("bf16")  # every configuration of this dtype is done
    assert (output / "results.jsonl").read_text() == before
    assert "| yarn | 2 | 512 | bf16 |" in (output / "table.md").read_text()


@pytest.mark.parametrize("script", ["compare_configurations.py", "compare_retrieval.py"])
@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--configs", "yarn;self-extend:neighbor_window=256"], "configuration 'self-extend:neighbor_window=256': "),
        (["--configs", "yarn;self-extend:neighbor_window=abc"], "neighbor_window must be a whole number"),
        (["--configs", "yarn;bogus"], "Unknown RoPE method 'bogus'"),
        (["--configs", "yarn;yarn:foo=1"], "Unknown parameter(s) for method 'yarn': 'foo'"),
        (["--configs", " ; "], "--configs names no configuration"),
        (["--configs", "yarn", "--scale", "0"], "scale must be > 1"),
        (["--configs", "yarn;self-extend:neighbor_window=64;yarn"], "--configs lists 'yarn' twice"),
        (["--configs", "self-extend:neighbor_window=64,group_size=4;self-extend:group_size=4,neighbor_window=64"],
         "lists 'self-extend:group_size=4,neighbor_window=64' twice"),
    ],
)
def test_compare_examples_refuse_bad_configurations_before_any_forward(
    tiny_checkpoint, tmp_path, monkeypatch, capsys, script, arguments, message
):
    """A bad configuration anywhere in --configs stops the example with one line naming it (exit 2),
    before the configurations listed ahead of it have run: nothing is written."""
    import sys

    module = _example_module(script.removesuffix(".py") + "_bad", script)
    text = tmp_path / "doc.txt"
    text.write_text("A short story about the sea. " * 200)
    output = tmp_path / "out"
    argv = [script, "--model", str(tiny_checkpoint), "--length", "512", "--scale", "2", "--output-dir", str(output)]
    if script == "compare_configurations.py":
        argv += ["--text-files", str(text)]
    monkeypatch.setattr(sys, "argv", replacing_options(argv, arguments))  # the case's --scale replaces the base one
    with pytest.raises(SystemExit) as stopped:
        module.main()
    assert stopped.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"{script}: error: ") and message in last
    assert not (output / "results.jsonl").exists()


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--ranges", "0,300,200,512"], "--ranges must rise strictly from 0 to --length 512"),
        (["--ranges", "0,a,512"], "--ranges takes comma-separated whole numbers"),
        (["--length", "0"], "--length must be at least 2 tokens"),
        (["--length", "100000"], "fewer than --length 100000"),
    ],
)
def test_compare_configurations_example_refuses_bad_lengths(tiny_checkpoint, tmp_path, monkeypatch, capsys, arguments,
                                                            message):  # fmt: skip
    import sys

    module = _example_module("compare_configurations_lengths", "compare_configurations.py")
    text = tmp_path / "doc.txt"
    text.write_text("A short story about the sea. " * 200)
    argv = ["compare_configurations.py", "--model", str(tiny_checkpoint), "--text-files", str(text), "--length", "512",
            "--scale", "2", "--configs", "yarn", "--output-dir", str(tmp_path / "out")]  # fmt: skip
    monkeypatch.setattr(sys, "argv", replacing_options(argv, arguments))
    with pytest.raises(SystemExit) as stopped:
        module.main()
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_compare_configurations_example_keeps_default_ranges_inside_a_short_input(tiny_checkpoint, tmp_path, monkeypatch):
    """--length inside the native context (256 here): the default ranges stop at the input's end."""
    import sys

    module = _example_module("compare_configurations_short", "compare_configurations.py")
    text = tmp_path / "doc.txt"
    text.write_text(" ".join(f"Line {i} of a long story about the sea and the ship." for i in range(60)))
    output = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", [
        "compare_configurations.py", "--model", str(tiny_checkpoint), "--text-files", str(text), "--length", "200",
        "--scale", "2", "--configs", "none", "--output-dir", str(output)])  # fmt: skip
    module.main()
    (record,) = [json.loads(line) for line in (output / "results.jsonl").read_text().splitlines()]
    assert record["edges"] == [0, 128, 200]
    assert len(record["ppl"]) == 2 and all(math.isfinite(p) for p in record["ppl"])


# ----------------------------------------------------------------------------------------------
# Hostile input: edited results, changed methods, bad plans, shared folders, the examples
# ----------------------------------------------------------------------------------------------


def _valid_records():
    """A perplexity and a retrieval record as the runner writes them (every field the reports read)."""
    return [_record("none", None, "a", 16, [[0, 8, 10.0], [8, 16, 12.0]]),
            {**_retrieval_record(depth=0.5, correct=1, outputs=["1", "3"]), "native_context": 8}]  # fmt: skip


@pytest.mark.parametrize(
    "index, edit, message",
    [
        (0, {"tokens": None}, "field 'tokens' must be an integer >= 1, got None"),
        # impossible or inconsistent numbers: the reports would show them as results
        (0, {"tokens": 0}, "field 'tokens' must be an integer >= 1, got 0"),
        (0, {"nll": -3.0}, "field 'nll' must be a number >= 0 (or NaN/inf), got -3.0"),
        (0, {"ppl": 5.0}, f"field 'ppl' is 5.0, but exp(nll) is {math.exp(_valid_records()[0]['nll'])!r}"),
        (0, {"buckets": [[0, 8, -5.0], [8, 16, 12.0]]},
         "field 'buckets' must be a list of [start, end, ppl] with 0 <= start < end <= context_length (16) and "
         "ppl > 0, got [0, 8, -5.0]"),
        (0, {"buckets": [[0, 8, 10.0], [8, 16, 12.0], [16, 100000, 3.0]]},
         "field 'buckets' must be a list of [start, end, ppl] with 0 <= start < end <= context_length (16) and "
         "ppl > 0, got [16, 100000, 3.0]"),
        (0, {"model": None}, "field 'model' must be a non-empty string, got None"),
        (0, {"model": "del"}, "field 'model' is missing"),
        (1, {"accuracy": 0.9}, "field 'accuracy' is 0.9, but correct/trials is 1/2; they must agree"),
        (0, {"tokens": "del"}, "field 'tokens' is missing"),
        (0, {"nll": "abc"}, "field 'nll' must be a number"),
        (0, {"buckets": "del"}, "field 'buckets' is missing"),
        (0, {"buckets": [[0, 8]]}, "field 'buckets' must be a list of [start, end, ppl]"),
        (0, {"method": 3}, "field 'method' must be a non-empty string, got 3"),
        (0, {"mode": "del"}, "field 'mode' is missing"),
        (0, {"context_length": "16"}, "field 'context_length' must be an integer"),
        (0, {"native_context": "8"}, "field 'native_context' must be a positive integer or null"),
        (0, {"scale": "2"}, "field 'scale' must be a number"),
        (0, {"reused_from": "none"}, "field 'reused_from' must be null or an object"),
        (1, {"correct": "1"}, "field 'correct' must be an integer"),
        (1, {"trials": 0, "correct": 0}, "field 'trials' must be an integer >= 1, got 0"),
        (1, {"depth": "0.5"}, "field 'depth' must be a number between 0 and 1"),
        (1, {"depth": "del"}, "field 'depth' is missing"),
        (1, {"task": "del"}, "field 'task' is missing"),
        (1, {"length": "del"}, "field 'length' is missing"),
        (1, {"kind": "del"}, "field 'kind' must be one of ['perplexity', 'retrieval'], got None"),
    ],
)
def test_an_edited_record_is_refused_naming_the_file_line_and_field(tmp_path, capsys, index, edit, message):
    """One line naming file, line and field (exit 2), not a traceback from whichever report reads it first."""
    records = _valid_records()
    for name, value in edit.items():
        if value == "del":
            del records[index][name]
        else:
            records[index][name] = value
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(record) + "\n" for record in records))
    assert cli_main(["eval", "--report-only", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {results}:{index + 1}: {message}") and err.endswith("fix or remove that line.")
    assert len(err.splitlines()) == 1


def test_edited_records_keep_the_inconsistent_counts_and_accuracy_only_rendering(tmp_path):
    """What the reports already show on purpose stays accepted: more correct than trials, and a
    hand-written record with an accuracy and no counts (plotted from its accuracy)."""
    counts = _retrieval_record(depth=0.1, correct=5, outputs=["1", "3"])
    accuracy_only = {key: value for key, value in _retrieval_record(0.9, 1, ["1", "3"]).items()
                     if key not in ("correct", "trials")}  # fmt: skip
    (tmp_path / "results.jsonl").write_text(json.dumps(counts) + "\n" + json.dumps(accuracy_only) + "\n")
    written = {path.name for path in write_reports(tmp_path)}
    assert "retrieval_passkey.png" in written
    assert "(5/2; counts inconsistent)" in (tmp_path / "results.md").read_text()


def test_an_edited_record_stops_a_run_before_any_forward(tmp_path):
    model = make_model("llama")
    documents = {"doc": random_ids(80)[0]}
    plan = _plan(methods=["none"], scales=[], ppl_lengths=[24, 64])
    run_evaluation(model, CharTokenizer(), _plan(methods=["none"], scales=[], ppl_lengths=[24]), tmp_path,
                   documents=documents, progress=False, write_report=False)  # fmt: skip
    results = tmp_path / "results.jsonl"
    record = json.loads(results.read_text())
    del record["tokens"]
    results.write_text(json.dumps(record) + "\n")
    counter = CallCounter(model)
    with pytest.raises(EvaluationError, match=r"results.jsonl:1: field 'tokens' is missing"):
        run_evaluation(model, CharTokenizer(), plan, tmp_path, documents=documents, progress=False)
    assert counter.calls == 0 and results.read_text() == json.dumps(record) + "\n"


def test_a_results_file_that_is_not_utf8_is_named(tmp_path):
    (tmp_path / "results.jsonl").write_bytes(b'{"kind": "perplexity"}\n\xff\xfe\x00binary\n')
    with pytest.raises(EvaluationError, match=r"results.jsonl is not UTF-8 text"):
        read_results(tmp_path)


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"context_length": "64k"}, "field 'context_length' must be an integer"),
        ({"scale": "x"}, "field 'scale' must be a number"),
        ({"buckets": [["a", 64, 3.0]]}, "field 'buckets' must be a list of [start, end, ppl]"),
    ],
)
def test_model_card_refuses_an_edited_eval_record_in_one_line(tmp_path, capsys, edit, message):
    pytest.importorskip("huggingface_hub")
    pytest.importorskip("jinja2")
    from hf_rope_ext.hub import save_patched

    model = make_model("llama")
    patch_model(model, 2.0, "yarn")
    checkpoint = save_patched(model, tmp_path / "checkpoint")
    capsys.readouterr()
    output = tmp_path / "eval"
    output.mkdir()
    record = {**_record("yarn", 2.0, "a", 16, [[0, 8, 10.0], [8, 16, 12.0]]), **edit}
    (output / "results.jsonl").write_text(json.dumps(_valid_records()[0]) + "\n" + json.dumps(record) + "\n")
    code = cli_main(["card", "--model-dir", str(checkpoint), "--base-model", "org/tiny-base", "--eval-dir",
                     str(output), "--output", str(tmp_path / "README.md")])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert f"{output / 'results.jsonl'}:2: {message}" in err


def test_changed_method_parameters_are_not_taken_for_finished_cases(tmp_path):
    """A method registered again with other defaults (as a built-in whose defaults change between
    versions) has other frequencies: its finished cases are refused, not reported with old numbers."""
    import hf_rope_ext

    def compute(dim, base, params, seq_len=None):
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        return inv_freq / params["divisor"], 1.0

    documents = {"doc": random_ids(80)[0]}
    model = make_model("llama")
    plan = _plan(methods=["none", "my-interp"], scales=[2.0], ppl_lengths=[64])
    try:
        hf_rope_ext.register_method("my-interp", compute, defaults={"divisor": 2.0})
        run_evaluation(model, CharTokenizer(), plan, tmp_path, documents=documents, progress=False)
        before = (tmp_path / "results.jsonl").read_text()
        hf_rope_ext.unregister_method("my-interp")
        hf_rope_ext.register_method("my-interp", compute, defaults={"divisor": 4.0})
        counter = CallCounter(model)
        with pytest.raises(EvaluationError, match=r"my-interp x2 ppl/buckets doc L=64: .* other rotary frequencies "
                                                  r".*Use another --output-dir"):  # fmt: skip
            run_evaluation(model, CharTokenizer(), plan, tmp_path, documents=documents, progress=False)
        assert counter.calls == 0 and (tmp_path / "results.jsonl").read_text() == before
        assert get_patch_info(model) is None
        # the same parameters again: the folder resumes
        hf_rope_ext.unregister_method("my-interp")
        hf_rope_ext.register_method("my-interp", compute, defaults={"divisor": 2.0})
        run_evaluation(model, CharTokenizer(), plan, tmp_path, documents=documents, progress=False)
        assert counter.calls == 0
    finally:
        hf_rope_ext.unregister_method("my-interp")


def test_a_bad_method_scale_pair_fails_before_any_case_runs(tmp_path):
    model = make_model("llama")
    counter = CallCounter(model)
    with pytest.raises(EvaluationError, match="longrope at scale 2: .*long_factor"):
        run_evaluation(model, CharTokenizer(), _plan(methods=["none", "yarn", "longrope"], scales=[2.0]), tmp_path,
                       documents={"doc": random_ids(80)[0]}, progress=False)  # fmt: skip
    assert counter.calls == 0 and not (tmp_path / "results.jsonl").exists()


def test_an_output_dir_that_is_a_file_is_refused_before_any_forward(tmp_path, capsys):
    model = make_model("llama")
    counter = CallCounter(model)
    documents = {"doc": random_ids(80)[0]}
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(EvaluationError, match="is a file, not a folder"):
        run_evaluation(model, CharTokenizer(), _plan(), afile, documents=documents, progress=False)
    (tmp_path / "out" / "results.jsonl").mkdir(parents=True)
    with pytest.raises(EvaluationError, match=r"results.jsonl is not a file"):
        run_evaluation(model, CharTokenizer(), _plan(), tmp_path / "out", documents=documents, progress=False)
    assert counter.calls == 0 and afile.read_text() == "x"
    book = tmp_path / "book.txt"
    book.write_text("word " * 100)
    code = cli_main(["eval", "--model", str(tmp_path / "no-model"), "--text-file", str(book), "--methods", "none",
                     "--ppl-lengths", "64", "--output-dir", str(afile)])  # fmt: skip
    assert code == 2 and "is a file, not a folder" in capsys.readouterr().err


def test_options_that_would_be_ignored_are_refused(tmp_path, capsys):
    book = tmp_path / "book.txt"
    book.write_text("word " * 100)
    common = ["eval", "--text-file", str(book), "--methods", "none", "--output-dir", str(tmp_path / "out")]
    assert cli_main([*common, "--ppl-lengths", "64", "--num-documents", "3"]) == 2
    assert "--num-documents counts texts taken from --dataset" in capsys.readouterr().err
    assert cli_main([*common, "--retrieval-tasks", "passkey", "--retrieval-lengths", "200", "--needle-count", "3"]) == 2
    assert "--needle-count applies to the needle task only" in capsys.readouterr().err
    assert cli_main([*common, "--ppl-lengths", "64", "--sliding-tokens", "100"]) == 2
    assert "applies to sliding-window perplexity only" in capsys.readouterr().err


def test_lengths_far_beyond_every_extended_context_are_refused_before_the_model_loads(tiny_checkpoint, tmp_path,
                                                                                      capsys, caplog):  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="hf_rope_ext.evaluation.plan"):
        _plan(ppl_lengths=[24, 128]).check_reach(ORIGINAL_CONTEXT)  # 4 x 32: the largest scale reaches it
        assert caplog.text == ""
        # past it, the patched models extrapolate: measured (papers plot it), with a warning
        _plan(ppl_lengths=[24, 8 * 128]).check_reach(ORIGINAL_CONTEXT)
        assert "Length 1024 is beyond 128 tokens" in caplog.text
    with pytest.raises(EvaluationError, match=r"Length 1025 is beyond 8 x 128 tokens \(128: the model's native "
                                              r"context of 32 times the largest scale 4\); a typo\?"):  # fmt: skip
        _plan(ppl_lengths=[24, 8 * 128 + 1]).check_reach(ORIGINAL_CONTEXT)
    code = cli_main(["eval", "--model", str(tiny_checkpoint), "--device", "cpu", "--methods", "none,yarn", "--scales",
                     "2", "--retrieval-tasks", "passkey", "--retrieval-lengths", "10000000", "--output-dir",
                     str(tmp_path / "out")])  # fmt: skip
    assert code == 2 and "Length 10000000 is beyond 8 x 512 tokens" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_no_progress_also_hides_the_per_trial_and_sliding_window_bars(tmp_path, capsys):
    plan = EvalPlan(methods=["none"], ppl_lengths=[160], ppl_modes=["sliding"], stride=80, sliding_tokens=200,
                    retrieval_tasks=["passkey"], retrieval_lengths=[400], depths=[0.5], trials=1, chunk_size=64)
    run_evaluation(make_model("llama"), CharTokenizer(), plan, tmp_path, documents={"doc": random_ids(200)[0]},
                   native_context=256, progress=False, write_report=False)  # fmt: skip
    err = capsys.readouterr().err
    assert "sliding windows" not in err and "passkey L=" not in err and len(read_results(tmp_path)) == 2


# -- the examples -------------------------------------------------------------------------------


def _copy_checkpoint(source: Path, target: Path, seed: int | None = None) -> Path:
    """A copy of the tiny checkpoint; with ``seed``, other random weights under the same config."""
    import shutil

    from transformers import AutoModelForCausalLM

    shutil.copytree(source, target, dirs_exist_ok=True)
    if seed is not None:
        torch.manual_seed(seed)
        config = AutoModelForCausalLM.from_pretrained(source).config
        AutoModelForCausalLM.from_config(config).save_pretrained(target)
    return target


def _run_example(module, monkeypatch, argv):
    import sys

    monkeypatch.setattr(sys, "argv", argv)
    module.main()


def _example_error(module, monkeypatch, capsys, argv) -> str:
    import sys

    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as stopped:
        module.main()
    assert stopped.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_compare_configurations_refuses_results_of_another_model_or_text(tiny_checkpoint, tmp_path, monkeypatch,
                                                                       capsys):  # fmt: skip
    module = _example_module("compare_configurations_inputs", "compare_configurations.py")
    model_dir = _copy_checkpoint(tiny_checkpoint, tmp_path / "model")
    text = tmp_path / "doc.txt"
    text.write_text(" ".join(f"Line {i} of a long story about the sea and the ship." for i in range(120)))
    output = tmp_path / "out"
    argv = ["compare_configurations.py", "--model", str(model_dir), "--text-files", str(text), "--length", "512",
            "--scale", "2", "--configs", "none", "--output-dir", str(output)]  # fmt: skip
    _run_example(module, monkeypatch, argv)
    before = (output / "results.jsonl").read_text()
    _copy_checkpoint(tiny_checkpoint, model_dir, seed=7)  # another checkpoint under the same name
    last = _example_error(module, monkeypatch, capsys, argv)
    assert "config or weights differ from the model loaded now" in last and "another --output-dir" in last
    _copy_checkpoint(tiny_checkpoint, model_dir)  # the first model again, another text under the same name
    text.write_text(" ".join(f"Row {i}: a different text about a desert and a camel." for i in range(120)))
    last = _example_error(module, monkeypatch, capsys, argv)
    assert "holds results for a text named 'doc.txt' with other content" in last
    assert (output / "results.jsonl").read_text() == before


def test_compare_retrieval_refuses_results_and_trials_of_another_model(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    module = _example_module("compare_retrieval_inputs")
    output = tmp_path / "out"
    argv = ["compare_retrieval.py", "--length", "512", "--scale", "2", "--configs", "yarn", "--tasks", "passkey",
            "--depths", "0.5", "--trials", "1", "--output-dir", str(output)]  # fmt: skip
    _run_example(module, monkeypatch, [*argv, "--model", str(tiny_checkpoint)])
    other = _copy_checkpoint(tiny_checkpoint, tmp_path / "other", seed=7)
    last = _example_error(module, monkeypatch, capsys, [*argv, "--model", str(other)])
    assert f"holds results of {str(tiny_checkpoint)!r}, not {str(other)!r}" in last
    (output / "results.jsonl").unlink()  # the finished trials alone would be taken too
    last = _example_error(module, monkeypatch, capsys, [*argv, "--model", str(other)])
    assert "trials.jsonl holds results of" in last


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--length", "20"], "--length must be at least 136 (128 prompt tokens plus 8 answer tokens), got 20"),
        (["--length", "-5"], "--length must be at least 136"),
        (["--depths", "0.5,0.5"], "--depths lists a value twice"),
        (["--tasks", "passkey,passkey"], "--tasks lists a value twice"),
        (["--model", "{tmp}/missing"], "missing"),
        (["--output-dir", "{tmp}/afile"], "is a file, not a folder"),
    ],
)
def test_compare_retrieval_refuses_bad_input_in_one_line(tiny_checkpoint, tmp_path, monkeypatch, capsys, arguments,
                                                         message):  # fmt: skip
    module = _example_module("compare_retrieval_input")
    (tmp_path / "afile").write_text("x")
    argv = ["compare_retrieval.py", "--model", str(tiny_checkpoint), "--length", "512", "--scale", "2", "--configs",
            "yarn", "--output-dir", str(tmp_path / "out")]  # fmt: skip
    argv = replacing_options(argv, [argument.format(tmp=tmp_path) for argument in arguments])
    last = _example_error(module, monkeypatch, capsys, argv)
    assert last.startswith("compare_retrieval.py: error: ") and message in last
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--model", "{tmp}/missing"], "missing"),
        (["--text-files", "{tmp}/missing.txt"], "text file not found"),
        (["--output-dir", "{tmp}/afile"], "is a file, not a folder"),
    ],
)
def test_compare_configurations_refuses_bad_input_in_one_line(tiny_checkpoint, tmp_path, monkeypatch, capsys,
                                                              arguments, message):  # fmt: skip
    module = _example_module("compare_configurations_input", "compare_configurations.py")
    (tmp_path / "afile").write_text("x")
    text = tmp_path / "doc.txt"
    text.write_text("A short story about the sea. " * 200)
    argv = ["compare_configurations.py", "--model", str(tiny_checkpoint), "--text-files", str(text), "--length", "512",
            "--scale", "2", "--configs", "yarn", "--output-dir", str(tmp_path / "out")]  # fmt: skip
    argv = replacing_options(argv, [argument.format(tmp=tmp_path) for argument in arguments])
    last = _example_error(module, monkeypatch, capsys, argv)
    assert last.startswith("compare_configurations.py: error: ") and message in last
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--scales", "2,x"], "expected comma-separated numbers"),
        (["--depths", "0.5,a"], "expected comma-separated numbers"),
        (["--scales", "1"], "Scales must be numbers > 1"),
        (["--ppl-lengths", "128,200"], "within the model's own context of 256 tokens"),
        (["--ppl-lengths", "8k"], "Length 8192 is beyond 8 x 512 tokens"),
        (["--ppl-lengths", "400", "--text-files", "{tmp}/short.txt"], "shorter than the 400 tokens requested"),
        (["--model", "{tmp}/missing"], "missing"),
        (["--output-dir", "{tmp}/afile"], "is a file, not a folder"),
        (["--methods", "none,yarn", "--scales", "2,2"], "is listed twice in scales"),
    ],
)
def test_run_results_table_refuses_bad_input_in_one_line(tiny_checkpoint, tmp_path, monkeypatch, capsys, arguments,
                                                         message):  # fmt: skip
    module = _example_module("run_results_table_input", "run_results_table.py")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "short.txt").write_text("A short story. " * 10)
    book = tmp_path / "book.txt"
    book.write_text("A short story about the sea. " * 200)
    argv = ["run_results_table.py", "--model", str(tiny_checkpoint), "--text-files", str(book), "--methods",
            "none,yarn", "--scales", "2", "--ppl-lengths", "512", "--retrieval-lengths", "", "--device", "cpu",
            "--output-dir", str(tmp_path / "out")]  # fmt: skip
    argv = replacing_options(argv, [argument.format(tmp=tmp_path) for argument in arguments])
    last = _example_error(module, monkeypatch, capsys, argv)
    assert last.startswith("run_results_table.py: error: ") and message in last
    assert not (tmp_path / "out" / "results.jsonl").exists()


def test_run_results_table_reads_the_eval_list_spellings():
    module = _example_module("run_results_table_spellings", "run_results_table.py")
    args = module.parse_args(["--text-files", "book.txt", "--output-dir", "out", "--ppl-lengths", "4k,8k", "--scales", "2,4"])
    assert args.ppl_lengths == [4096, 8192] and args.scales == [2.0, 4.0]


def test_run_results_table_shows_only_this_models_results(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    """Two models in one --output-dir: each table and goal check shows that model's rows only."""
    module = _example_module("run_results_table_models", "run_results_table.py")
    book = tmp_path / "book.txt"
    book.write_text(" ".join(f"Line {i} of a long story about the sea and the ship." for i in range(120)))
    other = _copy_checkpoint(tiny_checkpoint, tmp_path / "other", seed=7)
    argv = ["run_results_table.py", "--text-files", str(book), "--scales", "2", "--ppl-lengths", "128,512",
            "--retrieval-lengths", "", "--device", "cpu", "--output-dir", str(tmp_path / "out")]  # fmt: skip
    _run_example(module, monkeypatch, [*argv, "--model", str(tiny_checkpoint), "--methods", "none,yarn"])
    capsys.readouterr()
    _run_example(module, monkeypatch, [*argv, "--model", str(other), "--methods", "none,linear"])
    printed = capsys.readouterr().out
    mine = {r["context_length"]: r["ppl"] for r in read_results(tmp_path / "out")
            if r["model"] == str(other) and r["method"] == "none"}  # fmt: skip
    assert "| linear | 2 |" in printed and "| yarn |" not in printed
    assert f"| none |  | {format_ppl(mine[128])} | {format_ppl(mine[512])} |" in printed


# ----------------------------------------------------------------------------------------------
# Found by review: settings, documents and prompts are never mixed or counted twice
# ----------------------------------------------------------------------------------------------


def _write_results(folder: Path, records) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return folder


def _table_after(markdown: str, heading: str) -> str:
    """The markdown table right after the first heading line containing ``heading``."""
    rest = markdown[markdown.index(heading):].split("\n\n", 2)
    return rest[1]


def test_report_gives_each_dtype_stride_and_bucket_size_its_own_table(tmp_path):
    buckets = [[0, 4, 10.0], [4, 8, 8.0], [8, 12, 90.0], [12, 16, 120.0]]
    bf16 = [[0, 4, 11.0], [4, 8, 9.0], [8, 12, 95.0], [12, 16, 130.0]]
    sliding = {"mode": "sliding", "bucket_size": None, "eval_tokens": 16}
    records = [
        _record("none", None, "a", 16, buckets),
        _record("none", None, "a", 16, bf16, dtype="bf16"),
        _record("yarn", 2.0, "a", 16, buckets),
        {**_record("none", None, "a", 16, buckets, **sliding, stride=4, nll=math.log(7.0), ppl=7.0), "buckets": None},
        {**_record("none", None, "a", 16, buckets, **sliding, stride=8, nll=math.log(5.0), ppl=5.0), "buckets": None},
    ]  # fmt: skip
    write_reports(_write_results(tmp_path, records))
    markdown = (tmp_path / "results.md").read_text()
    # Closed form: exp of the token-weighted mean log ppl of each record's buckets (3 tokens in [0, 4)).
    fp32 = math.exp((3 * math.log(10) + 4 * (math.log(8) + math.log(90) + math.log(120))) / 15)
    half = math.exp((3 * math.log(11) + 4 * (math.log(9) + math.log(95) + math.log(130))) / 15)
    assert f"| none | {fp32:.2f} |" in _table_after(markdown, "first L tokens (one forward; documents: a; dtype fp32")
    assert f"| none | {half:.2f} |" in _table_after(markdown, "first L tokens (one forward; documents: a; dtype bf16")
    assert "yarn" not in _table_after(markdown, "dtype bf16")
    assert "| none | 7.00 |" in _table_after(markdown, "stride S=4,") and "| none | 5.00 |" in _table_after(
        markdown, "stride S=8,")  # fmt: skip
    from hf_rope_ext.evaluation.report import comparison_table

    with pytest.raises(ValueError, match="several dtype values"):
        comparison_table(json.loads((tmp_path / "summary.json").read_text()))


def test_report_keeps_rows_of_different_documents_in_different_tables(tmp_path):
    records = [
        _record("none", None, "a", 16, [[0, 4, 10.0], [4, 8, 8.0], [8, 12, 90.0], [12, 16, 120.0]]),
        _record("none", None, "b", 16, [[0, 4, 2.0], [4, 8, 2.0], [8, 12, 2.0], [12, 16, 2.0]]),
        _record("yarn", 2.0, "a", 16, [[0, 4, 11.0], [4, 8, 8.5], [8, 12, 9.0], [12, 16, 9.5]]),
    ]
    write_reports(_write_results(tmp_path, records))
    markdown = (tmp_path / "results.md").read_text()
    pooled = _table_after(markdown, "first L tokens (one forward; documents: a, b)")
    alone = _table_after(markdown, "first L tokens (one forward; documents: a)")
    assert "| none |" in pooled and "yarn" not in pooled
    assert "| yarn x2 |" in alone and "| none |" not in alone


def test_retrieval_prompts_of_a_rerun_with_more_trials_or_twice_are_counted_once(tmp_path):
    two = _retrieval_record(depth=0.5, correct=1, outputs=["1", "3"])
    three = {**two, "trials": 3, "correct": 2, "accuracy": 2 / 3, "answers": ["1", "2", "5"],
             "outputs": ["1", "3", "5"]}  # fmt: skip
    # the first 2 prompts of the 3-trial run are the 2-trial run's (one generator per depth), so 3 prompts in all
    write_reports(_write_results(tmp_path / "more", [two, three]))
    row = json.loads((tmp_path / "more" / "summary.json").read_text())["retrieval"][0]
    assert (row["correct"], row["trials"]) == (2, 3)
    assert "| none | 67% (2/3;" in (tmp_path / "more" / "results.md").read_text()
    write_reports(_write_results(tmp_path / "twice", [two, dict(two), {**two, "depth": 0.5000001}]))
    row = json.loads((tmp_path / "twice" / "summary.json").read_text())["retrieval"][0]
    assert (row["correct"], row["trials"]) == (1, 2)
    with pytest.raises(EvaluationError, match="give the same prompts"):
        _plan(retrieval_tasks=["passkey"], retrieval_lengths=[200], depths=[0.1, 0.1000001]).validate(None)
    from hf_rope_ext.evaluation.records import case_key

    assert case_key({**two, "scale": 2}) == case_key({**two, "scale": 2.0})
    # hand-written records without a depth (model cards) are different prompts: both count
    from hf_rope_ext.evaluation.summary import retrieval_rows

    by_hand = [{"kind": "retrieval", "task": "passkey", "method": "none", "length": 16, "accuracy": value}
               for value in (0.5, 1.0)]  # fmt: skip
    assert retrieval_rows(by_hand)[0]["accuracy"] == 0.75


def test_beyond_native_perplexity_is_over_exactly_the_positions_past_the_native_context(tmp_path):
    """Buckets of 24 tokens do not divide the native context of 32: the number must still be the
    perplexity of positions 32 .. L-1, from a float64 full-logits reference."""
    model = make_model("llama")
    ids = random_ids(80)[0]
    plan = _plan(methods=["none"], scales=[], ppl_lengths=[64], bucket_size=24)
    run_evaluation(model, CharTokenizer(), plan, tmp_path, documents={"doc": ids}, progress=False)
    row = json.loads((tmp_path / "summary.json").read_text())["perplexity"][0]
    losses = reference_losses(model, ids[:64])  # losses[i] scores token i + 1
    expected = math.exp(float(losses[ORIGINAL_CONTEXT - 1 :].mean()))
    assert row["beyond_native_ppl"] == pytest.approx(expected, rel=1e-5)
    assert f"| none | {format_ppl(expected)} |" in _table_after((tmp_path / "results.md").read_text(),
                                                               "beyond the native context")  # fmt: skip
    # A record (of an earlier version) whose bucket spans the native context cannot give the number: marked.
    spanning = _record("none", None, "a", 16, [[0, 6, 10.0], [6, 12, 8.0], [12, 16, 90.0]])
    write_reports(_write_results(tmp_path / "old", [spanning]))
    assert json.loads((tmp_path / "old" / "summary.json").read_text())["perplexity"][0]["beyond_native_ppl"] is None
    markdown = (tmp_path / "old" / "results.md").read_text()
    assert "| none | n/a |" in markdown and "spans position 8" in markdown


def test_nan_and_infinite_perplexities_still_give_every_report(tmp_path, caplog):
    from hf_rope_ext.evaluation.summary import safe_exp

    assert math.isnan(safe_exp(float("nan"))) and safe_exp(800.0) == float("inf")
    broken = {**_record("none", None, "a", 16, [[0, 8, float("inf")], [8, 16, float("inf")]]), "nll": float("nan"),
              "ppl": float("nan")}  # fmt: skip
    written = {path.name for path in write_reports(_write_results(tmp_path, [broken]))}
    assert {"perplexity_by_position.png", "perplexity_vs_length.png", "results.md"} <= written
    assert "| none | nan |" in (tmp_path / "results.md").read_text()
    # summary.json is strict JSON (no NaN/Infinity tokens, which JSON.parse refuses): null there
    summary = json.loads((tmp_path / "summary.json").read_text(), parse_constant=lambda name: pytest.fail(name))
    assert summary["perplexity"][0]["ppl"] is None and summary["perplexity"][0]["ranges"][0][2] is None
    model = make_model("llama")
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite logits"):
        token_losses(model, random_ids(20)[0])


def test_plans_that_cannot_run_are_refused_before_any_forward(tmp_path):
    model = make_model("llama")
    counter = CallCounter(model)
    with_bos = torch.cat([torch.tensor([CharTokenizer.bos_token_id]), random_ids(80)[0]])
    sliding = _plan(methods=["none"], scales=[], ppl_lengths=[24, 64], ppl_modes=["buckets", "sliding"], stride=24)
    with pytest.raises(EvaluationError, match="stride 24 must be at most 23"):
        run_evaluation(model, CharTokenizer(), sliding, tmp_path / "s", documents={"d": with_bos}, progress=False)
    needles = _plan(methods=["none"], scales=[], ppl_lengths=[], retrieval_tasks=["passkey", "needle"],
                    retrieval_lengths=[320], depths=[0.5], trials=1, needle_count=20)  # fmt: skip
    with pytest.raises(EvaluationError, match=r"needle at 320 tokens \(8 of them for the answer\): A prompt of 312 tokens"):
        run_evaluation(model, CharTokenizer(), needles, tmp_path / "n", progress=False)
    assert counter.calls == 0 and not (tmp_path / "s").exists() and not (tmp_path / "n").exists()
    for overrides, message in (({"bucket_size": 8.5}, "bucket_size must be a positive integer"),
                               ({"depths": ["0.5"], "retrieval_tasks": ["passkey"], "retrieval_lengths": [200]},
                                "Depths are fractions"),
                               ({"needle_count": 3.0}, "needle_count must be an integer")):  # fmt: skip
        with pytest.raises(EvaluationError, match=message):
            _plan(**overrides).validate(None)


def test_perplexity_functions_take_numpy_counts_and_refuse_empty_or_bad_input():
    import numpy as np

    model = make_model("llama")
    ids = random_ids(64)[0]
    expected = math.exp(float(reference_losses(model, ids[:48]).mean()))
    assert bucket_perplexity(model, [ids[None]], np.int64(48)).ppl == pytest.approx(expected, rel=1e-5)
    assert bucket_perplexity(model, [ids.numpy()], 48, bucket_size=np.int64(16)).ppl == pytest.approx(expected,
                                                                                                       rel=1e-5)
    for call, message in (
        (lambda: bucket_perplexity(model, [], 48), "No documents"),
        (lambda: sliding_window_perplexity(model, [], 48, stride=16, progress=False), "No documents"),
        (lambda: bucket_perplexity(model, [ids], 48, bucket_size=0), "bucket_size must be an integer >= 1"),
        (lambda: bucket_perplexity(model, [ids], 48.0), "context_length must be an integer"),
        (lambda: bucket_perplexity(model, [ids], 48, boundaries=[]), "boundaries must rise"),
        (lambda: bucket_perplexity(model, [ids], 48, boundaries=[0, 31.7, 48]), "each boundary must be an integer"),
        (lambda: sliding_window_perplexity(model, [ids], 48, stride=16, max_tokens=60.0, progress=False),
         "max_tokens must be an integer"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            call()


def test_run_evaluation_takes_documents_as_lists(tmp_path):
    ids = random_ids(80)[0]
    plan = _plan(methods=["none"], scales=[], ppl_lengths=[64])
    as_list = run_evaluation(make_model("llama"), CharTokenizer(), plan, tmp_path / "l", documents={"d": ids.tolist()},
                             progress=False)  # fmt: skip
    as_tensor = run_evaluation(make_model("llama"), CharTokenizer(), plan, tmp_path / "t", documents={"d": ids},
                               progress=False)  # fmt: skip
    assert as_list[0]["ppl"] == as_tensor[0]["ppl"]


def _configurations_argv(tiny_checkpoint, text, output, length="512", configs="none", *extra):
    return ["compare_configurations.py", "--model", str(tiny_checkpoint), "--text-files", str(text), "--length", length,
            "--scale", "2", "--configs", configs, "--output-dir", str(output), *extra]  # fmt: skip


def test_compare_configurations_drops_a_cut_line_and_keeps_the_folder_usable(tiny_checkpoint, tmp_path, monkeypatch):
    module = _example_module("compare_configurations_cut", "compare_configurations.py")
    text = tmp_path / "doc.txt"
    text.write_text(" ".join(f"Line {i} of a long story about the sea and the ship." for i in range(120)))
    output = tmp_path / "out"
    _run_example(module, monkeypatch, _configurations_argv(tiny_checkpoint, text, output))
    whole = (output / "results.jsonl").read_text()
    with open(output / "results.jsonl", "a") as handle:
        handle.write(whole[:150])  # what a killed append leaves
    _run_example(module, monkeypatch, _configurations_argv(tiny_checkpoint, text, output, "512", "none;yarn"))
    _run_example(module, monkeypatch, _configurations_argv(tiny_checkpoint, text, output, "512", "none;yarn"))
    lines = (output / "results.jsonl").read_text().splitlines()
    assert lines[0] == whole.strip() and [json.loads(line)["config"] for line in lines] == ["none", "yarn"]


def test_compare_scripts_refuse_an_eval_folder_before_the_model_loads(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    records = [_record("none", None, "a", 16, [[0, 8, 10.0], [8, 16, 12.0]])]
    output = _write_results(tmp_path / "eval", records)
    before = (output / "results.jsonl").read_text()
    loads = []
    for name, script, argv in (
        ("compare_configurations_mix", "compare_configurations.py",
         _configurations_argv(tiny_checkpoint, tmp_path / "doc.txt", output)),
        ("compare_retrieval_mix", "compare_retrieval.py",
         ["compare_retrieval.py", "--model", str(tiny_checkpoint), "--length", "300", "--scale", "2", "--configs",
          "none", "--depths", "0.5", "--trials", "1", "--output-dir", str(output)]),
    ):  # fmt: skip
        (tmp_path / "doc.txt").write_text("Line of a long story. " * 200)
        module = _example_module(name, script)
        monkeypatch.setattr(module, "load_base_model", lambda *a, **k: loads.append(1))
        last = _example_error(module, monkeypatch, capsys, argv)
        assert "holds results of hf-rope-ext eval, not of this script" in last
    assert not loads and (output / "results.jsonl").read_text() == before


def test_compare_configurations_writes_one_table_per_set_of_ranges(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    module = _example_module("compare_configurations_edges", "compare_configurations.py")
    text = tmp_path / "doc.txt"
    text.write_text(" ".join(f"Line {i} of a long story about the sea and the ship." for i in range(120)))
    output = tmp_path / "out"
    _run_example(module, monkeypatch, _configurations_argv(tiny_checkpoint, text, output, "128", "none;yarn"))
    _run_example(module, monkeypatch, _configurations_argv(tiny_checkpoint, text, output, "512", "none;yarn"))
    table = (output / "table.md").read_text()
    stored = [json.loads(line) for line in (output / "results.jsonl").read_text().splitlines()]
    for block in table.strip().split("\n\n"):
        header, _, *rows = block.splitlines()
        assert rows and all(row.count("|") == header.count("|") for row in rows)
    for record in stored:  # each row under the header of its own ranges
        block = next(b for b in table.split("\n\n") if f"| {record['config']} | 2 | {record['length']} |" in b)
        names = [f"ppl {a}-{b}" for a, b in zip(record["edges"], record["edges"][1:])]
        assert block.splitlines()[0] == "| config | scale | length | dtype | " + " | ".join(names) + \
            " | seconds | time vs none | peak memory GiB |"  # fmt: skip
    last = _example_error(module, monkeypatch, capsys, _configurations_argv(tiny_checkpoint, text, tmp_path / "r",
                                                                            "512", "none", "--ranges", "0,1,512"))
    assert "the first range [0, 1) scores no token" in last and not (tmp_path / "r").exists()


def test_run_results_table_shows_only_its_documents_numbers(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    module = _example_module("run_results_table_documents", "run_results_table.py")
    book, other = tmp_path / "book.txt", tmp_path / "book2.txt"
    book.write_text(" ".join(f"Line {i} of a long story about the sea and the ship." for i in range(120)))
    other.write_text(" ".join(f"Row {i}: a different text about a desert and a camel." for i in range(120)))
    argv = ["run_results_table.py", "--model", str(tiny_checkpoint), "--methods", "none", "--scales", "2",
            "--ppl-lengths", "128,512", "--retrieval-lengths", "", "--device", "cpu"]  # fmt: skip
    _run_example(module, monkeypatch, [*argv, "--text-files", str(book), "--output-dir", str(tmp_path / "shared")])
    capsys.readouterr()
    _run_example(module, monkeypatch, [*argv, "--text-files", str(other), "--output-dir", str(tmp_path / "shared")])
    shared = capsys.readouterr().out
    _run_example(module, monkeypatch, [*argv, "--text-files", str(other), "--output-dir", str(tmp_path / "alone")])
    alone = capsys.readouterr().out
    row = next(line for line in alone.splitlines() if line.startswith("| none |"))
    assert row in shared.splitlines()


def test_compare_retrieval_refuses_an_edited_trials_field_before_the_model_loads(tiny_checkpoint, tmp_path,
                                                                                  monkeypatch, capsys):  # fmt: skip
    output = tmp_path / "out"
    output.mkdir()
    (output / "results.jsonl").write_text(json.dumps({"key": "k", "config": "none", "trials": "1"}) + "\n")
    module = _example_module("compare_retrieval_edited", "compare_retrieval.py")
    monkeypatch.setattr(module, "load_base_model", lambda *a, **k: pytest.fail("the model loaded"))
    last = _example_error(module, monkeypatch, capsys, [
        "compare_retrieval.py", "--model", str(tiny_checkpoint), "--length", "300", "--scale", "2", "--configs", "none",
        "--depths", "0.5", "--trials", "1", "--output-dir", str(output)])  # fmt: skip
    assert "record 1 has no list of trials" in last


@pytest.mark.parametrize("overrides, message", [
    ({"trials": 2.0}, "trials must be an integer"), ({"length": 300.0}, "length must be an integer"),
    ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer"), ({"depth": "0.5"}, "depth must be a number"),
])  # fmt: skip
def test_retrieval_accuracy_refuses_values_of_the_wrong_type_in_one_line(overrides, message):
    settings = {"task": "passkey", "length": 300, "depth": 0.5, "trials": 1, "max_new_tokens": 4, **overrides}
    with pytest.raises(ValueError, match=message):
        retrieval_accuracy(KeyReader(CharTokenizer()), CharTokenizer(), settings.pop("task"), settings.pop("length"),
                           settings.pop("depth"), progress=False, **settings)  # fmt: skip


def _bucket_record(method, buckets, **fields):
    record = dict(kind="perplexity", mode="buckets", model="tiny", dtype="fp32", document="book",
                  document_sha256="x", model_fingerprint="f", context_length=384, bucket_size=96, native_context=256,
                  tokens=383, windows=1, method=method, scale=2.0, nll=math.log(50.0), ppl=50.0, buckets=buckets)
    record.update(fields)
    return record


def test_rows_of_two_bucket_layouts_each_keep_their_cells(tmp_path):
    """A folder holding records of an earlier version (buckets across the native context) and of
    this one (split there): each layout gets its own by-position table, no row loses its cells."""
    old = _bucket_record("yarn", [[0, 96, 40.0], [96, 192, 45.0], [192, 288, 50.0], [288, 384, 60.0]])
    new = _bucket_record("dynamic-yarn", [[0, 96, 41.0], [96, 192, 46.0], [192, 256, 48.0], [256, 288, 52.0],
                                          [288, 384, 61.0]], steps_per_doubling=1)
    (tmp_path / "results.jsonl").write_text(json.dumps(old) + "\n" + json.dumps(new) + "\n")
    assert cli_main(["eval", "--report-only", "--output-dir", str(tmp_path)]) == 0
    report = (tmp_path / "results.md").read_text()
    tables = report.split("### Perplexity by position")[1:]
    assert len(tables) == 2
    assert "| 40.00 | 45.00 | 50.00 | 60.00 |" in tables[0] and "yarn x2" in tables[0]
    assert "| 41.00 | 46.00 | 48.00 |" in tables[1] and "dynamic-yarn" in tables[1]


def test_eval_names_a_folder_of_the_compare_scripts(tmp_path, capsys):
    (tmp_path / "results.jsonl").write_text(json.dumps({"key": "k", "config": "yarn", "scale": 2.0}) + "\n")
    assert cli_main(["eval", "--report-only", "--output-dir", str(tmp_path)]) == 2
    assert "compare_configurations.py or compare_retrieval.py" in capsys.readouterr().err


def test_nan_perplexity_is_shown_and_never_the_best_in_the_comparison(tmp_path):
    """comparison_table prints a broken (NaN) forward as nan, and run_results_table's verdict is
    against the best finite method, whatever the order of the rows."""
    from hf_rope_ext.evaluation.report import comparison_table

    module = _example_module("run_results_table_nan", "run_results_table.py")

    def row(method, scale, ppl, beyond):
        return dict(mode="buckets", method=method, scale=scale, steps_per_doubling=None, model="m", dtype="fp32",
                    context_length=512, stride=None, eval_tokens=None, bucket_size=64, documents=["book"], ppl=ppl,
                    nll=math.log(ppl) if ppl == ppl else ppl, tokens=511, ranges=None, beyond_native_ppl=beyond)

    nan = float("nan")
    summary = {"models": ["m"], "native_context": 256, "cases": 5, "retrieval": [],
               "perplexity": [row("none", None, 20.0, 60.0), row("ntk", 2.0, nan, nan), row("linear", 2.0, 50.0, 30.0),
                              row("yarn", 2.0, 40.0, 45.0), row(DEFAULT_METHOD, 2.0, 30.0, 35.0)]}  # fmt: skip
    assert "| ntk | 2 | nan | nan |" in comparison_table(summary)
    (verdict,) = module.goal_checks(summary, 256)
    assert "does NOT beat the best other method, linear 30.00" in verdict


# ----------------------------------------------------------------------------------------------
# Found by review: folders of several models, hand edits, output folders, --report-only, progress
# ----------------------------------------------------------------------------------------------


def test_each_model_of_a_folder_gets_its_own_beyond_native_table(tmp_path):
    """Two models with other native contexts in one folder: each section has the table of the
    positions beyond its own model's native context (closed form from the buckets)."""
    buckets = [[0, 4, 10.0], [4, 8, 8.0], [8, 12, 90.0], [12, 16, 120.0]]
    records = [_record("none", None, "a", 16, buckets), {**_record("none", None, "a", 16, buckets), "model": "long",
                                                          "native_context": 12}]  # fmt: skip
    written = {path.name for path in write_reports(_write_results(tmp_path, records))}
    markdown = (tmp_path / "results.md").read_text()
    assert markdown.count("beyond the native context") == 2
    short = math.exp((4 * math.log(90) + 4 * math.log(120)) / 8)  # positions 8..15, 4 tokens a bucket
    sections = {section.split("\n")[0]: section for section in markdown.split("\n## ")[1:]}
    assert f"| none | {short:.2f} |" in _table_after(sections["m"], "beyond the native context (8 ..")
    assert "| none | 120.00 |" in _table_after(sections["long"], "beyond the native context (12 ..")
    assert "perplexity_by_position.png" in written
    rows = json.loads((tmp_path / "summary.json").read_text())["perplexity"]
    assert sorted(row["native_context"] for row in rows) == [8, 12]


@pytest.mark.parametrize("field, other", [("document_sha256", "ffff"), ("model_fingerprint", "abc")])
def test_a_folder_naming_one_document_or_model_with_other_content_is_refused(tmp_path, capsys, field, other):
    """What eval refuses to write (another text or checkpoint under a known name), edited in by
    hand, is refused by --report-only too, instead of being pooled as one."""
    records = [{**record, "model_fingerprint": "0123"} for record in _valid_records()]
    records[0]["document_sha256"] = "0123"
    records.append({**records[0], field: other})
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(record) + "\n" for record in records))
    assert cli_main(["eval", "--report-only", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {results}:3: field {field!r} is {other!r}, but line 1 names ")
    assert len(err.splitlines()) == 1 and not (tmp_path / "results.md").exists()


def _immutable(path: Path):
    """Make ``path`` unwritable for this user (root: chattr +i); returns the undo, or skips."""
    import subprocess

    if os.geteuid() != 0:
        mode = path.stat().st_mode
        path.chmod(mode & ~0o222)
        return lambda: path.chmod(mode)
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("no chattr on this file system")
    return lambda: subprocess.run(["chattr", "-i", str(path)], check=True)


def test_an_output_dir_that_cannot_be_written_is_refused_before_the_model_loads(tmp_path, capsys):
    """A report name taken by a folder, a results.jsonl or folder that cannot be written: one line
    naming it, before the model loads (the model here does not even exist), for eval and demo."""
    book = tmp_path / "book.txt"
    book.write_text("word " * 100)
    model = str(tmp_path / "no-model")
    blocked = tmp_path / "blocked"
    (blocked / "results.md").mkdir(parents=True)
    for command in ("eval", "demo"):
        assert cli_main([command, "--model", model, "--text-file", str(book), "--output-dir", str(blocked)]) == 2
        assert capsys.readouterr().err.strip() == (f"error: {blocked / 'results.md'} is a folder, where the report "
                                                   "results.md is written; move it, or use another --output-dir.")
    with pytest.raises(OSError, match=r"results.md could not be written \(Is a directory\)") as raised:
        write_reports(_write_results(blocked, _valid_records()))
    assert ".hf_rope_ext" not in str(raised.value)
    for target, message in (("results.jsonl", "results.jsonl is not writable for you"), (".", "is not writable")):
        folder = _write_results(tmp_path / f"ro{len(target)}", _valid_records())
        undo = _immutable(folder / target)
        try:
            assert cli_main(["eval", "--model", model, "--text-file", str(book), "--output-dir", str(folder)]) == 2
            err = capsys.readouterr().err
            assert message in err and "Model folder not found" not in err
        finally:
            undo()


def test_files_named_as_the_reports_without_results_are_kept(tmp_path, capsys):
    """A folder with the user's own results.md / summary.json and no results.jsonl is not an
    evaluation's: refused before any work, the files untouched (library and command line)."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "results.md").write_text("# my notes\n")
    (folder / "summary.json").write_text('{"mine": 1}\n')
    book = tmp_path / "book.txt"
    book.write_text("word " * 100)
    assert cli_main(["eval", "--model", str(tmp_path / "no-model"), "--text-file", str(book), "--output-dir",
                     str(folder)]) == 2  # fmt: skip
    assert "holds summary.json, results.md but no results.jsonl" in capsys.readouterr().err
    model = make_model("llama")
    counter = CallCounter(model)
    with pytest.raises(EvaluationError, match="would be overwritten"):
        run_evaluation(model, CharTokenizer(), _plan(), folder, documents={"doc": random_ids(80)[0]}, progress=False)
    assert counter.calls == 0 and (folder / "results.md").read_text() == "# my notes\n"
    assert sorted(path.name for path in folder.iterdir()) == ["results.md", "summary.json"]


def test_report_only_refuses_the_options_it_would_ignore(tmp_path, capsys):
    folder = _write_results(tmp_path / "out", _valid_records())
    command = ["eval", "--report-only", "--output-dir", str(folder)]
    assert cli_main([*command, "--methods", "bogus", "--scales", "-3", "--text-files", "nope.txt"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "leave out --text-files, --methods, --scales" in err
    assert not (folder / "results.md").exists()
    assert cli_main(command) == 0 and (folder / "results.md").is_file()


def test_no_progress_hides_the_loading_bar_for_that_call_only(tiny_checkpoint, capfd):
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers.utils import logging as transformers_logging

    from hf_rope_ext.loading import load_model

    load_model(str(tiny_checkpoint), device="cpu")
    assert "Loading weights" in capfd.readouterr().err  # the bar hidden below
    before = transformers_logging.is_progress_bar_enabled(), are_progress_bars_disabled()
    load_model(str(tiny_checkpoint), device="cpu", progress=False)
    assert "Loading weights" not in capfd.readouterr().err
    assert (transformers_logging.is_progress_bar_enabled(), are_progress_bars_disabled()) == before


# ----------------------------------------------------------------------------------------------
# Regressions: records the reader refuses, broken links, progress settings, --report-only, lengths
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arguments, message", [
    (dict(documents={0: None}), "documents' names (its keys) must be a non-empty string, got 0."),
    (dict(documents={"": None}), "documents' names (its keys) must be a non-empty string, got ''."),
    (dict(native_context=32.5), "native_context must be a positive integer, got 32.5."),
    (dict(native_context=True), "native_context must be a positive integer, got True."),
    (dict(model_name=5), "model_name must be a non-empty string, got 5."),
    (dict(dtype=5), "dtype must be a string, got 5."),
    (dict(native_context=torch.tensor(32.0)), "native_context must be a positive integer, got tensor(32.)."),
])  # fmt: skip
def test_run_evaluation_refuses_arguments_its_records_could_not_hold(tmp_path, arguments, message):
    """A value the results' reader refuses would be written into every record, the run lost and the
    folder refused on every rerun: refused in one line naming the argument, before any forward."""
    model = make_model("llama")
    counter = CallCounter(model)
    ids = random_ids(80)[0]
    documents = {name: ids for name in arguments.pop("documents", {"doc": None})}
    with pytest.raises(EvaluationError) as raised:
        run_evaluation(model, CharTokenizer(), _plan(methods=["none", "yarn"], scales=[2.0]), tmp_path,
                       documents=documents, progress=False, **arguments)  # fmt: skip
    assert str(raised.value) == message
    assert counter.calls == 0 and not (tmp_path / "results.jsonl").exists()


def test_run_evaluation_writes_a_float_native_context_and_a_torch_dtype_as_its_reader_takes_them(tmp_path):
    """native_context=32.0 and dtype=torch.float32 (natural in Python) are recorded as 32 and as the
    command line names that dtype (fp32), as is the model's own dtype by default and torch's name
    "float32": one dtype is one case, whoever runs it. The reader takes the records, and a rerun
    under any of those spellings finds every case done."""
    model = make_model("llama")
    documents = {"doc": random_ids(80)[0]}
    plan = _plan(methods=["none", "yarn"], scales=[2.0])
    default = run_evaluation(model, CharTokenizer(), plan, tmp_path / "default", documents=documents, progress=False)
    records = run_evaluation(model, CharTokenizer(), plan, tmp_path / "out", documents=documents, progress=False,
                             native_context=float(ORIGINAL_CONTEXT), dtype=torch.float32)  # fmt: skip
    stored = read_results(tmp_path / "out")
    assert len(stored) == len(records) == 4
    assert all(type(r["native_context"]) is int and r["native_context"] == ORIGINAL_CONTEXT for r in stored)
    assert {r["dtype"] for r in stored} == {r["dtype"] for r in default} == {"fp32"}
    counter = CallCounter(model)
    for spelling in ("float32", "fp32", None):
        run_evaluation(model, CharTokenizer(), plan, tmp_path / "out", documents=documents, progress=False,
                       native_context=ORIGINAL_CONTEXT, dtype=spelling)  # fmt: skip
    assert counter.calls == 0 and len(read_results(tmp_path / "out")) == 4


def test_records_that_name_a_dtype_as_torch_does_are_read_under_the_command_lines_name(tmp_path):
    """Earlier versions recorded run_evaluation's default dtype as "float32" where the command line
    records "fp32": the same cases then ran again and results.md showed every table twice."""
    model = make_model("llama")
    documents = {"doc": random_ids(80)[0]}
    plan = _plan(methods=["none", "yarn"], scales=[2.0])
    run_evaluation(model, CharTokenizer(), plan, tmp_path, documents=documents, progress=False)
    results = tmp_path / "results.jsonl"
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    results.write_text("".join(json.dumps({**line, "dtype": "float32"}) + "\n" for line in lines))
    assert {record["dtype"] for record in read_results(tmp_path)} == {"fp32"}
    counter = CallCounter(model)
    run_evaluation(model, CharTokenizer(), plan, tmp_path, documents=documents, progress=False, dtype="fp32")
    assert counter.calls == 0 and len(read_results(tmp_path)) == 4


@pytest.mark.parametrize("where", ["folder", "above", "results", "results linked to itself"])
def test_broken_symbolic_links_are_refused_before_the_model_loads(tmp_path, capsys, where):
    """An --output-dir that is a link to nothing, one under such a link, and a results.jsonl linked
    into a folder that does not exist: mkdir and open would fail only at the first append, after a
    case ran. Refused in one line, for the library and the command line (whose model does not exist)."""
    from hf_rope_ext.evaluation.records import check_output_dir

    link = tmp_path / "link"
    if where in ("results", "results linked to itself"):
        link.mkdir()
        target = "results.jsonl" if where == "results linked to itself" else tmp_path / "missing" / "results.jsonl"
        (link / "results.jsonl").symlink_to(target)
        output_dir, broken = link, link / "results.jsonl"
    else:
        link.symlink_to(tmp_path / "missing")
        output_dir, broken = (link if where == "folder" else link / "sub"), link
    with pytest.raises(EvaluationError, match=f"{broken} is a broken symbolic link"):
        check_output_dir(output_dir)
    model = make_model("llama")
    counter = CallCounter(model)
    with pytest.raises(EvaluationError, match="is a broken symbolic link"):
        run_evaluation(model, CharTokenizer(), _plan(), output_dir, documents={"doc": random_ids(80)[0]},
                       progress=False)  # fmt: skip
    assert counter.calls == 0
    book = tmp_path / "book.txt"
    book.write_text("word " * 100)
    assert cli_main(["eval", "--model", str(tmp_path / "no-model"), "--text-file", str(book), "--methods", "none",
                     "--ppl-lengths", "64", "--output-dir", str(output_dir)]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is a broken symbolic link" in err and "Model folder" not in err
    assert not (tmp_path / "missing").exists()


def test_a_results_file_linked_to_a_file_still_to_be_made_is_appended_to(tmp_path):
    """A results.jsonl that links to a file not made yet, in a folder that exists, is written through
    the link (not a broken folder)."""
    folder = tmp_path / "out"
    folder.mkdir()
    target = tmp_path / "kept" / "results.jsonl"
    target.parent.mkdir()
    (folder / "results.jsonl").symlink_to(target)
    records = run_evaluation(make_model("llama"), CharTokenizer(), _plan(methods=["none"]), folder,
                             documents={"doc": random_ids(80)[0]}, progress=False)  # fmt: skip
    assert len(read_results(folder)) == len(records) == 2 and target.is_file()


def test_no_progress_puts_back_huggingface_hubs_group_settings_and_does_not_warn(tiny_checkpoint, monkeypatch):
    """transformers' progress-bar switches call huggingface_hub's global ones, which clear its
    per-group settings: they are as before after load_model(progress=False), and with
    HF_HUB_DISABLE_PROGRESS_BARS=0 (which keeps priority) nothing is warned."""
    import importlib
    import warnings

    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as transformers_logging

    from hf_rope_ext.loading import load_model

    hub_tqdm = importlib.import_module("huggingface_hub.utils.tqdm")
    monkeypatch.setattr(hub_tqdm, "progress_bar_states", dict(hub_tqdm.progress_bar_states))  # this test's own
    enable_progress_bars()
    disable_progress_bars("huggingface_hub.http_get")  # the user hides download bars only
    enable_progress_bars("huggingface_hub.http_get.extra")
    expected = {"_global": True, "huggingface_hub.http_get": False, "huggingface_hub.http_get.extra": True}
    assert hub_tqdm.progress_bar_states == expected
    load_model(str(tiny_checkpoint), device="cpu", progress=False)
    assert hub_tqdm.progress_bar_states == expected
    assert are_progress_bars_disabled("huggingface_hub.http_get") and not are_progress_bars_disabled()
    assert transformers_logging.is_progress_bar_enabled()
    for variable in (False, True):  # HF_HUB_DISABLE_PROGRESS_BARS=0, then =1
        monkeypatch.setattr(hub_tqdm, "HF_HUB_DISABLE_PROGRESS_BARS", variable)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            load_model(str(tiny_checkpoint), device="cpu", progress=False)
        assert hub_tqdm.progress_bar_states == expected and transformers_logging.is_progress_bar_enabled()


@pytest.mark.parametrize("option", [["--model", "smollm2"], ["--trials", "3"], ["--dtype", "fp32"], ["--stride", "256"],
                                    ["--methods", "none,linear,ntk,dynamic,yarn,dynamic-yarn"],
                                    ["--ppl-modes", "buckets"], ["--seed", "0"], ["--no-progress"]])  # fmt: skip
def test_report_only_refuses_an_option_given_at_its_default_value(tmp_path, capsys, option):
    """`--model smollm2 --report-only` reads as "report smollm2", but would regenerate every model's
    reports: any option given is refused, whatever its value."""
    folder = _write_results(tmp_path / "out", _valid_records())
    assert cli_main(["eval", "--report-only", "--output-dir", str(folder), *option]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"leave out {option[0]} " in err
    assert not (folder / "results.md").exists()


def test_benchmark_speed_does_not_look_at_a_results_file_it_never_writes(tiny_checkpoint, tmp_path, monkeypatch):
    """examples/benchmark_speed.py writes speed.json only: a results.jsonl it cannot append to (here a
    folder of that name) is no reason to refuse the folder."""
    module = _example_module("benchmark_speed", "benchmark_speed.py")
    folder = tmp_path / "bench"
    (folder / "results.jsonl").mkdir(parents=True)
    assert module.main(["--model", str(tiny_checkpoint), "--device", "cpu", "--output-dir", str(folder),
                        "--forward-tokens", "64", "--forward-repeats", "1", "--skip-decode",
                        "--forward-methods", "yarn"]) == 0  # fmt: skip
    assert (folder / "speed.json").is_file() and (folder / "results.jsonl").is_dir()


@pytest.mark.parametrize("lengths, option", [("1,384", "--ppl-lengths"), ("0", "--ppl-lengths")])
def test_a_length_under_two_tokens_is_named_by_its_option_and_rule(tmp_path, capsys, lengths, option):
    """The rule is at least 2 tokens (a loss needs a token to predict from): the message says so,
    and names the option (command line) beside the plan field (Python API)."""
    book = tmp_path / "book.txt"
    book.write_text("word " * 100)
    assert cli_main(["eval", "--model", str(tmp_path / "no-model"), "--text-file", str(book), "--methods", "none",
                     "--ppl-lengths", lengths, "--output-dir", str(tmp_path / "out")]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: ppl_lengths ({option}) must be integer token counts of at least 2, got ")
    with pytest.raises(EvaluationError, match=r"^retrieval_lengths \(--retrieval-lengths\) must be integer token "
                                              r"counts of at least 2, got 1\.$"):  # fmt: skip
        _plan(retrieval_tasks=["passkey"], retrieval_lengths=[1]).validate(None)


def test_the_demo_on_a_model_of_one_token_names_its_native_context(tmp_path, capsys):
    """Its default perplexity length would be 1 token: the demo names the model's native context,
    not a --ppl-length that was never given (before the weights load: none are saved here)."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                max_position_embeddings=1).save_pretrained(tmp_path / "model")  # fmt: skip
    book = tmp_path / "book.txt"
    book.write_text("word " * 100)
    assert cli_main(["demo", "--model", str(tmp_path / "model"), "--device", "cpu", "--text-file", str(book),
                     "--output-dir", str(tmp_path / "out")]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "native context (max_position_embeddings) is 1" in err
    assert "ppl" not in err


# -- a patched model, a patched checkpoint, a folder spelled another way ------------------------


def _summary(records):
    return [(r["method"], r["scale"], r["native_context"], r["rope_fingerprint"], r["ppl"]) for r in records]


def test_a_patched_model_is_evaluated_from_its_original_rope_and_keeps_its_patch(tmp_path):
    from hf_rope_ext import patched

    model = make_model("llama")
    documents = {"doc": random_ids(80)[0]}
    plan = _plan(methods=["none", "yarn"], scales=[2.0], ppl_lengths=[64])
    # reference: the same plan on the model as it was never patched
    reference = _summary(run_evaluation(model, CharTokenizer(), plan, tmp_path / "clean", documents=documents,
                                        write_report=False, progress=False))  # fmt: skip
    assert [row[2] for row in reference] == [ORIGINAL_CONTEXT] * 2
    patch_model(model, scale=4, method="linear")
    linear = get_patch_info(model)
    records = run_evaluation(model, CharTokenizer(), plan, tmp_path / "patched", documents=documents,
                             write_report=False, progress=False)  # fmt: skip
    assert _summary(records) == reference  # 'none' is the original model; yarn x2 is built from 32 tokens
    assert get_patch_info(model) == linear  # the user's patch is put back
    with patched(model, 2, "ntk"):
        ntk = get_patch_info(model)
        records = run_evaluation(model, CharTokenizer(), plan, tmp_path / "block", documents=documents,
                                 write_report=False, progress=False)  # fmt: skip
        assert _summary(records) == reference and get_patch_info(model) == ntk
    assert get_patch_info(model) == linear
    # a run that fails (a document too short for the plan) puts the patch back too, having written nothing
    with pytest.raises(EvaluationError):
        run_evaluation(model, CharTokenizer(), _plan(ppl_lengths=[200]), tmp_path / "short", documents=documents,
                       write_report=False, progress=False)  # fmt: skip
    assert get_patch_info(model) == linear and not (tmp_path / "short" / "results.jsonl").exists()


def test_a_patched_checkpoint_is_evaluated_from_its_base_rope(tiny_checkpoint, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_rope_ext.hub import save_patched

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    patch_model(model, scale=4, method="yarn")
    save_patched(model, tmp_path / "pckpt")
    AutoTokenizer.from_pretrained(tiny_checkpoint).save_pretrained(tmp_path / "pckpt")
    book = tmp_path / "book.txt"
    book.write_text(" ".join(f"Line {i} of a long and winding story." for i in range(200)))
    options = ["--device", "cpu", "--text-file", str(book), "--methods", "none,yarn", "--scales", "2",
               "--ppl-lengths", "384", "--bucket-size", "128", "--no-progress"]  # fmt: skip
    assert cli_main(["eval", "--model", str(tiny_checkpoint), "--output-dir", str(tmp_path / "base"), *options]) == 0
    assert cli_main(["eval", "--model", str(tmp_path / "pckpt"), "--output-dir", str(tmp_path / "p"), *options]) == 0
    base, saved = read_results(tmp_path / "base"), read_results(tmp_path / "p")
    keys = ("method", "scale", "native_context", "rope_fingerprint", "ppl")
    assert [[r[k] for k in keys] for r in saved] == [[r[k] for k in keys] for r in base]
    assert [r["native_context"] for r in saved] == [256, 256]
    # The library refuses the checkpoint loaded with plain from_pretrained (patched RoPE in its config)
    # before any forward, naming load_patched.
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "pckpt")
    with pytest.raises(EvaluationError, match="hub.load_patched"):
        run_evaluation(plain, CharTokenizer(), _plan(methods=["none"], scales=[], ppl_lengths=[24]), tmp_path / "x",
                       documents={"doc": random_ids(80)[0]}, progress=False)  # fmt: skip
    assert not (tmp_path / "x" / "results.jsonl").exists()


def test_a_local_checkpoint_spelled_another_way_resumes_its_cases(tiny_checkpoint, tmp_path, monkeypatch, caplog):
    book = tmp_path / "book.txt"
    book.write_text(" ".join(f"Line {i} of a long and winding story." for i in range(200)))
    output = tmp_path / "out"
    options = ["--device", "cpu", "--text-file", str(book), "--methods", "none", "--ppl-lengths", "128",
               "--output-dir", str(output), "--no-progress"]  # fmt: skip
    monkeypatch.chdir(tiny_checkpoint.parent)
    assert cli_main(["eval", "--model", tiny_checkpoint.name, *options]) == 0
    before = (output / "results.jsonl").read_text()
    assert json.loads(before)["model"] == tiny_checkpoint.name
    for spelling in (f"./{tiny_checkpoint.name}/", str(tiny_checkpoint)):
        with caplog.at_level(logging.INFO, logger="hf_rope_ext.evaluation.runner"):
            assert cli_main(["eval", "--model", spelling, *options]) == 0
        assert "1 already in" in caplog.text and "0 to run" in caplog.text
        assert (output / "results.jsonl").read_text() == before
        caplog.clear()
    # in the library: another spelling of the same folder resumes the cases recorded under the first;
    # another name is another model (a fingerprint samples the weights, so it cannot tell them apart)
    model, documents, plan = make_model("llama"), {"doc": random_ids(80)[0]}, _plan(methods=["none"], ppl_lengths=[24])
    (tmp_path / "ckpt").mkdir()
    first = run_evaluation(model, CharTokenizer(), plan, tmp_path / "lib", documents=documents,
                           model_name=str(tmp_path / "ckpt"), progress=False)  # fmt: skip
    again = run_evaluation(model, CharTokenizer(), plan, tmp_path / "lib", documents=documents,
                           model_name=f"{tmp_path}/./ckpt/", progress=False)  # fmt: skip
    assert again == first and len(read_results(tmp_path / "lib")) == 1
    other = run_evaluation(model, CharTokenizer(), plan, tmp_path / "lib", documents=documents, model_name="b",
                           progress=False)  # fmt: skip
    assert [r["model"] for r in other] == ["b"] and len(read_results(tmp_path / "lib")) == 2
    # other weights under another spelling of a folder the file holds: refused, as under the same name
    changed = make_model("llama", seed=1)
    with pytest.raises(EvaluationError, match=r"whose config or weights differ from the model loaded now as"):
        run_evaluation(changed, CharTokenizer(), plan, tmp_path / "lib", documents=documents,
                       model_name=f"{tmp_path}/ckpt/", progress=False)  # fmt: skip
    assert len(read_results(tmp_path / "lib")) == 2


def test_eval_loading_a_checkpoint_that_lost_its_record_keeps_the_missing_record_warning(tiny_checkpoint, tmp_path,
                                                                                          caplog):
    """`hf-rope-ext eval` loads a save_patched checkpoint as load_patched does, which silences the
    construction's warning for a model patched right after; a checkpoint whose record was deleted is
    not patched after, so the warning that it runs without its attention must still be logged."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_rope_ext.evaluation.cli import load_for_evaluation
    from hf_rope_ext.hub import save_patched

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    patch_model(model, scale=4, method="self-extend")
    target = save_patched(model, tmp_path / "ckpt")
    AutoTokenizer.from_pretrained(tiny_checkpoint).save_pretrained(target)
    config = json.loads((target / "config.json").read_text())
    del config["hf_rope_ext"]
    (target / "config.json").write_text(json.dumps(config))
    with caplog.at_level("WARNING", logger="hf_rope_ext.config_io"):
        loaded, _ = load_for_evaluation(str(target), device="cpu", progress=False)
    assert get_patch_info(loaded) is None
    assert "no `hf_rope_ext` record to rebuild the attention from" in caplog.text
