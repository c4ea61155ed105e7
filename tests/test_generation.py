"""Generation with the KV cache past the original context equals full forward passes."""

from __future__ import annotations

import pytest
import torch
from conftest import ORIGINAL_CONTEXT, make_model, native_twin, random_ids
from transformers import DynamicCache

from hf_rope_ext import patch_model, unpatch_model

L0 = ORIGINAL_CONTEXT
LONG_FACTOR = [1.0 + 0.5 * i for i in range(8)]
TOLERANCE = 2e-5


def _extra(method):
    return {"long_factor": LONG_FACTOR} if method == "longrope" else {}


def generation_vs_full_forward(model, prompt, new_tokens, attention_mask=None, **generate_kwargs):
    """Largest difference between each generation step's logits and a full forward over the same tokens."""
    out = model.generate(
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
    worst = 0.0
    with torch.no_grad():
        for step, step_logits in enumerate(out.logits):
            length = prompt_length + step
            position_ids = (full_mask[:, :length].cumsum(-1) - 1).clamp(min=0)
            full = model(sequences[:, :length], attention_mask=full_mask[:, :length], position_ids=position_ids).logits
            worst = max(worst, (full[:, -1] - step_logits).abs().max().item())
    return worst


STATIC = ["linear", "ntk", "yarn", "llama3"]
DYNAMIC = ["dynamic", "dynamic-yarn", "dynamic-linear", "longrope"]


@pytest.mark.parametrize("method", STATIC + DYNAMIC)
def test_generation_matches_full_forward(method):
    model = make_model("llama")
    patch_model(model, scale=4, method=method, **_extra(method))
    worst = generation_vs_full_forward(model, random_ids(L0 - 12), new_tokens=3 * L0)
    assert worst < TOLERANCE, f"{method}: generation differs from a full forward by {worst}"


@pytest.mark.parametrize("method", ["yarn", "dynamic-yarn"])
@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_generation_matches_full_forward_other_families(family, method):
    model = make_model(family)
    patch_model(model, scale=4, method=method)
    worst = generation_vs_full_forward(model, random_ids(L0 - 12), new_tokens=2 * L0)
    assert worst < TOLERANCE, f"{method}: generation differs from a full forward by {worst}"


@pytest.mark.parametrize("method", ["dynamic", "dynamic-yarn"])
def test_token_exact_dynamic_generation_matches_full_forward(method):
    # steps_per_doubling=None: the frequencies change at every token, the cached states are recomputed each time.
    model = make_model("llama")
    patch_model(model, scale=4, method=method, steps_per_doubling=None)
    assert generation_vs_full_forward(model, random_ids(L0 - 4), new_tokens=L0) < TOLERANCE


@pytest.mark.parametrize("steps_per_doubling", [2, 4])
def test_finer_frequency_steps_generation_matches_full_forward(steps_per_doubling):
    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic-yarn", steps_per_doubling=steps_per_doubling)
    assert generation_vs_full_forward(model, random_ids(L0 - 4), new_tokens=2 * L0) < TOLERANCE


@pytest.mark.parametrize("steps_per_doubling, expected", [(None, 2), (1, 2), (2, 4), (4, 8)])
def test_cached_states_are_recomputed_once_per_frequency_step(steps_per_doubling, expected):
    """Generating from L0 - 4 to 4 L0 tokens crosses the grid L0 * 2 ** (k / n) at k = 0 .. 2n - 1.

    Each crossing re-runs the decoder over the whole sequence once (a call of more than one
    token); every other step runs one token. None means the default (one step per doubling).
    """
    model = make_model("llama")
    extra = {} if steps_per_doubling is None else {"steps_per_doubling": steps_per_doubling}
    patch_model(model, scale=4, method="dynamic", **extra)
    lengths = []
    hook = model.model.layers[0].register_forward_pre_hook(lambda module, args: lengths.append(args[0].shape[1]))
    prompt = random_ids(L0 - 4)
    new_tokens = 3 * L0 + 4
    model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    hook.remove()
    assert lengths[0] == L0 - 4  # the prefill
    assert lengths[1:].count(1) == new_tokens - 1 - expected
    assert sum(length > 1 for length in lengths[1:]) == expected


def test_transformers_dynamic_does_not_match_but_ours_does():
    """transformers issue 25104: its dynamic type keeps stale rotations in the cache."""
    model = make_model("llama")
    theirs = native_twin(model, {"rope_type": "dynamic", "factor": 4.0}, L0)
    prompt = random_ids(L0 - 4)
    their_error = generation_vs_full_forward(theirs, prompt, new_tokens=2 * L0)
    patch_model(model, scale=4, method="dynamic", steps_per_doubling=None)  # the very same frequencies as theirs
    our_error = generation_vs_full_forward(model, prompt, new_tokens=2 * L0)
    assert their_error > 1e-2
    assert our_error < TOLERANCE


def test_left_padded_batch(family):
    model = make_model(family)
    patch_model(model, scale=4, method="dynamic-yarn")
    prompt = random_ids(L0 - 8, batch=3)
    mask = torch.ones_like(prompt)
    mask[0, :11] = 0  # left padding of different widths
    mask[2, :5] = 0
    prompt = prompt.masked_fill(mask == 0, 0)
    assert generation_vs_full_forward(model, prompt, new_tokens=2 * L0, attention_mask=mask) < TOLERANCE


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


@pytest.mark.parametrize("method", ["dynamic-yarn", "yarn"])
def test_sliding_window_cache(method):
    # Mistral with a sliding window shorter than the sequence: sliding cache layers drop old tokens.
    model = make_model("mistral", sliding_window=24)
    patch_model(model, scale=4, method=method)
    assert generation_vs_full_forward(model, random_ids(L0 - 10), new_tokens=2 * L0) < TOLERANCE


def test_static_cache():
    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic-yarn")
    worst = generation_vs_full_forward(model, random_ids(L0 - 10), new_tokens=2 * L0, cache_implementation="static")
    assert worst < TOLERANCE


def test_beam_search_scores_match_full_forwards():
    # Beam search reorders the cache; the recomputed states must follow the reordered rows.
    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic-yarn")
    prompt = random_ids(L0 - 6)
    new_tokens = 2 * L0
    out = model.generate(
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
    with torch.no_grad():
        for step in range(new_tokens):
            length = prompt.shape[1] + step
            logits = model(best[None, :length]).logits[0, -1]
            total += torch.log_softmax(logits.float(), -1)[best[length]].item()
    assert total == pytest.approx(out.sequences_scores[0].item(), abs=1e-3)


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
        with pytest.raises(RuntimeError, match="fresh cache"):
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
