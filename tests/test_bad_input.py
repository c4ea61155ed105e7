"""Bad input as a new user gives it: each case is refused with one clear message, or works.

Tiny random Llama models (see conftest); every test here failed before the fix it covers.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
import subprocess
import threading
from pathlib import Path

import pytest
import torch
from conftest import ORIGINAL_CONTEXT, make_model, random_ids

import hf_rope_ext
from hf_rope_ext import get_patch_info, patch_model
from hf_rope_ext.methods import default_inv_freq

L0 = ORIGINAL_CONTEXT
REPO = Path(__file__).resolve().parents[1]


# -- a user-registered method's output is checked at patch time ---------------------------------

_HALF = 8  # frequencies of the tiny models (head_dim 16)


def _nan_beyond_original(rotary_dim, base, params, seq_len=None):
    inv_freq = default_inv_freq(rotary_dim, base)
    return (inv_freq * math.nan if seq_len is not None else inv_freq), 1.0


BAD_OUTPUTS = {
    "nan frequency": (lambda d, b, p, n=None: (default_inv_freq(d, b) * torch.tensor([1.0] * 7 + [math.nan]), 1.0),
                      False, r"inv_freq\[7\] = nan; every frequency must be finite and > 0"),
    "zero frequency": (lambda d, b, p, n=None: (default_inv_freq(d, b) * 0, 1.0), False, r"inv_freq\[0\] = 0.0"),
    "negative frequency": (lambda d, b, p, n=None: (-default_inv_freq(d, b), 1.0), False, r"inv_freq\[0\] = -1.0"),
    "nan attention factor": (lambda d, b, p, n=None: (default_inv_freq(d, b) / 2, math.nan), False,
                             "attention factor nan; it must be finite and > 0"),
    "zero attention factor": (lambda d, b, p, n=None: (default_inv_freq(d, b) / 2, 0.0), False,
                              "attention factor 0.0"),
    "None": (lambda d, b, p, n=None: None, False, r"returned None; a method must return the pair"),
    "a bare tensor": (lambda d, b, p, n=None: default_inv_freq(d, b), False, "must return the pair"),
    "wrong shape": (lambda d, b, p, n=None: (default_inv_freq(2 * d, b), 1.0), False, r"shape \(16,\), expected \(8,\)"),
    "integer frequencies": (lambda d, b, p, n=None: (torch.ones(d // 2, dtype=torch.int64), 1.0), False,
                            "dtype torch.int64; it must be a floating-point tensor"),
    "string attention factor": (lambda d, b, p, n=None: (default_inv_freq(d, b) / 2, "1"), False,
                                "attention factor '1'; it must be a number"),
    "nan beyond the original context": (_nan_beyond_original, True, r"at length 128\)"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_OUTPUTS))
def test_bad_method_output_is_refused_at_patch_time_naming_the_method(case):
    compute, length_dependent, message = BAD_OUTPUTS[case]
    hf_rope_ext.register_method("my-method", compute, length_dependent=length_dependent)
    try:
        model = make_model("llama")
        config_before = model.config.to_dict()
        with pytest.raises(ValueError, match=f"RoPE method 'my-method' .*{message}"):
            patch_model(model, scale=4, method="my-method")
        assert get_patch_info(model) is None and model.config.to_dict() == config_before
        with torch.no_grad():
            assert torch.isfinite(model(random_ids(L0)).logits).all()
    finally:
        hf_rope_ext.unregister_method("my-method")


# -- the command line: bad values exit 2 with one line, never a traceback --------------------------


def _word_tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{f"w{i}": 3 + i for i in range(100)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="[UNK]")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A patched tiny Llama saved with a tokenizer, and an unpatched one."""
    from hf_rope_ext.hub import save_patched

    folder = tmp_path_factory.mktemp("bad-input")
    model = make_model("llama")
    model.save_pretrained(folder / "base")
    _word_tokenizer().save_pretrained(folder / "base")
    patch_model(model, scale=4, method="yarn")
    save_patched(model, folder / "yarn", tokenizer=_word_tokenizer())
    (folder / "not-a-checkpoint").mkdir()
    (folder / "a-file").write_text("x")
    (folder / "book.txt").write_text(" ".join(f"w{i % 100}" for i in range(400)))
    (folder / "dataset").mkdir()  # a local datasets folder, split "train"
    (folder / "dataset" / "data.jsonl").write_text("".join(
        json.dumps({"text": text}) + "\n" for text in ("w1 " * 50, None, "w2 " * 50)
    ))  # fmt: skip
    return folder


DESCRIBED = ["runtimes", "--method", "yarn", "--scale", "4", "--original-context", "32", "--rope-theta", "10000"]
CLI_CASES = {
    "odd rotary dim": (DESCRIBED + ["--rotary-dim", "15"], "rotary_dim must be even"),
    "zero rotary dim": (DESCRIBED + ["--rotary-dim", "0"], "rotary_dim must be a positive number of dimensions"),
    "negative rope theta": (["runtimes", "--method", "yarn", "--scale", "4", "--original-context", "32",
                             "--rope-theta", "-1", "--rotary-dim", "16"], "rope_theta must be a finite number > 0"),
    "infinite scale": (["runtimes", "--method", "yarn", "--scale", "inf", "--original-context", "32",
                        "--rope-theta", "1e4", "--rotary-dim", "16"], "scale must be finite"),
    "unparsable param": (DESCRIBED + ["--rotary-dim", "16", "--param", "beta_fast=abc"],
                         "'beta_fast' of method 'yarn' must be a finite number, got 'abc'"),
    "missing model dir": (["runtimes", "--model-dir", "{folder}/missing"], "Checkpoint folder not found"),
    "not a checkpoint": (["runtimes", "--model-dir", "{folder}/not-a-checkpoint"], "has no config.json"),
    "card without base model": (["card", "--model-dir", "{folder}/yarn"], "pass base_model="),
    "card with missing eval dir": (["card", "--model-dir", "{folder}/yarn", "--base-model", "org/base",
                                    "--eval-dir", "{folder}/missing"], "No results.jsonl in"),
    "card to an unwritable output": (["card", "--model-dir", "{folder}/yarn", "--base-model", "org/base",
                                      "--output", "{folder}/a-file/README.md"], "Cannot write the model card to"),
    "eval of a missing local folder": (["eval", "--model", "{folder}/missing", "--text-file", "{folder}/book.txt",
                                        "--methods", "none", "--ppl-lengths", "16", "--output-dir", "{folder}/out"],
                                       "Model folder not found"),
    "eval of a dataset it cannot reach": (["eval", "--model", "{folder}/base", "--dataset",
                                           "hf-rope-ext-tests/no-such-dataset", "--methods", "none",
                                           "--ppl-lengths", "16", "--output-dir", "{folder}/out"],
                                          "Dataset 'hf-rope-ext-tests/no-such-dataset' .* could not be read"),
    "auto candidate with a parameter of the wrong type": (["auto", "--model", "{folder}/base", "--text-files",
                                                           "{folder}/book.txt", "--scale", "2", "--no-cache",
                                                           "--candidates", "yarn;yarn:truncate=1"],
                                                          "candidate 'yarn:truncate=1': Parameter 'truncate'"),
    "infinite rope theta": (["runtimes", "--method", "yarn", "--scale", "4", "--original-context", "32",
                             "--rope-theta", "inf", "--rotary-dim", "16"], "rope_theta must be a finite number > 0"),
    "zero original context with a model dir": (["runtimes", "--model-dir", "{folder}/base", "--method", "yarn",
                                                "--scale", "4", "--original-context", "0"],
                                               "original_max_length must be a positive number of tokens, got 0"),
    "model fact as a method parameter": (DESCRIBED + ["--rotary-dim", "16", "--param", "rope_theta=5"],
                                         "--param rope_theta: .* use --rope-theta"),
    "model fact as a parameter with a model dir": (["runtimes", "--model-dir", "{folder}/base", "--method", "yarn",
                                                    "--scale", "4", "--param", "rotary_dim=8"],
                                                   "rotary_dim is the model's own, read from the config in .* without "
                                                   "--model-dir"),
    "model type as a method parameter": (DESCRIBED + ["--rotary-dim", "16", "--param", "model_type=qwen2"],
                                         "use --model-type"),
    "eval with a text file that is a folder": (["eval", "--model", "{folder}/base", "--text-files",
                                                "{folder}/not-a-checkpoint", "--methods", "none", "--ppl-lengths",
                                                "16", "--output-dir", "{folder}/out"],
                                               "not-a-checkpoint is a folder, not a text file"),
    "ntk base overflowing to infinity": (["runtimes", "--method", "ntk", "--scale", "4", "--original-context", "32",
                                          "--rope-theta", "1e308", "--rotary-dim", "16"],
                                         "RoPE method 'ntk' .*every frequency must be finite and > 0"),
    "eval into a folder under a file": (["eval", "--model", "{folder}/base", "--text-files", "{folder}/book.txt",
                                         "--methods", "none", "--ppl-lengths", "16", "--output-dir",
                                         "{folder}/a-file/out"], "a-file is a file; pass another folder"),
    "demo against the unpatched model itself": (["demo", "--model", "{folder}/base", "--method", "none",
                                                 "--text-file", "{folder}/book.txt", "--output-dir",
                                                 "{folder}/demo-out"], "always runs the unpatched model \\(none\\)"),
    "eval with a dataset field it does not have": (["eval", "--model", "{folder}/base", "--dataset",
                                                    "{folder}/dataset", "--dataset-split", "train", "--text-field",
                                                    "body", "--methods", "none", "--ppl-lengths", "16",
                                                    "--output-dir", "{folder}/out"],
                                                   r"has no field 'body'; its fields are \['text'\]. .*--text-field"),
    "eval on a device torch does not know": (["eval", "--model", "{folder}/base", "--text-file", "{folder}/book.txt",
                                              "--device", "nonsense", "--methods", "none", "--ppl-lengths", "16",
                                              "--output-dir", "{folder}/out"],
                                             "--device nonsense is not a device torch knows; use cpu, cuda"),
    "runtimes for a model type patch_model refuses": (DESCRIBED + ["--rotary-dim", "16", "--model-type", "gpt2"],
                                                      "model_type 'gpt2' is not supported: learned absolute"),
    "runtimes for phi3 with a rope type its config rejects": (DESCRIBED + ["--rotary-dim", "16", "--model-type",
                                                                            "phi3"],
                                                              "model_type 'phi3': its config rejects rope_type 'yarn'"),
    "runtimes of a bare name that is no folder": (["runtimes", "--model-dir", "no-such-checkpoint-hf-rope-ext"],
                                                  "no local folder named 'no-such-checkpoint-hf-rope-ext', and "),
    "card of a bare name that is no folder": (["card", "--model-dir", "no-such-checkpoint-hf-rope-ext",
                                               "--base-model", "org/base"],
                                              "no local folder named 'no-such-checkpoint-hf-rope-ext', and "),
    "eval of a bare name that is no folder": (["eval", "--model", "no-such-checkpoint-hf-rope-ext", "--text-file",
                                               "{folder}/book.txt", "--methods", "none", "--ppl-lengths", "16",
                                               "--output-dir", "{folder}/out"],
                                              "no local folder named 'no-such-checkpoint-hf-rope-ext', and "),
    "demo at scale 0": (["demo", "--model", "{folder}/base", "--scale", "0", "--text-file", "{folder}/book.txt",
                         "--output-dir", "{folder}/demo-out"], r"Scales must be numbers > 1 .*got 0.0"),
    "demo with a passkey length inside the native context": (["demo", "--model", "{folder}/base", "--passkey-length",
                                                              "32", "--text-file", "{folder}/book.txt", "--output-dir",
                                                              "{folder}/demo-out"],
                                                             "--passkey-length 32 is within the model's native context "
                                                             "of 32 tokens; the demo shows retrieval beyond it"),
    "auto with a scale beyond any context": (["auto", "--model", "{folder}/base", "--text-files", "{folder}/book.txt",
                                              "--scale", "1e308", "--no-cache"], "beyond the 2147483647 positions"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli_bad_values_exit_2_with_one_line(case, checkpoint, capsys, monkeypatch):
    from hf_rope_ext.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    argv, message = CLI_CASES[case]
    code = main([part.format(folder=checkpoint) for part in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert re.search(message, lines[0]), lines[0]


# -- messages that name the right thing --------------------------------------------------------------


def test_model_folder_without_tokenizer_files_says_so(checkpoint, tmp_path):
    from hf_rope_ext.loading import load_model

    make_model("llama").save_pretrained(tmp_path / "no-tokenizer")
    with pytest.raises(FileNotFoundError, match="has no tokenizer files"):
        load_model(str(tmp_path / "no-tokenizer"), device="cpu")
    model, tokenizer = load_model(str(checkpoint / "base"), device="cpu")  # with them it loads
    assert tokenizer("w1 w2")["input_ids"] == [4, 5]


def test_loading_a_checkpoint_of_our_own_type_after_import_does_not_ask_to_install(tmp_path, caplog):
    from transformers import AutoModelForCausalLM

    from hf_rope_ext.hub import save_patched

    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic-yarn")
    folder = save_patched(model, tmp_path / "ckpt")
    with caplog.at_level(logging.WARNING):
        AutoModelForCausalLM.from_pretrained(folder)
    assert "pip install hf-rope-ext" not in caplog.text


def test_plain_from_pretrained_of_an_attention_level_checkpoint_warns_once(tmp_path, caplog):
    """transformers builds the rotary frequencies twice per model (construction, then its weight
    init): the warning that from_pretrained drops the attention is said once per load."""
    from transformers import AutoModelForCausalLM

    from hf_rope_ext.hub import save_patched

    model = make_model("llama")
    patch_model(model, scale=4, method="self-extend-yarn")
    folder = save_patched(model, tmp_path / "ckpt")
    for _ in range(2):  # a second load is warned about again
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hf_rope_ext"):
            AutoModelForCausalLM.from_pretrained(folder)
        assert caplog.text.count("saved with the attention-level patch 'self-extend-yarn'") == 1


@pytest.mark.parametrize("scale", [1e9, 1e300, 1e308])
def test_a_record_beyond_the_position_limit_is_refused_at_load_as_at_patch_time(tmp_path, scale):
    """The bound patch_model sets on L0 x scale (int32 positions) holds for a config.json edited
    consistently too, in one line, not as a raw OverflowError."""
    from hf_rope_ext.hub import load_patched, save_patched
    from hf_rope_ext.spec import PatchSpec

    model = make_model("llama")
    patch_model(model, scale=4, method="yarn")
    folder = save_patched(model, tmp_path / "ckpt")
    config = json.loads((folder / "config.json").read_text())
    config["hf_rope_ext"]["scale"] = config["rope_parameters"]["factor"] = config["rope_scaling"]["factor"] = scale
    if math.isfinite(ORIGINAL_CONTEXT * scale):
        config["max_position_embeddings"] = math.ceil(ORIGINAL_CONTEXT * scale)
    (folder / "config.json").write_text(json.dumps(config))
    limit = "beyond the 2147483647 positions models and runtimes index"
    refused = f"the `hf_rope_ext` entry of config.json has scale={re.escape(repr(scale))}.*{limit}"
    with pytest.raises(ValueError, match=refused) as error:
        load_patched(folder)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=limit):
        patch_model(make_model("llama"), scale=scale, method="yarn")
    with pytest.raises(ValueError, match=limit):
        PatchSpec("yarn", scale, ORIGINAL_CONTEXT)


def test_a_record_with_an_original_context_too_large_for_a_float_is_refused_in_one_line():
    from hf_rope_ext.spec import PatchSpec, RecordError

    record = PatchSpec.create("yarn", 4, original_max_length=32, rope_theta=10000.0).to_record()
    with pytest.raises(RecordError, match="original_max_position_embeddings of about 10\\^400 tokens, beyond the 2147483647"):
        PatchSpec.from_record(dict(record, original_max_position_embeddings=10**400))
    with pytest.raises(ValueError, match="about 10\\^400 tokens, beyond the 2147483647"):
        PatchSpec("yarn", 4.0, 10**400)


@pytest.mark.parametrize("original", [13, 1999, 8192])
def test_a_context_at_the_position_limit_is_taken_whatever_the_original_length(original):
    """max_length = 2**31 - 1 makes scale = max_length / L0, whose product with L0 can round just
    above the limit in float: the bound allows for that rounding, at patch time and in the spec."""
    from hf_rope_ext.spec import PatchSpec

    model = make_model("llama", max_position_embeddings=original)
    patch_model(model, max_length=2**31 - 1, method="linear")
    assert model.config.max_position_embeddings == 2**31 - 1
    PatchSpec("linear", (2**31 - 1) / original, original)  # the record load_patched reads builds one


@pytest.mark.parametrize("steps", [0, -1])
def test_steps_per_doubling_error_does_not_speak_of_tokens(steps):
    with pytest.raises(ValueError, match="steps_per_doubling must be a positive number of frequency steps") as error:
        patch_model(make_model("llama"), scale=4, method="dynamic", steps_per_doubling=steps)
    assert "tokens" not in str(error.value)


def _finetune_script():
    spec = importlib.util.spec_from_file_location("finetune_lora", REPO / "examples" / "finetune_lora.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_finetune_names_its_own_flags(tmp_path):
    from hf_rope_ext.training import FinetuneConfig

    config = FinetuneConfig(model="x", output_dir=str(tmp_path), text_files=[str(tmp_path / "missing.txt")], scale=4)
    with pytest.raises(FileNotFoundError, match=r"Text file not found: .*missing.txt \(given with --text-files\)"):
        config.validate()
    parser = _finetune_script().build_parser()
    helps = {}
    for action in parser._actions:
        for option in action.option_strings:
            helps[option] = action.help
    assert "--text-files" in helps and "--text-files" in parser.format_help()  # the flag it names is the script's
    assert helps["--no_shuffle"] != helps["--shuffle"] and "--shuffle" in helps["--no_shuffle"]
    assert helps["--no_save_merged"] != helps["--save_merged"]


def test_demo_names_its_own_flags(checkpoint, tmp_path, capsys):
    from hf_rope_ext.cli import main

    short = tmp_path / "short.txt"
    short.write_text("w1 w2 w3 " * 5)
    code = main(["demo", "--model", str(checkpoint / "base"), "--device", "cpu", "--text-file", str(short),
                 "--passkey-length", "200",
                 "--output-dir", str(tmp_path / "out"), "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "shorter --ppl-length." in err and "--ppl-lengths" not in err and "--sliding" not in err


# -- text files that are not UTF-8 text ----------------------------------------------------------------


def test_binary_and_non_utf8_files_are_refused(tmp_path):
    from hf_rope_ext.data import read_text

    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 40)
    with pytest.raises(ValueError, match="binary file"):
        read_text(binary)
    noise = tmp_path / "noise.txt"
    noise.write_bytes(bytes(range(128, 256)) * 40)  # no NUL byte, none of it UTF-8
    with pytest.raises(ValueError, match="5120 of its 5120 bytes are not valid UTF-8"):
        read_text(noise)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(("Ça été très élégant. " * 200).encode("latin-1"))
    with pytest.raises(ValueError, match="1200 of its 4200 bytes are not valid UTF-8.* iconv -f latin1"):
        read_text(latin1)


def test_a_few_undecodable_bytes_are_counted_in_a_warning(tmp_path, caplog):
    from hf_rope_ext.data import read_text

    path = tmp_path / "book.txt"
    path.write_bytes(b"An ordinary line of text. " * 200 + b"caf\xe9 " + b"more text. " * 10)
    with caplog.at_level(logging.WARNING, logger="hf_rope_ext.data"):
        text = read_text(path)
    assert "1 byte(s) are not valid UTF-8" in caplog.text
    assert text.count("\ufffd") == 1 and "caf\ufffd" in text


def test_eval_refuses_a_binary_text_file(checkpoint, tmp_path, capsys):
    from hf_rope_ext.cli import main

    binary = tmp_path / "model.safetensors"
    binary.write_bytes(bytes(range(256)) * 100)
    code = main(["eval", "--model", str(checkpoint / "base"), "--device", "cpu", "--text-file", str(binary),
                 "--methods", "none", "--ppl-lengths", "16", "--output-dir", str(tmp_path / "out"), "--no-progress"])
    assert code == 2 and "binary file" in capsys.readouterr().err
    assert not (tmp_path / "out" / "results.jsonl").exists()


@pytest.mark.parametrize("command", ["eval", "demo"])
@pytest.mark.parametrize("content, message", [
    ("w1 w2".encode("utf-16"), "is UTF-16 text"),
    (bytes(range(256)) * 100, "binary file"),
    ("w1 ".encode() + bytes(range(128, 256)) * 10, "are not valid UTF-8, so it is not UTF-8 text"),
])  # fmt: skip
def test_an_unreadable_text_file_is_refused_before_the_model_loads(checkpoint, tmp_path, capsys, monkeypatch, command,
                                                                   content, message):
    import hf_rope_ext.loading
    from hf_rope_ext.cli import main

    def not_loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the text file was checked")

    monkeypatch.setattr(hf_rope_ext.loading, "load_model", not_loaded)
    text = tmp_path / "book.txt"
    text.write_bytes(content)
    extra = ["--methods", "none", "--ppl-lengths", "16"] if command == "eval" else []
    code = main([command, "--model", str(checkpoint / "base"), "--device", "cpu", "--text-file", str(text),
                 "--output-dir", str(tmp_path / "out"), *extra])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and message in err, err


# -- demo lengths ----------------------------------------------------------------------------------


def test_demo_refuses_a_perplexity_length_inside_the_native_context(checkpoint, tmp_path, capsys):
    from hf_rope_ext.cli import main
    from hf_rope_ext.evaluation import EvaluationError
    from hf_rope_ext.evaluation.demo import demo_settings

    with pytest.raises(EvaluationError, match="--ppl-length 32 is within the model's native context of 32 tokens"):
        demo_settings(32, False, ppl_length=32)
    assert demo_settings(32, False, ppl_length=33).ppl_length == 33
    code = main(["demo", "--model", str(checkpoint / "base"), "--device", "cpu", "--text-file",
                 str(checkpoint / "book.txt"), "--ppl-length", "16", "--output-dir", str(tmp_path / "out")])
    assert code == 2 and "within the model's native context" in capsys.readouterr().err


# -- scales whose extended context is not a whole number of tokens ------------------------------------


def test_scale_that_does_not_change_the_context_by_a_token_is_refused():
    model = make_model("llama")
    before = model.config.to_dict()
    for scale in (1.0000001, 1 + 0.4 / L0):
        with pytest.raises(ValueError, match=r"less than half a token; the smallest extension is scale=1.03125 \(max_length=33\)"):
            patch_model(model, scale=scale, method="yarn")
    assert get_patch_info(model) is None and model.config.to_dict() == before


@pytest.mark.parametrize("scale, tokens", [(3.3, 106), (2.0000001, 64), (1 + 0.6 / L0, 33)])
def test_fractional_scale_is_rounded_to_a_whole_number_of_tokens(scale, tokens, caplog):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from conftest import native_twin

    model = make_model("llama")
    with caplog.at_level(logging.WARNING):
        patch_model(model, scale=scale, method="yarn")
    info = get_patch_info(model)
    assert info.scale == tokens / L0 and info.max_position_embeddings == model.config.max_position_embeddings == tokens
    assert f"using scale {tokens / L0!r} ({tokens} tokens)" in caplog.text
    assert "does not match the ratio implicitly set" not in caplog.text  # transformers' consistency check
    rope = {"rope_type": "yarn", "factor": tokens / L0, "original_max_position_embeddings": L0}
    expected, attention = ROPE_INIT_FUNCTIONS["yarn"](native_twin(make_model("llama"), rope, tokens).config)
    got, got_attention = model.model.rotary_emb.frequencies(tokens)
    torch.testing.assert_close(got.float(), expected, rtol=1e-6, atol=0)
    assert got_attention == pytest.approx(attention)


def test_a_whole_token_scale_is_kept_exactly(caplog):
    model = make_model("llama")
    with caplog.at_level(logging.WARNING, logger="hf_rope_ext.patching"):
        patch_model(model, scale=1.5, method="yarn")
        patch_model(model, max_length=3 * L0 + 1, method="yarn")
    assert get_patch_info(model).scale == (3 * L0 + 1) / L0 and caplog.text == ""


# -- numbers too large, names that cannot be used, a refused re-patch ---------------------------

HUGE = {
    "scale 1e308": ({"scale": 1e308}, "gives a context of inf tokens, beyond the 2147483647 positions"),
    "scale 1e300": ({"scale": 1e300}, "gives a context of 3.2e\\+301 tokens"),
    "int scale beyond float": ({"scale": 10**400}, "scale must be finite, got a number beyond float range"),
    "Fraction beyond float": ({"scale": __import__("fractions").Fraction(10**400, 3)}, "beyond float range"),
    "max_length beyond float": ({"max_length": 10**400}, "max_length gives a context of about 10\\^400 tokens"),
    "frequencies_scale 1e308": ({"scale": 4, "method": "self-extend-yarn", "frequencies_scale": 1e308},
                                "'self-extend-yarn' cannot use .*cannot convert float infinity"),
    "betas 1e308": ({"scale": 4, "method": "yarn", "beta_fast": 1e308, "beta_slow": 1e307},
                    "'yarn' .*cannot compute its frequencies .*math domain error"),
    "logn suffix twice": ({"scale": 4, "method": "yarn+logn+logn"}, "repeats the '\\+logn' suffix"),
    "logn suffix alone": ({"scale": 4, "method": "+logn"}, "names no method: '\\+logn' goes after one"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(HUGE))
def test_absurd_numbers_and_names_are_refused_with_one_line(case):
    kwargs, message = HUGE[case]
    model = make_model("llama", attn_implementation="sdpa")
    with pytest.raises(ValueError, match=message) as error:
        patch_model(model, **kwargs)
    assert "\n" not in str(error.value) and len(str(error.value)) < 500
    assert get_patch_info(model) is None


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("none", {}, "is reserved"),
        ("my:method", {}, "may only hold letters, digits"),
        ("a;b", {}, "may only hold letters, digits"),
        ("not-dynamic-halve", {}, "contains 'dynamic', which transformers reads as length-dependent"),
    ],
)
def test_method_names_that_cannot_be_used_are_refused(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        hf_rope_ext.register_method(name, lambda d, b, p, n=None: (default_inv_freq(d, b) / 2, 1.0), **kwargs)
    assert name not in hf_rope_ext.list_methods()


def test_register_method_of_the_methods_module_also_registers_with_transformers(tmp_path):
    """Both spellings register the rope type with transformers, so a checkpoint saved with the
    method loads through from_pretrained in the same process."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from hf_rope_ext import methods
    from hf_rope_ext.config_io import custom_rope_type
    from hf_rope_ext.hub import save_patched

    method = methods.register_method("quarter-test", lambda d, b, p, n=None: (default_inv_freq(d, b) / 4, 1.0))
    try:
        assert custom_rope_type(method) in ROPE_INIT_FUNCTIONS
        model = make_model("llama")
        patch_model(model, scale=4, method="quarter-test")
        folder = save_patched(model, tmp_path / "ckpt")
        reloaded = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        ids = random_ids(3 * L0)
        with torch.no_grad():
            torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=2e-5)
    finally:
        methods.unregister_method("quarter-test")
    assert custom_rope_type(method) not in ROPE_INIT_FUNCTIONS


@pytest.mark.parametrize(
    "kwargs",
    [{"scale": 0.5}, {"scale": "4"}, {"scale": 2, "method": "yran"}, {"scale": 2, "method": "yarn", "beta_fats": 3},
     {"scale": 2, "method": "yarn", "steps_per_doubling": 4}, {"scale": 1e308}],
)  # fmt: skip
def test_a_refused_repatch_keeps_the_previous_patch(kwargs):
    """patch_model re-patches from the original model; a new patch refused only then must not
    leave the model unpatched (the patched() context manager relies on it too)."""
    model = make_model("llama", attn_implementation="sdpa")
    patch_model(model, scale=2, method="self-extend-yarn")
    ids = random_ids(3 * L0)
    with torch.no_grad():
        before = model(ids).logits
    info = get_patch_info(model)
    with pytest.raises((ValueError, TypeError)):
        patch_model(model, **kwargs)
    assert get_patch_info(model) == info
    with pytest.raises((ValueError, TypeError)):
        with hf_rope_ext.patched(model, **kwargs):
            pass
    assert get_patch_info(model) == info
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


# -- text files and datasets: what the reader is given -------------------------------------------------


def test_byte_order_marks_folders_pipes_and_utf16(tmp_path):
    from hf_rope_ext.data import read_text

    bom = tmp_path / "bom.txt"
    bom.write_bytes("\ufeffOnce upon a time.".encode("utf-8"))
    assert read_text(bom) == "Once upon a time."
    gutenberg = tmp_path / "gutenberg.txt"
    gutenberg.write_bytes(("\ufeff*** START OF THE PROJECT GUTENBERG EBOOK X ***\nThe book.\n"
                           "*** END OF THE PROJECT GUTENBERG EBOOK X ***\nLicence.").encode("utf-8"))  # fmt: skip
    assert read_text(gutenberg) == "The book."
    (tmp_path / "folder").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "folder")
    for folder in ("folder", "link"):
        with pytest.raises(IsADirectoryError, match=f"{folder} is a folder, not a text file"):
            read_text(tmp_path / folder)
    with pytest.raises(FileNotFoundError, match="Text file not found"):
        read_text(tmp_path / "missing.txt")
    if os.path.exists("/dev/null"):
        with pytest.raises(ValueError, match="is not a regular file"):
            read_text("/dev/null")
    utf16 = tmp_path / "utf16.txt"
    utf16.write_text("A Windows text file. " * 20, encoding="utf-16")  # with its byte-order mark
    with pytest.raises(ValueError, match="is UTF-16 text .* iconv -f utf-16 -t utf-8"):
        read_text(utf16)
    # a named pipe, as `--text-files <(zcat book.gz)` gives: read once, like a file
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    writer = threading.Thread(target=lambda: pipe.write_text("Piped text."))
    writer.start()
    assert read_text(pipe) == "Piped text."
    writer.join()


def test_dataset_field_is_checked_when_opened_and_null_rows_are_named(checkpoint, monkeypatch, caplog):
    pytest.importorskip("datasets")
    from hf_rope_ext.data import iter_dataset_texts

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    folder = str(checkpoint / "dataset")
    # refused when called, before a caller loads its model, not at the first text
    with pytest.raises(ValueError, match=r"has no field 'body'; its fields are \['text'\]"):
        iter_dataset_texts(folder, split="train", text_field="body")
    with caplog.at_level(logging.WARNING, logger="hf_rope_ext.data"):
        texts = list(iter_dataset_texts(folder, split="train"))
    assert texts == ["w1 " * 50, "", "w2 " * 50]  # the null row stays in place, empty
    assert "row 1: field 'text' is null" in caplog.text


DEMO_STUBS = {
    "scripts/setup.sh": "echo setup >> \"$(dirname \"$0\")/../calls\"\n",
    ".venv/bin/hf-rope-ext": "#!/usr/bin/env bash\nprintf '%s\\n' \"$@\" >> \"$(dirname \"$0\")/../../calls\"\n",
}


@pytest.mark.skipif(os.name != "posix", reason="bash script")
def test_demo_script_takes_a_text_file_relative_to_where_it_is_called(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / ".venv" / "bin").mkdir(parents=True)
    (repo / "scripts" / "demo.sh").write_text((Path(__file__).parents[1] / "scripts" / "demo.sh").read_text())
    for name, text in DEMO_STUBS.items():  # set-up and CLI stubs that record their calls
        (repo / name).write_text(text)
        (repo / name).chmod(0o755)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "book.txt").write_text("text")
    result = subprocess.run(["bash", str(repo / "scripts" / "demo.sh"), "book.txt"], cwd=elsewhere,
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 0, result.stderr
    calls = (repo / "calls").read_text().splitlines()
    assert calls[0] == "setup" and calls[calls.index("--text-file") + 1] == str(elsewhere / "book.txt")
    (repo / "calls").unlink()
    result = subprocess.run(["bash", str(repo / "scripts" / "demo.sh"), "missing.txt"], cwd=elsewhere,
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 2 and f"text file not found: {elsewhere / 'missing.txt'}" in result.stderr
    assert not (repo / "calls").exists()  # refused before the set-up ran


def test_benchmark_refuses_a_decode_step_cache_inside_the_native_context(checkpoint, tmp_path, capsys):
    """Below L0 the attention-level methods change nothing: the ratio would time a no-op."""
    path = Path(__file__).parents[1] / "examples" / "benchmark_speed.py"
    spec = importlib.util.spec_from_file_location("benchmark_speed", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--model", str(checkpoint / "base"), "--output-dir", str(tmp_path / "out"), "--device", "cpu",
            "--skip-forward", "--skip-decode", "--decode-step-methods", "self-extend", "--decode-step-repeats", "1"]
    assert module.main([*argv, "--decode-step-tokens", "16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"error: --decode-step-tokens 16 is within the model's native context of {ORIGINAL_CONTEXT} "
                       f"tokens; give more than {ORIGINAL_CONTEXT}.")  # fmt: skip
    assert not (tmp_path / "out" / "speed.json").exists()
    # beyond it the benchmark runs: each patched step over a cache filled under that patch
    assert module.main([*argv, "--decode-step-tokens", str(2 * ORIGINAL_CONTEXT)]) == 0
    report = json.loads((tmp_path / "out" / "speed.json").read_text())
    assert set(report["decode_step"]) >= {"none", "self-extend"}


RECORDING_PYTHON = "#!/usr/bin/env bash\nprintf '%s|%s\\n' \"${PYTHONPATH:-}\" \"$*\" >> \"$(dirname \"$0\")/calls\"\n"


@pytest.mark.skipif(os.name != "posix", reason="bash script")
def test_gpu_attention_speed_refuses_a_folder_that_is_not_a_checkout(tmp_path):
    """The other checkout is only prepended to PYTHONPATH: a wrong folder timed this checkout twice."""
    script = Path(__file__).parents[1] / "scripts" / "gpu_attention_speed.sh"
    python = tmp_path / "python"
    python.write_text(RECORDING_PYTHON)
    python.chmod(0o755)
    env = {**os.environ, "PYTHON": str(python)}
    result = subprocess.run(["bash", str(script), "no-such-checkout"], cwd=tmp_path, env=env, capture_output=True,
                            text=True)  # fmt: skip
    assert result.returncode == 2 and not (tmp_path / "calls").exists()
    assert result.stderr.strip() == ("error: no-such-checkout is not a checkout of this project (no "
                                     "hf_rope_ext/__init__.py in it); pass the other checkout's root folder")
    (tmp_path / "other" / "hf_rope_ext").mkdir(parents=True)
    (tmp_path / "other" / "hf_rope_ext" / "__init__.py").write_text("")
    result = subprocess.run(["bash", str(script), "other"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    timed = [line for line in calls if "|scripts/time_remapped_attention.py " in line]
    assert len(timed) == 12  # 2 lengths x 3 methods x (other, this)
    # called from elsewhere: the other checkout by its absolute path, this one from the repo root
    assert {line.split("|")[0].split(":")[0] for line in timed} == {str(tmp_path / "other"), "."}


@pytest.mark.skipif(os.name != "posix", reason="bash script")
def test_check_runtimes_refuses_bad_arguments_before_the_download(tmp_path):
    import sys

    repo = Path(__file__).parents[1]
    base = tmp_path / "base-python"  # would download and build the runtime
    base.write_text(RECORDING_PYTHON)
    base.chmod(0o755)
    env = {**os.environ, "PROJECT_PYTHON": sys.executable, "RUNTIME_BASE_PYTHON": str(base),
           "HF_ROPE_EXT_CACHE": str(tmp_path / "cache")}  # fmt: skip
    result = subprocess.run(["bash", str(repo / "scripts" / "check_runtimes.sh"), "--cases", "bogus"], env=env,
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 2 and "unknown case(s) ['bogus']" in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "calls").exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["--tokens", "-5"], "--tokens must be at least 1, got -5"),
    (["--bucket-size", "0"], "--bucket-size must be at least 1, got 0"),
])  # fmt: skip
def test_check_runtimes_refuses_token_and_bucket_counts_below_one(argv, message, capsys, monkeypatch):
    """--tokens -5 made a workspace t-5 and saved ids[:-5]; --bucket-size 0 failed in range() at the end."""
    import sys

    path = Path(__file__).parents[1] / "scripts" / "check_runtimes.py"
    spec = importlib.util.spec_from_file_location("check_runtimes", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "check_runtimes", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as exit_info:
        module.main([*argv, "--check-args"])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_ctrl_c_while_the_commands_are_imported_is_one_line(monkeypatch, capsys):
    """Building the parser imports every subcommand (seconds): Ctrl-C there is one line, exit 130."""
    from hf_rope_ext import cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["methods"]) == 130
    assert capsys.readouterr().err == "interrupted\n"
