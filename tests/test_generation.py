"""Generation with the KV cache past the original context equals full forward passes.

``generate`` plans: its frequencies are those of the prompt plus ``max_new_tokens`` from the
prefill on, so each step equals a full forward over the same tokens inside
``planned_length(model, prompt + max_new_tokens)``. Calling the class's ``generate`` directly
skips the per-instance wrapper: that is a decode loop without a plan, whose frequencies follow
the length (rounded to ``steps_per_doubling`` steps), so each step equals a plain full forward.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import inspect
import math
import weakref

import pytest
import torch
from conftest import ORIGINAL_CONTEXT, make_model, native_twin, on_a_thread, paused_on_a_thread, random_ids
from transformers import DynamicCache, GenerationConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from hf_rope_ext import patch_model, planned_length, unpatch_model
from hf_rope_ext.rotary import effective_length

L0 = ORIGINAL_CONTEXT
LONG_FACTOR = [1.0 + 0.5 * i for i in range(8)]
TOLERANCE = 2e-5


def _extra(method):
    return {"long_factor": LONG_FACTOR} if method == "longrope" else {}


def unplanned_generate(model, *args, **kwargs):
    """``generate`` without the patch's per-instance wrapper: no planned length is announced."""
    return type(model).generate(model, *args, **kwargs)


def recomputations(model) -> int:
    return model.model.rotary_emb.cache_guard.recomputations


def generation_vs_full_forward(model, prompt, new_tokens, attention_mask=None, planned=True, **generate_kwargs):
    """Largest difference between each generation step's logits and a full forward over the same tokens.

    ``planned``: the reference forwards use the frequencies of the planned length (prompt plus
    new tokens), as ``generate`` does; else those of their own length (a loop without a plan).
    """
    generate = model.generate if planned else (lambda *a, **k: unplanned_generate(model, *a, **k))
    out = generate(
        prompt,
        attention_mask=attention_mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        **generate_kwargs,
    )
    sequences = out.sequences
    prompt_length = prompt.shape[1]
    if attention_mask is None:
        attention_mask = torch.ones_like(prompt)
    full_mask = torch.cat([attention_mask, torch.ones(prompt.shape[0], new_tokens, dtype=attention_mask.dtype)], 1)
    plan = planned_length(model, prompt_length + new_tokens) if planned else contextlib.nullcontext()
    worst = 0.0
    with torch.no_grad(), plan:
        for step, step_logits in enumerate(out.logits):
            length = prompt_length + step
            position_ids = (full_mask[:, :length].cumsum(-1) - 1).clamp(min=0)
            full = model(sequences[:, :length], attention_mask=full_mask[:, :length], position_ids=position_ids).logits
            worst = max(worst, (full[:, -1] - step_logits).abs().max().item())
    return worst


STATIC = ["linear", "ntk", "yarn", "llama3"]
DYNAMIC = ["dynamic", "dynamic-yarn", "dynamic-linear", "longrope", "dynamic-yarn-dca"]


@pytest.mark.parametrize("method", STATIC + DYNAMIC + ["self-extend-dca", "self-extend-yarn"])
def test_generation_matches_full_forward(method):
    model = make_model("llama")
    patch_model(model, scale=4, method=method, **_extra(method))
    worst = generation_vs_full_forward(model, random_ids(L0 - 12), new_tokens=3 * L0)
    assert worst < TOLERANCE, f"{method}: generation differs from a full forward by {worst}"


@pytest.mark.parametrize("method", DYNAMIC)
def test_planned_frequencies_are_not_those_of_each_length(method):
    """The planned reference is not vacuous: without the plan the full forwards differ."""
    model = make_model("llama")
    patch_model(model, scale=4, method=method, **_extra(method))
    prompt = random_ids(L0 - 3)  # inside L0 on its own (longrope: short factors), beyond it with the plan
    out = model.generate(prompt, max_new_tokens=L0, min_new_tokens=L0, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        own_length = model(prompt).logits[:, -1]
    assert (own_length - out.logits[0]).abs().max().item() > 1e-3


@pytest.mark.parametrize("method", ["yarn", "dynamic-yarn"])
@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_generation_matches_full_forward_other_families(family, method):
    model = make_model(family)
    patch_model(model, scale=4, method=method)
    worst = generation_vs_full_forward(model, random_ids(L0 - 12), new_tokens=2 * L0)
    assert worst < TOLERANCE, f"{method}: generation differs from a full forward by {worst}"


@pytest.mark.parametrize("steps_per_doubling", [None, 1, 2, 4])
@pytest.mark.parametrize("method", ["dynamic", "dynamic-yarn"])
def test_unplanned_generation_matches_full_forward(method, steps_per_doubling):
    # No plan: the frequencies follow the length (every token with None, grid steps otherwise)
    # and the cached states are recomputed at each change.
    model = make_model("llama")
    patch_model(model, scale=4, method=method, steps_per_doubling=steps_per_doubling)
    assert generation_vs_full_forward(model, random_ids(L0 - 4), new_tokens=L0, planned=False) < TOLERANCE


@pytest.mark.parametrize("steps_per_doubling", [None, 1])
def test_unplanned_generation_past_the_settle_length_matches_full_forward(steps_per_doubling):
    """dynamic-yarn-dca without a plan: frequencies follow the length up to 2 x L0, where dual chunk
    attention starts; past it the frequencies no longer change, so the cache is not recomputed again."""
    model = make_model("llama", attn_implementation="sdpa")
    patch_model(model, scale=4, method="dynamic-yarn-dca", steps_per_doubling=steps_per_doubling)
    assert generation_vs_full_forward(model, random_ids(L0 - 4), new_tokens=3 * L0, planned=False) < TOLERANCE
    crossing = recomputations(model)
    assert crossing >= 1  # the frequencies did change on the way to 2 x L0
    assert generation_vs_full_forward(model, random_ids(2 * L0 + 5), new_tokens=L0, planned=False) < TOLERANCE
    assert recomputations(model) == crossing  # settled: nothing recomputed beyond 2 x L0


@pytest.mark.parametrize("method", ["self-extend-dca", "self-extend-yarn"])
def test_self_extend_defaults_keep_their_cache_up_to_the_settle_length(method):
    """Both are one state from 0 to 2 x L0 (trained frequencies; Self-Extend is plain attention for
    queries inside L0): a decode loop without a plan that starts inside L0 recomputes its cache
    once, at 2 x L0 where yarn x2 takes over, never at L0, and every step equals a full forward
    over the same tokens."""
    model = make_model("llama", attn_implementation="sdpa")
    patch_model(model, scale=4, method=method)
    assert generation_vs_full_forward(model, random_ids(L0 - 4), new_tokens=L0 + 4, planned=False) < TOLERANCE
    assert recomputations(model) == 0  # crossed L0, stayed below 2 x L0: nothing recomputed
    lengths = _decoder_calls(model, lambda: unplanned_generate(
        model, random_ids(L0 - 4), max_new_tokens=2 * L0, min_new_tokens=2 * L0, do_sample=False, pad_token_id=0))
    assert recomputations(model) == 1
    # the one recomputation runs the whole sequence once the length passes 2 x L0
    assert [n for n in lengths if n > 1] == [L0 - 4, 2 * L0 + 1]
    assert generation_vs_full_forward(model, random_ids(L0 - 4), new_tokens=2 * L0, planned=False) < TOLERANCE


def _decoder_calls(model, run) -> list[int]:
    """Number of tokens of every call of the first decoder layer while ``run()`` runs."""
    lengths = []
    hook = model.model.layers[0].register_forward_pre_hook(lambda module, args: lengths.append(args[0].shape[1]))
    try:
        run()
    finally:
        hook.remove()
    return lengths


@pytest.mark.parametrize("prompt_length", [L0 - 4, L0, L0 + 9])
@pytest.mark.parametrize("steps_per_doubling", [None, 1, 4])
def test_planned_generation_recomputes_nothing(prompt_length, steps_per_doubling):
    """The frequencies of prompt + max_new_tokens are chosen before the prefill: one prefill,
    then one token per call, whatever the frequency grid."""
    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic", steps_per_doubling=steps_per_doubling)
    prompt = random_ids(prompt_length)
    new_tokens = 4 * L0 - prompt_length
    lengths = _decoder_calls(model, lambda: model.generate(
        prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0))
    assert lengths == [prompt_length] + [1] * (new_tokens - 1)
    assert recomputations(model) == 0


@pytest.mark.parametrize("steps_per_doubling, expected", [(None, 3 * L0 - 1), (1, 2), (2, 4), (4, 8)])
def test_unplanned_generation_recomputes_once_per_frequency_step(steps_per_doubling, expected):
    """Without a plan, generating from L0 - 4 to 4 L0 tokens feeds lengths up to 4 L0 - 1 and
    crosses the grid L0 * 2 ** (k / n) at k = 0 .. 2n - 1 (n = None: every length past L0).

    Each crossing re-runs the decoder over the whole sequence once (a call of more than one
    token); every other step runs one token.
    """
    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic", steps_per_doubling=steps_per_doubling)
    prompt = random_ids(L0 - 4)
    new_tokens = 3 * L0 + 4
    lengths = _decoder_calls(model, lambda: unplanned_generate(
        model, prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0))
    assert lengths[0] == L0 - 4  # the prefill
    assert lengths[1:].count(1) == new_tokens - 1 - expected
    assert sum(length > 1 for length in lengths[1:]) == expected
    assert recomputations(model) == expected


def test_continuing_the_cache_recomputes_only_past_the_planned_length():
    """A second generate call on the same cache keeps the first call's frequencies while the
    sequence fits them and recomputes once, to its own planned length, when it goes past."""
    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic-yarn")
    prompt = random_ids(L0 - 2)
    first_new, second_new = L0, L0
    kwargs = dict(do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    first = model.generate(prompt, max_new_tokens=first_new, min_new_tokens=first_new, **kwargs)
    first_plan = prompt.shape[1] + first_new
    cache = first.past_key_values
    assert recomputations(model) == 0
    lengths = []
    hook = model.model.layers[0].register_forward_pre_hook(lambda module, args: lengths.append(args[0].shape[1]))
    second = model.generate(first.sequences, past_key_values=cache, max_new_tokens=second_new,
                            min_new_tokens=second_new, **kwargs)
    hook.remove()
    second_plan = first_plan + second_new
    assert recomputations(model) == 1
    # Calls of the second generate: the uncached last token (length first_plan, fits), one token
    # at a time until the first step past first_plan, which re-runs the whole sequence.
    assert lengths[0] == 1 and lengths[1] == first_plan + 1 and lengths[2:] == [1] * (second_new - 2)
    sequences = second.sequences
    with torch.no_grad():
        for step, step_logits in enumerate(second.logits):
            length = first_plan + step
            plan = first_plan if length <= first_plan else second_plan
            with planned_length(model, plan):
                full = model(sequences[:, :length]).logits[:, -1]
            assert (full - step_logits).abs().max().item() < TOLERANCE, (step, length)


def test_transformers_dynamic_does_not_match_but_ours_does():
    """transformers issue 25104: its dynamic type keeps stale rotations in the cache."""
    model = make_model("llama")
    theirs = native_twin(model, {"rope_type": "dynamic", "factor": 4.0}, L0)
    prompt = random_ids(L0 - 4)
    their_error = generation_vs_full_forward(theirs, prompt, new_tokens=2 * L0, planned=False)
    patch_model(model, scale=4, method="dynamic", steps_per_doubling=None)  # the very same frequencies as theirs
    our_error = generation_vs_full_forward(model, prompt, new_tokens=2 * L0, planned=False)
    assert their_error > 1e-2
    assert our_error < TOLERANCE


@pytest.mark.parametrize("planned", [True, False])
def test_left_padded_batch(family, planned):
    model = make_model(family)
    patch_model(model, scale=4, method="dynamic-yarn", steps_per_doubling=None if planned else 1)
    prompt = random_ids(L0 - 8, batch=3)
    mask = torch.ones_like(prompt)
    mask[0, :11] = 0  # left padding of different widths
    mask[2, :5] = 0
    prompt = prompt.masked_fill(mask == 0, 0)
    worst = generation_vs_full_forward(model, prompt, new_tokens=2 * L0, attention_mask=mask, planned=planned)
    assert worst < TOLERANCE


def test_static_method_left_padding_matches_unpadded_rows():
    model = make_model("llama")
    patch_model(model, scale=4, method="yarn")
    short = random_ids(20, seed=3)
    long = random_ids(30, seed=4)
    batch = torch.cat([torch.cat([torch.zeros(1, 10, dtype=torch.long), short], 1), long])
    mask = (batch != 0).long()
    mask[1] = 1
    kwargs = dict(max_new_tokens=50, do_sample=False, pad_token_id=0)
    together = model.generate(batch, attention_mask=mask, **kwargs)
    alone = model.generate(short, attention_mask=torch.ones_like(short), **kwargs)
    assert torch.equal(together[0, 10:], alone[0])


@pytest.mark.parametrize("method, planned", [("dynamic-yarn", True), ("dynamic-yarn", False), ("yarn", True)])
def test_sliding_window_cache(method, planned):
    # Mistral with a sliding window shorter than the sequence: sliding cache layers drop old tokens.
    model = make_model("mistral", sliding_window=24)
    patch_model(model, scale=4, method=method, **({} if planned else {"steps_per_doubling": 1}))
    assert generation_vs_full_forward(model, random_ids(L0 - 10), new_tokens=2 * L0, planned=planned) < TOLERANCE


@pytest.mark.parametrize("method", ["dynamic-yarn", "self-extend-yarn", "self-extend-dca"])
def test_static_cache_of_a_sliding_window_model(method):
    """generate's 4-D masks for a sliding-window static cache are as wide as the window: once it is
    full, the new token is the last column (this failed with an IndexError, inside L0 too)."""
    model = make_model("mistral", attn_implementation="sdpa", sliding_window=24)
    patch_model(model, scale=4, method=method)
    for new_tokens in (8, 2 * L0):  # inside the native context, and across it
        worst = generation_vs_full_forward(model, random_ids(L0 - 12), new_tokens=new_tokens,
                                           cache_implementation="static")  # fmt: skip
        assert worst < TOLERANCE


@pytest.mark.parametrize("family, overrides", [("qwen2", {}), ("qwen3", {}),
                                               ("qwen2", {"use_sliding_window": True, "max_window_layers": 1})])
@pytest.mark.parametrize("method", ["self-extend-yarn", "dual-chunk"])
def test_static_cache_of_a_model_whose_masks_generate_builds(family, overrides, method):
    """For a model with layer_types (Qwen2, Qwen3) and a static cache, generate builds the masks before
    the forward (a dict by layer type; sdpa's is None for the prefill): the forward must keep the
    cache geometry that mask creation recorded. The static cache is longer than the prompt, so the
    keys are not "the cached tokens followed by this call's" (this was off by one slot, errors ~0.3)."""
    unpatched = make_model(family, attn_implementation="sdpa", **overrides)
    model = make_model(family, attn_implementation="sdpa", **overrides)
    prompt = random_ids(2 * L0 - 4)
    # the reference: transformers' own static-cache generation equals its full forward
    assert generation_vs_full_forward(unpatched, prompt, new_tokens=5, cache_implementation="static",
                                      planned=False) < TOLERANCE
    patch_model(model, scale=8, method=method)
    assert generation_vs_full_forward(model, prompt, new_tokens=5, cache_implementation="static") < TOLERANCE


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_two_static_caches_decoded_side_by_side_with_masks_built_before_their_forwards(family):
    """Masks built by the caller (a dict by layer type) for two static caches of one length, both
    before either forward: the geometry the mask function recorded for the second overwrote the
    first's (same shapes), and the first sequence's decode steps read the other cache's query slot
    (errors ~0.08). The geometry of a call with such masks is read from its own cache. Each step
    is checked against a full forward of that sequence, and the unpatched model's loop against its
    own full forward (the reference loop is sound)."""
    from transformers import StaticCache
    from transformers.masking_utils import create_causal_mask

    def worst_step(model, planned_context):
        first, second = random_ids(2 * L0 - 10), random_ids(2 * L0 - 10, seed=5)

        def masks(cache, position):
            return {"full_attention": create_causal_mask(
                config=model.config, inputs_embeds=torch.zeros(1, 1, model.config.hidden_size),
                attention_mask=torch.ones(1, position + 1, dtype=torch.long), cache=cache,
                position_ids=torch.tensor([[position]]))}  # fmt: skip

        with torch.no_grad(), planned_context(model):
            expected = model(first).logits
            caches = [StaticCache(config=model.config, max_cache_len=2 * L0) for _ in range(2)]
            start_first, start_second = L0 + 4, L0 - 6
            model(input_ids=first[:, :start_first], cache=caches[0], use_cache=True)
            model(input_ids=second[:, :start_second], cache=caches[1], use_cache=True)
            worst = 0.0
            for step in range(first.shape[1] - start_first):
                here, there = start_first + step, start_second + step
                built = masks(caches[0], here), masks(caches[1], there)
                logits = model(input_ids=first[:, here:here + 1], position_ids=torch.tensor([[here]]), cache=caches[0],
                               use_cache=True, attention_mask=built[0]).logits  # fmt: skip
                model(input_ids=second[:, there:there + 1], position_ids=torch.tensor([[there]]), cache=caches[1],
                      use_cache=True, attention_mask=built[1])  # fmt: skip
                worst = max(worst, (logits[0, -1] - expected[0, here]).abs().max().item())
        return worst

    unpatched, model = make_model(family), make_model(family)
    assert worst_step(unpatched, lambda _: contextlib.nullcontext()) < TOLERANCE
    patch_model(model, scale=4)
    assert worst_step(model, lambda each: planned_length(each, 2 * L0 - 10)) < TOLERANCE


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_forward_run_by_a_hook_keeps_the_outer_forwards_cache_geometry(family):
    """A hook that runs the model inside a prefill into a static cache (longer than its tokens):
    the inner forward cleared the outer one's cache geometry, whose remaining layers then read
    keys one slot off (errors ~0.5). Checked against the same prefill without the hook and a
    forward without cache (the unpatched model's prefill is its own reference)."""
    from transformers import StaticCache

    ids, other = random_ids(L0 + 8), random_ids(L0 + 18, seed=2)
    for patched_model in (False, True):
        model = make_model(family, attn_implementation="sdpa")
        if patched_model:
            model = patch_model(model, scale=4)
        calls = {"left": 0}

        def run_once(*_):
            if calls["left"]:
                calls["left"] -= 1
                model(other)

        model.model.layers[0].register_forward_hook(run_once)
        context = planned_length(model, ids.shape[1]) if patched_model else contextlib.nullcontext()
        with torch.no_grad(), context:
            expected = model(ids).logits
            calls["left"] = 1
            hooked = model(ids, cache=StaticCache(config=model.config, max_cache_len=2 * L0), use_cache=True).logits
        assert calls["left"] == 0
        torch.testing.assert_close(hooked, expected, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("planned", [True, False])
def test_static_cache(planned):
    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic-yarn", steps_per_doubling=None if planned else 1)
    worst = generation_vs_full_forward(model, random_ids(L0 - 10), new_tokens=2 * L0, cache_implementation="static",
                                       planned=planned)
    assert worst < TOLERANCE


@pytest.mark.parametrize("planned", [True, False])
def test_beam_search_scores_match_full_forwards(planned):
    # Beam search reorders the cache; without a plan the recomputed states must follow the reordered rows.
    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic-yarn", steps_per_doubling=None if planned else 1)
    prompt = random_ids(L0 - 6)
    new_tokens = 2 * L0
    generate = model.generate if planned else (lambda *a, **k: unplanned_generate(model, *a, **k))
    out = generate(
        prompt,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        num_beams=3,
        do_sample=False,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
        length_penalty=0.0,
    )
    best = out.sequences[0]
    # The winning beam's score is the sum of its tokens' log-probabilities, each computed by a
    # full forward over the tokens before it (the frequencies depend on that prefix's length).
    total = 0.0
    plan = planned_length(model, prompt.shape[1] + new_tokens) if planned else contextlib.nullcontext()
    with torch.no_grad(), plan:
        for step in range(new_tokens):
            length = prompt.shape[1] + step
            logits = model(best[None, :length]).logits[0, -1]
            total += torch.log_softmax(logits.float(), -1)[best[length]].item()
    assert total == pytest.approx(out.sequences_scores[0].item(), abs=1e-3)
    assert recomputations(model) == (0 if planned else 2)  # unplanned: the grid steps 2 L0 and 4 L0 (n = 1)


def test_manual_cache_loop_and_foreign_cache():
    model = make_model("qwen2")
    ids = random_ids(3 * L0)
    with torch.no_grad():
        full = model(ids).logits  # unpatched
        stale = model(ids[:, : L0 + 5], use_cache=True).past_key_values  # filled before patching
        patch_model(model, scale=4, method="dynamic")
        patched_full = model(ids).logits
        assert not torch.allclose(patched_full, full, atol=1e-3)
        cache = DynamicCache(config=model.config)
        for start, end in [(0, 20), (20, 45), (45, 46), (46, 3 * L0)]:
            chunk = model(ids[:, start:end], past_key_values=cache, use_cache=True).logits
            # Each chunk's logits are those of a full forward over everything up to its end.
            reference = model(ids[:, :end]).logits[:, start:end]
            torch.testing.assert_close(chunk, reference, rtol=0, atol=TOLERANCE)
        torch.testing.assert_close(chunk, patched_full[:, 46:], rtol=0, atol=TOLERANCE)
        with pytest.raises(ValueError, match="fresh cache"):
            model(ids[:, L0 + 5 : L0 + 6], past_key_values=stale, use_cache=True)
    unpatch_model(model)


def test_length_dependent_frequencies_follow_the_longest_row_of_the_batch():
    """The documented rule: one set of frequencies per forward, those of max(position_ids) + 1 over
    the whole batch (as transformers' dynamic). A left-padded short row batched with a longer one
    gets the longer row's frequencies, so its logits depend on the batch."""
    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic-yarn", steps_per_doubling=None)  # frequencies of the exact length
    short, long = random_ids(40, seed=3), random_ids(60, seed=4)
    batch = torch.cat([torch.cat([torch.zeros(1, 20, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(batch)
    mask[0, :20] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate computes them: the short row ends at 39
    # dynamic-yarn at 60 tokens is yarn at scale 60 / L0: transformers' own yarn, on the short row alone.
    longest = native_twin(model, {"rope_type": "yarn", "factor": 60 / L0, "original_max_position_embeddings": L0}, L0)
    with torch.no_grad():
        together = model(batch, attention_mask=mask, position_ids=position_ids).logits[0, 20:]
        alone = model(short).logits[0]
        expected = longest(short).logits[0]
    torch.testing.assert_close(together, expected, rtol=0, atol=2e-5)
    assert (together - alone).abs().max() > 1e-3  # alone, the row gets the frequencies of 40 tokens


def test_manual_decode_loop_with_planned_length_recomputes_nothing():
    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic")
    ids = random_ids(3 * L0)
    with torch.no_grad(), planned_length(model, 3 * L0):
        reference = model(ids).logits
        cache = DynamicCache(config=model.config)
        chunks = [model(ids[:, start:end], past_key_values=cache, use_cache=True).logits
                  for start, end in [(0, L0 - 3)] + [(i, i + 1) for i in range(L0 - 3, 3 * L0)]]
    torch.testing.assert_close(torch.cat(chunks, 1), reference, rtol=0, atol=TOLERANCE)
    assert recomputations(model) == 0


def _cache_keywords():
    """The cache keywords the installed transformers' forward declares or still accepts:
    `past_key_values` up to 5.23; `cache` from 5.24, where the old name is renamed inside the forward."""
    declared = inspect.signature(make_model("llama").model.forward).parameters
    return ["past_key_values"] + (["cache"] if "cache" in declared else [])


@pytest.mark.parametrize("keyword", _cache_keywords())
def test_cache_passed_under_each_keyword_stays_exact(keyword):
    """The hooks find the cache under whichever name the caller used (transformers 5.24 renamed
    `past_key_values` to `cache`); a loop without a plan then recomputes it past L0."""
    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic")
    ids = random_ids(2 * L0)
    with torch.no_grad():
        reference = [model(ids[:, :end]).logits[:, -1] for end in range(L0 - 2, 2 * L0 + 1)]
        cache = DynamicCache(config=model.config)
        steps = [model(ids[:, : L0 - 2], use_cache=True, **{keyword: cache}).logits[:, -1]]
        steps += [model(ids[:, end - 1 : end], use_cache=True, **{keyword: cache}).logits[:, -1]
                  for end in range(L0 - 1, 2 * L0 + 1)]
    torch.testing.assert_close(torch.stack(steps), torch.stack(reference), rtol=0, atol=TOLERANCE)
    assert cache.get_seq_length() == 2 * L0
    assert recomputations(model) == L0  # each of the L0 tokens past L0 changes the frequencies of an unplanned loop


def test_forward_without_a_cache_logs_no_deprecation(monkeypatch):
    """Reading the output's cache must not touch a renamed field: from transformers 5.24 an
    output's `.past_key_values` is a property that logs a deprecation (and a user sees it)."""
    from transformers.utils import generic

    logged = []
    monkeypatch.setattr(generic.logger, "warning_once", lambda message, *args, **kwargs: logged.append(message))
    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic")
    with torch.no_grad():
        model(random_ids(2 * L0), use_cache=False)
        model(random_ids(2 * L0), use_cache=True)
    assert [message for message in logged if "deprecated" in message] == []


@pytest.mark.parametrize("length", [L0 - 3, L0, L0 + 1, 45, 3 * L0 + 5])
def test_single_forward_uses_the_exact_length_like_transformers_dynamic(length):
    """By default a forward without a cache over L tokens uses the frequencies of L itself:
    transformers' own `dynamic` (which follows the exact length) gives the same cos/sin and logits."""
    model = make_model("llama")
    theirs = native_twin(model, {"rope_type": "dynamic", "factor": 4.0}, L0)
    patch_model(model, scale=4, method="dynamic")
    ids = random_ids(length)
    positions = torch.arange(length)[None]
    probe = torch.zeros(1)
    with torch.no_grad():
        our_cos, our_sin = model.model.rotary_emb(probe, positions)
        their_cos, their_sin = theirs.model.rotary_emb(probe, positions)
        torch.testing.assert_close(our_cos, their_cos, rtol=0, atol=1e-5)
        torch.testing.assert_close(our_sin, their_sin, rtol=0, atol=1e-5)
        torch.testing.assert_close(model(ids).logits, theirs(ids).logits, rtol=0, atol=1e-4)


def test_steps_per_doubling_still_rounds_a_single_forward():
    """With an explicit grid, L0 + 1 tokens get the frequencies of 2 L0 (transformers' `dynamic`
    function at seq_len 2 L0), not those of L0 + 1."""
    model = make_model("llama")
    theirs = native_twin(model, {"rope_type": "dynamic", "factor": 4.0}, L0)
    patch_model(model, scale=4, method="dynamic", steps_per_doubling=1)
    ours, _ = model.model.rotary_emb.frequencies(L0 + 1)
    at_double, _ = ROPE_INIT_FUNCTIONS["dynamic"](theirs.config, seq_len=2 * L0)
    at_length, _ = ROPE_INIT_FUNCTIONS["dynamic"](theirs.config, seq_len=L0 + 1)
    torch.testing.assert_close(ours.float(), at_double.float(), rtol=1e-6, atol=0)
    assert not torch.allclose(ours.float(), at_length.float(), rtol=1e-4, atol=0)


def test_planned_length_refuses_bad_input():
    model = make_model("llama")
    with pytest.raises(ValueError, match="not patched"):
        with planned_length(model, 100):
            pass
    patch_model(model, scale=4, method="dynamic")
    for bad in (0, -5, 2.5, "100", True, torch.tensor(100)):
        with pytest.raises(ValueError, match="positive (integer )?number of tokens"):
            with planned_length(model, bad):
                pass
    with pytest.raises(ValueError, match="gives a context of about 10\\^400 tokens"):
        with planned_length(model, 10**400):
            pass
    import numpy as np

    ids = random_ids(L0 + 8)
    with torch.no_grad():
        with planned_length(model, 3 * L0):
            expected = model(ids).logits
        for same in (np.int64(3 * L0), float(3 * L0)):  # the lengths patch_model's max_length takes
            with planned_length(model, same):
                assert torch.equal(model(ids).logits, expected)


def test_generate_wrapper_is_per_instance_and_removed_by_unpatch():
    model = make_model("llama")
    other = make_model("llama")
    class_generate = type(model).generate
    patch_model(model, scale=4, method="dynamic-yarn")
    assert "generate" in vars(model) and "generate" not in vars(other)
    assert type(model).generate is class_generate
    twin = copy.deepcopy(model)  # the copy's wrapper plans for the copy, not for the original
    assert twin.generate.__self__ is twin
    prompt = random_ids(L0 + 5)
    twin.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert recomputations(twin) == 0 and recomputations(model) == 0
    unpatch_model(model)
    assert "generate" not in vars(model) and not any(name.startswith("_hf_rope_ext") for name in vars(model))


@pytest.mark.parametrize("steps_per_doubling", [1, 2, 3, 4, 8])
def test_frequency_grid_takes_the_smallest_step_and_maps_steps_to_themselves(steps_per_doubling):
    """The length a sequence's frequencies come from is the smallest ceil(L0 * 2 ** (k / n)) >= L
    (a brute-force search here), and a grid length maps to itself: the cache guard hands the
    rotary module lengths it already rounded."""
    grid = sorted({math.ceil(L0 * 2 ** (k / steps_per_doubling)) for k in range(1, 8 * steps_per_doubling)})
    for length in range(L0 + 1, 8 * L0):
        expected = min(step for step in grid if step >= length)
        rounded = effective_length(length, L0, steps_per_doubling)
        assert rounded == expected, (length, rounded, expected)
        assert effective_length(rounded, L0, steps_per_doubling) == rounded
    assert effective_length(L0, L0, steps_per_doubling) is None


def test_generate_without_a_length_keeps_an_enclosing_plan():
    # No max_new_tokens nor max_length: the wrapper plans transformers' default (prompt + 20),
    # shorter than the enclosing plan of 4 L0, which must hold.
    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic")
    prompt = random_ids(L0 - 12)
    with planned_length(model, 4 * L0):
        out = model.generate(prompt, min_new_tokens=20, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
        with torch.no_grad():
            full = model(out.sequences[:, :-1]).logits[:, L0 - 13 :]
    assert out.sequences.shape[1] == L0 + 8
    torch.testing.assert_close(torch.stack(out.logits, 1), full, rtol=0, atol=TOLERANCE)
    with torch.no_grad():  # and the plan matters here: inside L0 on their own, these are the original frequencies
        assert not torch.allclose(model(out.sequences[:, :-1]).logits[:, L0 - 13 :], full, atol=1e-3)


# Lengths as transformers resolves them (generation/utils.py `_prepare_generated_length`): the
# call's keyword, else a generation_config passed to it, else the model's; without max_new_tokens
# nor max_length anywhere, 20 new tokens capped at config.max_position_embeddings, which is the
# extended context (4 L0) during the call.
LENGTH_CASES = {  # name: (prompt, what the model's generation_config sets, the call's keywords, final length)
    "default": (L0 + 18, {}, {}, L0 + 38),
    "default capped at the extended context": (4 * L0 - 8, {}, {}, 4 * L0),
    "model's max_length": (L0 + 18, {"max_length": L0 + 40}, {}, L0 + 40),
    "model's max_new_tokens": (L0 + 18, {"max_new_tokens": 15}, {}, L0 + 33),
    "call's None over the model's max_new_tokens": (L0 + 18, {"max_new_tokens": 15}, {"max_new_tokens": None}, L0 + 38),
    "generation_config argument's max_length": (L0 + 18, {}, {"generation_config": {"max_length": L0 + 30}}, L0 + 30),
    # the argument's unset fields are the model's, and max_new_tokens wins over max_length
    "model's max_new_tokens with the argument's max_length": (
        L0 + 18, {"max_new_tokens": 15}, {"generation_config": {"max_length": L0 + 30}}, L0 + 33),
}


@pytest.mark.parametrize("case", list(LENGTH_CASES))
def test_generate_plans_the_length_transformers_resolves(case):
    """A call without max_new_tokens is planned as transformers reads it: one prefill, then one
    token per step, and the same tokens and logits as the explicit max_new_tokens call and as full
    forwards over the generated tokens."""
    prompt_length, model_settings, call, final = LENGTH_CASES[case]
    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic-yarn")
    for name, value in model_settings.items():
        setattr(model.generation_config, name, value)
    settings = dict(do_sample=False, pad_token_id=0, min_new_tokens=final - prompt_length,
                    output_logits=True, return_dict_in_generate=True)
    if "generation_config" in call:
        call = {"generation_config": GenerationConfig(**call["generation_config"], **settings)}
    else:
        call = {**call, **settings}
    prompt = random_ids(prompt_length)
    outputs = []
    lengths = _decoder_calls(model, lambda: outputs.append(model.generate(prompt, **call)))
    out = outputs[0]
    assert out.sequences.shape[1] == final  # transformers' own resolution, as the case says
    assert lengths == [prompt_length] + [1] * (final - prompt_length - 1)
    assert recomputations(model) == 0

    explicit = model.generate(prompt, max_new_tokens=final - prompt_length, **settings)
    assert torch.equal(out.sequences, explicit.sequences)
    with torch.no_grad(), planned_length(model, final):
        full = model(out.sequences[:, :-1]).logits[:, prompt_length - 1 :]
    torch.testing.assert_close(torch.stack(out.logits, 1), full, rtol=0, atol=TOLERANCE)


def test_generate_from_inputs_embeds_without_a_length_plans_transformers_default():
    # From embeddings alone the generated ids start empty: transformers' default max_length is 20
    # new ids (capped at the context), so the sequence is the prompt plus 20.
    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic-yarn")
    prompt = random_ids(L0 + 8)
    with torch.no_grad():
        embeddings = model.get_input_embeddings()(prompt)
    outputs = []
    lengths = _decoder_calls(model, lambda: outputs.append(model.generate(
        inputs_embeds=embeddings, min_new_tokens=20, do_sample=False, pad_token_id=0,
        output_logits=True, return_dict_in_generate=True)))
    out = outputs[0]
    assert out.sequences.shape[1] == 20
    assert lengths == [L0 + 8] + [1] * 19
    assert recomputations(model) == 0
    sequence = torch.cat([prompt, out.sequences], 1)
    with torch.no_grad(), planned_length(model, L0 + 28):
        full = model(sequence[:, :-1]).logits[:, L0 + 7 :]
    torch.testing.assert_close(torch.stack(out.logits, 1), full, rtol=0, atol=TOLERANCE)


# generate(self, inputs=None, generation_config=None, ...) binds both positionally, and with
# inputs=None takes the prompt from input_ids (generation/utils.py `_prepare_model_inputs`).
GENERATE_CALLS = {  # name: (the GenerationConfig's length, (args, kwargs) from prompt and config, new tokens)
    "generation_config positional": ({"max_new_tokens": 60}, lambda prompt, config: ((prompt, config), {}), 60),
    "inputs None positional, input_ids keyword": (
        {"max_new_tokens": 60}, lambda prompt, config: ((None, config), {"input_ids": prompt}), 60),
    # what a wrapper forwarding its own inputs=inputs passes; without a length: transformers' 20 new tokens
    "inputs=None keyword, input_ids keyword": (
        {}, lambda prompt, config: ((), {"inputs": None, "input_ids": prompt, "generation_config": config}), 20),
}


@pytest.mark.parametrize("case", list(GENERATE_CALLS))
def test_generate_plans_its_arguments_as_generate_binds_them(case):
    """The plan reads the prompt and the generation_config where generate reads them: one prefill,
    then one token per step, and the logits of full forwards planned for the length reached."""
    length, call, new_tokens = GENERATE_CALLS[case]
    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic-yarn")
    prompt = random_ids(L0 + 18)
    config = GenerationConfig(**length, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)  # fmt: skip
    args, kwargs = call(prompt, config)
    outputs = []
    lengths = _decoder_calls(model, lambda: outputs.append(model.generate(*args, **kwargs)))
    out = outputs[0]
    final = L0 + 18 + new_tokens
    assert out.sequences.shape[1] == final  # transformers' own reading of the call
    assert lengths == [L0 + 18] + [1] * (new_tokens - 1)
    assert recomputations(model) == 0
    with torch.no_grad(), planned_length(model, final):
        full = model(out.sequences[:, :-1]).logits[:, L0 + 17 :]
    torch.testing.assert_close(torch.stack(out.logits, 1), full, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("source", ["call with max_new_tokens", "model's generation_config, default length"])
def test_prompt_lookup_plans_the_candidates_it_verifies_past_max_length(source):
    """Prompt lookup (transformers' PromptLookupCandidateGenerator) drafts up to prompt_lookup_num_tokens
    tokens from any length up to max_length - 2 and verifies them in one forward: up to
    max_length - 2 + prompt_lookup_num_tokens tokens. The plan covers that, so the call recomputes
    nothing and its logits are those of full forwards planned for it."""
    lookup = 5
    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic-yarn")
    # prompts whose drafts go past max_length whether the plan covers them or not
    if source == "call with max_new_tokens":
        prompt = random_ids(L0 + 18)
        kwargs, max_length = {"prompt_lookup_num_tokens": lookup, "max_new_tokens": 40}, L0 + 58
    else:
        prompt = random_ids(L0 + 18, seed=5)
        model.generation_config.prompt_lookup_num_tokens = lookup
        kwargs, max_length = {}, L0 + 38  # transformers' default: 20 new tokens
    reach = []  # the furthest position of each forward
    hook = model.model.layers[0].register_forward_pre_hook(
        lambda module, args, k: reach.append(int(k["position_ids"].max()) + 1), with_kwargs=True)
    try:
        out = model.generate(prompt, **kwargs, do_sample=False, pad_token_id=0, eos_token_id=None,
                             output_logits=True, return_dict_in_generate=True)  # fmt: skip
    finally:
        hook.remove()
    plan = max_length - 2 + lookup
    assert out.sequences.shape[1] == max_length
    assert recomputations(model) == 0
    assert max_length < max(reach) <= plan  # the drafts did go past max_length
    with torch.no_grad(), planned_length(model, plan):
        full = model(out.sequences[:, :-1]).logits[:, L0 + 17 :]
    torch.testing.assert_close(torch.stack(out.logits, 1), full, rtol=0, atol=TOLERANCE)


class _Passthrough:
    """A subclass's generate that takes everything on to transformers' (wrappers often do)."""

    def generate(self, *args, **kwargs):
        return super().generate(*args, **kwargs)


class _DefaultLength:
    """A subclass's generate with a length of its own by default."""

    def generate(self, input_ids, max_new_tokens=24, **kwargs):
        return super().generate(input_ids, max_new_tokens=max_new_tokens, **kwargs)


class _NamedPrompt:
    """A subclass's generate that names its prompt otherwise."""

    def generate(self, prompt=None, **kwargs):
        return super().generate(prompt, **kwargs)


class _DefaultConfig:
    """A subclass's generate with a generation config of its own by default."""

    def generate(self, inputs=None, generation_config=GenerationConfig(max_new_tokens=24), **kwargs):
        return super().generate(inputs, generation_config, **kwargs)


class _OwnPrompt:
    """A subclass's generate whose first argument is not the prompt (features it builds one from)."""

    def generate(self, features, **kwargs):
        return super().generate(random_ids(L0 + 18), **kwargs)


@pytest.mark.parametrize("own_generate, length, new_tokens, by_name", [
    (_Passthrough, {"max_new_tokens": 24}, 24, None), (_Passthrough, {}, 20, None), (_DefaultLength, {}, 24, None),
    (_NamedPrompt, {"max_new_tokens": 24}, 24, "prompt"), (_DefaultConfig, {}, 24, None),
])
def test_a_subclass_generate_is_planned_as_it_calls_transformers(own_generate, length, new_tokens, by_name):
    """A model class whose own generate has another signature: the plan reads the prompt it hands
    on (by position or by its own name) and the length or config it sets by default, so the call
    recomputes nothing."""
    base = make_model("llama")
    model = type("Subclass", (own_generate, type(base)), {})(base.config)
    model.load_state_dict(base.state_dict())
    model.eval()
    patch_model(model, scale=4, method="dynamic-yarn")
    prompt = random_ids(L0 + 18)
    args, prompt_kwargs = ((), {by_name: prompt}) if by_name else ((prompt,), {})
    out = model.generate(*args, **prompt_kwargs, **length, do_sample=False, pad_token_id=0, eos_token_id=None,
                         output_logits=True, return_dict_in_generate=True)  # fmt: skip
    final = L0 + 18 + new_tokens
    assert out.sequences.shape[1] == final
    assert recomputations(model) == 0
    with torch.no_grad(), planned_length(model, final):
        full = model(out.sequences[:, :-1]).logits[:, L0 + 17 :]
    torch.testing.assert_close(torch.stack(out.logits, 1), full, rtol=0, atol=TOLERANCE)


def test_a_first_argument_that_is_not_token_ids_is_not_read_as_the_prompt():
    """Float features handed to a subclass's generate are no prompt: the plan does not count them
    (a prompt of 400 tokens would plan past the extended context, with other frequencies); the
    call then goes unplanned, each step equal to a full forward up to it."""
    base = make_model("llama")
    model = type("Subclass", (_OwnPrompt, type(base)), {})(base.config)
    model.load_state_dict(base.state_dict())
    model.eval()
    patch_model(model, scale=4, method="self-extend-yarn")
    out = model.generate(torch.randn(1, 400), max_new_tokens=10, do_sample=False, pad_token_id=0,
                         eos_token_id=None, output_logits=True, return_dict_in_generate=True)  # fmt: skip
    assert out.sequences.shape[1] == L0 + 28
    with torch.no_grad():
        full = model(out.sequences[:, :-1]).logits[:, L0 + 17 :]
    torch.testing.assert_close(torch.stack(out.logits, 1), full, rtol=0, atol=TOLERANCE)


def test_early_exit_with_prompt_lookup_recomputes_nothing():
    """assistant_early_exit's drafter runs the model's own generate with the call's prompt lookup,
    whose drafts reach past max_length as prompt lookup's do."""
    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic-yarn")
    prompt = random_ids(L0 + 18)
    out = model.generate(prompt, max_new_tokens=40, prompt_lookup_num_tokens=5, assistant_early_exit=1,
                         do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
    assert out.shape[1] == L0 + 58
    assert recomputations(model) == 0


# -- the cache operations the prefix recompute follows -----------------------------------------
#
# Without a plan and with steps_per_doubling=None, a call that continues a cache past the
# length its frequencies were chosen for re-runs the logged prefix with those of its own end,
# so its logits are those of a plain full forward over everything up to that end.


def _recompute(model):
    return model.model.rotary_emb.cache_guard


def _continue(model, cache, sequence, start, mask=None):
    """Logits of ``sequence[:, start:]`` run on ``cache`` (which holds ``sequence[:, :start]``)."""
    kwargs = {}
    if mask is not None:
        kwargs = dict(attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)[:, start:])
    return model(sequence[:, start:], past_key_values=cache, use_cache=True, **kwargs).logits


def _full(model, sequence, start, mask=None, plan=None):
    """Logits of ``sequence[:, start:]`` from one forward over the whole sequence."""
    kwargs = {} if mask is None else dict(attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    with planned_length(model, plan) if plan else contextlib.nullcontext():
        return model(sequence, **kwargs).logits[:, start:]


@pytest.mark.parametrize("new_tokens, recomputed", [(2, 0), (20, 1)])
def test_crop_then_continue_matches_full_forward(new_tokens, recomputed):
    """``cache.crop(-k)`` (assisted decoding) drops tokens; others take their place. Within the
    frequencies the cache was filled with they stay; past them the recomputed prefix is the cropped one."""
    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic")
    ids, other = random_ids(L0 + 10, seed=5), random_ids(new_tokens, seed=6)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)  # the frequencies of L0 + 10
        cache.crop(-6)
        assert cache.get_seq_length() == L0 + 4
        sequence = torch.cat([ids[:, : L0 + 4], other], 1)
        chunk = _continue(model, cache, sequence, L0 + 4)
        reference = _full(model, sequence, L0 + 4, plan=None if recomputed else L0 + 10)
    assert recomputations(model) == recomputed
    torch.testing.assert_close(chunk, reference, rtol=0, atol=TOLERANCE)


def test_assisted_generation_crops_the_cache_and_matches_full_forwards():
    # The main model verifies several drafted tokens per call and crops the rejected ones. Only
    # planned: without a plan the drafts, not the kept tokens, decide when the frequencies change.
    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic-yarn")
    assistant = make_model("llama", seed=7)
    worst = generation_vs_full_forward(model, random_ids(L0 - 6), new_tokens=2 * L0, assistant_model=assistant)
    assert worst < TOLERANCE


@pytest.mark.parametrize("method", ["self-extend-yarn", "self-extend", "dual-chunk"])
@pytest.mark.parametrize("speculation", ["assistant model", "prompt lookup"])
def test_speculative_decoding_with_attention_level_methods_matches_full_forwards(method, speculation):
    """Drafted tokens are verified several at a time and the rejected ones cropped from the cache:
    the positions that follow a cropped cache are not a jump (the check for those must not fire)."""
    model = make_model("llama", attn_implementation="sdpa")
    patch_model(model, scale=4, method=method)
    kwargs = ({"assistant_model": make_model("llama", seed=7, attn_implementation="sdpa")}
              if speculation == "assistant model" else {"prompt_lookup_num_tokens": 3})  # fmt: skip
    prompt = torch.cat([random_ids(L0 // 2)] * 2, dim=1)  # repeated: prompt lookup finds drafts in it
    assert generation_vs_full_forward(model, prompt, new_tokens=2 * L0, **kwargs) < TOLERANCE


BATCH_OPERATIONS = [
    ("batch_select_indices", lambda: torch.tensor([2, 0]), [2, 0]),
    ("batch_repeat_interleave", lambda: 2, [0, 0, 1, 1, 2, 2]),
    ("reorder_cache", lambda: torch.tensor([1, 1, 0]), [1, 1, 0]),
]


@pytest.mark.parametrize("past_the_frequencies", [False, True])
@pytest.mark.parametrize("operation, argument, rows", BATCH_OPERATIONS, ids=[op[0] for op in BATCH_OPERATIONS])
def test_batch_operation_then_continue_matches_full_forward(operation, argument, rows, past_the_frequencies):
    """After a batch operation on the cache, its rows continue as their own sequences; past the
    frequencies the cache was filled with, the recomputed prefix follows the moved rows (padding included)."""
    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic-yarn")
    prefill = L0 - 6
    ids = random_ids(prefill, batch=3, seed=8)
    mask = torch.ones(3, prefill, dtype=torch.long)
    mask[0, :5] = 0  # left padding: rows differ in positions and padding
    ids = ids.masked_fill(mask == 0, 0)
    new_tokens = 12 if past_the_frequencies else 4
    sequence = torch.cat([ids[rows], random_ids(new_tokens, batch=len(rows), seed=9)], 1)
    full_mask = torch.cat([mask[rows], torch.ones(len(rows), new_tokens, dtype=torch.long)], 1)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), past_key_values=cache,
              use_cache=True)
        getattr(cache, operation)(argument())
        chunk = _continue(model, cache, sequence, prefill, full_mask)
        # Row 0 is shorter: the frequencies follow the longest row, as in one forward over the batch.
        reference = _full(model, sequence, prefill, full_mask)
    assert recomputations(model) == int(past_the_frequencies)
    torch.testing.assert_close(chunk, reference, rtol=0, atol=TOLERANCE)


def test_mixed_input_ids_and_inputs_embeds_match_full_forward_and_keep_ids():
    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic")
    ids = random_ids(3 * L0)
    embeddings = model.get_input_embeddings()(ids).detach()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        for start, end, kind in [(0, 20, "embeds"), (20, 30, "ids"), (30, L0 + 5, "embeds"), (L0 + 5, L0 + 6, "ids"),
                                 (L0 + 6, 2 * L0, "ids"), (2 * L0, 3 * L0, "embeds")]:
            inputs = dict(inputs_embeds=embeddings[:, start:end]) if kind == "embeds" else dict(input_ids=ids[:, start:end])
            chunk = model(**inputs, past_key_values=cache, use_cache=True).logits
            torch.testing.assert_close(chunk, model(ids[:, :end]).logits[:, start:end], rtol=0, atol=TOLERANCE)
    assert recomputations(model) == 4  # every chunk past L0
    # The log keeps ids where ids were given: one run per change of kind.
    assert [segment.dim() for segment in _recompute(model).logs.get(cache).segments] == [3, 2, 3, 2, 3]


@pytest.mark.parametrize("planned", [True, False])
def test_generate_from_inputs_embeds_matches_full_forwards(planned):
    # The prefill passes embeddings, the decoding steps ids: recomputations join both.
    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic-yarn", steps_per_doubling=None if planned else 1)
    prompt = random_ids(L0 - 6)
    new_tokens = 2 * L0
    with torch.no_grad():
        embeddings = model.get_input_embeddings()(prompt)
    generate = model.generate if planned else (lambda **k: unplanned_generate(model, **k))
    out = generate(inputs_embeds=embeddings, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    sequence = torch.cat([prompt, out.sequences], 1)
    assert out.sequences.shape[1] == new_tokens
    with torch.no_grad(), planned_length(model, prompt.shape[1] + new_tokens) if planned else contextlib.nullcontext():
        for step, step_logits in enumerate(out.logits):
            full = model(sequence[:, : prompt.shape[1] + step]).logits[:, -1]
            torch.testing.assert_close(step_logits, full, rtol=0, atol=TOLERANCE)
    assert recomputations(model) == (0 if planned else 2)
    assert [segment.dim() for segment in _recompute(model).logs.get(out.past_key_values).segments] == [3, 2]


def test_a_copied_cache_continues_on_its_own():
    """``copy.deepcopy(cache)`` (reusing a prefilled prompt): the copy gets the log; a batch
    operation on the copy leaves the original and its log alone."""
    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic")
    prefill = L0 - 4
    ids = random_ids(L0 + 8, batch=2, seed=10)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :prefill], past_key_values=cache, use_cache=True)
        duplicate = copy.deepcopy(cache)
        duplicate.batch_select_indices(torch.tensor([1]))
        other = torch.cat([ids[1:, :prefill], random_ids(12, seed=11)], 1)
        torch.testing.assert_close(_continue(model, duplicate, other, prefill), _full(model, other, prefill),
                                   rtol=0, atol=TOLERANCE)
        torch.testing.assert_close(_continue(model, cache, ids, prefill), _full(model, ids, prefill),
                                   rtol=0, atol=TOLERANCE)
    assert recomputations(model) == 2


def test_logs_are_held_by_the_hooks_and_freed_with_the_cache():
    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic")
    logs = _recompute(model).logs
    ids = random_ids(L0 + 3)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids, past_key_values=cache, use_cache=True)
        assert cache in logs and not any(name.startswith("_hf_rope_ext") for name in vars(cache))
        del cache
        assert len(logs) == 0
        out = model(ids)  # a cache the model makes, freed with its output
        assert len(logs) == 1
        del out
        assert len(logs) == 0
        kept = DynamicCache(config=model.config)
        model(ids, past_key_values=kept, use_cache=True)
    # A kept cache does not keep the model alive.
    alive = weakref.ref(model)
    del model, logs
    gc.collect()
    assert alive() is None
    kept.reorder_cache(torch.tensor([0]))  # its operations still work without the hooks


def test_a_forward_inside_a_forward_ends_with_its_own_call():
    """A hook that runs the model inside the model's forward: each forward keeps its own
    frequencies, cut and log (the outer one recomputes its cache)."""
    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic")
    ids, inner_ids = random_ids(L0 + 6, seed=12), random_ids(L0 + 9, seed=13)
    inner = []

    def nested(module, args):
        if not inner:
            inner.append(None)  # the nested forward runs this hook too
            inner[0] = model(inner_ids).logits

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, : L0 - 4], past_key_values=cache, use_cache=True)
        hook = model.model.layers[0].register_forward_pre_hook(nested)
        try:
            outer = _continue(model, cache, ids, L0 - 4)
        finally:
            hook.remove()
        assert model.model.rotary_emb.frequency_length is None
        torch.testing.assert_close(outer, _full(model, ids, L0 - 4), rtol=0, atol=TOLERANCE)
        torch.testing.assert_close(inner[0], model(inner_ids).logits, rtol=0, atol=TOLERANCE)
        # and the outer cache was recorded: it continues exactly
        more = torch.cat([ids, random_ids(3, seed=14)], 1)
        torch.testing.assert_close(_continue(model, cache, more, L0 + 6), _full(model, more, L0 + 6),
                                   rtol=0, atol=TOLERANCE)


def test_a_failed_forward_leaves_the_cache_and_the_hooks_usable():
    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic")
    ids = random_ids(L0 + 2)
    cache = DynamicCache(config=model.config)

    def fail(module, args):
        raise KeyError("boom")

    with torch.no_grad():
        model(ids[:, :20], past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="attention_mask"):  # raised by the pre-hook itself
            model(ids[:, 20:22], past_key_values=cache, use_cache=True, attention_mask=torch.ones(1, 1, 1))
        hook = model.model.layers[0].register_forward_pre_hook(fail)
        with pytest.raises(KeyError):  # raised inside the forward, before anything is written
            model(ids[:, 20:22], past_key_values=cache, use_cache=True)
        hook.remove()
        assert model.model.rotary_emb.frequency_length is None
        torch.testing.assert_close(_continue(model, cache, ids, 20), _full(model, ids, 20), rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("method", ["self-extend-yarn", "dynamic-yarn"])
def test_generate_without_a_length_reads_a_prompt_beyond_the_original_context(method):
    """Length-dependent patches keep config.max_position_embeddings at L0 (config_io), which generate
    reads as the model's length: a call without max_new_tokens on a longer prompt was refused by
    transformers. During generate it is the extended context, as a static patch writes it: the call
    gives transformers' 20 default tokens capped there, planned as that length: the same tokens as the
    explicit call, and the config is back to L0 afterwards, also after a failed call."""
    model = make_model("llama", attn_implementation="sdpa")
    prompt = random_ids(L0 + L0 // 2)
    with pytest.raises(ValueError, match="max_length"):  # what the unpatched model does
        model.generate(prompt, do_sample=False, pad_token_id=0)
    patch_model(model, scale=2, method=method)
    assert model.config.max_position_embeddings == L0
    default = model.generate(prompt, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert default.shape[1] == 2 * L0  # min(prompt + 20, 2 L0): the cap of the extended context
    explicit = model.generate(prompt, max_new_tokens=2 * L0 - prompt.shape[1], do_sample=False, pad_token_id=0,
                              eos_token_id=None)  # fmt: skip
    assert torch.equal(default, explicit)
    assert model.config.max_position_embeddings == L0
    with pytest.raises(ValueError):
        model.generate(prompt, max_new_tokens=-1)
    assert model.config.max_position_embeddings == L0


def test_a_cache_filled_under_a_length_dependent_patch_can_be_saved_with_torch_save(tmp_path):
    """torch.save of a prefilled cache (to reuse a prompt later): the row logs the patch keeps for
    the cache are this process's and are left out; the loaded cache is a plain one, whose rows
    reorder as the class's own method does, and the patch refuses to continue it (it cannot tell
    which frequencies its states carry) instead of reading them wrongly."""
    import io

    model = make_model("llama", attn_implementation="sdpa")
    patch_model(model, scale=4, method="dynamic-yarn")
    out = model.generate(random_ids(L0 - 4, batch=2), max_new_tokens=12, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True)  # fmt: skip
    buffer = io.BytesIO()
    torch.save(out.past_key_values, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.get_seq_length() == out.past_key_values.get_seq_length() == L0 + 7  # the last token is not cached
    keys = loaded.layers[0].keys.clone()
    loaded.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(loaded.layers[0].keys, keys[[1, 0]])
    with pytest.raises(ValueError, match="not written under this model's current 'dynamic-yarn' patch"):
        model(out.sequences[:, -1:], past_key_values=loaded)


@pytest.mark.parametrize("where", ["passed to generate", "the model's own"])
@pytest.mark.parametrize("method", ["dynamic", "self-extend-yarn"])
def test_a_max_length_in_a_generation_config_is_planned_as_the_keyword(method, where):
    """``max_length`` in a GenerationConfig (passed, or the model's from generation_config.json) is the
    same request as ``max_length=`` in the call: transformers generates as many tokens, and the patch
    plans the cache for them: no recomputation, and every step's logits those of one full forward with
    the frequencies of the planned length."""
    model = make_model("llama", attn_implementation="sdpa")
    patch_model(model, scale=4, method=method)
    prompt = random_ids(L0 - 4 if method == "dynamic" else 2 * L0 - 14)
    total = prompt.shape[1] + 40
    lengths = dict(max_length=total, min_length=total)
    options = dict(do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    if where == "passed to generate":
        from transformers import GenerationConfig

        out = model.generate(prompt, generation_config=GenerationConfig(**lengths, **options))
    else:
        for name, value in lengths.items():
            setattr(model.generation_config, name, value)
        out = model.generate(prompt, **options)
    assert out.sequences.shape[1] == total
    assert recomputations(model) == 0
    steps = torch.stack(out.logits, dim=1)
    with torch.no_grad():
        full = _full(model, out.sequences[:, :-1], prompt.shape[1] - 1, plan=total)
    torch.testing.assert_close(steps, full, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("first", [None, "dynamic"], ids=["unpatched", "dynamic"])
@pytest.mark.parametrize("second", [
    "yarn", "linear",
    "self-extend", "dual-chunk", "self-extend-yarn", "dynamic-yarn",
])  # fmt: skip
def test_a_cache_filled_without_the_current_patch_is_refused(first, second):
    """A cache's states carry the rotations of the patch they were written under: one filled before
    patching or under another patch is refused by every patch (ValueError naming the fix), before
    anything is written to it; a fresh cache under the new patch equals the full forward."""
    model = make_model("llama", attn_implementation="sdpa")
    if first:
        patch_model(model, scale=4, method=first)
    prompt = random_ids(L0 + 8)
    stale = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0,
                           return_dict_in_generate=True).past_key_values  # fmt: skip
    held = stale.get_seq_length()
    patch_model(model, scale=4, method=second)
    with torch.no_grad(), pytest.raises(ValueError, match=r"not written under this model's current .*fresh cache"):
        model(random_ids(1), past_key_values=stale)
    assert stale.get_seq_length() == held
    with torch.no_grad():
        fresh = _continue(model, DynamicCache(config=model.config), prompt, 0)
        torch.testing.assert_close(fresh, _full(model, prompt, 0), rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("method", ["yarn", "self-extend", "dual-chunk", "self-extend-yarn"])
def test_caches_filled_under_the_current_patch_continue_after_copy_crop_and_beam_search(method):
    """The record of which patch filled a cache follows it: generate's own cache continued by a second
    generate, a deep copy of it (transformers' recipe to reuse a prompt), a cropped one, beam search
    (rows reordered) and generate's static cache (reset and reused) all continue, equal to full forwards."""
    model = make_model("llama", attn_implementation="sdpa")
    patch_model(model, scale=4, method=method)
    prompt = random_ids(L0 + 4)
    options = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    first = model.generate(prompt, max_new_tokens=6, return_dict_in_generate=True, **options)
    copied = copy.deepcopy(first.past_key_values)
    cropped = copy.deepcopy(first.past_key_values)
    cropped.crop(L0 - cropped.get_seq_length())  # keep the first L0 tokens
    with torch.no_grad():
        for cache, start in [(first.past_key_values, first.sequences.shape[1] - 1), (copied, first.sequences.shape[1] - 1),
                             (cropped, L0)]:  # fmt: skip
            step = _continue(model, cache, first.sequences, start)
            torch.testing.assert_close(step, _full(model, first.sequences, start), rtol=0, atol=TOLERANCE)
    for _ in range(2):  # generate keeps its static cache and resets it for the next call
        assert generation_vs_full_forward(model, prompt, new_tokens=5, cache_implementation="static") < TOLERANCE
    beams = model.generate(prompt, max_new_tokens=5, num_beams=3, output_scores=True, return_dict_in_generate=True,
                           length_penalty=0.0, **options)  # fmt: skip
    best = beams.sequences[0]
    with torch.no_grad(), planned_length(model, best.shape[0]):
        logits = model(best[None, :-1]).logits[0, prompt.shape[1] - 1 :]
    total = torch.log_softmax(logits.float(), -1).gather(-1, best[prompt.shape[1] :, None]).sum()
    assert total.item() == pytest.approx(beams.sequences_scores[0].item(), abs=1e-4)


def test_a_length_dependent_patch_refuses_a_forward_on_another_thread_meanwhile():
    """The frequencies a length-dependent patch chose belong to the forward under way: a second
    thread that started one meanwhile made the first compute with its length (0.70 off), and is
    now refused in one line. Each forward equals transformers' own dynamic type over its length,
    and once the first ends, the other thread may run."""

    model = make_model("llama", attn_implementation="sdpa")
    theirs = native_twin(model, {"rope_type": "dynamic", "factor": 4.0}, L0)
    patch_model(model, scale=4, method="dynamic", steps_per_doubling=None)  # the very same frequencies as theirs
    short, long = random_ids(L0 + 8), random_ids(3 * L0)
    with torch.no_grad():
        expected_short, expected_long = theirs(short).logits, theirs(long).logits
    # the short forward waits between choosing its frequencies and using them
    with paused_on_a_thread(model.model.rotary_emb, lambda: model(short).logits) as first:
        with torch.no_grad(), pytest.raises(RuntimeError, match="running a forward on another thread"):
            model(long)
    torch.testing.assert_close(first["result"], expected_short, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(on_a_thread(lambda: model(long).logits)["result"], expected_long, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["dynamic-yarn", "self-extend", "self-extend-dca"])
def test_a_forward_interrupted_by_ctrl_c_does_not_refuse_other_threads_later(method):
    """Ctrl-C skips PyTorch's always-call hooks, so the interrupted forward's thread stays counted:
    later forwards on other threads were refused until the model was patched again. The count is
    now checked against the forwards that thread's stack really runs. A forward that does run
    meanwhile is still refused, and each forward equals one on an identically patched model."""
    import threading

    def interrupt(module, args, kwargs):
        raise KeyboardInterrupt

    model, fresh = (make_model("llama", attn_implementation="sdpa") for _ in range(2))
    for each in (model, fresh):
        patch_model(each, scale=4, method=method)
    ids = random_ids(3 * L0)
    with torch.no_grad():
        expected = fresh(ids).logits
    handle = model.model.layers[1].register_forward_pre_hook(interrupt, with_kwargs=True)
    with pytest.raises(KeyboardInterrupt):
        model(ids)
    handle.remove()

    outcome = on_a_thread(lambda: model(ids).logits)
    assert "error" not in outcome, outcome.get("error")
    torch.testing.assert_close(outcome["result"], expected, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # the interrupted thread itself goes on as before
        torch.testing.assert_close(model(ids).logits, expected, atol=1e-5, rtol=1e-5)

    inner = {}

    def from_inside(module, args, kwargs):  # while this forward runs, another thread's is refused
        if threading.current_thread() is threading.main_thread() and not inner:
            inner.update(on_a_thread(lambda: model(ids).logits))

    handle = model.model.layers[1].register_forward_pre_hook(from_inside, with_kwargs=True)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, atol=1e-5, rtol=1e-5)
    handle.remove()
    assert "running a forward on another thread" in str(inner.get("error")), inner


@pytest.mark.parametrize("method", ["dynamic-yarn", "self-extend"])
def test_replicas_that_share_the_patch_refuse_each_others_forwards_meanwhile(method):
    """nn.DataParallel's replicas are other module objects with the patched module's hooks (one
    patch): a replica's forward on another thread while one runs mixes their state, so it is
    refused like any other thread's."""

    model = make_model("llama", attn_implementation="sdpa")
    patch_model(model, scale=4, method=method)
    replica = model.model._replicate_for_data_parallel()  # what torch.nn.parallel.replicate makes of it
    ids = random_ids(3 * L0)
    with paused_on_a_thread(model.model.layers[1], lambda: model(ids)) as first:
        with torch.no_grad(), pytest.raises(RuntimeError, match="running a forward on another thread"):
            replica(ids)
    assert "result" in first


class _StopAtLength:
    """A stopping criterion (as a stop string or ``max_time`` would be): the caller bounds the length."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


@pytest.mark.parametrize("setting, unbounded", [
    ("max_new_tokens", float("inf")), ("max_length", float("inf")),
    ("max_new_tokens", torch.tensor(float("inf"))),  # what float() reads as inf, as transformers compares it
])  # fmt: skip
def test_an_unbounded_length_is_planned_as_the_extended_context(setting, unbounded):
    """transformers runs max_new_tokens (or max_length) float("inf") until a stopping criterion ends
    it; the patched call does too, planned as max_length = the extended context (4 L0): one prefill,
    no recomputation, and the logits of full forwards with the frequencies of 4 L0."""
    from transformers import StoppingCriteriaList

    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic-yarn")
    prompt, final = random_ids(L0 + 8), L0 + 30
    outputs = []
    lengths = _decoder_calls(model, lambda: outputs.append(model.generate(
        prompt, **{setting: unbounded}, stopping_criteria=StoppingCriteriaList([_StopAtLength(final)]),
        do_sample=False, pad_token_id=0, eos_token_id=None, output_logits=True, return_dict_in_generate=True)))
    out = outputs[0]
    assert out.sequences.shape[1] == final
    assert lengths == [L0 + 8] + [1] * (final - L0 - 9)
    assert recomputations(model) == 0
    with torch.no_grad(), planned_length(model, 4 * L0):
        full = model(out.sequences[:, :-1]).logits[:, L0 + 7 :]
    torch.testing.assert_close(torch.stack(out.logits, 1), full, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("setting, value, error", [
    ("max_new_tokens", float("nan"), ValueError), ("max_new_tokens", -math.inf, ValueError),
    ("max_length", float("nan"), ValueError), ("max_new_tokens", "x", TypeError),
    ("prompt_lookup_num_tokens", "x", TypeError), ("prompt_lookup_num_tokens", math.inf, ValueError),
    ("max_new_tokens", torch.tensor(-math.inf), ValueError),  # a number, if not a Python one
    ("max_new_tokens", "inf", TypeError), ("max_length", "5", TypeError),  # text, which transformers compares with ints
    ("max_new_tokens", torch.tensor([5]), TypeError),  # not one number: transformers cannot fill a tensor with it
])  # fmt: skip
def test_a_length_that_is_no_number_of_tokens_is_refused_naming_it(setting, value, error):
    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic-yarn")
    kwargs = {"max_new_tokens": 5, setting: value} if setting == "prompt_lookup_num_tokens" else {setting: value}
    prompt = random_ids(L0 + 8)

    def run():
        with pytest.raises(error, match=rf"^generate's {setting} must be a whole number of tokens, got .*; pass an int"):
            model.generate(prompt, **kwargs, do_sample=False, pad_token_id=0)

    assert _decoder_calls(model, run) == []  # refused before the prefill
