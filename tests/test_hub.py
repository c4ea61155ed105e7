"""Patched checkpoints: save, reload (with and without hf_rope_ext), offline Hub, runtimes, cards."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import FAMILIES, ORIGINAL_CONTEXT, make_config, make_model, random_ids
from huggingface_hub import ModelCard
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

import hf_rope_ext
from hf_rope_ext import get_patch_info, patch_model, unpatch_model
from hf_rope_ext.cli import main as cli_main
from hf_rope_ext.hub import load_patched, push_patched_to_hub, restore_patch, save_patched
from hf_rope_ext.runtimes import describe_patch, runtime_settings
from hf_rope_ext.evaluation.runner import recorded_steps
from hf_rope_ext.methods import default_inv_freq
from hf_rope_ext.model_card import render_model_card, write_model_card
from hf_rope_ext.patching import DEFAULT_STEPS_PER_DOUBLING

L0 = ORIGINAL_CONTEXT
LONG_FACTOR = [1.0 + 0.5 * i for i in range(8)]  # head_dim 16 -> 8 frequencies
NATIVE = ["linear", "ntk", "dynamic", "yarn", "llama3", "longrope"]
CUSTOM = ["dynamic-yarn", "dynamic-linear"]
LENGTH = 3 * L0 + 5  # beyond the original context, not on a frequency step


def _patch(model, method, scale=4, **kwargs):
    if method == "longrope":
        kwargs.setdefault("long_factor", LONG_FACTOR)
    return patch_model(model, scale=scale, method=method, **kwargs)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _hub_cache_snapshot(cache: Path, repo_id: str, folder: Path) -> None:
    """Lay out ``folder`` as the Hub cache does: blobs by sha256, a snapshot of links, refs/main."""
    org, name = repo_id.split("/")
    repo = cache / f"models--{org}--{name}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    for file in sorted(folder.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / file.name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)


# ----------------------------------------------------------------------------------------------
# A fresh interpreter without hf_rope_ext, then with it, on an offline Hub cache
# ----------------------------------------------------------------------------------------------

FRESH_INTERPRETER = textwrap.dedent(
    """
    import importlib.abc, json, sys
    from safetensors.torch import load_file

    class NotInstalled(importlib.abc.MetaPathFinder):  # as if hf_rope_ext were not installed
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "hf_rope_ext":
                raise ModuleNotFoundError(f"No module named {name!r}")

    blocker = NotInstalled()
    sys.meta_path.insert(0, blocker)
    import torch
    from transformers import AutoModelForCausalLM

    manifest = json.load(open(sys.argv[1]))
    report = {"native": {}, "custom_errors": {}}

    def max_error(source, case):
        model = AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager").eval()
        tensors = load_file(case["tensors"])
        with torch.no_grad():
            return (model(tensors["ids"]).logits - tensors["expected"]).abs().max().item(), model

    for name, case in manifest["native"].items():
        error, model = max_error(case["path"], case)
        report["native"][name] = {"error": error, "rope_type": model.config.rope_parameters["rope_type"]}
    for name, path in manifest["custom"].items():
        try:
            AutoModelForCausalLM.from_pretrained(path)
            report["custom_errors"][name] = None
        except Exception as exc:
            report["custom_errors"][name] = f"{type(exc).__name__}: {exc}"
    case = manifest["hub_native"]
    report["hub_native_error"] = max_error(case["repo_id"], case)[0]
    report["imported_without_package"] = "hf_rope_ext" in sys.modules

    sys.meta_path.remove(blocker)  # now "install" the package
    import hf_rope_ext
    from hf_rope_ext import unpatch_model
    from hf_rope_ext.hub import load_patched

    case = manifest["hub_custom"]
    tensors = load_file(case["tensors"])
    model = load_patched(case["repo_id"], attn_implementation="eager").eval()
    with torch.no_grad():
        report["hub_custom_error"] = (model(tensors["ids"]).logits - tensors["expected"]).abs().max().item()
        unpatch_model(model)
        report["hub_custom_unpatched_equal"] = bool(torch.equal(model(tensors["ids"]).logits, tensors["base"]))
    print("REPORT" + json.dumps(report))
    """
)


def test_fresh_interpreter_without_and_with_package(tmp_path):
    manifest = {"native": {}, "custom": {}}
    ids = random_ids(LENGTH)
    cases = [(family, method, {}) for family in FAMILIES for method in NATIVE]
    # patch_model's default for `dynamic` changes frequencies in steps; transformers' `dynamic`
    # follows every length, so the two agree at the step lengths (2 * L0 is one).
    cases += [(family, "dynamic", {"steps_per_doubling": None}) for family in FAMILIES]
    for family, method, kwargs in cases:
        name = f"{family}-{method}" + ("-exact" if kwargs else "")
        model = make_model(family)
        _patch(model, method, **kwargs)
        case_ids = random_ids(2 * L0) if method == "dynamic" and not kwargs else ids
        tensors = tmp_path / f"{name}.safetensors"
        save_file({"ids": case_ids, "expected": _logits(model, case_ids)}, tensors)
        manifest["native"][name] = {"path": str(save_patched(model, tmp_path / name)), "tensors": str(tensors)}
    for method in ("yarn", "ntk"):  # transformers' own save_pretrained writes a loadable config too
        name = f"qwen3-{method}-save_pretrained"
        model = make_model("qwen3")
        _patch(model, method)
        tensors = tmp_path / f"{name}.safetensors"
        save_file({"ids": ids, "expected": _logits(model, ids)}, tensors)
        model.save_pretrained(tmp_path / name)
        manifest["native"][name] = {"path": str(tmp_path / name), "tensors": str(tensors)}
    for method in CUSTOM:
        model = make_model("qwen2")
        _patch(model, method)
        manifest["custom"][method] = str(save_patched(model, tmp_path / method))

    cache = tmp_path / "hub_cache"
    _hub_cache_snapshot(cache, "hf-rope-ext-test/tiny-llama-yarn", Path(manifest["native"]["llama-yarn"]["path"]))
    manifest["hub_native"] = {
        "repo_id": "hf-rope-ext-test/tiny-llama-yarn",
        "tensors": manifest["native"]["llama-yarn"]["tensors"],
    }
    base = make_model("mistral")
    model = make_model("mistral")
    _patch(model, "dynamic-yarn")
    folder = save_patched(model, tmp_path / "mistral-dynamic-yarn")
    _hub_cache_snapshot(cache, "hf-rope-ext-test/tiny-mistral-dynamic-yarn", folder)
    tensors = tmp_path / "mistral-dynamic-yarn.safetensors"
    save_file({"ids": ids, "expected": _logits(model, ids), "base": _logits(base, ids)}, tensors)
    manifest["hub_custom"] = {"repo_id": "hf-rope-ext-test/tiny-mistral-dynamic-yarn", "tensors": str(tensors)}

    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "check.py").write_text(FRESH_INTERPRETER)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(cache),
        "HF_HOME": str(tmp_path / "hf_home"),
        "PYTHONPATH": "",
    }
    result = subprocess.run(
        [sys.executable, str(tmp_path / "check.py"), str(tmp_path / "manifest.json")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.split("REPORT", 1)[1])

    assert not report["imported_without_package"]
    assert len(report["native"]) == len(cases) + 2
    for name, outcome in report["native"].items():
        assert outcome["error"] < 2e-5, (name, outcome)
        assert not outcome["rope_type"].startswith("hf_rope_ext"), name
    for method, message in report["custom_errors"].items():
        assert message is not None, f"{method} loaded without hf_rope_ext"
        assert message.startswith("KeyError")
        assert "pip install hf-rope-ext" in message and "import hf_rope_ext" in message
    assert report["hub_native_error"] < 2e-5
    assert report["hub_custom_error"] < 2e-5
    assert report["hub_custom_unpatched_equal"]


# ----------------------------------------------------------------------------------------------
# Round trips with the package
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", NATIVE + CUSTOM)
def test_round_trip_restores_the_patch_and_the_original(tmp_path, family, method):
    base_config = make_config(family).to_dict()
    model = make_model(family)
    ids = random_ids(LENGTH)
    base_logits = _logits(model, ids)
    _patch(model, method)
    info = get_patch_info(model)
    patched_logits = _logits(model, ids)
    assert not torch.allclose(patched_logits, base_logits, atol=1e-3)  # the patch matters at this length

    loaded = load_patched(save_patched(model, tmp_path / "ckpt"), attn_implementation="eager").eval()
    assert get_patch_info(loaded) == info
    torch.testing.assert_close(_logits(loaded, ids), patched_logits, rtol=0, atol=2e-5)

    unpatch_model(loaded)
    assert torch.equal(_logits(loaded, ids), base_logits)
    metadata = ("architectures", "dtype", "_name_or_path", "transformers_version")
    config = {key: value for key, value in loaded.config.to_dict().items() if key not in metadata}
    assert config == {key: value for key, value in base_config.items() if key not in metadata}


@pytest.mark.parametrize("method", CUSTOM)
def test_plain_from_pretrained_with_package(tmp_path, method):
    model = make_model("llama")
    _patch(model, method)
    folder = save_patched(model, tmp_path / "ckpt")
    for length in (L0 - 3, 2 * L0 + 7, LENGTH):  # fresh model per length: transformers' dynamic state
        loaded = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        ids = random_ids(length)
        torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), rtol=0, atol=2e-5)


def test_restored_patch_keeps_generation_exact(tmp_path):
    """transformers' module keeps stale cached keys; the restored patch recomputes them."""
    model = make_model("qwen3")
    _patch(model, "dynamic-yarn")
    folder = save_patched(model, tmp_path / "ckpt")
    ids = random_ids(2 * L0 + 6)
    full = _logits(model, ids)[0, -1]

    def last_step(loaded):
        with torch.no_grad():
            out = loaded(ids[:, : L0 - 4], use_cache=True)
            cache = out.past_key_values
            for position in range(L0 - 4, ids.shape[1]):
                out = loaded(ids[:, position : position + 1], past_key_values=cache, use_cache=True)
                cache = out.past_key_values
        return out.logits[0, -1]

    restored = load_patched(folder, attn_implementation="eager").eval()
    plain = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    torch.testing.assert_close(last_step(restored), full, rtol=0, atol=1e-4)
    assert (last_step(plain) - full).abs().max() > 1e-3


def test_user_registered_method_round_trip(tmp_path):
    def halve(rotary_dim, base, params, seq_len=None):
        """Halve every frequency."""
        return default_inv_freq(rotary_dim, base) / 2, 1.0

    hf_rope_ext.register_method("halve-test", halve)
    try:
        model = make_model("llama")
        patch_model(model, scale=2, method="halve-test")
        ids = random_ids(LENGTH)
        folder = save_patched(model, tmp_path / "ckpt")
        loaded = load_patched(folder, attn_implementation="eager").eval()
        torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), rtol=0, atol=2e-5)
        settings = runtime_settings(loaded)
        assert settings.vllm.status == settings.llama_cpp.status == "unsupported"
        assert "halve-test" in settings.vllm.notes[0] and "halve-test" in settings.llama_cpp.notes[0]
    finally:
        hf_rope_ext.unregister_method("halve-test")
    with pytest.raises(ValueError, match=r"method 'halve-test', which is not registered.*register_method"):
        load_patched(folder)


# ----------------------------------------------------------------------------------------------
# Corrupt and contradictory configs
# ----------------------------------------------------------------------------------------------


def _edit_config(folder: Path, edit) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    for key in ("rope_scaling", "rope_theta"):  # keep the legacy spelling out of the way
        config.pop(key, None)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "method, edit, message",
    [
        ("yarn", lambda c: c["rope_parameters"].update(factor=8.0), r"'factor' is 8.0, expected 4.0"),
        ("ntk", lambda c: c["rope_parameters"].update(rope_theta=10000.0), r"'rope_theta' is 10000.0, expected"),
        ("linear", lambda c: c.update(max_position_embeddings=64), r"max_position_embeddings is 64, expected 128"),
        ("llama3", lambda c: c["rope_parameters"].update(rope_type="yarn"), r"rope_type is 'yarn', expected 'llama3'"),
        ("yarn", lambda c: c["rope_parameters"].update(beta_fast=8.0), r"'beta_fast' is 8.0, expected 32.0"),
        ("dynamic-yarn", lambda c: c["hf_rope_ext"].update(scale=2.0), r"'factor' is 4.0, expected 2.0"),
        ("yarn", lambda c: c["hf_rope_ext"].pop("params"), r"lacks \['params'\]"),
        ("yarn", lambda c: c["hf_rope_ext"].update(scale="4"), r"scale='4'; it must be a number > 1"),
        (
            "yarn",
            lambda c: c["hf_rope_ext"]["params"].update(beta_fats=3),
            r"does not accept.*did you mean 'beta_fast'",
        ),
        ("yarn", lambda c: c["hf_rope_ext"].update(method="yarnn"), r"method 'yarnn', which is not registered"),
        ("dynamic", lambda c: c["hf_rope_ext"].update(steps_per_doubling=0), r"steps_per_doubling=0"),
        # refused by the spec with patch_model's advice, naming neither the file nor the record
        ("self-extend-yarn", lambda c: c["hf_rope_ext"].update(steps_per_doubling=4),
         r"`hf_rope_ext` entry of config.json has steps_per_doubling=4, but 'self-extend-yarn' changes its frequencies "
         r"only once .* restore the config.json"),
        ("self-extend-dca", lambda c: c["hf_rope_ext"].update(steps_per_doubling=4),
         r"`hf_rope_ext` entry of config.json has steps_per_doubling=4, but 'self-extend-dca'"),
    ],
)
def test_contradictory_config_is_refused(tmp_path, method, edit, message):
    model = make_model("llama")
    _patch(model, method)
    folder = save_patched(model, tmp_path / "ckpt")
    _edit_config(folder, edit)
    with pytest.raises(ValueError, match=message):
        load_patched(folder)


def _edit_raw_config(folder: Path, edit) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "method, edit, message",
    [
        ("yarn", lambda c: c["rope_parameters"].update(factor=8.0), "factor is 8.0 in rope_parameters, 4.0 in rope_scaling"),
        ("dynamic-yarn", lambda c: c["rope_scaling"].update(factor=2.0), "factor is 4.0 in rope_parameters, 2.0 in rope_scaling"),
        ("ntk", lambda c: c["rope_parameters"].update(rope_theta=10000.0), r"rope_theta is 10000.0 in rope_parameters, .* at the top level"),
        ("ntk", lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": 4.0}), "rope_parameters is plain RoPE"),
        ("llama3", lambda c: c["rope_scaling"].pop("low_freq_factor"), "low_freq_factor is 1.0 in rope_parameters, 'missing' in rope_scaling"),
        ("longrope", lambda c: c.update(original_max_position_embeddings=64), "original_max_position_embeddings is 32 in rope_parameters, 64 at the top level"),
    ],
)  # fmt: skip
def test_rope_parameters_and_legacy_rope_scaling_must_agree(tmp_path, method, edit, message):
    model = make_model("llama")
    _patch(model, method)
    folder = save_patched(model, tmp_path / "ckpt")
    _edit_raw_config(folder, edit)
    with pytest.raises(ValueError, match=f"spells the RoPE settings twice and the two disagree .*{message}"):
        load_patched(folder)
    assert cli_main(["runtimes", "--model-dir", str(folder)]) == 2


def test_custom_type_contradiction_stops_plain_from_pretrained(tmp_path):
    model = make_model("llama")
    _patch(model, "dynamic-yarn")
    folder = save_patched(model, tmp_path / "ckpt")
    _edit_config(folder, lambda c: c["rope_parameters"].update(factor=8.0))
    with pytest.raises(ValueError, match="contradicts the RoPE fields"):
        AutoModelForCausalLM.from_pretrained(folder)
    _edit_config(folder, lambda c: (c["rope_parameters"].pop("factor"), c.pop("hf_rope_ext")))
    with pytest.raises(ValueError, match=r"lacks \['factor'\]"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_failed_restore_leaves_the_model_as_loaded(tmp_path):
    model = make_model("llama")
    _patch(model, "yarn")
    folder = save_patched(model, tmp_path / "ckpt")
    # A consistent record of a patch patch_model refuses (it would leave the frequencies unchanged).
    no_op = {"beta_fast": 1e9, "beta_slow": 1e8, "attention_factor": 1.0}
    _edit_config(folder, lambda c: (c["rope_parameters"].update(no_op), c["hf_rope_ext"]["params"].update(no_op)))
    loaded = load_patched(folder, restore=False, attn_implementation="eager").eval()
    ids = random_ids(LENGTH)
    config, logits, rotary = loaded.config.to_dict(), _logits(loaded, ids), loaded.model.rotary_emb
    with pytest.raises(ValueError, match="leaves the frequencies unchanged"):
        restore_patch(loaded)
    assert loaded.config.to_dict() == config and loaded.model.rotary_emb is rotary
    assert torch.equal(_logits(loaded, ids), logits)


def test_restore_and_save_refuse_models_without_a_patch(tmp_path):
    model = make_model("llama")
    with pytest.raises(ValueError, match="not patched by hf_rope_ext"):
        save_patched(model, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="no `hf_rope_ext` record"):
        restore_patch(model)
    _patch(model, "yarn")
    with pytest.raises(ValueError, match="already patched"):
        restore_patch(model)
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


# ----------------------------------------------------------------------------------------------
# What save_patched writes
# ----------------------------------------------------------------------------------------------


def _tokenizer(max_length):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")), model_max_length=max_length
    )


def test_saved_files(tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "training_summary.json").write_text("{}")
    (target / "model-00001-of-00002.safetensors").write_text("stale shard")
    model = make_model("qwen2")
    _patch(model, "yarn", beta_fast=16)
    tokenizer = _tokenizer(L0)
    save_patched(model, target, tokenizer=tokenizer, card="# card\n")

    names = {path.name for path in target.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer_config.json", "README.md", "training_summary.json"} <= names
    assert "model-00001-of-00002.safetensors" not in names
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(".ckpt")]  # no staging folder left
    saved = json.loads((target / "config.json").read_text())
    assert saved["rope_parameters"]["beta_fast"] == 16 and saved["max_position_embeddings"] == 4 * L0
    # transformers 4.x spelling: same values, read back by transformers 5 to the same config
    assert saved["rope_theta"] == saved["rope_parameters"]["rope_theta"]
    assert saved["rope_scaling"] == {k: v for k, v in saved["rope_parameters"].items() if k != "rope_theta"}
    legacy_only = dict(saved)
    legacy_only.pop("rope_parameters")
    (tmp_path / "legacy").mkdir()
    (tmp_path / "legacy" / "config.json").write_text(json.dumps(legacy_only))
    assert AutoConfig.from_pretrained(tmp_path / "legacy").rope_parameters == model.config.rope_parameters
    # vLLM caps its maximum length by the tokenizer's: raised in the saved copy only
    assert json.loads((target / "tokenizer_config.json").read_text())["model_max_length"] == 4 * L0
    assert tokenizer.model_max_length == L0

    _patch(model, "longrope")  # transformers 4.x reads longrope's original context only at the top level
    saved = json.loads((save_patched(model, tmp_path / "longrope") / "config.json").read_text())
    assert saved["original_max_position_embeddings"] == saved["rope_scaling"]["original_max_position_embeddings"] == L0


def test_failed_save_leaves_the_target_alone(tmp_path):
    model = make_model("llama")
    _patch(model, "linear")
    target = save_patched(model, tmp_path / "ckpt")
    before = {path.name: path.read_bytes() for path in target.iterdir()}
    _patch(model, "yarn")
    with pytest.raises(FileNotFoundError):
        save_patched(model, target, card="x\n", card_assets=[tmp_path / "missing.png"])
    assert {path.name: path.read_bytes() for path in target.iterdir()} == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.parametrize(
    "failing",
    ["hf_rope_ext.hub._check_saved_config", "hf_rope_ext.files.give_umask_permissions", "hf_rope_ext.files._swap_in"],
)
def test_save_failing_after_staging_leaves_the_existing_target_byte_identical(tmp_path, monkeypatch, failing):
    """The read-back check, the permissions of the staged files, or the swap of the entries
    fails: the old checkpoint and the user's README are untouched."""
    model = make_model("llama")
    _patch(model, "linear")
    target = save_patched(model, tmp_path / "ckpt", max_shard_size="20KB")  # several shards
    (target / "README.md").write_text("my notes\n")
    before = {path.name: path.read_bytes() for path in target.iterdir()}
    assert sum(name.startswith("model-0") for name in before) > 1
    _patch(model, "yarn")

    def fail(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(failing, fail)
    with pytest.raises(RuntimeError, match="disk full"):
        save_patched(model, target, card="new card\n")
    assert {path.name: path.read_bytes() for path in target.iterdir()} == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt"]  # no staging folder left
    monkeypatch.undo()
    save_patched(model, target)  # and a save that succeeds drops the stale shards, keeps the README
    names = {path.name for path in target.iterdir()}
    assert "README.md" in names and not any(name.startswith("model-0") for name in names)
    assert json.loads((target / "config.json").read_text())["rope_parameters"]["rope_type"] == "yarn"


def test_failed_save_to_a_new_folder_leaves_nothing_behind(tmp_path):
    model = make_model("llama")
    _patch(model, "yarn")
    with pytest.raises(FileNotFoundError):
        save_patched(model, tmp_path / "new" / "deeper" / "ckpt", card="x\n", card_assets=[tmp_path / "missing.png"])
    assert list(tmp_path.iterdir()) == []  # no empty target (or parent) that load_patched would misread


def test_numpy_parameters_are_plain_numbers_and_save(tmp_path):
    import numpy as np

    model = make_model("llama")
    patch_model(model, scale=np.float32(4), method="yarn", beta_fast=np.float32(30), beta_slow=np.int64(2),
                truncate=np.bool_(False))  # fmt: skip
    info = get_patch_info(model)
    assert type(info.scale) is float and info.params["beta_fast"] == 30.0
    assert [type(info.params[key]) for key in ("beta_fast", "beta_slow", "truncate")] == [float, int, bool]
    json.dumps(model.config.to_dict())  # what save_pretrained writes
    patch_model(model, scale=4, method="longrope", long_factor=np.array(LONG_FACTOR, dtype=np.float32))
    assert get_patch_info(model).params["long_factor"] == LONG_FACTOR
    patch_model(model, scale=np.float32(4), method="yarn", beta_fast=np.float32(30))
    target = save_patched(model, tmp_path / "ckpt")
    reference = make_model("llama")
    patch_model(reference, scale=4, method="yarn", beta_fast=30)
    reloaded = load_patched(target, attn_implementation="eager").eval()
    ids = random_ids(LENGTH)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, reference(ids).logits, rtol=0, atol=2e-5)


def test_saved_checkpoint_and_card_get_the_users_umask_permissions(tmp_path):
    model = make_model("llama")
    _patch(model, "yarn")
    previous = os.umask(0o027)
    try:
        target = save_patched(model, tmp_path / "ckpt", card="# card\n")
        card = write_model_card("# card", tmp_path / "cards" / "README.md")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(target.stat().st_mode) == 0o750
    assert {stat.S_IMODE(path.stat().st_mode) for path in target.iterdir()} == {0o640}
    assert stat.S_IMODE(card.stat().st_mode) == 0o640


def test_saving_into_a_folder_keeps_the_modes_of_the_users_files(tmp_path):
    """The checkpoint's files get the umask's modes; the user's files carried into the new
    folder are hard links to the same inodes and must keep theirs (a 0600 token stays private)."""
    model = make_model("llama")
    _patch(model, "yarn")
    target = tmp_path / "ckpt"
    (target / "private").mkdir(parents=True)
    modes = {"hf_token": 0o600, "run.sh": 0o755, "notes.md": 0o640}
    for name, mode in modes.items():
        (target / name).write_text(name)
        os.chmod(target / name, mode)
    os.chmod(target / "private", 0o700)
    previous = os.umask(0o022)
    try:
        save_patched(model, target)
    finally:
        os.umask(previous)
    assert {name: stat.S_IMODE((target / name).stat().st_mode) for name in modes} == modes
    assert stat.S_IMODE((target / "private").stat().st_mode) == 0o700
    assert stat.S_IMODE((target / "model.safetensors").stat().st_mode) == 0o644


def test_merged_model_saved_over_its_adapter_loads_as_the_merged_model(tmp_path, caplog):
    """An adapter left in the folder would be attached again by from_pretrained on top of the
    merged weights: the save removes it (and pickled weights), and says so."""
    from peft import LoraConfig, get_peft_model

    model = make_model("llama")
    _patch(model, "yarn")
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    target = tmp_path / "ckpt"
    peft_model.save_pretrained(target)
    (target / "pytorch_model.bin").write_bytes(b"stale pickled weights")
    (target / "NOTES.md").write_text("mine")
    merged = peft_model.merge_and_unload()
    with caplog.at_level("WARNING", logger="hf_rope_ext.hub"):
        save_patched(merged, target)
    assert "adapter_config.json, adapter_model.safetensors, pytorch_model.bin" in caplog.text
    names = {path.name for path in target.iterdir()}
    assert "NOTES.md" in names and not names & {"adapter_config.json", "adapter_model.safetensors", "pytorch_model.bin"}
    reloaded = load_patched(target, attn_implementation="eager").eval()
    assert not any("lora" in name for name, _ in reloaded.named_modules())
    ids = random_ids(LENGTH)
    torch.testing.assert_close(_logits(reloaded, ids), _logits(merged, ids), rtol=0, atol=2e-5)


def test_card_and_tokenizer_arguments_are_checked_before_anything_is_written(tmp_path):
    model = make_model("llama")
    _patch(model, "yarn")
    target = save_patched(model, tmp_path / "ckpt")
    before = {path.name: path.read_bytes() for path in target.iterdir()}
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "plot.png").write_bytes(b"png")
    (tmp_path / "plot.png").write_bytes(b"other png")
    cases = [
        ({"card_assets": [tmp_path / "config.json"]}, ValueError, "would replace the checkpoint's own config.json"),
        ({"card_assets": [tmp_path / "plot.png", tmp_path / "assets" / "plot.png"]}, ValueError, "several files named"),
        ({"card_assets": [tmp_path / "assets"]}, FileNotFoundError, "is not a file"),
        ({"card_assets": [3]}, TypeError, "card_assets must be file paths"),
        ({"card": b"# card"}, TypeError, "card must be a huggingface_hub.ModelCard"),
        ({"card": tmp_path / "missing.md"}, FileNotFoundError, "missing.md is not a file"),
        ({"tokenizer": "gpt2"}, TypeError, "tokenizer must be a tokenizer object"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            save_patched(model, target, **kwargs)
        assert {path.name: path.read_bytes() for path in target.iterdir()} == before
    with pytest.raises(ValueError, match="no language-model head"):
        save_patched(model.model, tmp_path / "inner")
    (tmp_path / "card.md").write_text("# from a file\n")
    save_patched(model, target, card=tmp_path / "card.md", card_assets=str(tmp_path / "plot.png"))
    assert (target / "README.md").read_text() == "# from a file\n"
    assert (target / "plot.png").read_bytes() == b"other png"  # one path, not its characters


def test_save_paths_home_symlink_and_working_folder(tmp_path, monkeypatch):
    model = make_model("llama")
    _patch(model, "yarn")
    ids = random_ids(LENGTH)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    assert save_patched(model, "~/ckpt") == tmp_path / "home" / "ckpt"
    torch.testing.assert_close(_logits(load_patched("~/ckpt").eval(), ids), _logits(model, ids), rtol=0, atol=2e-5)
    # a symlinked folder is written where it points; the link stays a link
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    save_patched(model, tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and (tmp_path / "real" / "config.json").is_file()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["home", "link", "real"]
    # the working folder (or one holding it) would be pulled from under the process
    monkeypatch.chdir(tmp_path / "real")
    for path in (".", "", tmp_path):
        with pytest.raises(ValueError, match="current working folder or holds it"):
            save_patched(model, path)
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ValueError, match="a-file is a file, not a folder"):
        save_patched(model, tmp_path / "a-file" / "ckpt")


def test_hand_edited_values_of_the_wrong_type_or_not_finite_are_named(tmp_path):
    model = make_model("llama")
    _patch(model, "yarn")
    folder = save_patched(model, tmp_path / "ckpt")
    original = (folder / "config.json").read_text()

    def edit_all_spellings(c):
        c["rope_parameters"]["beta_fast"] = c["rope_scaling"]["beta_fast"] = "32"

    _edit_raw_config(folder, edit_all_spellings)
    with pytest.raises(ValueError, match=r"config.json has rope_parameters.beta_fast = '32'; it must be a number") as error:
        load_patched(folder)
    assert "\n" not in str(error.value)
    assert cli_main(["runtimes", "--model-dir", str(folder)]) == 2
    (folder / "config.json").write_text(original)
    _edit_raw_config(folder, lambda c: c["rope_parameters"].update(factor="8"))  # one spelling only
    with pytest.raises(ValueError, match=r"config.json has rope_parameters.factor = '8'; it must be a number"):
        load_patched(folder)
    (folder / "config.json").write_text(original)
    _edit_raw_config(folder, lambda c: c.update(use_cache="yes"))
    with pytest.raises(ValueError, match=r"config.json has a value of the wrong type: .*use_cache"):
        load_patched(folder)  # a field this package does not check: transformers' message, on one line
    (folder / "config.json").write_text(original)

    def nan_in_both_spellings(c):
        c["rope_parameters"]["beta_fast"] = c["rope_scaling"]["beta_fast"] = float("nan")

    _edit_raw_config(folder, nan_in_both_spellings)
    assert (folder / "config.json").read_text().count('"beta_fast": NaN') == 2
    with pytest.raises(ValueError, match=r"rope_parameters.beta_fast = nan; it must be a finite number"):
        load_patched(folder)


def test_record_with_the_logn_spelling_or_unknown_keys(tmp_path):
    model = make_model("llama")
    patch_model(model, scale=4, method="yarn", logn_attention=True)
    folder = save_patched(model, tmp_path / "ckpt")
    ids = random_ids(LENGTH)
    expected = _logits(model, ids)

    def method_spelled_with_suffix(c):
        c["hf_rope_ext"]["method"] = "yarn+logn"
        c["hf_rope_ext"].pop("logn_attention")

    _edit_raw_config(folder, method_spelled_with_suffix)
    reloaded = load_patched(folder, attn_implementation="eager").eval()
    assert get_patch_info(reloaded).logn_attention is True
    torch.testing.assert_close(_logits(reloaded, ids), expected, rtol=0, atol=2e-5)
    _edit_raw_config(folder, lambda c: c["hf_rope_ext"].update(logn_attention=False))
    with pytest.raises(ValueError, match="method='yarn\\+logn' but logn_attention=false"):
        load_patched(folder)
    _edit_raw_config(folder, lambda c: (c["hf_rope_ext"].pop("logn_attention"), c["hf_rope_ext"].update(logn_atention=True)))
    with pytest.raises(ValueError, match=r"has unknown keys \['logn_atention'\]"):
        load_patched(folder)


def test_phi3_with_its_default_original_context_saves_and_loads(tmp_path):
    """Phi-3 configs keep a top-level original_max_position_embeddings (default 4096) that need not
    be max_position_embeddings; transformers gives it priority over rope_parameters'."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from conftest import TINY_SHAPE

    config = AutoConfig.for_model("phi3", **{**TINY_SHAPE, "max_position_embeddings": 2 * L0}, pad_token_id=0)
    assert config.original_max_position_embeddings == 4096  # the class default
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    before = model.config.to_dict()
    patch_model(model, scale=4, method="longrope", long_factor=LONG_FACTOR)
    assert model.config.original_max_position_embeddings == 2 * L0  # the context the patch extends
    rotary = model.model.rotary_emb
    for length in (2 * L0, 2 * L0 + 1):  # transformers' own longrope on the patched config, short and long
        expected, attention = ROPE_INIT_FUNCTIONS["longrope"](model.config, seq_len=length)
        got, got_attention = rotary.frequencies(length)
        torch.testing.assert_close(got.float(), expected, rtol=1e-6, atol=0)
        assert got_attention == pytest.approx(attention)
    loaded = load_patched(save_patched(model, tmp_path / "ckpt"), attn_implementation="eager").eval()
    ids = random_ids(5 * L0)
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), rtol=0, atol=2e-5)
    unpatch_model(model)
    metadata = ("architectures", "dtype", "_name_or_path", "transformers_version")  # set by save_pretrained
    after = model.config.to_dict()
    assert {key: after[key] for key in after if key not in metadata} == {
        key: before[key] for key in before if key not in metadata
    }
    assert after["original_max_position_embeddings"] == 4096


class RecordingApi:
    """Stands in for huggingface_hub.HfApi: records what would be uploaded."""

    def __init__(self):
        self.calls = []

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def create_branch(self, repo_id, **kwargs):
        self.calls.append(("create_branch", repo_id, kwargs))

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        files = {path.name: path.read_bytes() for path in Path(folder_path).iterdir()}
        self.calls.append(("upload_folder", repo_id, {**kwargs, "files": files}))
        return "commit-info"


def test_push_to_hub_uploads_a_checked_folder(tmp_path):
    model = make_model("mistral")
    _patch(model, "dynamic-linear")
    plot = tmp_path / "ppl_vs_length.png"
    plot.write_bytes(b"png")
    api = RecordingApi()
    commit = push_patched_to_hub(model, "me/tiny", card="# card\n", card_assets=[plot], private=True, api=api)
    assert commit == "commit-info"
    (create, repo, create_kwargs), (upload, repo_again, upload_kwargs) = api.calls
    assert (create, repo, repo_again) == ("create_repo", "me/tiny", "me/tiny")
    assert create_kwargs["exist_ok"] and create_kwargs["private"]
    files = upload_kwargs["files"]
    assert {"config.json", "model.safetensors", "README.md", "ppl_vs_length.png"} <= set(files)
    assert "dynamic-linear x4" in upload_kwargs["commit_message"]
    assert json.loads(files["config.json"])["hf_rope_ext"]["method"] == "dynamic-linear"


# ----------------------------------------------------------------------------------------------
# vLLM and llama.cpp settings, checked against transformers and llama.cpp's formulas
# ----------------------------------------------------------------------------------------------


def _transformers_frequencies(config, overrides, seq_len):
    """What transformers computes from a config with vLLM-style overrides applied."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.for_model(**{**config.to_dict(), **overrides})
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        head_dim = config.head_dim
        return default_inv_freq(head_dim, config.rope_parameters["rope_theta"]), 1.0
    inv_freq, attention = ROPE_INIT_FUNCTIONS[rope_type](config, seq_len=seq_len)
    return inv_freq.double(), attention


@pytest.mark.parametrize("method", NATIVE + CUSTOM)
def test_vllm_overrides_reproduce_the_patch(method):
    model = make_model("llama")
    base_config = AutoConfig.for_model(**model.config.to_dict())
    _patch(model, method)
    settings = runtime_settings(model)
    overrides = settings.vllm.settings["hf_overrides"]
    assert settings.vllm.args[:2] == ("--max-model-len", str(4 * L0))
    assert json.loads(settings.vllm.args[3]) == overrides
    overrides = dict(overrides)
    overrides["rope_parameters"] = {
        k: v for k, v in overrides["rope_parameters"].items() if k not in ("short_mscale", "long_mscale", "attn_factor")
    }
    rotary = model.model.rotary_emb
    lengths = [4 * L0] if settings.vllm.status == "approximate" else [L0 + 1, 4 * L0]
    for length in lengths:
        expected, expected_attention = rotary.frequencies(length)
        got, attention = _transformers_frequencies(base_config, overrides, length)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
        if method == "longrope":  # vLLM takes the attention factor from short/long_mscale
            attention = settings.vllm.settings["hf_overrides"]["rope_parameters"]["long_mscale"]
        assert math.isclose(attention, expected_attention, rel_tol=1e-6)
    expected_status = {"dynamic": "approximate", "longrope": "approximate", "dynamic-yarn": "approximate",
                       "dynamic-linear": "approximate"}.get(method, "exact")
    assert settings.vllm.status == expected_status


def _llama_cpp_frequencies(flags, rotary_dim):
    """llama.cpp's RoPE from its command-line flags, written from ggml's rope_yarn
    (ggml/src/ggml-cpu/ops.cpp) and llama_context's YaRN attention factor (src/llama-context.cpp)."""
    base = float(flags["--rope-freq-base"])
    scaling = flags["--rope-scaling"]
    freq_scale = 1.0 / float(flags["--rope-scale"]) if scaling in ("linear", "yarn") else 1.0
    theta = [base ** (-2 * i / rotary_dim) for i in range(rotary_dim // 2)]
    if scaling != "yarn":
        return torch.tensor([t * freq_scale for t in theta], dtype=torch.float64), 1.0
    n_ctx_orig = int(flags["--yarn-orig-ctx"])

    def corr_dim(rotations):
        return rotary_dim * math.log(n_ctx_orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(0.0, math.floor(corr_dim(float(flags["--yarn-beta-fast"]))))
    high = min(rotary_dim - 1.0, math.ceil(corr_dim(float(flags["--yarn-beta-slow"]))))
    ext_factor = float(flags["--yarn-ext-factor"])
    out = []
    for i, t in enumerate(theta):
        ramp = 1 - min(1.0, max(0.0, (i - low) / max(0.001, high - low)))
        mix = ramp * ext_factor
        out.append(t * freq_scale * (1 - mix) + t * mix)
    mscale = float(flags["--yarn-attn-factor"]) * (1 + 0.1 * math.log(1 / freq_scale))
    return torch.tensor(out, dtype=torch.float64), mscale


@pytest.mark.parametrize("method", ["linear", "ntk", "yarn", "dynamic-yarn", "dynamic-linear", "dynamic"])
def test_llama_cpp_flags_reproduce_the_patch(method):
    gguf = pytest.importorskip("gguf")
    model = make_model("qwen2")
    _patch(model, method)
    command = runtime_settings(model).llama_cpp
    flags = dict(zip(command.args[::2], command.args[1::2]))
    assert flags["--ctx-size"] == str(4 * L0)
    got, mscale = _llama_cpp_frequencies(flags, rotary_dim=16)
    expected, attention = model.model.rotary_emb.frequencies(4 * L0)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=0)
    assert math.isclose(mscale, attention, rel_tol=1e-9)
    assert command.status == ("exact" if method in ("linear", "ntk", "yarn") else "approximate")
    # metadata keys are the GGUF spec's (gguf-py constants), for the qwen2 architecture
    known = {value.format(arch="qwen2") for name, value in vars(gguf.constants.Keys.Rope).items() if name.isupper()}
    known.add(gguf.constants.Keys.LLM.CONTEXT_LENGTH.format(arch="qwen2"))
    assert set(command.settings["gguf_metadata"]) <= known


def test_user_registered_method_declares_its_llama_cpp_translator():
    from hf_rope_ext.runtimes import llama_cpp_command

    def quadruple_base(rotary_dim, base, params, seq_len=None):
        """Plain RoPE with four times the base."""
        return default_inv_freq(rotary_dim, 4 * base), 1.0

    def to_llama_cpp(spec, model_type):
        base = 4 * spec.original_rope_theta
        return llama_cpp_command(spec, model_type, {"--rope-scaling": "none", "--rope-freq-base": base})

    hf_rope_ext.register_method("quadruple-base", quadruple_base, runtimes={"llama.cpp": to_llama_cpp})
    try:
        settings = runtime_settings(make_config("llama"), "quadruple-base", 2)
        assert settings.llama_cpp.status == "exact"
        flags = dict(zip(settings.llama_cpp.args[::2], settings.llama_cpp.args[1::2]))
        assert flags == {"--rope-scaling": "none", "--rope-freq-base": "40000", "--ctx-size": str(2 * L0)}
        assert settings.llama_cpp.settings["gguf_metadata"] == {"llama.context_length": 2 * L0}
        assert settings.vllm.status == "unsupported" and "quadruple-base" in settings.vllm.notes[0]
    finally:
        hf_rope_ext.unregister_method("quadruple-base")
    with pytest.raises(ValueError, match="unknown runtime 'tgi'"):
        hf_rope_ext.register_method("quadruple-base", quadruple_base, runtimes={"tgi": to_llama_cpp})
    assert "quadruple-base" not in hf_rope_ext.list_methods()


def test_runtime_messages_for_what_cannot_be_expressed():
    qwen = make_config("qwen2")
    llama3_on_qwen = runtime_settings(qwen, "llama3", 4)
    assert llama3_on_qwen.llama_cpp.status == "unsupported" and not llama3_on_qwen.llama_cpp.args
    llama3_on_llama = runtime_settings(make_config("llama"), "llama3", 4)
    assert llama3_on_llama.llama_cpp.status == "exact"
    assert llama3_on_llama.llama_cpp.args == ("--ctx-size", str(4 * L0))
    assert "rope_freqs" in " ".join(llama3_on_llama.llama_cpp.notes)
    longrope = runtime_settings(qwen, "longrope", 4, long_factor=LONG_FACTOR)
    assert longrope.llama_cpp.status == "unsupported" and "Phi-3" in longrope.llama_cpp.notes[0]
    dynamic_yarn = runtime_settings(qwen, "dynamic-yarn", 4)
    assert "No runtime has dynamic YaRN" in dynamic_yarn.vllm.notes[0]
    dynamic = runtime_settings(qwen, "dynamic", 4)
    assert "no dynamic NTK" in " ".join(dynamic.llama_cpp.notes)
    assert "no length-dependent NTK" in " ".join(dynamic.vllm.notes)
    for params in ({}, {"group_size": 12}):  # the group chosen per query (8 at the last position), or a fixed one
        self_extend = runtime_settings(qwen, "self-extend", 4, **params)
        flags = dict(zip(self_extend.llama_cpp.args[::2], self_extend.llama_cpp.args[1::2]))
        # llama.cpp's grouped attention is broken as released (pos_div's sign): unsupported, flags kept
        assert self_extend.llama_cpp.status == "unsupported" and self_extend.vllm.status == "unsupported"
        assert "pos_div" in self_extend.llama_cpp.notes[0]
        assert flags["--grp-attn-n"] == str(params.get("group_size", 8)) and flags["--ctx-size"] == str(4 * L0)
        assert not any("This patch" in note for note in self_extend.llama_cpp.notes)
    # The flags run the trained frequencies with floor grouping: what else the patch does is named.
    on_yarn = runtime_settings(qwen, "self-extend", 4, frequencies="linear", frequencies_scale=2.0).llama_cpp.notes
    assert any("linear x2 frequencies (frequencies='linear')" in note for note in on_yarn), on_yarn
    by_parts = runtime_settings(qwen, "self-extend", 4, far_positions="by-parts").llama_cpp.notes
    assert any("far_positions='by-parts'" in note for note in by_parts), by_parts
    dual_chunk = runtime_settings(qwen, "dual-chunk", 4).vllm.notes[0]
    assert "for this architecture" not in dual_chunk and "dual_chunk_attention_config" in dual_chunk
    # a patched config answers without method/scale; an unpatched one needs them
    with pytest.raises(ValueError, match="give method= and scale="):
        runtime_settings(qwen)


def test_runtime_settings_check_a_model_type_given_by_name():
    """What patch_model refuses on a model of that type, runtime_settings refuses for the type's name."""
    yarn = describe_patch("yarn", 4, original_max_length=32, rope_theta=10000.0, rotary_dim=16)
    for name in ("gpt2", "cohere", "opt"):
        with pytest.raises(ValueError, match=f"model_type '{name}' is not supported"):
            runtime_settings(yarn, model_type=name)
    with pytest.raises(ValueError, match="model_type 'phi3': its config rejects rope_type 'yarn'"):
        runtime_settings(yarn, model_type="phi3")
    from conftest import TINY_SHAPE

    phi3 = AutoModelForCausalLM.from_config(AutoConfig.for_model("phi3", **TINY_SHAPE, pad_token_id=0))
    with pytest.raises(ValueError, match="its config rejects rope_type 'yarn'"):  # the reference: patch_model
        patch_model(phi3, scale=4, method="yarn")
    factors = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    longrope = describe_patch("longrope", 4, original_max_length=32, rope_theta=10000.0, rotary_dim=16, **factors)
    assert runtime_settings(longrope, model_type="phi3").scale == 4
    assert runtime_settings(yarn, model_type="qwen2").llama_cpp.status == "exact"
    # types whose default config cannot be set up as described (a head_dim property, no
    # max_position_embeddings) are not checked, as before: falcon patches with yarn
    for name in ("falcon", "recurrent_gemma"):
        assert runtime_settings(yarn, model_type=name).scale == 4


def test_a_bare_name_that_is_no_folder_fails_fast_in_one_line(tmp_path, monkeypatch):
    """Not a local folder: a Hub id, but one the Hub cannot give is refused at once (no ~25 s of retries)."""
    import huggingface_hub

    from transformers import AutoConfig

    def retried(*args, **kwargs):  # transformers' loading, where the slow retries happen, is never reached
        raise AssertionError("transformers was asked to load it")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(AutoConfig, "from_pretrained", retried)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="no local folder named 'nonexist', and it is not in the Hub cache"):
        load_patched("nonexist")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    def unreachable(*args, **kwargs):
        raise ConnectionError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", unreachable)
    with pytest.raises(OSError, match="no local folder named 'org/nonexist', and the Hub could not be reached .*"
                                      "ConnectionError: \\[Errno -2\\]"):
        load_patched("org/nonexist")
    with pytest.raises(FileNotFoundError, match="no local folder named 'a b', and it is not a Hub id"):
        load_patched("a b")


def test_load_patched_of_a_file_asks_for_the_folder(tmp_path):
    model = make_model("llama")
    patch_model(model, scale=2, method="yarn")
    save_patched(model, tmp_path / "ckpt")
    for name in ("config.json", "model.safetensors"):
        with pytest.raises(ValueError, match=f"{name} is a file; pass the checkpoint folder that holds it"):
            load_patched(tmp_path / "ckpt" / name)


def test_runtime_settings_of_a_described_patch_and_the_cli(capsys):
    described = describe_patch("yarn", 4, original_max_length=8192, rope_theta=1e5, rotary_dim=64)
    settings = runtime_settings(described, model_type="llama")
    flags = dict(zip(settings.llama_cpp.args[::2], settings.llama_cpp.args[1::2]))
    assert flags["--yarn-orig-ctx"] == "8192" and flags["--rope-scale"] == "4" and flags["--ctx-size"] == "32768"
    assert settings.llama_cpp.settings["gguf_metadata"]["llama.rope.scaling.original_context_length"] == 8192
    assert cli_main(["runtimes", "--method", "yarn", "--scale", "4", "--original-context", "8192", "--rope-theta",
                     "100000", "--rotary-dim", "64", "--model-type", "llama", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(settings.to_dict()))
    assert cli_main(["runtimes", "--method", "yarn", "--scale", "4", "--original-context", "8192"]) == 2
    assert capsys.readouterr().err.startswith("error: Without --model-dir, give --rope-theta, --rotary-dim.")
    with pytest.raises(ValueError, match="below 1, which would shrink"):
        describe_patch("yarn", 0.5, original_max_length=8192, rope_theta=1e5, rotary_dim=64)


# ----------------------------------------------------------------------------------------------
# Model cards
# ----------------------------------------------------------------------------------------------

RESULTS = [
    {"kind": "perplexity", "mode": "buckets", "method": "none", "scale": 1.0, "model": "m", "document": "pg84",
     "context_length": 128, "stride": None, "buckets": [[0, 32, 13.061], [32, 128, 91.384]], "ppl": 40.123},
    {"kind": "perplexity", "mode": "buckets", "method": "yarn", "scale": 4.0, "model": "m", "document": "pg84",
     "context_length": 128, "stride": None, "buckets": [[0, 32, 13.467], [32, 128, 9.012]], "ppl": 11.234},
    # optional fields (mode, document, stride, model) missing
    {"kind": "perplexity", "method": "yarn", "scale": 4.0, "context_length": 64, "ppl": 9.876},
    {"kind": "retrieval", "task": "passkey", "method": "yarn", "scale": 4.0, "model": "m", "length": 128,
     "depth": 0.5, "trials": 5, "correct": 4, "accuracy": 0.8},
    {"kind": "retrieval", "task": "passkey", "method": "yarn", "scale": 4.0, "model": "m", "length": 128,
     "depth": 0.9, "trials": 5, "correct": 3, "accuracy": 0.6},
]
TRAINING = {"base_model": "org/tiny-base", "method": "yarn", "scale": 4.0, "original_context": 32, "target_length": 128,
            "pose": True, "steps": 321, "lora": {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"],
            "trainable_params": 4096}, "learning_rate": 2e-4, "tokens_seen": 987654, "final_loss": 2.71828,
            "wall_time_s": 12.5, "data_files": ["pg84.txt"]}


def test_model_card_from_results(tmp_path):
    model = make_model("llama")
    _patch(model, "yarn")
    folder = save_patched(model, tmp_path / "ckpt")
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    (eval_dir / "results.jsonl").write_text("\n".join(json.dumps(r) for r in RESULTS) + "\n\n")
    (eval_dir / "ppl_vs_length.png").write_bytes(b"\x89PNG")
    (tmp_path / "training_summary.json").write_text(json.dumps(TRAINING))

    assert cli_main(["card", "--model-dir", str(folder), "--eval-dir", str(eval_dir), "--training-summary",
                     str(tmp_path / "training_summary.json"), "--repo-id", "me/tiny-yarn"]) == 0
    text = (folder / "README.md").read_text()
    assert (folder / "ppl_vs_length.png").read_bytes() == b"\x89PNG" and "](ppl_vs_length.png)" in text

    card = ModelCard(text)
    assert card.data.base_model == "org/tiny-base"
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert {"hf-rope-ext", "long-context", "rope-yarn"} <= set(card.data.tags)
    perplexities = {r.metric_name: r.metric_value for r in card.data.eval_results if r.metric_type == "perplexity"}
    assert perplexities == {"perplexity (buckets, 128 tokens)": 11.234, "perplexity (forward, 64 tokens)": 9.876}
    accuracy = [r.metric_value for r in card.data.eval_results if r.metric_type == "accuracy"]
    assert accuracy == [pytest.approx((4 + 3) / (5 + 5))]
    for record in RESULTS[:3]:  # every perplexity in the file, as the card rounds it
        assert f"{record['ppl']:.2f}" in text
        for _, _, value in record.get("buckets", []):
            assert f"{value:.2f}" in text
    assert "| passkey | yarn | 4 | 128 | 0.5, 0.9 | 7/10 | 70% |" in text
    for value in ("321", "987654", "2.7183", "q_proj, v_proj", "4096", "pg84.txt"):
        assert value in text
    assert "from_pretrained(\"me/tiny-yarn\")" in text and "--max-model-len 128" in text
    assert "--rope-scaling yarn --rope-scale 4" in text


def test_model_card_of_a_length_dependent_patch_takes_only_its_own_frequency_steps(tmp_path):
    model = make_model("llama")
    _patch(model, "dynamic-yarn")  # the default steps_per_doubling
    folder = save_patched(model, tmp_path / "ckpt")
    common = {"kind": "perplexity", "mode": "buckets", "method": "dynamic-yarn", "scale": 4.0, "document": "d",
              "context_length": 96, "stride": None}  # fmt: skip
    results = [
        {**common, "steps_per_doubling": recorded_steps("dynamic-yarn", DEFAULT_STEPS_PER_DOUBLING), "ppl": 11.111},
        {**common, "steps_per_doubling": 4, "ppl": 22.222},  # another grid
        {**common, "ppl": 33.333},  # steps not recorded
    ]
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    (eval_dir / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    card, _ = render_model_card(AutoConfig.from_pretrained(folder), base_model="org/tiny-base", eval_dir=eval_dir)
    metrics = [r.metric_value for r in card.data.eval_results if r.metric_type == "perplexity"]
    assert metrics == [11.111]
    text = str(card)  # the full table keeps every record, labelled with its steps
    assert "dynamic-yarn (4 steps/doubling) | 4 |" in text and "22.22" in text
    assert "dynamic-yarn (steps unrecorded) | 4 |" in text and "33.33" in text


def test_model_card_refuses_a_training_summary_or_evaluation_of_another_checkpoint(tmp_path, capsys):
    model = make_model("llama")
    _patch(model, "yarn")  # yarn x4
    folder = save_patched(model, tmp_path / "ckpt")
    config = AutoConfig.from_pretrained(folder)
    other_run = {**TRAINING, "method": "dynamic-yarn", "scale": 2.0}
    with pytest.raises(ValueError, match=r"of another run than this yarn x4 checkpoint: method 'dynamic-yarn'"):
        render_model_card(config, training_summary=other_run)
    with pytest.raises(ValueError, match=r"parameters .*'beta_fast': 16.0"):
        render_model_card(config, training_summary={**TRAINING, "rope_patch": {
            "method": "yarn", "scale": 4.0, "original_max_position_embeddings": L0,
            "params": {"beta_fast": 16.0, "beta_slow": 1.0, "attention_factor": None, "truncate": True}}})

    def eval_folder(name, records):
        path = tmp_path / name
        path.mkdir()
        (path / "results.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
        return path

    other_patch = eval_folder("other-patch", [{**RESULTS[1], "method": "dynamic-yarn", "scale": 2.0}])
    with pytest.raises(ValueError, match=r"holds no result of this yarn x4 checkpoint's patch \(its results: dynamic-yarn x2\)"):
        render_model_card(config, base_model="org/tiny-base", eval_dir=other_patch)
    other_model = eval_folder("other-model", [{**RESULTS[0], "model": str(tmp_path / "other-ckpt")}])
    (tmp_path / "other-ckpt").mkdir()
    with pytest.raises(ValueError, match="holds no result of this yarn x4 checkpoint"):
        render_model_card(config, base_model="org/tiny-base", eval_dir=other_model)
    assert cli_main(["card", "--model-dir", str(folder), "--base-model", "org/tiny-base", "--eval-dir",
                     str(other_patch)]) == 2  # fmt: skip
    assert "holds no result" in capsys.readouterr().err
    # This folder evaluated with --methods none is its merged weights at the base RoPE (eval measures a
    # save_patched checkpoint from its base RoPE), not the checkpoint as it runs: refused, naming the command.
    unpatched = eval_folder("own-none", [{**RESULTS[0], "model": str(folder)}])
    with pytest.raises(ValueError, match=rf"--model {re.escape(str(folder))} --methods yarn --scales 4"):
        render_model_card(config, eval_dir=unpatched, training_summary=TRAINING)
    # What belongs: its patch, on this folder or on the base model, with the matching run.
    own = eval_folder("own", [{**RESULTS[1], "model": str(folder)}])
    card, _ = render_model_card(config, eval_dir=own, training_summary=TRAINING)
    assert "11.23" in str(card)
    render_model_card(config, eval_dir=eval_folder("patch", RESULTS[1:2]), training_summary=TRAINING)


def test_model_card_inputs_are_checked(tmp_path):
    model = make_model("llama")
    _patch(model, "dynamic-yarn")
    folder = save_patched(model, tmp_path / "ckpt")
    config = AutoConfig.from_pretrained(folder)
    with pytest.raises(ValueError, match="base_model must be the base model's Hub repo id"):
        render_model_card(config)
    card, plots = render_model_card(config, base_model="org/tiny-base")
    assert plots == [] and "No evaluation results were supplied" in str(card)
    assert "KeyError: 'hf_rope_ext.dynamic-yarn (needs `pip install hf-rope-ext`" in str(card)
    assert "Not fine-tuned" in str(card)
    written = write_model_card(card, tmp_path / "out" / "README.md")
    assert ModelCard.load(written).data.base_model == "org/tiny-base"
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "results.jsonl").write_text(json.dumps(RESULTS[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"results.jsonl:2 is not valid JSON"):
        render_model_card(config, base_model="org/tiny-base", eval_dir=bad)
    with pytest.raises(ValueError, match="no hf_rope_ext record"):
        render_model_card(make_config("llama"), base_model="org/tiny-base")


@pytest.mark.parametrize("method, kwargs", [
    ("yarn", {"logn_attention": True}),  # frequencies transformers has, attention it has not
    ("self-extend", {}),
    ("dual-chunk", {}),
    ("yarn", {}),  # control: plain transformers reproduces it
])  # fmt: skip
def test_model_card_says_how_to_load_what_plain_from_pretrained_does_not_rebuild(tmp_path, method, kwargs):
    model = make_model("llama")
    _patch(model, method, **kwargs)
    folder = save_patched(model, tmp_path / "ckpt")
    # The reference: does transformers' own loading (hf_rope_ext imported, as here) give the patched model?
    ids = random_ids(3 * L0)
    plain = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    patched = load_patched(folder, attn_implementation="eager").eval()
    plain_is_exact = torch.allclose(_logits(plain, ids), _logits(patched, ids), atol=1e-5)
    assert plain_is_exact == (kwargs == {} and method == "yarn")

    card, _ = render_model_card(AutoConfig.from_pretrained(folder), base_model="org/tiny-base", repo_id="me/tiny")
    text = str(card)
    assert ('from_pretrained("me/tiny")' in text) == plain_is_exact and 'load_patched("me/tiny")' in text
    assert ("without extra packages" in text) == plain_is_exact
    logn = kwargs.get("logn_attention", False)
    title = next(line for line in text.splitlines() if line.startswith("# "))
    assert ("log-n" in text.split("## How to load")[0]) == logn and ("logn-attention" in card.data.tags) == logn
    if logn:
        assert "**log-n attention**" in text and "| Log-n attention | on:" in text
        card, _ = render_model_card(AutoConfig.from_pretrained(folder), base_model="org/tiny-base")
        assert "logn" in next(line for line in str(card).splitlines() if line.startswith("# "))
    assert title == "# tiny"
    # A quoted KeyError holds backticks: it must sit in a double-backtick code span to render.
    if method in ("self-extend", "dual-chunk"):
        rope_type = hf_rope_ext.config_io.custom_rope_type(get_patch_info(model).rope_method)
        assert "`" in rope_type and f"``KeyError: '{rope_type}'``" in text
        assert not re.search(r"(?<!`)`KeyError", text)


def test_model_card_training_summary_must_be_one_of_this_checkpoint(tmp_path, capsys):
    model = make_model("llama")
    _patch(model, "yarn")  # yarn x4: extended context 4 * L0
    folder = save_patched(model, tmp_path / "ckpt")
    config = AutoConfig.from_pretrained(folder)
    for not_a_summary in ({}, json.loads((folder / "config.json").read_text()), {**TRAINING, "scale": "4"}):
        with pytest.raises(ValueError, match="is not one: it has no method .* and scale"):
            render_model_card(config, base_model="org/tiny-base", training_summary=not_a_summary)
    with pytest.raises(ValueError, match="rope_patch that is not an object"):
        render_model_card(config, training_summary={**TRAINING, "rope_patch": "junk"})
    with pytest.raises(ValueError, match=r"trained from 'org/tiny-base', not the base model 'org/other' given"):
        render_model_card(config, base_model="org/other", training_summary=TRAINING)
    with pytest.raises(ValueError, match=rf"target_length {4 * L0 + 1} \(checkpoint: extended context {4 * L0}\)"):
        render_model_card(config, training_summary={**TRAINING, "target_length": 4 * L0 + 1})
    (tmp_path / "config-as-summary.json").write_text((folder / "config.json").read_text())
    assert cli_main(["card", "--model-dir", str(folder), "--base-model", "org/tiny-base", "--training-summary",
                     str(tmp_path / "config-as-summary.json")]) == 2  # fmt: skip
    assert "config-as-summary.json is not one" in capsys.readouterr().err and not (folder / "README.md").exists()

    # Values with a | or a line break stay in their cell: each row of the Training table has two cells.
    odd = {**TRAINING, "data_files": ["a|b.txt"], "dataset": "x\ny", "new | field": "z"}
    text = str(render_model_card(config, training_summary=odd)[0])
    rows = [line for line in text.split("## Training")[1].split("##")[0].splitlines() if line.startswith("|")]
    assert all(len(re.split(r"(?<!\\)\|", row)) == 4 for row in rows), rows
    assert "| Data files | a\\|b.txt |" in text and "| Dataset | x y |" in text


def test_model_card_is_not_written_over_the_checkpoints_own_files(tmp_path, capsys):
    model = make_model("llama")
    _patch(model, "yarn")
    folder = save_patched(model, tmp_path / "ckpt", tokenizer=_tokenizer(4 * L0))
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert cli_main(["card", "--model-dir", str(folder), "--base-model", "org/tiny-base", "--output",
                         str(folder / name)]) == 2, name  # fmt: skip
        assert f"is the checkpoint's own {name}" in capsys.readouterr().err
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before
    AutoModelForCausalLM.from_pretrained(folder)  # still a checkpoint
    assert cli_main(["card", "--model-dir", str(folder), "--base-model", "org/tiny-base", "--output",
                     str(folder / "CARD.md")]) == 0  # fmt: skip


def test_model_card_leaves_out_unreadable_plots_and_no_folder_on_failure(tmp_path, caplog, capsys, monkeypatch):
    model = make_model("llama")
    _patch(model, "yarn")
    folder = save_patched(model, tmp_path / "ckpt")
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    (eval_dir / "results.jsonl").write_text(json.dumps(RESULTS[1]) + "\n")
    (eval_dir / "ok.png").write_bytes(b"\x89PNG")
    (eval_dir / "dir.png").mkdir()
    (eval_dir / "broken.png").symlink_to(tmp_path / "nowhere.png")
    command = ["card", "--model-dir", str(folder), "--base-model", "org/tiny-base", "--eval-dir", str(eval_dir)]
    with caplog.at_level("WARNING", logger="hf_rope_ext.model_card"):
        assert cli_main([*command, "--output", str(tmp_path / "out" / "README.md")]) == 0
    assert "broken.png, dir.png" in caplog.text
    text = (tmp_path / "out" / "README.md").read_text()
    assert "](ok.png)" in text and "dir.png" not in text and "broken.png" not in text
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["README.md", "ok.png"]

    def failing(path, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("hf_rope_ext.model_card.atomic_write_text", failing)
    assert cli_main([*command, "--output", str(tmp_path / "new" / "deeper" / "README.md")]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # neither the plot copied nor the folders made are left


def test_model_card_template_errors_and_repo_ids_are_named(tmp_path, capsys):
    model = make_model("llama")
    _patch(model, "yarn")
    folder = save_patched(model, tmp_path / "ckpt")
    template = tmp_path / "bad.md"
    template.write_text("---\n{{ card_data }}\n---\n{% for x in %}\n")
    command = ["card", "--model-dir", str(folder), "--base-model", "org/tiny-base"]
    assert cli_main([*command, "--template", str(template)]) == 2
    assert f"Model card template {template}, line 4: " in capsys.readouterr().err
    for repo_id in ("not a repo", "me/x\n# Injected", "/abs/path"):
        assert cli_main([*command, "--repo-id", repo_id]) == 2
        assert f"repo_id must be a Hub repo id like 'me/SmolLM2-yarn-x4', got {repo_id!r}" in capsys.readouterr().err
    assert not (folder / "README.md").exists()


def test_patching_a_patched_checkpoint_loaded_plainly_is_refused(tmp_path):
    """ntk writes a plain rope_type with a larger rope_theta: loaded with plain from_pretrained
    and patched again, the scaling would be stacked on the scaling, from false originals."""
    model = make_model("llama")
    _patch(model, "ntk")
    folder = save_patched(model, tmp_path / "ckpt")
    plain = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    with pytest.raises(ValueError, match=r"saved with an hf_rope_ext patch \(ntk x4.0 from 32 tokens\).*load_patched"):
        patch_model(plain, scale=2, method="linear")
    assert get_patch_info(plain) is None
    restored = load_patched(folder, attn_implementation="eager")
    patch_model(restored, scale=2, method="linear")  # re-patched from the original
    info = get_patch_info(restored)
    assert (info.original_max_position_embeddings, info.original_rope_theta) == (L0, 10000.0)


def test_saving_a_patched_model_whose_config_was_edited_in_memory_names_the_cause(tmp_path):
    model = make_model("llama")
    _patch(model, "yarn")
    model.config.max_position_embeddings = 2 * L0
    with pytest.raises(ValueError, match="changed after patch_model.*max_position_embeddings.*call patch_model again"):
        save_patched(model, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    _patch(model, "yarn")
    save_patched(model, tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["max_position_embeddings"] == 4 * L0


# ----------------------------------------------------------------------------------------------
# Runtime settings refuse what patch_model refuses; GGUF names; the notes and numbers they print
# ----------------------------------------------------------------------------------------------


def _tiny_config(model_type, **overrides):
    from conftest import TINY_SHAPE

    return AutoConfig.for_model(model_type, **{**TINY_SHAPE, "pad_token_id": 0, **overrides})


@pytest.mark.parametrize("model_type, method", [("phi3", "yarn"), ("phi3", "dynamic-yarn"), ("cohere", "yarn"),
                                                ("gpt2", "yarn"), ("gptj", "ntk")])  # fmt: skip
def test_runtime_settings_refuse_what_patch_model_refuses_with_its_reason(model_type, method):
    overrides = {"n_positions": L0, "n_embd": 64, "n_head": 4, "n_layer": 2, "rotary_dim": 8} \
        if model_type in ("gpt2", "gptj") else {}  # fmt: skip
    config = _tiny_config(model_type, **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError) as refused:
        patch_model(model, scale=4, method=method)
    with pytest.raises(ValueError) as runtime_refused:
        runtime_settings(config, method, 4)
    assert str(runtime_refused.value) == str(refused.value)
    assert config.to_dict() == _tiny_config(model_type, **overrides).to_dict()  # checked on a copy
    if model_type == "phi3":  # what its config class accepts still works
        assert runtime_settings(config, "longrope", 4, long_factor=LONG_FACTOR).vllm.status == "approximate"


def test_gguf_architecture_names_are_llama_cpps():
    gguf = pytest.importorskip("gguf")
    from hf_rope_ext.runtimes import _GGUF_ARCH, gguf_arch

    names = gguf.constants.MODEL_ARCH_NAMES
    arch = gguf.constants.MODEL_ARCH
    assert gguf_arch("gpt_neox") == names[arch.GPTNEOX]
    assert gguf_arch("qwen3_moe") == names[arch.QWEN3MOE]
    assert gguf_arch("phi") == names[arch.PHI2]
    assert set(_GGUF_ARCH.values()) <= set(names.values())


def test_runtime_notes_describe_only_the_context_the_patch_reaches():
    # the frequencies change at frequencies_scale x L0 (2 x 32 = 64): beyond a context of 48 tokens
    short = runtime_settings(make_config("llama"), "self-extend-yarn", 1.5)
    note = short.vllm.notes[0]
    assert short.extended_context == 48 and "up to 48" in note and "64" not in note and "beyond that" not in note
    wide = runtime_settings(make_config("llama"), "self-extend-yarn", 4, frequencies_scale=8)
    assert "yarn x8" not in wide.llama_cpp.notes[0] and f"up to {4 * L0}" in wide.llama_cpp.notes[0]
    reached = runtime_settings(make_config("llama"), "self-extend-yarn", 4)  # settles at 64 < 128
    assert "up to 64, and beyond that yarn x2" in reached.vllm.notes[0]


def test_huge_rope_theta_is_printed_as_a_float_and_infinite_is_refused():
    settings = runtime_settings(describe_patch("ntk", 4, original_max_length=8192, rope_theta=1e30, rotary_dim=64))
    flags = dict(zip(settings.llama_cpp.args[::2], settings.llama_cpp.args[1::2]))
    expected = 1e30 * 4 ** (64 / 62)  # NTK-aware base: theta * s^(d / (d - 2))
    assert len(flags["--rope-freq-base"]) < 30 and float(flags["--rope-freq-base"]) == pytest.approx(expected, rel=1e-12)
    assert flags["--ctx-size"] == "32768"
    with pytest.raises(ValueError, match="rope_theta must be a finite number > 0, got inf"):
        describe_patch("yarn", 4, original_max_length=8192, rope_theta=math.inf, rotary_dim=64)
    with pytest.raises(ValueError, match="rope_theta of this ntk x4 patch is 1e\\+300, beyond float32"):
        runtime_settings(describe_patch("ntk", 4, original_max_length=8192, rope_theta=1e300, rotary_dim=64))


def test_runtimes_cli_reads_the_smollm2_alias_python_literals_and_patched_checkpoints(tmp_path, monkeypatch, capsys):
    from hf_rope_ext import loading

    base = tmp_path / "base"
    make_config("llama").save_pretrained(base)
    calls = []
    monkeypatch.setattr(loading, "smollm2_checkpoint", lambda: calls.append(1) or base)  # no conversion, no Hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli_main(["runtimes", "--model-dir", "SmolLM2", "--method", "yarn", "--scale", "4"]) == 0
    out = capsys.readouterr().out
    assert calls and f"context {L0} -> {4 * L0} tokens" in out and "vllm serve HuggingFaceTB/SmolLM2-135M-Instruct" in out

    def settings(*params):
        assert cli_main(["runtimes", "--model-dir", str(base), "--method", "yarn", "--scale", "4", "--json",
                         *params]) == 0  # fmt: skip
        return json.loads(capsys.readouterr().out)

    assert settings("--param", "truncate=False") == settings("--param", "truncate=false")
    assert settings("--param", "attention_factor=None") == settings()
    # a patched checkpoint: every way of asking for another patch gets the same answer
    model = make_model("llama")
    _patch(model, "yarn")
    patched = save_patched(model, tmp_path / "yarn")
    messages = set()
    for extra in (["--param", "beta_fast=16"], ["--method", "ntk", "--scale", "2"], ["--original-context", "16"]):
        assert cli_main(["runtimes", "--model-dir", str(patched), *extra]) == 2
        messages.update(line for line in capsys.readouterr().err.splitlines() if line.startswith("error:"))
    (message,) = messages
    assert "is already patched (yarn, scale 4.0): run without --method/--scale/--param" in message


# ----------------------------------------------------------------------------------------------
# Loading: damaged files, ~, the SmolLM2 cache
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def tiny_checkpoint(tmp_path):
    folder = tmp_path / "tiny"
    make_model("llama").save_pretrained(folder)
    _tokenizer(L0).save_pretrained(folder)
    return folder


def test_load_model_names_a_cut_weights_file_expands_home_and_refuses_device_with_device_map(
    tiny_checkpoint, tmp_path, monkeypatch
):
    from hf_rope_ext.loading import load_model

    monkeypatch.setenv("HOME", str(tmp_path))
    model, _ = load_model("~/tiny", device="CPU")  # "~" is the home folder, not a Hub id
    assert model.device.type == "cpu"
    with pytest.raises(ValueError, match="Give device or device_map, not both"):
        load_model(str(tiny_checkpoint), device="cpu", device_map="cpu")
    weights = tiny_checkpoint / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    with pytest.raises(OSError, match=f"{weights} is damaged or incomplete .* Download or save the checkpoint again"):
        load_model(str(tiny_checkpoint), device="cpu")


def _stub_converter(monkeypatch, calls):
    """Stand-in for the GGUF conversion: a tiny model and tokenizer, and a record of each call."""
    from hf_rope_ext import loading

    def convert(staging):
        calls.append(staging)
        make_model("llama").save_pretrained(staging)
        _tokenizer(L0).save_pretrained(staging)

    monkeypatch.setattr(loading, "_convert_smollm2", convert)


def test_smollm2_cache_location_and_a_damaged_cache_is_converted_again(tmp_path, monkeypatch):
    from safetensors import safe_open

    from hf_rope_ext.loading import cache_dir, smollm2_checkpoint

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_ROPE_EXT_CACHE", "")  # empty: unset, not the working folder
    assert cache_dir() == tmp_path / "home" / ".cache" / "hf_rope_ext"
    monkeypatch.setenv("HF_ROPE_EXT_CACHE", "~/pc")
    assert cache_dir() == tmp_path / "home" / "pc"
    calls = []
    _stub_converter(monkeypatch, calls)
    target = smollm2_checkpoint()
    assert target == tmp_path / "home" / "pc" / "smollm2-135m-instruct" and len(calls) == 1
    assert smollm2_checkpoint() == target and len(calls) == 1  # cached
    weights = target / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    assert smollm2_checkpoint() == target and len(calls) == 2  # damaged: converted again
    with safe_open(weights, "pt") as tensors:
        assert len(list(tensors.keys())) > 0
    # a file where the cache should be: refused before converting
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv("HF_ROPE_EXT_CACHE", str(tmp_path / "a-file"))
    with pytest.raises(NotADirectoryError, match="a-file is a file. Set HF_ROPE_EXT_CACHE to a folder"):
        smollm2_checkpoint()
    assert len(calls) == 2


def test_smollm2_conversion_removes_what_killed_conversions_left(tmp_path, monkeypatch):
    from hf_rope_ext.loading import STALE_STAGING_SECONDS, smollm2_checkpoint

    calls = []
    _stub_converter(monkeypatch, calls)
    monkeypatch.setenv("HF_ROPE_EXT_CACHE", str(tmp_path))
    old = time.time() - STALE_STAGING_SECONDS - 60
    leftovers = {}
    for name in (".smollm2-135m-instruct.staging-killed", ".smollm2-135m-instruct.old-killed",
                 ".smollm2-135m-instruct.staging-running", ".other.staging-killed"):  # fmt: skip
        folder = tmp_path / name
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"0" * 1000)
        leftovers[name] = folder
        os.utime(folder / "model.safetensors", (old, old))
        os.utime(folder, (old, old))
    import fcntl

    running = os.open(leftovers[".smollm2-135m-instruct.staging-running"], os.O_RDONLY)
    fcntl.flock(running, fcntl.LOCK_EX)  # another process is still writing this one: it holds the lock
    try:
        smollm2_checkpoint()
    finally:
        os.close(running)
    assert len(calls) == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        ".other.staging-killed", ".smollm2-135m-instruct.staging-running", "smollm2-135m-instruct"
    ]


def test_smollm2_conversions_started_together_convert_once(tmp_path, monkeypatch):
    """Two loads of a model not yet converted at the same time (the ranks of `accelerate launch`
    on a new machine): one converts, the other waits for it and reads its copy (two conversions
    renamed onto one new folder made the second fail with "Directory not empty")."""
    from hf_rope_ext import loading

    calls = []

    def slow_convert(staging):
        calls.append(staging)
        time.sleep(1.0)  # long enough for the other load to reach its own conversion
        make_model("llama").save_pretrained(staging)

    monkeypatch.setattr(loading, "_convert_smollm2", slow_convert)
    monkeypatch.setenv("HF_ROPE_EXT_CACHE", str(tmp_path / "cache"))
    outcomes = []

    def load():
        try:
            outcomes.append(loading.smollm2_checkpoint())
        except Exception as error:  # noqa: BLE001 - the outcome is the assertion
            outcomes.append(error)

    workers = [threading.Thread(target=load) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    target = tmp_path / "cache" / "smollm2-135m-instruct"
    assert outcomes == [target, target] and len(calls) == 1
    assert sorted(path.name for path in (tmp_path / "cache").iterdir()) == ["smollm2-135m-instruct"]


# ----------------------------------------------------------------------------------------------
# Saving over an earlier save or push; loading edited records
# ----------------------------------------------------------------------------------------------


class HubLikeApi:
    """Stands in for huggingface_hub.HfApi with its upload semantics: upload_folder adds and
    overwrites files, and deletes only the remote files that match ``delete_patterns`` (matched
    with huggingface_hub's own filter) and are not uploaded in the same commit."""

    def __init__(self, repo: Path):
        self.repo = repo

    def create_repo(self, repo_id, **kwargs):
        self.repo.mkdir(exist_ok=True)

    def upload_folder(self, *, repo_id, folder_path, delete_patterns=None, **kwargs):
        from huggingface_hub.utils import filter_repo_objects

        uploaded = sorted(path.name for path in Path(folder_path).iterdir())
        remote = sorted(path.name for path in self.repo.iterdir())
        if delete_patterns is not None:
            for name in filter_repo_objects(remote, allow_patterns=delete_patterns):
                if name not in uploaded:
                    (self.repo / name).unlink()
        for name in uploaded:
            (self.repo / name).write_bytes((Path(folder_path) / name).read_bytes())
        return "commit-info"


def test_push_over_an_earlier_push_serves_the_new_weights(tmp_path):
    repo = tmp_path / "repo"
    api = HubLikeApi(repo)
    first, second = make_model("llama", seed=1), make_model("llama", seed=2)
    _patch(first, "yarn")
    _patch(second, "yarn")
    push_patched_to_hub(first, "me/tiny", api=api)  # one model.safetensors
    (repo / "notes.md").write_text("mine")
    push_patched_to_hub(second, "me/tiny", api=api, max_shard_size="20KB")  # shards and an index
    names = sorted(path.name for path in repo.iterdir())
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names and "notes.md" in names
    ids = random_ids(LENGTH)
    loaded = AutoModelForCausalLM.from_pretrained(repo, attn_implementation="eager").eval()
    torch.testing.assert_close(_logits(loaded, ids), _logits(second, ids), rtol=0, atol=2e-5)
    # the Hub patterns name the files save_patched removes locally
    from fnmatch import fnmatch

    from hf_rope_ext.hub import _WEIGHT_FILES, _WEIGHT_PATTERNS

    for name in ("model.safetensors", "model-00002-of-00014.safetensors", "model.safetensors.index.json",
                 "pytorch_model.bin", "pytorch_model-00001-of-00002.bin", "pytorch_model.bin.index.json",
                 "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", "config.json",
                 "README.md", "tokenizer.json", "training_args.bin", "model.fp32.safetensors",
                 "model.fp32-00001-of-00004.safetensors", "model.safetensors.index.fp32.json",
                 "pytorch_model.fp16.bin", "pytorch_model.fp16-00001-of-00002.bin",
                 "pytorch_model.bin.index.fp16.json", "models.safetensors", "model.safetensors.json"):  # fmt: skip
        assert bool(_WEIGHT_FILES.match(name)) == any(fnmatch(name, pattern) for pattern in _WEIGHT_PATTERNS), name
    # variant= weights (transformers' _add_variant) are weights too: a push with one left them on the Hub
    for name in ("model.fp32.safetensors", "model.fp32-00001-of-00004.safetensors", "model.safetensors.index.fp32.json",
                 "pytorch_model.fp16.bin", "pytorch_model.bin.index.fp16.json"):  # fmt: skip
        assert _WEIGHT_FILES.match(name), name


def test_a_save_with_a_variant_removes_the_weights_of_an_earlier_variant_save(tmp_path):
    """variant= names weights model.<variant>.safetensors (shards model.<variant>-00001-of-...,
    index model.safetensors.index.<variant>.json): they were left in place, and a load with that
    variant paired the new config with the old weights."""
    target = tmp_path / "ckpt"
    first, second = make_model("llama", seed=1), make_model("llama", seed=2)
    _patch(first, "yarn", scale=2)
    _patch(second, "self-extend-yarn", scale=4)
    save_patched(first, target, variant="v1")
    assert (target / "model.v1.safetensors").exists()
    save_patched(second, target, variant="v2")
    assert sorted(path.name for path in target.glob("model*")) == ["model.v2.safetensors"]
    with pytest.raises(OSError, match="model.v1.safetensors"):
        load_patched(target, variant="v1")
    save_patched(first, target, variant="v2")  # the same variant, now sharded
    save_patched(second, target, variant="v2", max_shard_size="20KB")
    names = sorted(path.name for path in target.glob("model*"))
    assert "model.v2.safetensors" not in names and "model.safetensors.index.v2.json" in names, names
    loaded = load_patched(target, variant="v2", attn_implementation="eager").eval()
    ids = random_ids(LENGTH)
    assert torch.equal(loaded.model.embed_tokens.weight, second.model.embed_tokens.weight)
    torch.testing.assert_close(_logits(loaded, ids), _logits(second, ids), rtol=0, atol=2e-5)


def test_saving_another_patch_over_a_save_replaces_its_card_and_tokenizer_limit(tmp_path, caplog):
    model = make_model("llama")
    _patch(model, "yarn", scale=4)
    target = tmp_path / "ckpt"
    card = render_model_card(model, base_model="org/base")[0]
    save_patched(model, target, tokenizer=_tokenizer(L0), card=card)
    assert json.loads((target / "tokenizer_config.json").read_text())["model_max_length"] == 4 * L0
    save_patched(model, target)  # the same patch again: its card still describes it
    assert (target / "README.md").read_text() == str(card)
    (target / "NOTES.md").write_text("mine")
    unpatch_model(model)
    _patch(model, "yarn", scale=8)
    with caplog.at_level("WARNING", logger="hf_rope_ext.hub"):
        save_patched(model, target)
    # vLLM caps its maximum length by the tokenizer's: raised to the new extended context
    assert json.loads((target / "tokenizer_config.json").read_text())["model_max_length"] == 8 * L0
    assert not (target / "README.md").exists() and (target / "NOTES.md").read_text() == "mine"
    assert "Removed README.md" in caplog.text and "not for this yarn x8 patch" in caplog.text
    # a README of the user's own (no hf-rope-ext tag) stays whatever the patch
    (target / "README.md").write_text("# my model\n")
    unpatch_model(model)
    _patch(model, "linear", scale=2)
    save_patched(model, target)
    assert (target / "README.md").read_text() == "# my model\n"
    assert json.loads((target / "tokenizer_config.json").read_text())["model_max_length"] == 8 * L0  # not lowered


def test_saving_into_an_existing_private_folder_keeps_it_private(tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    os.chmod(target, 0o700)
    model = make_model("llama")
    _patch(model, "yarn")
    save_patched(model, target, max_shard_size="20KB")
    save_patched(model, target)
    assert stat.S_IMODE(target.stat().st_mode) == 0o700
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt"]
    assert not any(path.name.startswith(".") for path in target.iterdir())


def test_save_into_a_folder_with_a_name_of_255_bytes(tmp_path):
    model = make_model("llama")
    _patch(model, "yarn")
    target = save_patched(model, tmp_path / ("b" * 255))
    ids = random_ids(LENGTH)
    torch.testing.assert_close(_logits(load_patched(target).eval(), ids), _logits(model, ids), rtol=0, atol=2e-5)
    assert os.listdir(tmp_path) == ["b" * 255]


def test_load_patched_without_the_record_warns_like_from_pretrained(tmp_path, caplog):
    model = make_model("llama")
    _patch(model, "self-extend-yarn")
    folder = save_patched(model, tmp_path / "ckpt")
    _edit_raw_config(folder, lambda c: c.pop("hf_rope_ext"))
    with caplog.at_level("WARNING"):
        loaded = load_patched(folder)
    assert get_patch_info(loaded) is None
    assert "attention-level patch 'self-extend-yarn'" in caplog.text and "load_patched" in caplog.text


def test_custom_rope_type_without_its_install_hint_loads_the_same_frequencies(tmp_path):
    model = make_model("llama")
    _patch(model, "dynamic-yarn")
    folder = save_patched(model, tmp_path / "ckpt")

    def drop_hint(c):
        c["rope_parameters"]["rope_type"] = c["rope_scaling"]["rope_type"] = "hf_rope_ext.dynamic-yarn"

    _edit_raw_config(folder, drop_hint)
    ids = random_ids(LENGTH)
    torch.testing.assert_close(_logits(load_patched(folder).eval(), ids), _logits(model, ids), rtol=0, atol=2e-5)
    plain = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    torch.testing.assert_close(_logits(plain, ids[:, :L0]), _logits(model, ids[:, :L0]), rtol=0, atol=2e-5)


def test_runtimes_cli_input_errors_exit_2_with_one_line(tmp_path, capsys):
    base = tmp_path / "base"
    make_config("llama").save_pretrained(base)
    cases = {
        ("--method", "yarn", "--scale", "4"): "Without --model-dir, give --original-context, --rope-theta, --rotary-dim.",
        ("--model-dir", str(base), "--method", "yarn", "--scale", "4", "--rotary-dim", "16"):
            "--rope-theta/--rotary-dim describe a model without --model-dir",
        ("--model-dir", str(base), "--method", "yarn", "--scale", "4", "--param", "beta_fast=32", "--param",
         "beta_fast=16"): "--param beta_fast is given twice (32 and 16); give it once.",
        ("--model-dir", str(base / "config.json"), "--method", "yarn", "--scale", "4"):
            f"--model-dir {base / 'config.json'} is a file; pass the checkpoint folder that holds it ({base}).",
    }  # fmt: skip
    for argv, message in cases.items():
        assert cli_main(["runtimes", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"error: {message}"] or (len(err) == 1 and err[0].startswith(f"error: {message}")), err


def test_relative_cache_folder_is_refused(monkeypatch):
    from hf_rope_ext.loading import cache_dir

    monkeypatch.setenv("HF_ROPE_EXT_CACHE", "relcache")
    with pytest.raises(ValueError, match="HF_ROPE_EXT_CACHE='relcache' is a relative path.*absolute path"):
        cache_dir()


# ----------------------------------------------------------------------------------------------
# Cards: the patch they describe, and what card= and a training summary may be
# ----------------------------------------------------------------------------------------------


def test_model_card_of_a_logn_checkpoint_takes_its_logn_results_not_plain_yarns(tmp_path):
    model = make_model("llama")
    _patch(model, "yarn", logn_attention=True)  # yarn+logn x4
    folder = save_patched(model, tmp_path / "ckpt")
    config = AutoConfig.from_pretrained(folder)

    def eval_folder(name, methods_and_ppl):
        path = tmp_path / name
        path.mkdir()
        records = [{**RESULTS[1], "method": method, "ppl": ppl} for method, ppl in methods_and_ppl]
        (path / "results.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
        return path

    # `hf-rope-ext eval --methods yarn,yarn+logn` records each method as it was given
    both = eval_folder("both", [("yarn", 111.0), ("yarn+logn", 222.0)])
    card, _ = render_model_card(config, base_model="org/tiny-base", eval_dir=both)
    assert [r.metric_value for r in card.data.eval_results if r.metric_type == "perplexity"] == [222.0]
    card, _ = render_model_card(config, base_model="org/tiny-base", eval_dir=eval_folder("own", [("yarn+logn", 222.0)]))
    assert [r.metric_value for r in card.data.eval_results] == [222.0]
    with pytest.raises(ValueError, match=r"no result of this yarn\+logn x4 checkpoint's patch \(its results: yarn x4\).*"
                                         r"--methods yarn\+logn --scales 4"):
        render_model_card(config, base_model="org/tiny-base", eval_dir=eval_folder("plain", [("yarn", 111.0)]))


def test_save_patched_reads_a_one_line_str_card_as_a_file_and_refuses_one_naming_none(tmp_path, monkeypatch):
    model = make_model("llama")
    _patch(model, "yarn")
    card_file = tmp_path / "my card.md"
    card_file.write_text(str(render_model_card(model, base_model="org/tiny-base")[0]))
    target = save_patched(model, tmp_path / "ckpt", card=str(card_file))
    assert (target / "README.md").read_bytes() == card_file.read_bytes()
    monkeypatch.setenv("HOME", str(tmp_path))
    save_patched(model, target, card="~/my card.md")
    assert (target / "README.md").read_bytes() == card_file.read_bytes()
    before = {path.name: path.read_bytes() for path in target.iterdir()}
    for one_line in (str(tmp_path / "missing.md"), "# my card", str(tmp_path), ""):
        with pytest.raises(FileNotFoundError, match="is not a file \\(a one-line str is read as a path\\)"):
            save_patched(model, target, card=one_line)
        assert {path.name: path.read_bytes() for path in target.iterdir()} == before
    save_patched(model, target, card="# my card\n\nText of my own.\n")  # with line breaks: the card's text
    assert (target / "README.md").read_text() == "# my card\n\nText of my own.\n"
    before = {path.name: path.read_bytes() for path in target.iterdir()}
    for text in ("~~Draft~~ card of my own\n", "A card of my own, on one long line. " * 9 + "\n"):  # no path: the text
        save_patched(model, target, card=text)
        assert (target / "README.md").read_text() == text
    for one_line in ("~nosuchuser/card.md", "y" * 300):  # no file, and no path a file could have
        with pytest.raises(FileNotFoundError, match="is not a file \\(a one-line str is read as a path\\)"):
            save_patched(model, target, card=one_line)
    save_patched(model, target, card="# my card\n\nText of my own.\n")
    before = {path.name: path.read_bytes() for path in target.iterdir()}
    for with_line_break in (f"{card_file}\n", f"{card_file}\r\n"):  # a path read from a file or a command
        with pytest.raises(ValueError, match="is one line and a line break, and names the file .*my card.md"):
            save_patched(model, target, card=with_line_break)
        assert {path.name: path.read_bytes() for path in target.iterdir()} == before


def test_save_patched_refuses_a_card_rendered_for_another_patch(tmp_path, caplog):
    model = make_model("llama")
    _patch(model, "yarn")  # yarn x4
    target = save_patched(model, tmp_path / "ckpt")
    before = {path.name: path.read_bytes() for path in target.iterdir()}
    for method, kwargs, described in [("linear", {"scale": 2}, "linear x2"), ("yarn", {"scale": 8}, "yarn x8"),
                                      ("yarn", {"logn_attention": True}, "yarn\\+logn x4")]:  # fmt: skip
        other = make_model("llama")
        _patch(other, method, **kwargs)
        other_card = render_model_card(other, base_model="org/tiny-base")[0]
        for card in (other_card, str(other_card)):
            with pytest.raises(ValueError, match=f"rendered for a {described} patch, not this yarn x4 checkpoint"):
                save_patched(model, target, card=card)
            assert {path.name: path.read_bytes() for path in target.iterdir()} == before
    own = render_model_card(model, base_model="org/tiny-base")[0]
    save_patched(model, target, card=own)
    assert (target / "README.md").read_text() == str(own)
    # A card put there by other means, rendered for another patch, is not kept by a later save
    # of this one (the folder's config.json records this patch: only the card's metadata tells).
    write_model_card(other_card, target / "README.md")
    with caplog.at_level("WARNING", logger="hf_rope_ext.hub"):
        save_patched(model, target)
    assert not (target / "README.md").exists() and "not for this yarn x4 patch" in caplog.text
    # A card of an earlier version (hf-rope-ext tag, no patch named) cannot be checked: saved, with a warning.
    older = re.sub(r"\nhf_rope_ext:\n(  .*\n)+", "\n", str(other_card))
    assert "hf-rope-ext" in older and "hf_rope_ext:" not in older
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_rope_ext.hub"):
        save_patched(model, target, card=older)
    assert (target / "README.md").read_text() == older and "not checked against this yarn x4" in caplog.text


def test_model_card_refuses_a_training_summary_that_is_not_one_or_has_damaged_values(tmp_path):
    model = make_model("llama")
    _patch(model, "yarn")
    config = save_patched(model, tmp_path / "ckpt") and AutoConfig.from_pretrained(tmp_path / "ckpt")
    not_one = [{"rope_patch": {}}, {"rope_patch": {"method": "yarn"}}, {"rope_patch": {"scale": 4.0}},
               {**TRAINING, "scale": float("nan")}, {**TRAINING, "scale": -4.0}, {**TRAINING, "method": None}]
    for summary in not_one:
        with pytest.raises(ValueError, match="is not one: it has no method"):
            render_model_card(config, base_model="org/tiny-base", training_summary=summary)
    damaged = {"final_loss": ("low", float("nan"), float("inf"), True), "losses": ("x", [float("nan"), 1.0], [1.0, "2"]),
               "target_length": (-5, 0, 12.5, "128", float("inf"))}  # fmt: skip
    for field, values in damaged.items():
        for value in values:
            with pytest.raises(ValueError, match=f"is damaged: {field} "):
                render_model_card(config, training_summary={**TRAINING, field: value})
    # Written to a file as json.dump writes NaN: refused the same way, naming the file.
    (tmp_path / "summary.json").write_text(json.dumps({**TRAINING, "losses": [float("nan"), 2.0]}))
    with pytest.raises(ValueError, match=r"summary.json is damaged: losses is not a list of finite numbers"):
        render_model_card(config, training_summary=tmp_path / "summary.json")
    # What a run writes: a rope_patch record with method and scale, finite losses (shown briefly however large).
    run = {**TRAINING, "rope_patch": {"method": "yarn", "scale": 4.0}, "losses": [1e308, 2.5], "final_loss": 2.5}
    text = str(render_model_card(config, training_summary=run)[0])
    assert "| Loss, first → last step | 1e+308 → 2.5000 |" in text and "| Final training loss | 2.5000 |" in text


def _kill_during_the_swap(target: Path) -> Path:
    """The state a save into ``target`` leaves when killed (SIGKILL) in its swap, after it moved the
    old files aside and before it placed the new ones: the folder holds neither version."""
    from hf_rope_ext import files

    old = sorted(os.listdir(target))
    aside = target / f"{files.INNER_ASIDE_PREFIX}killed"
    aside.mkdir()
    (aside / files.SWAP_JOURNAL).write_text(json.dumps({"old": old, "new": old}))
    for name in old:
        os.replace(target / name, aside / name)
    past = time.time() - 60  # killed a minute ago: no run holds it
    for path in (aside, *aside.iterdir()):
        os.utime(path, (past, past), follow_symlinks=False)
    return aside


def test_loading_a_folder_whose_save_was_killed_during_the_swap_puts_the_previous_files_back(tmp_path):
    from hf_rope_ext.loading import load_model

    model = make_model("llama")
    _patch(model, "yarn")
    target = save_patched(model, tmp_path / "ckpt", tokenizer=_tokenizer(64))
    files_before = {path.name: path.read_bytes() for path in target.iterdir()}
    ids = random_ids(12)
    with torch.no_grad():
        expected = model(ids).logits
    # evaluation's loader too: plain from_pretrained, transformers' own yarn frequencies (float32 angles)
    plain = lambda folder: load_model(str(folder), device="cpu", attn_implementation="eager")[0]  # noqa: E731
    patched = lambda folder: load_patched(folder, attn_implementation="eager")  # noqa: E731
    for load, tolerance in ((patched, 0), (plain, 1e-5)):
        _kill_during_the_swap(target)
        assert not (target / "config.json").exists()
        loaded = load(target)
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, expected, atol=tolerance, rtol=tolerance)
        assert {path.name: path.read_bytes() for path in target.iterdir()} == files_before


def test_loading_a_folder_while_a_save_swaps_its_files_waits_for_that_swap(tmp_path):
    """A swap under way holds its lock: a load waits for it (here the run holding it dies, and the
    load then puts the previous files back) instead of reading the folder half swapped."""
    import threading

    from hf_rope_ext import files

    model = make_model("llama")
    _patch(model, "yarn")
    target = save_patched(model, tmp_path / "ckpt")
    aside = _kill_during_the_swap(target)
    held, events = threading.Event(), []

    def swapping_run():
        with files.folder_lock(aside):
            held.set()
            time.sleep(0.5)
            events.append("lock released")

    thread = threading.Thread(target=swapping_run)
    thread.start()
    held.wait()
    load_patched(target)
    events.append("loaded")
    thread.join()
    assert events == ["lock released", "loaded"]
    assert (target / "config.json").is_file() and not aside.exists()


def test_a_save_killed_while_removing_its_aside_folder_is_not_undone_by_a_load(tmp_path):
    """The swap's journal goes before the old files: a run killed while it removes them has placed
    the whole new version, which a later load keeps (an undo from what is left would mix them)."""
    from hf_rope_ext import files

    model = make_model("llama")
    _patch(model, "yarn")
    target = save_patched(model, tmp_path / "ckpt")
    other = make_model("llama", seed=1)
    _patch(other, "linear", scale=2)
    real_rmtree = files.shutil.rmtree
    killed = []

    def killed_halfway(path, *args, **kwargs):  # the old config.json removed, then the run dies
        if Path(path).name.startswith(files.INNER_ASIDE_PREFIX) and not killed:
            killed.append(path)
            assert not (Path(path) / files.SWAP_JOURNAL).exists()
            (Path(path) / "config.json").unlink()
            past = time.time() - 60
            os.utime(path, (past, past))
            raise KeyboardInterrupt
        return real_rmtree(path, *args, **kwargs)

    files.shutil.rmtree = killed_halfway
    try:
        with pytest.raises(KeyboardInterrupt):
            save_patched(other, target)
    finally:
        files.shutil.rmtree = real_rmtree
    assert killed
    loaded = load_patched(target)
    ids = random_ids(12)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, other(ids).logits, atol=1e-5, rtol=1e-5)
    assert get_patch_info(loaded).method == "linear"

# ----------------------------------------------------------------------------------------------
# Runtime settings and checkpoints: defects found by review
# ----------------------------------------------------------------------------------------------


def test_saved_yarn_attention_factor_is_also_written_as_the_legacy_attn_factor(tmp_path):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = make_model("llama")
    patch_model(model, scale=3, method="yarn", attention_factor=1.3)
    folder = save_patched(model, tmp_path / "ckpt")
    raw = json.loads((folder / "config.json").read_text())
    # Older vLLM multiplies attn_factor by its own 0.1 ln(s) + 1 (closed form).
    assert math.isclose(raw["rope_scaling"]["attn_factor"], 1.3 / (0.1 * math.log(3) + 1), rel_tol=1e-12)
    assert raw["rope_scaling"]["attention_factor"] == 1.3
    # Plain transformers reads rope_scaling (with attn_factor) to the same frequencies and scale as
    # the rope_parameters without it.
    config = AutoConfig.from_pretrained(folder)
    assert "attn_factor" in config.rope_parameters
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](config)
    reference = AutoConfig.from_pretrained(folder)
    reference.rope_parameters = dict(raw["rope_parameters"])
    expected_freq, expected_attention = ROPE_INIT_FUNCTIONS["yarn"](reference)
    torch.testing.assert_close(inv_freq, expected_freq, rtol=0, atol=0)
    assert attention == expected_attention == 1.3
    # The checkpoint passes its own checks, describes itself, and saves again.
    assert runtime_settings(config).vllm.settings["legacy_hf_overrides"]["rope_scaling"]["attn_factor"] == \
        raw["rope_scaling"]["attn_factor"]  # fmt: skip
    save_patched(load_patched(folder), tmp_path / "again")


@pytest.mark.parametrize("method", ["linear", "ntk", "yarn"])
def test_partial_rotary_factor_that_the_llama_module_ignores(tmp_path, method):
    # transformers' Llama rotates the whole head whatever partial_rotary_factor says.
    model = make_model("llama", partial_rotary_factor=0.5)
    head_dim = 2 * model.model.rotary_emb.inv_freq.numel()
    base = model.config.rope_parameters["rope_theta"]
    ids = random_ids(LENGTH)
    _patch(model, method)
    rope = runtime_settings(model).vllm.settings["hf_overrides"]["rope_parameters"]
    assert rope["partial_rotary_factor"] == 1.0
    if method == "ntk":  # the NTK base over the rotated dimensions: theta * s^(d / (d - 2))
        assert math.isclose(rope["rope_theta"], base * 4 ** (head_dim / (head_dim - 2)), rel_tol=1e-12)
    folder = save_patched(model, tmp_path / "ckpt")
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    torch.testing.assert_close(_logits(plain, ids), _logits(model, ids), rtol=1e-4, atol=1e-4)
    # The patched model's own config says what it rotates, and the saved record checks the factor.
    assert model.config.rope_parameters["partial_rotary_factor"] == 1.0
    config_path = folder / "config.json"
    saved = json.loads(config_path.read_text())
    for spelling in ("rope_parameters", "rope_scaling"):  # ntk writes no rope_scaling
        if saved.get(spelling) is not None:
            saved[spelling]["partial_rotary_factor"] = 0.5
    config_path.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        load_patched(folder)


@pytest.mark.parametrize(
    "content, message",
    [
        ("[]", "config.json holds [], not a JSON object"),
        ('"llama"', "config.json holds \"llama\", not a JSON object"),
        ("3", "config.json holds 3, not a JSON object"),
        ('{"model_type": "llama", "num_attention_heads": 0}', "config.json has num_attention_heads = 0; it must be a positive"),
    ],
)  # fmt: skip
def test_runtimes_cli_names_a_damaged_config(tmp_path, capsys, content, message):
    (tmp_path / "config.json").write_text(content)
    assert cli_main(["runtimes", "--model-dir", str(tmp_path), "--method", "yarn", "--scale", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("factor", [float("nan"), 0.0, -0.5, 2.0, "0.5"])
def test_describe_patch_refuses_a_partial_rotary_factor_outside_0_1(factor):
    with pytest.raises(ValueError, match="partial_rotary_factor must be a number with 0 < factor <= 1"):
        describe_patch("yarn", 4, original_max_length=8192, rope_theta=1e4, rotary_dim=64, partial_rotary_factor=factor)


def test_llama_cpp_longrope_on_phi3_converts_with_its_factors():
    original = 4096
    long_factor = [1.0 + 0.1 * i for i in range(32)]

    def llama_cpp(**params):
        patch = describe_patch("longrope", 4, original_max_length=original, rope_theta=1e4, rotary_dim=64,
                               long_factor=long_factor, **params)  # fmt: skip
        return runtime_settings(patch, model_type="phi3").llama_cpp

    # convert_hf_to_gguf.py (Phi3MiniModel) writes sqrt(1 + ln(s) / ln(L0)) as the attention factor.
    same = llama_cpp(short_factor=long_factor)
    assert same.status == "exact"
    assert math.isclose(same.settings["gguf_metadata"]["phi3.rope.scaling.attn_factor"],
                        math.sqrt(1 + math.log(4) / math.log(original)), rel_tol=1e-12)  # fmt: skip
    assert llama_cpp().status == "approximate"  # short_factor (all ones) differs from long_factor
    assert llama_cpp(short_factor=long_factor, attention_factor=1.2).status == "approximate"
    assert not any("convert without" in note for note in same.notes)
    other = runtime_settings(describe_patch("longrope", 4, original_max_length=original, rope_theta=1e4, rotary_dim=64,
                                            long_factor=long_factor), model_type="llama").llama_cpp  # fmt: skip
    assert other.status == "unsupported"


def test_runtime_settings_minor_input_checks(tmp_path, capsys):
    patch = describe_patch("ntk", 4, original_max_length=32, rope_theta=1e4, rotary_dim=16)
    with pytest.raises(TypeError, match="model_type must be a transformers model_type string"):
        runtime_settings(patch, model_type=5)
    # 1e38 * 4^(16/14) is beyond float32, which both runtimes compute RoPE in.
    with pytest.raises(ValueError, match="beyond float32"):
        runtime_settings(describe_patch("ntk", 4, original_max_length=32, rope_theta=1e38, rotary_dim=16))
    with pytest.raises(ValueError, match="'\\+logn' is only the suffix"):
        runtime_settings(make_config("llama"), "+logn", 4)
    assert cli_main(["runtimes", "--method", "longrope", "--scale", "4", "--original-context", "4096", "--rope-theta",
                     "10000", "--rotary-dim", "64", "--model-type", "phi3"]) == 2  # fmt: skip
    assert "--param long_factor=" in capsys.readouterr().err
    model = make_model("llama")
    _patch(model, "yarn")
    folder = save_patched(model, tmp_path / "ckpt")
    _edit_raw_config(folder, lambda c: c["rope_scaling"].update(factor=2.0))
    with pytest.raises(ValueError, match="disagree") as error:
        load_patched(folder)
    assert "edit of rope_parameters alone" not in str(error.value)


def _mixtral(seed=0, **overrides):
    from conftest import TINY_SHAPE, strengthen_weights
    from transformers import MixtralConfig

    torch.manual_seed(seed)
    config = MixtralConfig(**{**TINY_SHAPE, "tie_word_embeddings": False, **overrides})
    return strengthen_weights(AutoModelForCausalLM.from_config(config, attn_implementation="eager")).eval()


@pytest.mark.parametrize("method", ["linear", "yarn"])
def test_untabled_family_whose_module_ignores_partial_rotary_factor(tmp_path, method):
    # Mixtral is in no family table; its rotary module rotates the whole head whatever the factor says.
    half = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    model = _mixtral(head_dim=16, rope_parameters=half)
    assert 2 * model.model.rotary_emb.inv_freq.numel() == 16
    described = runtime_settings(model, method, 4).vllm.settings["hf_overrides"]["rope_parameters"]
    assert described["partial_rotary_factor"] == 1.0
    ids = random_ids(LENGTH)
    _patch(model, method)
    folder = save_patched(model, tmp_path / "ckpt")
    assert json.loads((folder / "config.json").read_text())["rope_parameters"]["partial_rotary_factor"] == 1.0
    # The reference: plain transformers builds the frequencies from the saved config alone.
    plain = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    expected = _logits(plain, ids)
    torch.testing.assert_close(_logits(model, ids), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(_logits(load_patched(folder, attn_implementation="eager"), ids), expected,
                               rtol=1e-4, atol=1e-4)  # fmt: skip


def test_check_patch_reads_the_rotary_dimension_build_model_patches():
    from hf_rope_ext.training.config import FinetuneConfig, Lengths
    from hf_rope_ext.training.model import check_patch

    config = _mixtral(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                    "partial_rotary_factor": 0.5}).config  # fmt: skip
    # longrope takes one factor per rotated frequency: 8 for the 16 dimensions the module rotates.
    params = json.dumps({"long_factor": LONG_FACTOR})
    check_patch(FinetuneConfig(model="m", output_dir="o", method="longrope", method_params=params),
                Lengths(original=L0, target=4 * L0, scale=4, window=4 * L0), config)  # fmt: skip


def test_null_head_dim_is_saved_as_the_head_size(tmp_path):
    model = _mixtral()  # MixtralConfig's head_dim defaults to None; transformers' yarn reads it
    assert model.config.head_dim is None
    ids = random_ids(LENGTH)
    _patch(model, "yarn")
    folder = save_patched(model, tmp_path / "ckpt")
    assert json.loads((folder / "config.json").read_text())["head_dim"] == 64 // 4
    plain = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    expected = _logits(plain, ids)
    torch.testing.assert_close(_logits(model, ids), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(_logits(load_patched(folder, attn_implementation="eager"), ids), expected,
                               rtol=1e-4, atol=1e-4)  # fmt: skip


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_checkpoint_with_the_ignored_factor_names_the_fix(tmp_path, family):
    # What the earlier version saved for a Llama-style config with partial_rotary_factor 0.5
    # (mixtral: a family in no table, whose module rotates the whole head too).
    half = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    model = make_model("llama", partial_rotary_factor=0.5) if family == "llama" else _mixtral(rope_parameters=half)
    ids = random_ids(LENGTH)
    _patch(model, "yarn")
    expected = _logits(model, ids)
    folder = save_patched(model, tmp_path / "ckpt")

    def set_factor(factor):
        def edit(config):
            for spelling in ("rope_parameters", "rope_scaling"):
                config[spelling]["partial_rotary_factor"] = factor
            if "partial_rotary_factor" in config:
                config["partial_rotary_factor"] = factor
        _edit_raw_config(folder, edit)

    set_factor(0.5)
    fix = "Set partial_rotary_factor to 1.0 in rope_parameters and rope_scaling"
    with pytest.raises(ValueError, match=fix) as error:
        load_patched(folder)
    assert "edited or is corrupt" not in str(error.value)
    set_factor(1.0)  # the fix the message names
    torch.testing.assert_close(_logits(load_patched(folder), ids), expected, rtol=1e-5, atol=1e-5)


def test_runtime_notes_of_a_yarn_checkpoint_without_attn_factor(tmp_path, capsys):
    model = make_model("llama")
    _patch(model, "yarn", attention_factor=1.3)
    folder = save_patched(model, tmp_path / "ckpt")
    holds = "already holds these settings"
    assert any(holds in note for note in runtime_settings(AutoConfig.from_pretrained(folder)).vllm.notes)

    def drop(config):  # what the earlier version saved: attention_factor only
        for spelling in ("rope_parameters", "rope_scaling"):
            config[spelling].pop("attn_factor", None)
    _edit_raw_config(folder, drop)
    notes = runtime_settings(AutoConfig.from_pretrained(folder)).vllm.notes
    assert not any(holds in note for note in notes)
    assert any("config.json has no attn_factor" in note and "save_patched" in note for note in notes)
    assert cli_main(["runtimes", "--model-dir", str(folder)]) == 0
    out = capsys.readouterr().out
    assert holds not in out and "has no attn_factor" in out


@pytest.mark.parametrize("not_a_model", ["model", None, 3])
def test_save_patched_of_something_else_than_a_model_names_save_patched(tmp_path, not_a_model):
    with pytest.raises(TypeError, match="^save_patched expects a torch.nn.Module"):
        save_patched(not_a_model, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


# ----------------------------------------------------------------------------------------------
# Hub arguments: pushes, config overrides, revisions and subfolders
# ----------------------------------------------------------------------------------------------


def test_save_patched_refuses_save_pretrained_push_arguments(tmp_path, monkeypatch):
    """save_pretrained would push the staging folder itself, before save_patched completes and checks it."""
    import huggingface_hub

    def no_hub(*args, **kwargs):
        raise AssertionError("the Hub was called")

    for name in ("create_repo", "create_commit", "upload_folder"):  # save_pretrained's push calls HfApi's
        monkeypatch.setattr(huggingface_hub.HfApi, name, no_hub)
    model = make_model("llama")
    _patch(model, "yarn")
    for kwargs in ({"push_to_hub": True, "repo_id": "me/x"}, {"push_to_hub": True}, {"token": "hf_x"},
                   {"commit_message": "m", "private": True}):
        with pytest.raises(ValueError, match=r"^save_patched saves to a folder and does not take .*push_patched_to_hub"):
            save_patched(model, tmp_path / "ckpt", **kwargs)
    assert not (tmp_path / "ckpt").exists()
    api = RecordingApi()
    with pytest.raises(ValueError, match="^push_patched_to_hub uploads the checked folder itself; leave out push_to"):
        push_patched_to_hub(model, "me/x", api=api, push_to_hub=True)
    assert api.calls == []


def test_load_patched_sets_config_keyword_arguments_as_from_pretrained_does(tmp_path):
    model = make_model("llama")
    _patch(model, "self-extend-yarn")
    folder = save_patched(model, tmp_path / "ckpt")
    overrides = {"use_cache": False, "output_attentions": True}
    reference = AutoModelForCausalLM.from_pretrained(folder, **overrides).config  # transformers' own reading
    loaded = load_patched(folder, attn_implementation="eager", **overrides).eval()
    for key in overrides:
        assert getattr(loaded.config, key) == getattr(reference, key) == overrides[key], key
    assert get_patch_info(loaded).method == "self-extend-yarn"
    ids = random_ids(LENGTH)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, use_cache=False).logits, model(ids).logits, rtol=0, atol=2e-5)
    # with config= given too, the caller's config object is not changed
    config = AutoConfig.from_pretrained(folder)
    assert not load_patched(folder, config=config, use_cache=False).config.use_cache and config.use_cache
    # the RoPE fields the record describes are refused before the model is built
    for field, value in (("max_position_embeddings", 256), ("rope_theta", 5e5),
                         ("rope_parameters", {"rope_type": "default", "rope_theta": 1e4})):
        with pytest.raises(ValueError, match=rf"^load_patched\({field}=\.\.\.\) would change the RoPE fields that the "
                                             r"checkpoint's self-extend-yarn x4 record describes"):
            load_patched(folder, **{field: value})


def test_load_patched_reads_and_checks_a_config_given_as_a_path(tmp_path):
    model = make_model("llama")
    _patch(model, "self-extend-yarn")
    folder = save_patched(model, tmp_path / "ckpt")
    loaded = load_patched(folder, config=str(folder), attn_implementation="eager").eval()
    assert get_patch_info(loaded).method == "self-extend-yarn"
    ids = random_ids(LENGTH)
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), rtol=0, atol=2e-5)
    edited = tmp_path / "edited"
    save_patched(model, edited)
    _edit_config(edited, lambda c: c["hf_rope_ext"].update(scale=2))
    with pytest.raises(ValueError, match="scale"):
        load_patched(folder, config=edited)
    with pytest.raises(TypeError, match="^config must be a PretrainedConfig or the folder or Hub id of one, got dict"):
        load_patched(folder, config={})


def test_push_to_a_revision_creates_the_branch_first(tmp_path):
    model = make_model("llama")
    _patch(model, "yarn")
    api = RecordingApi()
    push_patched_to_hub(model, "me/tiny", api=api, revision="long-ctx", token="hf_x")
    assert [call[0] for call in api.calls] == ["create_repo", "create_branch", "upload_folder"]
    _, repo, branch_kwargs = api.calls[1]
    assert repo == "me/tiny" and branch_kwargs == {"branch": "long-ctx", "token": "hf_x", "exist_ok": True}
    assert api.calls[2][2]["revision"] == "long-ctx"
    for revision in (None, "refs/pr/3"):  # the default branch, and a pull request the Hub made
        api = RecordingApi()
        push_patched_to_hub(model, "me/tiny", api=api, revision=revision)
        assert [call[0] for call in api.calls] == ["create_repo", "upload_folder"]


def test_push_without_a_tokenizer_warns_that_the_repositorys_limit_stays(tmp_path, caplog):
    model = make_model("llama")
    _patch(model, "yarn", scale=4)
    with caplog.at_level("WARNING", logger="hf_rope_ext.hub"):
        push_patched_to_hub(model, "me/tiny", api=RecordingApi())
    assert "Pushing without tokenizer=" in caplog.text and f"extended context {4 * L0}" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_rope_ext.hub"):
        push_patched_to_hub(model, "me/tiny", api=RecordingApi(), tokenizer=_tokenizer(L0))
    assert "tokenizer=" not in caplog.text


def test_push_refuses_a_card_for_another_repository_and_names_its_own(tmp_path):
    model = make_model("llama")
    _patch(model, "self-extend-yarn")
    api = RecordingApi()
    other = render_model_card(model, base_model="org/base", repo_id="me/other")[0]
    with pytest.raises(ValueError, match="^card= was rendered for the repository 'me/other', not 'me/x'"):
        push_patched_to_hub(model, "me/x", api=api, card=other)
    assert api.calls == []
    # a card rendered without repo_id: its loading instructions are those of a card rendered for me/x
    push_patched_to_hub(model, "me/x", api=api, card=render_model_card(model, base_model="org/base")[0])
    pushed = api.calls[-1][2]["files"]["README.md"].decode()
    expected = str(render_model_card(model, base_model="org/base", repo_id="me/x")[0])
    section = "## How to load"
    assert pushed[pushed.index(section):] == expected[expected.index(section):]
    assert 'load_patched("me/x")' in pushed
    # a card for this repository, and a card of the user's own, are pushed as given
    push_patched_to_hub(model, "me/x", api=api, card=expected)
    assert api.calls[-1][2]["files"]["README.md"].decode() == expected
    mine = "# notes\n\nmodel = from_pretrained(\"someone/else\")\n"
    push_patched_to_hub(model, "me/x", api=api, card=mine)
    assert api.calls[-1][2]["files"]["README.md"].decode() == mine


def test_load_messages_name_the_revision_the_subfolder_and_restore_patch(tmp_path, monkeypatch, caplog):
    import httpx2  # huggingface_hub's HTTP client, whose response its errors carry
    import huggingface_hub
    from huggingface_hub.errors import RevisionNotFoundError

    def no_such_revision(self, repo_id, revision=None, **kwargs):  # what the Hub answers for a model that exists
        url = f"https://huggingface.co/api/models/{repo_id}/revision/{revision}"
        response = httpx2.Response(404, request=httpx2.Request("GET", url))
        raise RevisionNotFoundError("404 Revision Not Found", response=response)

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", no_such_revision)
    with pytest.raises(FileNotFoundError, match=r"^The Hub model 'org/model-x' has no revision 'v2-typo' .*=\.$"):
        load_patched("org/model-x", revision="v2-typo", cache_dir=tmp_path / "cache")
    model = make_model("llama")
    _patch(model, "self-extend-yarn")
    folder = save_patched(model, tmp_path / "ckpt")
    # offline, a model cached at main but not at the revision asked for
    _hub_cache_snapshot(tmp_path / "cache", "me/tiny", folder)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="^The Hub cache has 'me/tiny', but not at revision 'v2'"):
        load_patched("me/tiny", revision="v2", cache_dir=tmp_path / "cache")
    # a subfolder: the folder named is the one without config.json
    with pytest.raises(FileNotFoundError, match=f"^{re.escape(str(folder))} has no subfolder 'x'; check subfolder="):
        load_patched(folder, subfolder="x")
    (folder / "sub").mkdir()
    with pytest.raises(FileNotFoundError, match=f"^{re.escape(str(folder / 'sub'))} has no config.json"):
        load_patched(folder, subfolder="sub")
    (folder / "sub").rmdir()
    # restore=False on an attention-level patch: the fix named is restore_patch, not load_patched again
    with caplog.at_level("WARNING"):
        loaded = load_patched(folder, restore=False)
    assert "hf_rope_ext.hub.restore_patch(model)" in caplog.text and "Load it with" not in caplog.text
    assert get_patch_info(restore_patch(loaded)).method == "self-extend-yarn"


# ----------------------------------------------------------------------------------------------
# from_pretrained's arguments, checked against transformers' own reading
# ----------------------------------------------------------------------------------------------


def test_load_patched_with_output_loading_info_returns_the_model_and_transformers_info(tmp_path):
    model = make_model("llama")
    _patch(model, "self-extend-yarn")
    folder = save_patched(model, tmp_path / "ckpt")
    loaded, info = load_patched(folder, output_loading_info=True)
    assert info == AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)[1]
    assert get_patch_info(loaded).method == "self-extend-yarn"
    ids = random_ids(LENGTH)
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), rtol=0, atol=2e-5)


def test_save_patched_refuses_keyword_arguments_save_pretrained_would_ignore(tmp_path):
    model = make_model("llama")
    _patch(model, "yarn")
    # transformers 5 dropped safe_serialization; a misspelt argument; push_to_hub's, without a push
    cases = (("safe_serialization", False, ""), ("max_shard_sise", "20KB", " did you mean max_shard_size=?"),
             ("revision", "dev", ""), ("tokeniser", None, " did you mean tokenizer=?"))
    for key, value, hint in cases:
        message = (rf"^save_patched got an unexpected keyword argument '{key}' \(LlamaForCausalLM\.save_pretrained "
                   rf"would ignore it\);{re.escape(hint)} the keyword arguments passed on to save_pretrained are "
                   r".*max_shard_size")
        with pytest.raises(TypeError, match=message):
            save_patched(model, tmp_path / "ckpt", **{key: value})
        assert not (tmp_path / "ckpt").exists()
    api = RecordingApi()
    for key in ("max_shard_sise", "commit_description", "repo_type", "exist_ok"):
        with pytest.raises(TypeError, match=f"^push_patched_to_hub got an unexpected keyword argument '{key}'"):
            push_patched_to_hub(model, "me/x", api=api, **{key: "x"})
    assert api.calls == []
    # the arguments save_pretrained names are passed on: the files are those it writes itself
    kwargs = {"max_shard_size": "20KB", "variant": "v1"}
    model.save_pretrained(tmp_path / "reference", **kwargs)
    written = save_patched(model, tmp_path / "ckpt", **kwargs)
    weights = sorted(path.name for path in written.iterdir() if "safetensors" in path.name)
    assert weights == sorted(path.name for path in (tmp_path / "reference").iterdir() if "safetensors" in path.name)
    assert len(weights) > 2
    push_patched_to_hub(model, "me/x", api=api, legacy_fields=False, max_shard_size="20KB")  # save_patched's own too
    assert "rope_scaling" not in json.loads(api.calls[-1][2]["files"]["config.json"])
    # is_main_process=False: save_pretrained would write no config.json, where the record lives
    before = sorted(path.name for path in written.iterdir())
    with pytest.raises(ValueError, match=r"takes no is_main_process=False; call it on the main process only"):
        save_patched(model, written, is_main_process=False)
    assert sorted(path.name for path in written.iterdir()) == before
    for truthy in (True, 1):  # read by truth, as save_pretrained reads it
        assert (save_patched(model, tmp_path / f"main-{truthy!r}", is_main_process=truthy) / "config.json").is_file()


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_load_patched_with_a_patched_models_config_builds_that_models_own_attention(tmp_path, implementation):
    model = make_model("llama", attn_implementation=implementation)
    _patch(model, "self-extend-yarn")
    folder = save_patched(model, tmp_path / "ckpt")
    ids = random_ids(LENGTH)
    loaded = load_patched(folder, config=model.config)
    assert get_patch_info(loaded).method == "self-extend-yarn"
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), rtol=0, atol=2e-5)
    # restore=False: what plain from_pretrained builds with that attention, whose forward runs
    plain = load_patched(folder, config=model.config, restore=False)
    reference = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=implementation)
    assert plain.config._attn_implementation == reference.config._attn_implementation == implementation
    unpatch_model(model)
    torch.testing.assert_close(_logits(plain, ids), _logits(reference, ids), rtol=0, atol=2e-5)


def test_load_patched_accepts_rope_keyword_arguments_equal_to_the_checkpoints(tmp_path):
    model = make_model("llama")
    _patch(model, "self-extend-yarn")
    folder = save_patched(model, tmp_path / "ckpt")
    read = AutoConfig.from_pretrained(folder)  # transformers' reading of the checkpoint
    same = {"max_position_embeddings": read.max_position_embeddings, "head_dim": read.head_dim,
            "rope_parameters": dict(read.rope_parameters)}
    loaded = load_patched(folder, **same)
    assert get_patch_info(loaded).method == "self-extend-yarn"
    ids = random_ids(LENGTH)
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match=r"^load_patched\(max_position_embeddings=\.\.\.\) would change"):
        load_patched(folder, **{**same, "max_position_embeddings": read.max_position_embeddings + 1})
    # the spellings config.json also holds: rope_theta (in rope_parameters in transformers 5) and the
    # legacy rope_scaling, written without rope_theta (it sits beside it); the caller's dict is left as given
    saved = json.loads((folder / "config.json").read_text())
    legacy = dict(saved["rope_scaling"])
    loaded = load_patched(folder, rope_theta=saved["rope_theta"], rope_scaling=legacy)
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), rtol=0, atol=2e-5)
    assert legacy == saved["rope_scaling"]
    with pytest.raises(ValueError, match=r"^load_patched\(rope_theta=\.\.\.\) would change"):
        load_patched(folder, rope_theta=saved["rope_theta"] * 2)


def test_offline_hub_cache_messages_name_the_missing_subfolder_or_revision(tmp_path, monkeypatch):
    import huggingface_hub

    model = make_model("llama")
    _patch(model, "yarn")
    folder = save_patched(model, tmp_path / "ckpt")
    _hub_cache_snapshot(tmp_path / "cache", "me/tiny", folder)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cache = {"cache_dir": tmp_path / "cache"}
    assert get_patch_info(load_patched("me/tiny", **cache)).method == "yarn"
    with pytest.raises(FileNotFoundError, match="^The Hub cache has 'me/tiny', but no subfolder 'sub' in it"):
        load_patched("me/tiny", subfolder="sub", **cache)
    with pytest.raises(FileNotFoundError, match="^The Hub cache has 'me/tiny', but not at revision 'v2'"):
        load_patched("me/tiny", revision="v2", subfolder="sub", **cache)


def test_load_patched_names_the_config_given_when_it_has_no_record(tmp_path, caplog):
    model = make_model("llama")
    _patch(model, "yarn")
    folder = save_patched(model, tmp_path / "ckpt")
    base = tmp_path / "base"
    make_model("llama").save_pretrained(base)
    with caplog.at_level("INFO", logger="hf_rope_ext.hub"):
        assert get_patch_info(load_patched(folder, config=base)) is None
    assert f"The config= given ({base}) has no hf_rope_ext record" in caplog.text
    assert f"{folder} has no hf_rope_ext record" not in caplog.text


def _card_metadata_patch(folder):
    return ModelCard.load(folder / "README.md").data.to_dict()["hf_rope_ext"]


@pytest.mark.parametrize(
    "kwargs, difference",
    [
        ({"method": "yarn", "original_max_length": 16, "beta_fast": 8.0}, "original_max_position_embeddings 32 vs 16"),
        ({"method": "yarn", "attention_factor": 1.5}, "params.attention_factor"),
        ({"method": "dynamic", "steps_per_doubling": 2}, "steps_per_doubling"),
    ],
)
def test_save_patched_refuses_a_card_for_the_same_method_and_scale_but_another_patch(tmp_path, kwargs, difference):
    method = kwargs.pop("method")
    model = make_model("llama")
    _patch(model, method, scale=4)
    card = render_model_card(model, base_model="org/base")[0]
    # The card names the whole patch: the checkpoint's record less its version, as config.json holds it.
    target = save_patched(model, tmp_path / "own", card=card)
    record = json.loads((target / "config.json").read_text())["hf_rope_ext"]
    assert _card_metadata_patch(target) == {key: value for key, value in record.items() if key != "version"}
    other = make_model("llama")
    _patch(other, method, scale=4, **kwargs)
    with pytest.raises(ValueError, match=f"rendered for a {method} x4 patch, not this {method} x4 checkpoint "
                                         rf"\(card vs checkpoint: .*{re.escape(difference)}"):  # fmt: skip
        save_patched(other, tmp_path / "other", card=card)
    assert not (tmp_path / "other").exists()


def test_resaving_another_patch_of_the_same_method_and_scale_removes_the_generated_card(tmp_path, caplog):
    model = make_model("llama")
    _patch(model, "yarn", scale=4)
    target = tmp_path / "ckpt"
    card = render_model_card(model, base_model="org/base")[0]
    save_patched(model, target, card=card)
    unpatch_model(model)
    _patch(model, "yarn", scale=4, beta_fast=8.0, attention_factor=1.5)
    with caplog.at_level("WARNING", logger="hf_rope_ext.hub"):
        save_patched(model, target)
    assert json.loads((target / "config.json").read_text())["hf_rope_ext"]["params"]["beta_fast"] == 8.0
    assert not (target / "README.md").exists() and "Removed README.md" in caplog.text
    # A card of an earlier version naming only method and scale: judged by the record saved beside it.
    new_card = render_model_card(model, base_model="org/base")[0]
    save_patched(model, target, card=new_card)
    older = re.sub(r"\nhf_rope_ext:\n(  .*\n)+", "\nhf_rope_ext:\n  method: yarn\n  scale: 4.0\n", str(new_card))
    (target / "README.md").write_text(older)
    save_patched(model, target)  # the same patch: kept
    assert (target / "README.md").read_text() == older
    unpatch_model(model)
    _patch(model, "yarn", scale=4)
    save_patched(model, target)
    assert not (target / "README.md").exists()


def test_yarn_card_rendered_from_the_model_describes_the_attn_factor_save_patched_writes(tmp_path):
    model = make_model("llama")
    _patch(model, "yarn", scale=4, attention_factor=1.5)
    card = render_model_card(model, base_model="org/base")[0]
    target = save_patched(model, tmp_path / "ckpt", card=card)
    saved = json.loads((target / "config.json").read_text())
    # older vLLM multiplies attn_factor by yarn's mscale (0.1 ln s + 1) itself
    assert saved["rope_scaling"]["attn_factor"] == pytest.approx(1.5 / (0.1 * math.log(4) + 1))
    text = (target / "README.md").read_text()
    assert "has no attn_factor" not in text
    # the note runtime_settings gives for the config as saved on disk
    note = next(n for n in runtime_settings(AutoConfig.from_pretrained(target)).vllm.notes if "checkpoint" in n)
    assert note.startswith("A checkpoint saved with hf_rope_ext already holds") and note.split(":")[0] in text


@pytest.mark.parametrize("method", ["self-extend", "yarn"])
def test_a_null_record_is_refused_not_read_as_none(tmp_path, method):
    model = make_model("llama")
    _patch(model, method)
    target = save_patched(model, tmp_path / "ckpt")
    config = json.loads((target / "config.json").read_text())
    config["hf_rope_ext"] = None
    (target / "config.json").write_text(json.dumps(config))
    expected = "the `hf_rope_ext` entry of config.json must be a JSON object, got NoneType"
    with pytest.raises(ValueError, match=re.escape(expected)):
        load_patched(target)
    with pytest.raises(ValueError, match=re.escape(expected)):
        runtime_settings(AutoConfig.from_pretrained(target))


def test_a_record_whose_method_is_not_a_string_is_refused_as_edited(tmp_path):
    model = make_model("llama")
    _patch(model, "yarn")
    target = save_patched(model, tmp_path / "ckpt")
    config = json.loads((target / "config.json").read_text())
    config["hf_rope_ext"]["method"] = 3
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"has method=3; it must be a string .* The config was edited") as error:
        load_patched(target)
    assert "not registered" not in str(error.value) and "\n" not in str(error.value)


def test_loading_an_attention_level_checkpoint_without_its_record_says_the_record_is_missing(tmp_path, caplog):
    model = make_model("llama")
    _patch(model, "self-extend")
    target = save_patched(model, tmp_path / "ckpt")
    config = json.loads((target / "config.json").read_text())
    del config["hf_rope_ext"]
    (target / "config.json").write_text(json.dumps(config))
    with caplog.at_level("WARNING", logger="hf_rope_ext.config_io"):
        assert get_patch_info(load_patched(target)) is None
    assert "no `hf_rope_ext` record to rebuild the attention from" in caplog.text
    assert "Load it with hf_rope_ext.hub.load_patched" not in caplog.text


def test_model_card_attributes_no_evaluation_to_a_patch_with_parameters_eval_does_not_set(tmp_path):
    """Evaluation records name method and scale only (`hf-rope-ext eval` applies methods with their
    defaults), so yarn x4 results are not results of a yarn x4 checkpoint with attention_factor 1.3:
    the card must not publish them as its results (model-index)."""
    model = make_model("llama")
    _patch(model, "yarn", attention_factor=1.3)  # yarn x4
    folder = save_patched(model, tmp_path / "ckpt")
    config = AutoConfig.from_pretrained(folder)
    evaluation = tmp_path / "eval"
    evaluation.mkdir()
    (evaluation / "results.jsonl").write_text(json.dumps({**RESULTS[1], "model": str(folder)}) + "\n")
    with pytest.raises(ValueError, match=r"parameters other than its method's defaults \(attention_factor=1\.3\).*"
                                         r"render the card without --eval-dir"):
        render_model_card(config, base_model="org/tiny-base", eval_dir=evaluation)
    card, _ = render_model_card(config, base_model="org/tiny-base")  # without results: rendered
    assert not card.data.eval_results


def test_save_patched_refusal_of_a_model_carrying_an_adapter_names_fixes_that_exist(tmp_path):
    """The refusal's fixes must exist on what the user holds: a PeftModel's inner model (and a model
    given an adapter with transformers' load_adapter) has no merge_and_unload."""
    from peft import LoraConfig, PeftModel, get_peft_model

    import hf_rope_ext.training

    model = make_model("llama")
    _patch(model, "yarn")
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    inner = peft_model.get_base_model()
    assert not hasattr(inner, "merge_and_unload")  # so "model.merge_and_unload()" alone cannot be the fix
    for holder in (peft_model, inner):
        with pytest.raises(ValueError) as refusal:
            save_patched(holder, tmp_path / "ckpt")
        message = str(refusal.value)
        assert "\n" not in message
        assert "merge_and_unload()" in message and hasattr(peft_model, "merge_and_unload")
        assert "PeftModel.from_pretrained" in message and hasattr(PeftModel, "from_pretrained")
        assert "hf_rope_ext.training.merge_adapter" in message and callable(hf_rope_ext.training.merge_adapter)
        assert "get_base_model()" in message and "load_adapter()" in message
    assert not (tmp_path / "ckpt").exists()
