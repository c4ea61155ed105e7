"""method="auto": the choice is the candidate with the lowest loss, measured here independently
with transformers' own loss; the cache answers repeated questions and survives damage; bad input
is refused with one clear message."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re

import pytest
import torch
from conftest import ORIGINAL_CONTEXT, make_model, random_ids

from hf_rope_ext import get_method, get_patch_info, patch_model, register_method, unpatch_model
from hf_rope_ext.auto import choose_configuration

L0 = ORIGINAL_CONTEXT
# Candidates spelled out with their patch_model arguments, so the reference does not parse the
# strings the code under test parses.
CANDIDATES = {
    "yarn": ("yarn", {}),
    "ntk": ("ntk", {}),
    "self-extend:neighbor_window=8": ("self-extend", {"neighbor_window": 8}),
    "dual-chunk": ("dual-chunk", {}),
    "self-extend+logn": ("self-extend+logn", {}),
}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ROPE_EXT_CACHE", str(tmp_path / "cache"))


def _reference_losses(model, ids, scale):
    """Per candidate: (mean loss of all positions, mean loss beyond L0), from the model's own logits."""
    results = {}
    for text, (method, params) in CANDIDATES.items():
        patch_model(model, scale, method, **params)
        with torch.no_grad():
            output = model(input_ids=ids[None], labels=ids[None])
            losses = torch.nn.functional.cross_entropy(output.logits[0, :-1].double(), ids[1:], reduction="none")
        unpatch_model(model)
        results[text] = (float(output.loss), float(losses[L0 - 1 :].mean()))
    return results


@pytest.mark.parametrize("objective", ["all", "beyond"])
def test_the_choice_is_the_lowest_loss_measured_independently(objective):
    model = make_model("llama")
    ids = random_ids(3 * L0)[0]
    reference = _reference_losses(model, ids, 3)
    choice = choose_configuration(model, ids, 3, candidates=list(CANDIDATES), objective=objective, cache=False,
                                  progress=False)  # fmt: skip
    assert [score.configuration for score in choice.scores] == list(CANDIDATES)
    for score in choice.scores:
        every, beyond = reference[score.configuration]
        expected = every if objective == "all" else beyond
        assert score.mean_loss == pytest.approx(expected, rel=1e-5)
        assert score.perplexity == pytest.approx(math.exp(expected), rel=1e-5)
        assert score.perplexity_beyond == pytest.approx(math.exp(beyond), rel=1e-5)
    index = 0 if objective == "all" else 1
    best = min(reference, key=lambda text: reference[text][index])
    assert choice.chosen == best and (choice.method, choice.params) == CANDIDATES[best]
    assert choice.length == 3 * L0 and choice.scale == 3 and not choice.from_cache
    assert get_patch_info(model) is None  # measuring leaves the model as it was
    assert choice.chosen + " (chosen)" in choice.table()


def test_patch_model_auto_applies_the_choice_and_unpatches_bitwise():
    model = make_model("qwen2")
    ids = random_ids(2 * L0, seed=4)[0]
    probe = random_ids(2 * L0, seed=5)
    with torch.no_grad():
        before = model(probe).logits
    state = {key: value.clone() for key, value in model.state_dict().items()}
    config = model.config.to_dict()
    choice = choose_configuration(model, ids, 2, candidates=list(CANDIDATES), progress=False)
    patch_model(model, 2, "auto", calibration_ids=ids, candidates=list(CANDIDATES))
    info = get_patch_info(model)
    assert info.method == get_method(choice.method).name and info.scale == 2
    assert info.logn_attention == choice.method.endswith("+logn")
    # the patch is the chosen configuration: the same logits as patching it by name
    with torch.no_grad():
        auto_logits = model(probe).logits
    unpatch_model(model)
    patch_model(model, 2, choice.method, **choice.params)
    with torch.no_grad():
        assert torch.equal(model(probe).logits, auto_logits)
    unpatch_model(model)
    with torch.no_grad():
        assert torch.equal(model(probe).logits, before)
    assert all(torch.equal(state[key], value) for key, value in model.state_dict().items())
    assert model.config.to_dict() == config


def test_a_previous_patch_is_restored_after_measuring():
    model = make_model("llama")
    patch_model(model, 2, "yarn", beta_fast=16)
    previous = get_patch_info(model)
    choose_configuration(model, random_ids(2 * L0)[0], 2, candidates=["ntk", "dual-chunk"], cache=False, progress=False)
    assert get_patch_info(model) == previous


def _count_forwards(model):
    calls = []
    model.model.register_forward_hook(lambda *args: calls.append(1))
    return calls


def test_the_cache_answers_the_same_question_without_a_forward(tmp_path):
    model = make_model("llama")
    ids = random_ids(2 * L0)[0]
    first = choose_configuration(model, ids, 2, candidates=["yarn", "ntk"], progress=False)
    path = tmp_path / "cache" / "auto"
    (cache_file,) = path.iterdir()
    assert first.cache_path == str(cache_file) and not first.from_cache
    calls = _count_forwards(model)
    again = choose_configuration(model, ids, 2, candidates=["yarn", "ntk"], progress=False)
    assert calls == [] and again.from_cache
    assert again.scores == first.scores and again.chosen == first.chosen
    # another text, another candidate list or another length is another question
    choose_configuration(model, random_ids(2 * L0, seed=9)[0], 2, candidates=["yarn", "ntk"], progress=False)
    assert len(calls) == 2
    choose_configuration(model, ids, 2, candidates=["ntk", "yarn"], progress=False)
    assert len(calls) == 4
    choose_configuration(model, ids, 2, candidates=["yarn", "ntk"], length=L0 + 8, progress=False)
    assert len(calls) == 6
    assert len(json.loads(cache_file.read_text())["entries"]) == 4
    # another model (other weights) has its own file
    choose_configuration(make_model("llama", seed=3), ids, 2, candidates=["yarn"], progress=False)
    assert len(list(path.iterdir())) == 2


def test_a_damaged_cache_is_reported_and_measured_again(tmp_path, caplog):
    model = make_model("llama")
    ids = random_ids(2 * L0)[0]
    first = choose_configuration(model, ids, 2, candidates=["yarn", "ntk"], progress=False)
    cache_file = tmp_path / "cache" / "auto" / next((tmp_path / "cache" / "auto").iterdir()).name
    # an edited entry: the chosen configuration is not among its scores
    data = json.loads(cache_file.read_text())
    (entry,) = data["entries"].values()
    entry["chosen"] = "linear"
    cache_file.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="hf_rope_ext.auto"):
        again = choose_configuration(model, ids, 2, candidates=["yarn", "ntk"], progress=False)
    assert "damaged entry" in caplog.text and not again.from_cache and again.chosen == first.chosen
    # a file that is not JSON at all
    cache_file.write_text("{not json")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_rope_ext.auto"):
        again = choose_configuration(model, ids, 2, candidates=["yarn", "ntk"], progress=False)
    assert caplog.text.count("Ignoring the calibration cache") == 1
    assert [score.mean_loss for score in again.scores] == [score.mean_loss for score in first.scores]
    assert list(json.loads(cache_file.read_text())["entries"].values())[0]["chosen"] == first.chosen


@pytest.mark.parametrize(
    "edit",
    [
        lambda entry: entry["scores"][0].update(seconds=None),
        lambda entry: entry["scores"][1].update(perplexity="x"),
        lambda entry: entry["scores"][0].update(perplexity_beyond=None),
        lambda entry: entry["scores"][0].update(mean_loss=float("inf")),
        # perplexities that do not follow from the mean loss (exp of it, and the pooled mean of inside and beyond)
        lambda entry: entry["scores"][0].update(perplexity=1.0),
        lambda entry: entry["scores"][0].update(perplexity_beyond=1.0),
        lambda entry: entry["scores"][1].update(perplexity_inside=1.0),
        lambda entry: entry["scores"][0].update(perplexity=1.0, perplexity_beyond=1.0),
        # the candidate with the higher loss named as the choice
        lambda entry: entry.update(chosen=max(entry["scores"], key=lambda score: score["mean_loss"])["configuration"]),
    ],
)
def test_an_edited_cache_entry_is_measured_again(tmp_path, caplog, edit):
    model = make_model("llama")
    ids = random_ids(2 * L0)[0]
    first = choose_configuration(model, ids, 2, candidates=["yarn", "ntk"], progress=False)
    assert first.scores[0].mean_loss != first.scores[1].mean_loss
    (cache_file,) = (tmp_path / "cache" / "auto").iterdir()
    data = json.loads(cache_file.read_text())
    edit(next(iter(data["entries"].values())))
    cache_file.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="hf_rope_ext.auto"):
        again = choose_configuration(model, ids, 2, candidates=["yarn", "ntk"], progress=False)
    assert "damaged entry" in caplog.text and not again.from_cache
    assert again.chosen == first.chosen and again.scores[0].mean_loss == first.scores[0].mean_loss


@pytest.mark.parametrize(
    "content, message",
    [
        ("my thesis draft\n", "is not JSON"),
        ('{"my": "important data"}', "is not a calibration cache"),
        ('{"entries": {}, "my": "important data"}', "is not a calibration cache"),
        ('{"entries": ["x"]}', "is not a calibration cache"),
        (None, "is a folder"),
    ],
)
def test_a_cache_path_that_is_not_a_cache_is_refused_and_kept(tmp_path, content, message):
    """Only a missing file or a cache written here is overwritten: anything else is refused before a forward."""
    model = make_model("llama")
    path = tmp_path / "mine"
    if content is None:
        path.mkdir()
        (path / "notes.txt").write_text("kept")
    else:
        path.write_text(content)
    calls = _count_forwards(model)
    with pytest.raises(ValueError, match=f"cache_path {re.escape(str(path))} {message}.*give a new file name"):
        choose_configuration(model, random_ids(2 * L0)[0], 2, candidates=["yarn", "ntk"], progress=False,
                             cache_path=path)  # fmt: skip
    assert calls == []
    if content is None:
        assert [entry.name for entry in path.iterdir()] == ["notes.txt"]
    else:
        assert path.read_text() == content
    # a cache written here at that path is read and extended, as before
    path = tmp_path / "cache.json"
    choose_configuration(model, random_ids(2 * L0)[0], 2, candidates=["yarn"], progress=False, cache_path=path)
    again = choose_configuration(model, random_ids(2 * L0)[0], 2, candidates=["yarn"], progress=False, cache_path=path)
    assert again.from_cache


def test_a_cache_path_replaced_while_measuring_is_kept(tmp_path, caplog):
    """Another program writes its own file at cache_path during the forwards: it is not overwritten."""
    model = make_model("llama")
    path = tmp_path / "cache.json"
    model.model.register_forward_hook(lambda *args: path.write_text("written meanwhile") and None)
    with caplog.at_level(logging.WARNING, logger="hf_rope_ext.auto"):
        choice = choose_configuration(model, random_ids(2 * L0)[0], 2, candidates=["yarn"], progress=False,
                                      cache_path=path)  # fmt: skip
    assert choice.chosen == "yarn" and path.read_text() == "written meanwhile"
    assert "Not writing the calibration cache" in caplog.text


def test_auto_measures_an_accelerate_offloaded_model():
    """Offloaded weights sit on the meta device: the calibration forwards run where accelerate runs them."""
    from accelerate import cpu_offload

    model = make_model("llama")
    ids = random_ids(2 * L0)[0]
    reference = _reference_losses(model, ids, 2)  # before offloading
    cpu_offload(model, execution_device=torch.device("cpu"))
    choice = choose_configuration(model, ids, 2, candidates=list(CANDIDATES)[:2], cache=False, progress=False)
    assert [score.mean_loss for score in choice.scores] == pytest.approx(
        [reference[text][0] for text in list(CANDIDATES)[:2]], rel=1e-5)  # fmt: skip


def test_a_cache_that_cannot_be_written_keeps_the_measured_choice(tmp_path, caplog):
    model = make_model("llama")
    ids = random_ids(2 * L0)[0]
    (tmp_path / "a-file").write_text("x")
    with caplog.at_level(logging.WARNING, logger="hf_rope_ext.auto"):
        choice = choose_configuration(model, ids, 2, candidates=["yarn", "ntk"], progress=False,
                                      cache_path=tmp_path / "a-file" / "cache.json")  # fmt: skip
    assert "Could not write the calibration cache" in caplog.text
    assert choice.cache_path is None  # it names no file that would not hold it
    reference = _reference_losses(model, ids, 2)
    assert choice.chosen == min(["yarn", "ntk"], key=lambda text: reference[text][0])
    assert get_patch_info(model) is None


def test_cache_path_expands_the_home_folder(tmp_path, monkeypatch):
    """As HF_ROPE_EXT_CACHE is: "~/c.json" is a file in the home folder, not in a folder named "~"."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    model = make_model("llama")
    ids = random_ids(2 * L0)[0]
    choice = choose_configuration(model, ids, 2, candidates=["yarn", "ntk"], cache_path="~/c.json", progress=False)
    assert choice.cache_path == str(tmp_path / "home" / "c.json") and not (tmp_path / "~").exists()
    assert len(json.loads((tmp_path / "home" / "c.json").read_text())["entries"]) == 1
    again = choose_configuration(model, ids, 2, candidates=["yarn", "ntk"], cache_path="~/c.json", progress=False)
    assert again.from_cache and again.scores == choice.scores
    # a "~user" that names no user: one line naming cache_path, before any forward
    calls = _count_forwards(model)
    with pytest.raises(ValueError, match=r"^cache_path='~no-such-user-here/c\.json': its '~' cannot be expanded"):
        choose_configuration(model, ids, 2, candidates=["yarn"], cache_path="~no-such-user-here/c.json")
    assert calls == []
    monkeypatch.setenv("HF_ROPE_EXT_CACHE", "~no-such-user-here/cache")
    with pytest.raises(ValueError, match=r"^HF_ROPE_EXT_CACHE='~no-such-user-here/cache': its '~' cannot be expanded"):
        choose_configuration(model, ids, 2, candidates=["yarn"])


def test_cache_path_with_cache_off_is_refused_in_one_line(tmp_path):
    model = make_model("llama")
    calls = _count_forwards(model)
    for call in (
        lambda: choose_configuration(model, random_ids(2 * L0)[0], 2, cache=False, cache_path=tmp_path / "c.json"),
        lambda: patch_model(model, 2, "auto", calibration_ids=random_ids(2 * L0)[0], cache=False, cache_path="c.json"),
    ):
        with pytest.raises(ValueError, match=r"cache_path=.*c\.json' was given with cache=False") as error:
            call()
        assert "\n" not in str(error.value)
    assert calls == [] and get_patch_info(model) is None and not (tmp_path / "c.json").exists()


@pytest.mark.parametrize(
    ("kwargs", "tail"),
    [
        ({"calibration_text": "a long text"}, "not calibration_text."),  # close to calibration_length, not its type
        ({"target_length": 128}, "not target_length."),
        ({"cache_dir": "/tmp/x"}, "not cache_dir."),
        ({"cach": "yes"}, "not cach."),  # cache takes True or False
        ({"progres": False}, "not progres. Did you mean progress (not progres)?"),
        ({"beta_fast": 8, "cache_pth": "c.json"},
         "not beta_fast, cache_pth. Did you mean cache_path (not cache_pth)? Name a method to set its parameters."),
    ],
)  # fmt: skip
def test_a_misspelt_auto_option_is_hinted_only_when_close_and_of_its_type(kwargs, tail):
    """Following a hint must not lead to another error; a method's parameter keeps its advice."""
    model = make_model("llama")
    with pytest.raises(ValueError) as error:
        patch_model(model, 2, "auto", calibration_ids=random_ids(2 * L0)[0], **kwargs)
    assert str(error.value).endswith(", progress, " + tail)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"calibration_ids": None}, "needs calibration_ids="),
        ({"calibration_ids": "some text"}, "not text"),
        ({"calibration_ids": torch.rand(64)}, "integer token ids"),
        ({"calibration_ids": torch.zeros(2, 64, dtype=torch.long)}, "one sequence"),
        ({"calibration_ids": torch.full((64,), 500)}, "outside the model's vocabulary"),
        ({"calibration_ids": torch.full((64,), -1)}, "outside the model's vocabulary"),
        ({"calibration_ids": torch.zeros(L0, dtype=torch.long)}, "longer than the native context"),
        ({"calibration_length": L0}, "longer than the native context"),
        ({"calibration_length": 3 * L0, "calibration_ids": random_ids(3 * L0)[0]}, "beyond the target context"),
        ({"calibration_length": 3 * L0}, "has only 64 tokens"),
        ({"calibration_length": 2.5}, "whole number"),
        ({"candidates": ["linear", "auto"]}, "cannot include 'auto'"),
        ({"candidates": ["yarn", "no-such-method"]}, "Unknown RoPE method"),
        ({"candidates": ["yarn", "self-extend:neighbor_window=40"]}, "candidate 'self-extend:neighbor_window=40'"),
        ({"candidates": ["yarn", "yarn"]}, "more than once"),
        ({"candidates": "best"}, "'all' or 'servable'"),
        ({"candidates": []}, "non-empty"),
        ({"candidates": ["yarn:beta_fast"]}, "not key=value"),
        ({"objective": "inside"}, "'all' or 'beyond'"),
        ({"beta_fast": 32}, "not beta_fast"),
        ({"logn_attention": True}, "not taken"),
        ({"calibration_ids": []}, "has only 0 tokens"),  # an empty list is a float tensor: not "integer ids"
        ({"calibration_length": L0}, "got a calibration length of 32. Give a larger one"),
        ({"progress": "no"}, "progress must be True or False"),
        ({"calibration_lenght": L0 + 8}, "Did you mean calibration_length"),
    ],
)
def test_bad_auto_input_is_refused_with_the_cause(kwargs, message):
    model = make_model("llama")
    arguments = {"calibration_ids": random_ids(2 * L0)[0], "cache": False, **kwargs}
    calls = _count_forwards(model)
    with pytest.raises((ValueError, TypeError), match=message):
        patch_model(model, 2, "auto", **arguments)
    assert get_patch_info(model) is None and calls == []  # refused before any forward


def test_numpy_numbers_are_taken_as_plain_ones():
    import numpy as np

    model = make_model("llama")
    choice = choose_configuration(model, random_ids(2 * L0)[0].numpy(), np.float64(2), length=np.int64(L0 + 8),
                                  candidates=["ntk"], cache=False, progress=False)  # fmt: skip
    assert choice.length == L0 + 8 and type(choice.length) is int and choice.scale == 2


def test_auto_is_not_a_method_name_elsewhere():
    with pytest.raises(ValueError, match="not a method but a choice"):
        get_method("auto")
    with pytest.raises(ValueError, match="reserved"):
        register_method("auto", lambda *args: None)


def test_configuration_values_are_json_or_bare_words():
    from hf_rope_ext.auto import parse_configuration

    assert parse_configuration("self-extend:neighbor_window=2048,far_positions=by-parts") == (
        "self-extend", {"neighbor_window": 2048, "far_positions": "by-parts"}
    )
    assert parse_configuration('self-extend:far_positions="by-parts",group_size=null') == (
        "self-extend", {"far_positions": "by-parts", "group_size": None}
    )
    for bad in ("self-extend:neighbor_window=2 048", "self-extend:far_positions=by parts", "yarn:beta_fast=[1"):
        with pytest.raises(ValueError, match="is not a number, true/false, null or a word"):
            parse_configuration(bad)


def test_check_configurations_patches_nothing_and_names_the_bad_one():
    """check_configurations: every configuration is checked on the model, the first bad one is named,
    and the model is left as it was (no patch, same weights and rotary buffers)."""
    from hf_rope_ext.auto import check_configurations

    model = make_model("llama")
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    buffers = {name: tensor.clone() for name, tensor in model.named_buffers()}
    assert check_configurations(model, ["none", "yarn", "self-extend:neighbor_window=8"], 2) == [
        ("none", {}), ("yarn", {}), ("self-extend", {"neighbor_window": 8})]  # fmt: skip
    for texts, message in (
        (["yarn", f"self-extend:neighbor_window={L0}"], f"configuration 'self-extend:neighbor_window={L0}': "),
        (["yarn", "dual-chunk:chunk_size=0"], "configuration 'dual-chunk:chunk_size=0': "),
        (["yarn", "self-extend:group_size=\"x\""], "configuration 'self-extend:group_size=\"x\"': "),
        (["nope"], "Unknown RoPE method 'nope'"),
        ([], "give at least one configuration"),
        ("yarn", "give at least one configuration"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            check_configurations(model, texts, 2)
    with pytest.raises(ValueError, match=re.escape("configuration 'yarn': scale=0.5 is below 1")):
        check_configurations(model, ["none", "yarn"], 0.5)
    assert get_patch_info(model) is None
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert all(torch.equal(buffers[name], tensor) for name, tensor in model.named_buffers())


@pytest.mark.parametrize("target", [["--max-length", "3276799"], ["--scale", "102399.96875"], ["--scale", "2"]])
def test_the_printed_call_reproduces_the_measured_target(target, tmp_path, capsys):
    """`hf-rope-ext auto` prints the patch_model call of the best: evaluated, it must reach the
    context that was measured (3276799 tokens is scale 102399.96875 over L0 = 32, which six
    digits print as 102400: another context)."""
    from test_bad_input import _word_tokenizer

    from hf_rope_ext.cli import main as cli_main

    make_model().save_pretrained(tmp_path / "model")
    _word_tokenizer().save_pretrained(tmp_path / "model")
    (tmp_path / "book.txt").write_text(" ".join(f"w{i % 100}" for i in range(3 * L0)))
    assert cli_main(["auto", "--model", str(tmp_path / "model"), "--device", "cpu", "--text-files",
                     str(tmp_path / "book.txt"), *target, "--length", str(2 * L0), "--candidates", "yarn;ntk"]) == 0
    call = capsys.readouterr().out.strip().splitlines()[-1].strip()
    assert call.startswith("patch_model(model, ")
    model = make_model()
    eval(call, {"patch_model": patch_model, "model": model})
    expected = int(target[1]) if target[0] == "--max-length" else round(float(target[1]) * L0)
    assert get_patch_info(model).extended_context == expected
    if target == ["--scale", "2"]:
        assert "scale=2," in call  # a whole scale stays short


def test_a_shared_cache_path_does_not_answer_one_model_with_another(tmp_path):
    """With cache_path the file name no longer holds the model's fingerprint: the key must."""
    shared = tmp_path / "calibration.json"
    ids = random_ids(3 * L0)[0]
    first, second = make_model("llama", seed=0), make_model("llama", seed=2)
    choose_configuration(first, ids, 3, candidates=list(CANDIDATES), cache_path=shared, progress=False)
    got = choose_configuration(second, ids, 3, candidates=list(CANDIDATES), cache_path=shared, progress=False)
    reference = _reference_losses(second, ids, 3)
    assert not got.from_cache
    expected = [reference[text][0] for text in CANDIDATES]
    assert [score.mean_loss for score in got.scores] == pytest.approx(expected, rel=1e-5)
    assert got.chosen == min(reference, key=lambda text: reference[text][0])
    assert len(json.loads(shared.read_text())["entries"]) == 2


def test_the_cache_does_not_answer_bf16_with_the_fp32_numbers():
    """Weights exact in bf16 give the same fingerprint in fp32 and bf16; the numbers differ."""
    model = make_model("llama").to(torch.bfloat16).float()
    ids = random_ids(3 * L0)[0]
    candidates = ["yarn", "ntk"]
    in_fp32 = choose_configuration(model, ids, 3, candidates=candidates, progress=False)
    model.to(torch.bfloat16)
    in_bf16 = choose_configuration(model, ids, 3, candidates=candidates, progress=False)
    assert not in_bf16.from_cache
    for score in in_bf16.scores:  # the bf16 model's own losses, from its logits in float64
        method, params = CANDIDATES[score.configuration]
        patch_model(model, 3, method, **params)
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0, :-1].double()
        unpatch_model(model)
        assert score.mean_loss == pytest.approx(float(torch.nn.functional.cross_entropy(logits, ids[1:])), rel=1e-6)
    assert [score.mean_loss for score in in_bf16.scores] != [score.mean_loss for score in in_fp32.scores]
    model.float()
    assert choose_configuration(model, ids, 3, candidates=candidates, progress=False).from_cache  # fp32 still cached


def test_a_configuration_giving_a_key_twice_is_refused():
    from hf_rope_ext.auto import candidate_configurations, parse_configuration

    with pytest.raises(ValueError, match="gives beta_fast more than once; give it once"):
        parse_configuration("yarn:beta_fast=32,beta_fast=16")
    with pytest.raises(ValueError, match="gives beta_fast more than once"):
        candidate_configurations(["ntk", "yarn:beta_fast=32, beta_fast =16"], L0)


def _cli_model(tmp_path, patched: bool = False):
    """A tiny Llama folder with a tokenizer (saved patched yarn x4 with ``patched``), and a book."""
    from test_bad_input import _word_tokenizer

    from hf_rope_ext.hub import save_patched

    model = make_model()
    if patched:
        patch_model(model, 4, "yarn")
        save_patched(model, tmp_path / "model", tokenizer=_word_tokenizer())
    else:
        model.save_pretrained(tmp_path / "model")
        _word_tokenizer().save_pretrained(tmp_path / "model")
    (tmp_path / "book.txt").write_text(" ".join(f"w{i % 100}" for i in range(3 * L0)))
    return ["auto", "--model", str(tmp_path / "model"), "--device", "cpu", "--text-files", str(tmp_path / "book.txt")]


def test_ctrl_c_in_auto_is_one_line_and_caches_nothing(tmp_path, monkeypatch, capsys):
    import hf_rope_ext.auto as auto
    from hf_rope_ext.cli import main as cli_main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    argv = _cli_model(tmp_path)
    monkeypatch.setattr(auto, "choose_configuration", interrupted)
    assert cli_main([*argv, "--scale", "3", "--candidates", "yarn;ntk"]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == "interrupted: nothing was cached for this question."
    assert not (tmp_path / "cache").exists()


def test_auto_measures_a_patched_checkpoint_from_its_original_rope(tmp_path, capsys):
    """A save_patched folder: the candidates are measured on the base model's RoPE (patch_model
    re-patches from the original), not refused with a Python-only fix."""
    from hf_rope_ext.cli import main as cli_main

    argv = _cli_model(tmp_path, patched=True)
    assert cli_main([*argv, "--scale", "3", "--candidates", "yarn;ntk", "--json"]) == 0
    choice = json.loads(capsys.readouterr().out)
    book_ids = torch.tensor([1] + [3 + i % 100 for i in range(3 * L0 - 1)])  # BOS, then the words w0 w1 ...
    reference = _reference_losses(make_model(), book_ids, 3)
    assert [score["mean_loss"] for score in choice["scores"]] == pytest.approx(
        [reference["yarn"][0], reference["ntk"][0]], rel=1e-5)  # fmt: skip


def test_auto_checks_the_attention_backend_like_eval(tmp_path, capsys):
    import importlib.util

    from hf_rope_ext.cli import main as cli_main

    argv = _cli_model(tmp_path)
    assert cli_main([*argv, "--scale", "3", "--attn-implementation", "flash_attention_2"]) == 2
    err = capsys.readouterr().err
    expected = "needs the flash_attn package" if importlib.util.find_spec("flash_attn") is None else "runs on CUDA GPUs"
    assert f"error: --attn-implementation flash_attention_2 {expected}" in err


def _own_losses(model, ids, scale, candidates, dtype=None):
    """Per candidate (patched by name): the mean float64 cross-entropy of the model's own logits,
    in eval mode, under ``torch.autocast("cpu", dtype)`` when ``dtype`` is given."""
    results = []
    for text in candidates:
        method, params = CANDIDATES[text]
        patch_model(model, scale, method, **params)
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            logits = model(input_ids=ids[None]).logits[0, :-1].double()
        unpatch_model(model)
        results.append(float(torch.nn.functional.cross_entropy(logits, ids[1:])))
    return results


def test_a_model_in_training_mode_is_measured_in_eval_mode_and_keeps_its_mode(monkeypatch):
    """With attention dropout, training-mode losses are noise: the candidates are measured in eval
    mode (so the cache holds eval numbers), and every module gets its own mode back."""
    import hf_rope_ext.auto as auto

    model = make_model("llama", attention_dropout=0.5)
    ids = random_ids(3 * L0)[0]
    candidates = ["yarn", "ntk"]  # rotary-only: patch_model takes them in training mode
    reference = _own_losses(model.eval(), ids, 3, candidates)
    model.train()
    model.model.layers[0].eval()  # a mixed mode is put back as it was
    modes = [module.training for module in model.modules()]
    choice = choose_configuration(model, ids, 3, candidates=candidates, progress=False)
    assert [score.mean_loss for score in choice.scores] == pytest.approx(reference, rel=1e-6)
    assert [module.training for module in model.modules()] == modes
    model.eval()
    cached = choose_configuration(model, ids, 3, candidates=candidates, progress=False)
    assert cached.from_cache and [score.mean_loss for score in cached.scores] == pytest.approx(reference, rel=1e-6)
    model.train()

    def failing(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(auto, "_score", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        choose_configuration(model, ids, 3, candidates=candidates, cache=False, progress=False)
    assert all(module.training for module in model.modules())  # also after a failure


def test_check_configurations_puts_the_previous_patch_back():
    """Checking patches from the original model; the patch the model had comes back, also when a
    configuration is refused (its logits as before, bitwise)."""
    from hf_rope_ext.auto import check_configurations

    model = make_model("llama")
    patch_model(model, 2, "yarn", beta_fast=16)
    previous = get_patch_info(model)
    probe = random_ids(2 * L0, seed=3)
    with torch.no_grad():
        before = model(probe).logits
    check_configurations(model, ["ntk", "dual-chunk"], 4)
    assert get_patch_info(model) == previous
    with pytest.raises(ValueError, match="configuration 'yarn:beta_fast=-1'"):
        check_configurations(model, ["ntk", "yarn:beta_fast=-1"], 4)
    assert get_patch_info(model) == previous
    with torch.no_grad():
        assert torch.equal(model(probe).logits, before)


def test_measuring_a_patched_model_keeps_its_config_and_its_rotary_modules_mode(monkeypatch):
    """check_configurations and choose_configuration put the model's patch back as it was, also
    after a refusal or a failure: the same config object, with the changes made since patching
    (use_cache=False before gradient-checkpointed training), and its rotary module in training
    mode, as model.train() left it."""
    import hf_rope_ext.auto as auto
    from hf_rope_ext.auto import check_configurations

    model = make_model("llama")
    ids = random_ids(3 * L0)[0]
    probe = random_ids(2 * L0, seed=3)
    patch_model(model, 2, "self-extend")
    model.config.use_cache, model.config.pad_token_id = False, 0
    config, values = model.config, model.config.to_dict()
    with torch.no_grad():
        before = model(probe).logits
    model.train()

    def failing(*args, **kwargs):
        raise RuntimeError("out of memory")

    calls = [
        lambda: check_configurations(model, ["ntk", "dual-chunk"], 4),
        lambda: check_configurations(model, ["ntk", "yarn:beta_fast=-1"], 4),
        lambda: choose_configuration(model, ids, 3, candidates=["yarn", "ntk"], cache=False, progress=False),
        lambda: (monkeypatch.setattr(auto, "_score", failing),
                 choose_configuration(model, ids, 3, candidates=["yarn", "ntk"], cache=False, progress=False)),
    ]  # fmt: skip
    for call in calls:
        with contextlib.suppress(ValueError, RuntimeError):
            call()
        assert get_patch_info(model).method == "self-extend"
        assert all(module.training for module in model.modules())  # the patched rotary module is one of them
        assert model.config is config and config.to_dict() == values
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(probe).logits, before)


def test_the_cache_tells_autocast_from_full_precision():
    """The weights are fp32 either way; under autocast the forward runs in bf16, other numbers."""
    model = make_model("llama")
    ids = random_ids(3 * L0)[0]
    candidates = ["yarn", "ntk", "dual-chunk"]
    in_fp32 = choose_configuration(model, ids, 3, candidates=candidates, progress=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        in_bf16 = choose_configuration(model, ids, 3, candidates=candidates, progress=False)
    assert not in_bf16.from_cache
    reference = _own_losses(model, ids, 3, candidates, dtype=torch.bfloat16)
    assert [score.mean_loss for score in in_bf16.scores] == pytest.approx(reference, rel=1e-4)
    again = choose_configuration(model, ids, 3, candidates=candidates, progress=False)
    assert again.from_cache and again.scores == in_fp32.scores
    in_fp32_reference = _own_losses(model, ids, 3, candidates)
    assert [score.mean_loss for score in again.scores] == pytest.approx(in_fp32_reference, rel=1e-6)


def test_writers_sharing_a_cache_keep_each_others_entries(tmp_path, monkeypatch):
    """Two writers whose re-read and write interleave (held at a barrier between them, as two
    processes may be) must not lose an entry: the second waits for the first."""
    import threading

    import hf_rope_ext.auto as auto

    shared = tmp_path / "shared.json"
    barrier = threading.Barrier(2)
    write = auto.atomic_write_json

    def interleaved_write(path, data):
        try:
            barrier.wait(timeout=1.5)  # both writers here at once, unless one waits for the other
        except threading.BrokenBarrierError:
            pass
        write(path, data)

    monkeypatch.setattr(auto, "atomic_write_json", interleaved_write)
    errors = []

    def measure(seed, length):
        try:
            choose_configuration(make_model("llama", seed=seed), random_ids(3 * L0)[0], 3, length=length,
                                 candidates=["yarn"], cache_path=shared, progress=False)  # fmt: skip
        except Exception as error:  # noqa: BLE001 - reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=measure, args=(seed, L0 + 8 + seed)) for seed in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(json.loads(shared.read_text())["entries"]) == 2


def test_user_registered_methods_are_measured_each_time_and_checked_before_the_cache(caplog):
    """A method registered again under the same name with other code must not get the old numbers;
    one no longer registered is refused, not chosen from the cache."""
    from hf_rope_ext import unregister_method
    from hf_rope_ext.methods import default_inv_freq

    model = make_model("llama")
    ids = random_ids(3 * L0)[0]
    candidates = ["mine", "ntk"]
    def frequencies_divided_by(divisor):
        return lambda dim, base, params, length=None: (default_inv_freq(dim, base) / divisor, 1.0)

    for divisor in (4, 1 / 3):  # one name, two implementations
        register_method("mine", frequencies_divided_by(divisor))
        try:
            with caplog.at_level(logging.INFO, logger="hf_rope_ext.auto"):
                choice = choose_configuration(model, ids, 3, candidates=candidates, progress=False)
            CANDIDATES["mine"] = ("mine", {})
            try:
                reference = _own_losses(model, ids, 3, candidates)
            finally:
                del CANDIDATES["mine"]
            assert [score.mean_loss for score in choice.scores] == pytest.approx(reference, rel=1e-6)
        finally:
            unregister_method("mine")
    assert not choice.from_cache and choice.cache_path is None
    assert "Not caching this calibration: mine use a user-registered method" in caplog.text
    with pytest.raises(ValueError, match="candidate 'mine': Unknown RoPE method 'mine'"):
        choose_configuration(model, ids, 3, candidates=candidates, progress=False)
    assert get_patch_info(model) is None


def test_patch_model_auto_takes_cache_path(tmp_path):
    """README: a cache_path= shared by several models keeps their answers apart; patch_model takes it too."""
    model = make_model("llama")
    ids = random_ids(3 * L0)[0]
    shared = tmp_path / "calibration.json"
    patch_model(model, 3, "auto", calibration_ids=ids, candidates=["yarn", "ntk"], cache_path=shared, progress=False)
    (entry,) = json.loads(shared.read_text())["entries"].values()
    reference = _own_losses(make_model("llama"), ids, 3, ["yarn", "ntk"])
    assert [score["mean_loss"] for score in entry["scores"]] == pytest.approx(reference, rel=1e-6)
    assert get_patch_info(model).method == ["yarn", "ntk"][reference.index(min(reference))]
