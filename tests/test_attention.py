"""Attention-level methods (self-extend, dual-chunk, log-n attention) against naive references.

The reference builds the full matrices of query and key positions from the papers' formulas,
rotates raw queries and keys to them in float64, and runs one unchunked softmax; it is plugged
into the *unpatched* model through transformers' own attention registry, so it shares no code
with the package.
"""

from __future__ import annotations

import contextlib
import math
import os
import traceback

import pytest
import torch
import transformers
from packaging import version
from transformers import DynamicCache
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from hf_rope_ext import get_patch_info, patch_model, planned_length, unpatch_model
from hf_rope_ext import attention as attention_level

from conftest import (
    ORIGINAL_CONTEXT,
    TINY_SHAPE,
    make_model,
    native_twin,
    on_a_thread,
    paused_on_a_thread,
    random_ids,
    strengthen_weights,
)

L0 = ORIGINAL_CONTEXT
LENGTH = 100  # > 3 x L0


# ----------------------------------------------------------------------------------------------
# The papers' position matrices, written out
# ----------------------------------------------------------------------------------------------


def self_extend_positions(i: int, j: int, group: int | None, window: int) -> tuple[int, int]:
    """Jin et al. 2024, eq. (3)-(4) / LongLM's code; plain attention for queries inside L0.
    ``group=None``: the query's own group, the smallest whose farthest position difference
    (to the key at position 0) stays below L0."""
    if i - j < window or i < L0:
        return i, j
    if group is None:
        group = next(g for g in range(2, i + 2) if i // g + window - window // g < L0)
    return i // group + window - window // group, j // group


def self_extend_by_parts_positions(i: int, j: int, group: int | None, window: int, theta: torch.Tensor, beta_fast=32.0, beta_slow=1.0):
    """Self-Extend's neighbour/far split with YaRN's NTK-by-parts ramp (arXiv 2309.00071, eq. 17-18) on far
    keys: per frequency, ``kappa = gamma + (1 - gamma) / G`` with ``gamma`` the ramp of ``r = L0 theta / 2 pi``;
    ``P_q = kappa i + (1 - kappa) W``, ``P_k = kappa j`` (tensors, one position per frequency)."""
    if i - j < window or i < L0:
        return i, j
    if group is None:
        group = next(g for g in range(2, i + 2) if i // g + window - window // g < L0)
    turns = L0 * theta / (2 * math.pi)
    gamma = torch.clamp((turns - beta_slow) / (beta_fast - beta_slow), 0, 1)
    kappa = gamma + (1 - gamma) / group
    return kappa * i + (1 - kappa) * window, kappa * j


def dual_chunk_positions(i: int, j: int, chunk: int, local: int) -> tuple[int, int]:
    """An et al. 2024, sec. 3 / ChunkLlama's code; plain attention for queries inside L0."""
    if i < L0:
        return i, j
    ci, cj = i // chunk, j // chunk
    if cj == ci:
        return i % chunk, j % chunk
    if cj == ci - 1:
        return min(i % chunk + chunk, chunk + local), j % chunk
    return chunk + local, j % chunk


def _rotation(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x (..., D) by angles (..., D/2), float64."""
    half = x.shape[-1] // 2
    cos, sin = torch.cat((angle.cos(), angle.cos()), -1), torch.cat((angle.sin(), angle.sin()), -1)
    turned = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos + turned * sin


def naive_attention_factory(position_fn, theta: torch.Tensor, logn: bool = False, window: bool = False):
    """An attention function (transformers' signature) computing the reference in float64;
    ``window``: apply the sliding window transformers passes for the layer (keys less than
    ``sliding_window`` tokens before the query)."""

    def naive(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        batch, heads, length, dim = query.shape
        groups = heads // key.shape[1]
        key = key.repeat_interleave(groups, 1).double()
        value = value.repeat_interleave(groups, 1).double()
        query = query.double()
        # extra key rotation relative to the query's, per frequency (positions may differ by dimension)
        delta = torch.zeros(length, length, theta.shape[0], dtype=torch.float64)
        for i in range(length):
            for j in range(i + 1):
                pq, pk = position_fn(i, j)
                delta[i, j] = (torch.as_tensor(pk, dtype=torch.float64) - j) - (torch.as_tensor(pq, dtype=torch.float64) - i)
        # (R(a) q) . (R(b) k) = q . R(b - a) k
        keys = _rotation(key[:, :, None, :, :], delta[None, None] * theta)  # (B, H, i, j, D)
        scores = torch.einsum("bhid,bhijd->bhij", query, keys) * scaling
        if logn:
            factor = torch.tensor([max(1.0, math.log(i + 1) / math.log(L0)) for i in range(length)], dtype=torch.float64)
            scores = scores * factor[:, None]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        if window and kwargs.get("sliding_window") is not None:
            causal &= ~torch.ones(length, length, dtype=torch.bool).tril(-kwargs["sliding_window"])
        scores = scores.masked_fill(~causal, -math.inf)
        weights = scores.softmax(-1)
        return torch.matmul(weights, value).transpose(1, 2).to(torch.float32), weights.to(torch.float32)

    return naive


def reference_logits(model, ids, position_fn, logn=False, window=False):
    """Logits of the unpatched model with the naive attention plugged in under a test-only name."""
    return reference_logits_at(model, ids, None, position_fn, logn, window=window)


def reference_logits_at(model, ids, positions, position_fn, logn=False, theta=None, window=False, attentions=False):
    """:func:`reference_logits` with explicit position ids (``position_fn`` then works on indices);
    ``theta`` are the frequencies the model's rotary module uses (default: plain RoPE);
    ``attentions``: return the per-layer attention weights too."""
    if theta is None:
        head_dim = model.model.layers[0].self_attn.head_dim
        theta = 1.0 / model.config.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    name = "test_naive_reference"
    AttentionInterface.register(name, naive_attention_factory(position_fn, theta, logn, window))
    AttentionMaskInterface.register(name, AttentionMaskInterface._global_mapping["sdpa"])
    previous = model.config._attn_implementation
    model.config._attn_implementation = name
    try:
        with torch.no_grad():
            out = model(ids, position_ids=positions, output_attentions=attentions)
        return (out.logits, out.attentions) if attentions else out.logits
    finally:
        model.config._attn_implementation = previous
        del AttentionInterface._global_mapping[name]
        del AttentionMaskInterface._global_mapping[name]


# ----------------------------------------------------------------------------------------------
# Against the reference
# ----------------------------------------------------------------------------------------------


# method, its parameters, and the papers' position map with the same parameters
PAPER_CASES = {
    "self-extend": ({"group_size": 6, "neighbor_window": 8}, lambda i, j: self_extend_positions(i, j, 6, 8)),
    "self-extend per-query group": ({"neighbor_window": 8}, lambda i, j: self_extend_positions(i, j, None, 8)),
    "dual-chunk": ({"chunk_size": 20, "local_window": 4}, lambda i, j: dual_chunk_positions(i, j, 20, 4)),
}


@pytest.mark.parametrize("group", [6, None])
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_by_parts_far_positions_match_naive_reference(family, implementation, group):
    model = make_model(family, attn_implementation=implementation)
    ids = random_ids(LENGTH)
    head_dim = model.model.layers[0].self_attn.head_dim
    theta = 1.0 / model.config.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    expected = reference_logits(model, ids, lambda i, j: self_extend_by_parts_positions(i, j, group, 8, theta))
    grouped = reference_logits(model, ids, lambda i, j: self_extend_positions(i, j, group, 8))
    patch_model(model, scale=4, method="self-extend", group_size=group, neighbor_window=8, far_positions="by-parts")
    with torch.no_grad():
        actual = model(ids).logits
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)
    # and it is not the floor-grouped variant beyond L0
    assert (grouped[:, L0:] - expected[:, L0:]).abs().max() > 1e-2


def test_by_parts_keeps_fast_dimensions_exact():
    """With a ramp that keeps the fast half of the dimensions, those see the true distance and the
    slow ones W + (d - W) / G: the kernel against a float64 softmax with rotations per dimension."""
    torch.manual_seed(0)
    length, dim = 90, 16
    theta = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    remap = attention_level.SelfExtendRemap(3, 8, L0, "by-parts", beta_fast=3.0, beta_slow=1.0)
    kappa = remap.keep_fraction(theta, 3)
    turns = L0 * theta / (2 * math.pi)
    assert torch.equal(kappa[turns >= 3], torch.ones(int((turns >= 3).sum()), dtype=torch.float64))
    assert torch.allclose(kappa[turns <= 1], torch.full((int((turns <= 1).sum()),), 1 / 3, dtype=torch.float64))
    assert (turns >= 3).any() and (turns <= 1).any()
    query, key, value = torch.randn(1, 2, length, dim), torch.randn(1, 2, length, dim), torch.randn(1, 2, length, dim)
    positions = torch.arange(length)
    rq = _rotation(query.double(), positions[:, None].double() * theta)
    rk = _rotation(key.double(), positions[:, None].double() * theta)
    scores = torch.full((1, 2, length, length), -math.inf, dtype=torch.float64)
    for i in range(length):
        for j in range(i + 1):
            pq, pk = self_extend_by_parts_positions(i, j, 3, 8, theta, beta_fast=3.0, beta_slow=1.0)
            shift = (torch.as_tensor(pk, dtype=torch.float64) - j) - (torch.as_tensor(pq, dtype=torch.float64) - i)
            scores[0, :, i, j] = (rq[0, :, i] * _rotation(rk[0, :, j], shift * theta)).sum(-1) * 0.25
    expected = torch.matmul(scores.softmax(-1), value.double()).transpose(1, 2)
    actual = attention_level.remapped_attention(
        rq.float(), rk.float(), value, query_positions=positions[None], key_positions=positions[None],
        allowed=lambda a, b: None, remap=remap, inv_freq=theta, scaling=0.25, query_chunk=7,
    )
    torch.testing.assert_close(actual.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", list(PAPER_CASES))
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_matches_naive_reference(family, implementation, case):
    model = make_model(family, attn_implementation=implementation)
    ids = random_ids(LENGTH)
    params, position_fn = PAPER_CASES[case]
    expected = reference_logits(model, ids, position_fn)
    unpatched = model(ids).logits.detach()
    patch_model(model, scale=4, method=case.split()[0], **params)
    with torch.no_grad():
        actual = model(ids).logits
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)
    # and it is not the unpatched model beyond L0 (the reference would then be meaningless)
    assert (unpatched[:, L0:] - expected[:, L0:]).abs().max() > 1e-2


@pytest.mark.parametrize("case", list(PAPER_CASES))
def test_output_attentions_match_the_reference_weights(case, caplog):
    """An eager model returns the attention weights the remap applies, beyond L0 as inside it;
    other implementations return none, as transformers' own do, and say so once."""
    model = make_model("llama", attn_implementation="eager")
    ids = random_ids(LENGTH)
    params, position_fn = PAPER_CASES[case]
    _, expected = reference_logits_at(model, ids, None, position_fn, attentions=True)
    patch_model(model, scale=4, method=case.split()[0], **params)
    with torch.no_grad():
        actual = model(ids, output_attentions=True).attentions
    assert len(actual) == len(expected) == model.config.num_hidden_layers
    for layer_actual, layer_expected in zip(actual, expected):
        torch.testing.assert_close(layer_actual, layer_expected, atol=1e-5, rtol=1e-4)
    sdpa = make_model("llama", attn_implementation="sdpa")
    patch_model(sdpa, scale=4, method=case.split()[0], **params)
    with caplog.at_level("WARNING", logger="hf_rope_ext.attention"), torch.no_grad():
        assert not sdpa(ids, output_attentions=True).attentions
    assert sum("return weights only for attn_implementation='eager'" in r.getMessage() for r in caplog.records) == 1


def test_logn_attention_matches_naive_reference():
    model = make_model("llama")
    ids = random_ids(LENGTH)
    expected = reference_logits(model, ids, lambda i, j: self_extend_positions(i, j, 6, 8), logn=True)
    patch_model(model, scale=4, method="self-extend+logn", group_size=6, neighbor_window=8)
    assert get_patch_info(model).logn_attention
    with torch.no_grad():
        actual = model(ids).logits
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)


def test_logn_on_a_frequency_method_scales_only_beyond_the_original_context():
    model = make_model("llama")
    ids = random_ids(LENGTH)
    with torch.no_grad():
        patch_model(model, scale=4, method="yarn")
        yarn = model(ids).logits
        patch_model(model, scale=4, method="yarn", logn_attention=True)
        yarn_logn = model(ids).logits
    torch.testing.assert_close(yarn_logn[:, :L0], yarn[:, :L0], atol=1e-5, rtol=1e-5)
    assert (yarn_logn[:, L0:] - yarn[:, L0:]).abs().max() > 1e-3


def test_paper_position_maps_bound_every_distance():
    """The remaps' own claims about the longest distance, checked pair by pair from the formulas."""
    length = 4 * L0
    for group, window in [(4, 8), (3, 16), (8, 2)]:
        remap = attention_level.SelfExtendRemap(group, window, L0)
        longest = max(
            pq - pk for i in range(L0, length) for j in range(i + 1) for pq, pk in [self_extend_positions(i, j, group, window)]
        )
        assert longest <= remap.max_distance(length)
    longest = max(
        pq - pk for i in range(L0, length) for j in range(i + 1) for pq, pk in [dual_chunk_positions(i, j, 20, 4)]
    )
    assert longest <= 24 < L0


# ----------------------------------------------------------------------------------------------
# Chunking, cache, round trip
# ----------------------------------------------------------------------------------------------


# remaps of the kernel-level tests, by name ("logn only": no remap)
KERNEL_REMAPS = {
    "self-extend": attention_level.SelfExtendRemap(3, 8, L0),
    "self-extend by-parts": attention_level.SelfExtendRemap(None, 8, L0, "by-parts"),
    "dual-chunk": attention_level.DualChunkRemap(20, 4, L0),
    "logn only": None,
}


def kernel_inputs(length: int = 90):
    """Random queries (2 rows, 4 heads), keys and values (2 heads), head size 16, and their positions."""
    torch.manual_seed(0)
    query, key, value = torch.randn(2, 4, length, 16), torch.randn(2, 2, length, 16), torch.randn(2, 2, length, 16)
    return query, key, value, torch.arange(length)[None]


@pytest.mark.parametrize("method", ["self-extend", "self-extend by-parts", "dual-chunk"])
def test_chunked_equals_unchunked(method, monkeypatch):
    length = 90
    query, key, value, positions = kernel_inputs(length)
    remap = KERNEL_REMAPS[method]
    theta = 1.0 / 10000 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    common = dict(query_positions=positions, key_positions=positions, allowed=lambda a, b: None, remap=remap,
                  inv_freq=theta, scaling=0.25)
    whole = attention_level.remapped_attention(query, key, value, query_chunk=length, **common)
    monkeypatch.setattr(attention_level, "KEY_BLOCK", 7)
    pieces = attention_level.remapped_attention(query, key, value, query_chunk=5, **common)
    torch.testing.assert_close(pieces, whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["self-extend", "self-extend by-parts", "dual-chunk"])
def test_a_decode_step_rotates_the_cache_once(method, monkeypatch):
    """One query beyond L0 over a long cache re-rotates the cached keys for the one regime it uses
    (its own group; dual chunk's three regimes share one key map), not once per regime of the
    remap, and gives the same output as the same query inside a full forward."""
    torch.manual_seed(0)
    length = 12 * L0
    query, key, value = torch.randn(1, 4, length, 16), torch.randn(1, 2, length, 16), torch.randn(1, 2, length, 16)
    positions = torch.arange(length)[None]
    remap = {
        "self-extend": attention_level.SelfExtendRemap(None, 8, L0),
        "self-extend by-parts": attention_level.SelfExtendRemap(None, 8, L0, "by-parts"),
        "dual-chunk": attention_level.DualChunkRemap(20, 4, L0),
    }[method]
    theta = 1.0 / 10000 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    groups = [regime for regime in remap.regimes(length - 1, theta) if regime.key_position is not None]
    assert len({regime.key_position for regime in groups}) > 1 or method == "dual-chunk"
    common = dict(key_positions=positions, allowed=lambda a, b: None, remap=remap, inv_freq=theta, scaling=0.25)
    full = attention_level.remapped_attention(query, key, value, query_positions=positions, **common)
    rotated_lengths = []
    real_rotation = attention_level._apply_rotation

    def counting_rotation(x, cos, sin):
        rotated_lengths.append(x.shape[2])
        return real_rotation(x, cos, sin)

    monkeypatch.setattr(attention_level, "_apply_rotation", counting_rotation)
    last = attention_level.remapped_attention(query[:, :, -1:], key, value, query_positions=positions[:, -1:], **common)
    assert rotated_lengths.count(length) == 1
    torch.testing.assert_close(last, full[:, -1:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["self-extend", "dual-chunk"])
def test_key_rotation_tables_are_computed_once_per_forward(method, monkeypatch):
    """The layers of one forward share each key map's cos/sin tables (computed once, not once per
    layer), a call with other key positions computes them afresh, and the logits equal those of
    a model that recomputes the tables in every layer, bitwise."""
    model = make_model("llama")
    layers = model.config.num_hidden_layers
    assert layers > 1
    ids = random_ids(LENGTH)
    monkeypatch.setattr(attention_level, "QUERY_CHUNK", 7)  # query tables (7 rows) apart from key tables
    computed = []
    real_table = attention_level._rotation_table

    def counting_table(shift, inv_freq):
        computed.append(shift.shape[1])
        return real_table(shift, inv_freq)

    monkeypatch.setattr(attention_level, "_rotation_table", counting_table)
    patch_model(model, scale=4, method=method)
    with torch.no_grad():
        shared = model(ids).logits
        maps = computed.count(LENGTH)
        model(ids)  # the same key positions: nothing to compute
        assert computed.count(LENGTH) == maps >= 1
        model(ids[:, :-1])  # other key positions: computed afresh, once
        assert computed.count(LENGTH - 1) == maps
        # every layer computing its own tables: the same logits, at `layers` times the work
        monkeypatch.setattr(attention_level.KeyRotationTables, "get", lambda self, regime, positions, inv_freq:
                            counting_table(attention_level._shift(regime.key_position, positions), inv_freq))
        computed.clear()
        per_layer = model(ids).logits
    assert computed.count(LENGTH) == maps * layers
    torch.testing.assert_close(shared, per_layer, atol=0, rtol=0)


def test_layers_of_one_forward_read_the_positions_once(monkeypatch):
    """Copying positions to the host and deriving the key positions wait for the device on a GPU:
    the layers of one forward share them (one copy and one derivation per forward, not per layer),
    and the next forward computes them again, also for the same tensor changed in place."""
    model = make_model("llama", attn_implementation="sdpa")
    assert model.config.num_hidden_layers > 1
    ids = random_ids(LENGTH)
    copies, derived = [], []
    real_of, real_keys = attention_level._HostPositions.of.__func__, attention_level._key_positions
    monkeypatch.setattr(attention_level._HostPositions, "of",
                        classmethod(lambda cls, q, k: copies.append(q.shape) or real_of(cls, q, k)))
    monkeypatch.setattr(attention_level, "_key_positions", lambda *args: derived.append(args[1:]) or real_keys(*args))
    patch_model(model, scale=4, method="self-extend", neighbor_window=8)
    positions = torch.arange(LENGTH)[None]
    with torch.no_grad():
        first = model(ids, position_ids=positions).logits
        assert (len(copies), len(derived)) == (1, 1)
        positions.add_(5)
        shifted = model(ids, position_ids=positions).logits
        assert (len(copies), len(derived)) == (2, 2)
        with torch.inference_mode():  # inference tensors keep no version counter: each forward starts afresh
            frozen = torch.arange(LENGTH)[None]
            model(ids, position_ids=frozen)
            frozen.add_(5)
            frozen_shifted = model(ids, position_ids=frozen).logits
        assert (len(copies), len(derived)) == (4, 4)
    fresh = make_model("llama", attn_implementation="sdpa")
    patch_model(fresh, scale=4, method="self-extend", neighbor_window=8)
    with torch.no_grad():
        expected_shifted = fresh(ids, position_ids=torch.arange(5, LENGTH + 5)[None]).logits
        torch.testing.assert_close(shifted, expected_shifted, atol=0, rtol=0)
        torch.testing.assert_close(frozen_shifted, expected_shifted, atol=0, rtol=0)
        torch.testing.assert_close(first, fresh(ids).logits, atol=0, rtol=0)


class _HostTransfers(torch.overrides.TorchFunctionMode):
    """Counts the library's calls that move a tensor between devices (``.cpu()``, ``.to(device)``):
    on a GPU each waits for the device."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        moves = name == "cpu" or (name == "to" and any(isinstance(a, (str, torch.device)) for a in (*args[1:], *kwargs.values())))
        if moves:
            library = [f for f in traceback.extract_stack()[:-1] if f"{os.sep}hf_rope_ext{os.sep}" in f.filename]
            if library:
                self.calls.append(f"{name} in {library[-1].name}")
        return func(*args, **kwargs)


@pytest.mark.parametrize("method", ["self-extend", "self-extend-yarn", "dual-chunk"])
def test_a_forward_moves_tensors_between_devices_the_same_number_of_times_whatever_its_layers(method):
    """Positions read to the host, frequencies copied to the device: once per forward, never once
    per layer (on a GPU each such copy stops the host until the device has caught up)."""
    counts = {}
    for layers in (2, 4):
        model = make_model("llama", attn_implementation="sdpa", num_hidden_layers=layers)
        patch_model(model, scale=4, method=method)
        ids = random_ids(LENGTH)
        with torch.no_grad():
            model(ids)  # the first forward may set things up
            with _HostTransfers() as transfers:
                model(ids)
        counts[layers] = sorted(transfers.calls)
    assert counts[2] == counts[4]


def test_position_memos_see_in_place_changes():
    """Outside a forward of the patched model (layers called on their own) the memos recompute
    every time; inside one they check the tensor's version counter, not only its identity."""
    positions = torch.arange(40)[None]
    memo = attention_level._PositionMemo()
    assert memo.of(positions) is not memo.of(positions)  # outside a forward: computed every time
    memo.within_forward = True  # as the patch's hooks set it during a forward
    facts = memo.of(positions)
    assert facts.max_position == 39 and memo.of(positions) is facts
    keys = facts.key_positions(0, 0, 40)
    assert facts.key_positions(0, 0, 40) is keys
    positions.add_(10)
    changed = memo.of(positions)
    assert changed.max_position == 49
    assert torch.equal(changed.key_positions(0, 0, 40), torch.arange(10, 50)[None])
    assert facts.max_position == 39  # what an earlier holder (another forward) reads is left alone
    tables = attention_level.KeyRotationTables()
    query = torch.arange(30, 40)[None]
    assert tables.positions_of_call(query, positions, 1) is not tables.positions_of_call(query, positions, 1)
    tables.within_forward = True
    facts = tables.positions_of_call(query, positions, 1)
    assert tables.positions_of_call(query, positions, 1) is facts
    query.add_(10)
    assert tables.positions_of_call(query, positions, 1).q_lo == 40


@pytest.mark.parametrize("how", ["inference_mode", ".data"])
def test_a_layer_called_alone_under_inference_mode_sees_positions_changed_in_place(how):
    """Inference tensors keep no version counter, and writes through ``.data`` do not count:
    outside a forward of the patched model (a layer called on its own), the memos must not reuse
    what they computed for the same tensor."""

    def layer(model, hidden, positions):
        return model.model.layers[0](hidden, attention_mask=None, position_ids=positions,
                                     position_embeddings=model.model.rotary_emb(hidden, positions))

    model, fresh = (make_model("llama", attn_implementation="sdpa") for _ in range(2))
    for each in (model, fresh):
        patch_model(each, scale=4, method="self-extend", neighbor_window=8)
    hidden = torch.randn(1, 60, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode() if how == "inference_mode" else torch.no_grad():
        positions = torch.arange(60)[None]
        layer(model, hidden, positions)
        if how == ".data":
            positions.data.add_(40)
        else:
            positions += 40  # the same buffer, positions 40 ... 99
        actual = layer(model, hidden, positions)
        expected = layer(fresh, hidden, torch.arange(40, 100)[None])
    torch.testing.assert_close(actual, expected, atol=0, rtol=0)


def _generation_matches_full_forward(model, ids, attention_mask=None, **kwargs):
    out = model.generate(
        # min_new_tokens: the sequence reaches the planned length, whose frequencies a length-dependent
        # method uses in both runs
        ids, attention_mask=attention_mask, max_new_tokens=LENGTH - ids.shape[1], min_new_tokens=LENGTH - ids.shape[1],
        do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kwargs,
    )
    full_mask = positions = None
    if attention_mask is not None:
        full_mask = torch.cat([attention_mask, torch.ones_like(out.sequences[:, ids.shape[1]:])], dim=1)
        # the positions generate gives padded rows (a plain forward would count the padding)
        positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        full = model(out.sequences, attention_mask=full_mask, position_ids=positions).logits
    generated = torch.stack(out.logits, dim=1)
    torch.testing.assert_close(generated, full[:, ids.shape[1] - 1 : -1], atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "method",
    ["self-extend", "self-extend by-parts", "dual-chunk", "yarn+logn", "dynamic-yarn-dca", "self-extend-dca", "self-extend-yarn"],
)
def test_generation_with_cache_equals_full_forward(family, method):
    model = make_model(family, attn_implementation="sdpa")
    params = {
        "self-extend": {"neighbor_window": 8},
        "self-extend by-parts": {"neighbor_window": 8, "far_positions": "by-parts"},
        "dual-chunk": {"chunk_size": 20, "local_window": 4},
        "dynamic-yarn-dca": {"chunk_size": 20, "local_window": 4},
        "self-extend-dca": {"chunk_size": 20, "local_window": 4},
    }.get(method, {})
    patch_model(model, scale=4, method=method.split()[0], **params)
    _generation_matches_full_forward(model, random_ids(20))


def test_generation_with_left_padding_and_static_cache():
    model = make_model("llama", attn_implementation="sdpa")
    patch_model(model, scale=4, method="self-extend", neighbor_window=8)
    ids = random_ids(20, batch=2)
    mask = torch.ones_like(ids)
    ids[0, :5], mask[0, :5] = 0, 0  # left padding on the first row
    _generation_matches_full_forward(model, ids, attention_mask=mask)
    _generation_matches_full_forward(model, random_ids(20), cache_implementation="static")


def test_inside_the_original_context_outputs_are_the_unpatched_model_bitwise(family):
    model = make_model(family, attn_implementation="sdpa")
    ids = random_ids(L0)
    with torch.no_grad():
        before = model(ids).logits
        patch_model(model, scale=4, method="self-extend")
        during = model(ids).logits
    assert torch.equal(before, during)


@pytest.mark.parametrize(
    "method", ["self-extend", "dual-chunk", "ntk+logn", "dynamic-yarn-dca", "self-extend-dca", "self-extend-yarn"]
)
def test_unpatch_restores_everything_bitwise(method):
    model = make_model("llama", attn_implementation="sdpa")
    ids = random_ids(LENGTH)
    with torch.no_grad():
        before = model(ids).logits
    implementation = model.config._attn_implementation
    functions = set(AttentionInterface._global_mapping)
    masks = set(AttentionMaskInterface._global_mapping)
    patch_model(model, scale=4, method=method)
    name = model.config._attn_implementation
    assert name != implementation and name in ALL_ATTENTION_FUNCTIONS
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, before)
    unpatch_model(model)
    assert model.config._attn_implementation == implementation
    assert set(AttentionInterface._global_mapping) == functions
    assert set(AttentionMaskInterface._global_mapping) == masks
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_two_models_keep_their_own_settings():
    first, second = make_model("llama", attn_implementation="sdpa"), make_model("llama", attn_implementation="sdpa")
    ids = random_ids(LENGTH)
    patch_model(first, scale=4, method="self-extend", group_size=6, neighbor_window=8)
    patch_model(second, scale=4, method="self-extend", group_size=8, neighbor_window=4)
    with torch.no_grad():
        assert not torch.allclose(first(ids).logits, second(ids).logits)
        unpatched = make_model("llama", attn_implementation="sdpa")  # the same weights
        expected = reference_logits(unpatched, ids, lambda i, j: self_extend_positions(i, j, 8, 4))
        torch.testing.assert_close(second(ids).logits, expected, atol=2e-5, rtol=1e-4)


# ----------------------------------------------------------------------------------------------
# Parameters
# ----------------------------------------------------------------------------------------------


def test_group_per_query_reaches_the_edge_of_the_trained_distances_and_no_further():
    longest = max(pq - pk for i in range(LENGTH) for j in range(i + 1) for pq, pk in [self_extend_positions(i, j, None, 8)])
    assert longest == L0 - 1
    model = make_model("llama")
    patch_model(model, scale=4, method="self-extend", neighbor_window=8)
    remap = model.model.rotary_emb.attention_patch.remap
    groups = [remap.group_for(i) for i in range(L0, LENGTH)]
    # several group sizes in one call (one regime each), and each the smallest that fits
    assert set(groups) == {2, 3, 4}
    assert groups == [next(g for g in range(2, i + 2) if i // g + 8 - 8 // g < L0) for i in range(L0, LENGTH)]


def test_group_per_query_is_the_smallest_that_fits_far_beyond_the_trained_context():
    """group_for starts its search at a bound no fitting group lies below (it stepped from 2, which
    made a forward quadratic in position / L0: 18.7 s for 12 tokens at position 131072 with L0 = 32);
    brute force from 2 agrees for small and extreme ratios and odd windows."""
    cases = [(32, 8, range(32, 5000, 7)), (33, 1, range(33, 3000, 5)), (100, 99, range(100, 4000, 13)),
             (8192, 2048, range(8192, 1 << 20, 4099)), (32, 16, [131071, 131072, 999_983])]
    for original, window, positions in cases:
        remap = attention_level.SelfExtendRemap(None, window, original)
        for position in positions:
            brute = next(g for g in range(2, position + 2) if position // g + window - window // g < original)
            assert remap.group_for(position) == brute, (original, window, position)


@pytest.mark.parametrize("window, group", [(8, None), (4096, None), (2048, None), (8, 3)])
def test_query_chunks_are_cut_where_the_group_size_changes(window, group):
    """The cut points are the positions where the paper's group of a query (the smallest that keeps its
    distances inside L0, brute force) changes, plus L0 where the remap starts; and cutting there keeps
    every tile of a chunk inside one group."""
    original = 32 if window == 8 else 8192
    remap = attention_level.SelfExtendRemap(group, window, original)

    def paper_group(i):
        return group or next(g for g in range(2, i + 2) if i // g + window - window // g < original)

    last = 4 * original
    expected = [original] + [i for i in range(original + 1, last + 1) if paper_group(i) != paper_group(i - 1)]
    assert remap.query_breaks(0, last) == expected
    assert remap.query_breaks(original, last) == expected[1:]  # (q_lo, q_hi]: q_lo itself is no cut
    if group is None:
        assert len(expected) > 2
        middle = expected[2]
        assert remap.query_breaks(middle - 1, middle) == [middle] and remap.query_breaks(middle, middle + 5) == []


def test_dual_chunk_query_chunks_are_cut_at_chunk_starts():
    """The cuts are L0 (where the remap starts) and each position from L0 on whose chunk index differs
    from the previous position's (brute force over the paper's chunk index)."""
    remap = attention_level.DualChunkRemap(20, 4, L0)
    last = 5 * L0
    expected = [L0] + [i for i in range(L0 + 1, last + 1) if i // 20 != (i - 1) // 20]
    assert remap.query_breaks(0, last) == expected
    assert remap.query_breaks(L0, last) == expected[1:]
    assert remap.query_breaks(0, L0 - 1) == [] and remap.query_breaks(41, 59) == []


@pytest.mark.parametrize("method", ["self-extend", "self-extend by-parts", "dual-chunk", "logn only"])
def test_masks_built_per_run_give_the_per_block_result(method, monkeypatch):
    """On CUDA undecided key blocks are not checked one by one (that would wait for the device per
    block): one mask per run of blocks. Forced here on the CPU with a padding mask, it gives the
    per-block result. (Without padding no remap needs a mask at all: see
    test_band_regimes_need_no_mask_and_match_the_masked_path.)"""
    length = 90
    query, key, value, positions = kernel_inputs(length)
    remap = KERNEL_REMAPS[method]
    padding = torch.ones(2, length, dtype=torch.bool)
    padding[1, :7] = False  # left padding on the second row
    causal = positions[0][None, :] <= positions[0][:, None]

    def allowed(start, end):
        return causal[None, None, start:end] & padding[:, None, None, :]

    theta = 1.0 / 10000 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    common = dict(query_positions=positions, key_positions=positions, allowed=allowed, remap=remap, inv_freq=theta,
                  scaling=0.25, logn_length=L0 if remap is None else None)
    monkeypatch.setattr(attention_level, "KEY_BLOCK", 7)
    per_block = attention_level.remapped_attention(query, key, value, query_chunk=11, **common)
    calls = []
    original = attention_level._partial_attention
    monkeypatch.setattr(attention_level, "_partial_attention", lambda *a, **kw: calls.append(a[3] is not None) or original(*a, **kw))
    monkeypatch.setattr(attention_level, "_refines_masks", lambda device: False)
    monkeypatch.setattr(attention_level, "MASKED_RUN_BLOCKS", 2)  # long masked runs go in pieces
    per_run = attention_level.remapped_attention(query, key, value, query_chunk=11, **common)
    torch.testing.assert_close(per_run, per_block, atol=1e-5, rtol=1e-5)
    assert True in calls  # masked runs


@pytest.mark.parametrize("method", ["self-extend", "self-extend by-parts", "self-extend W=1", "dual-chunk", "logn only"])
@pytest.mark.parametrize("first_position", [0, 30])
def test_band_regimes_need_no_mask_and_match_the_masked_path(method, first_position, monkeypatch):
    """Without padding, the regimes of self-extend and dual chunk and plain attention are bands of
    distances and key positions: they run as causal triangles and rectangles without any mask
    (chunks of 11 queries, cut into runs no wider than the band), and give what the masked tiles
    give for the same causal structure (with a gradient, through the explicit computation).
    Positions starting at 30 cut the first triangles of the 8-token window (L0 = 32: they would
    start at 32 - 7 and 32 - 8), which fall back to a mask; the 1-token window's, dual chunk's
    (its triangles start at the query) and plain attention's are never cut."""
    remaps = {**KERNEL_REMAPS, "self-extend W=1": attention_level.SelfExtendRemap(None, 1, L0)}
    remap = remaps[method]
    torch.manual_seed(0)
    length = 90
    query = torch.randn(2, 4, length, 16, requires_grad=True)
    key, value = torch.randn(2, 2, length, 16), torch.randn(2, 2, length, 16)
    positions = torch.arange(first_position, first_position + length)[None]
    causal = positions[0][None, :] <= positions[0][:, None]
    theta = 1.0 / 10000 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    common = dict(query_positions=positions, key_positions=positions, remap=remap, inv_freq=theta, scaling=0.25,
                  logn_length=L0 if remap is None else None, query_chunk=11)
    masked = attention_level.remapped_attention(
        query, key, value, allowed=lambda start, end: causal[None, None, start:end].expand(2, 1, -1, -1), **common
    )
    calls = []
    original = attention_level._partial_attention
    monkeypatch.setattr(attention_level, "_partial_attention",
                        lambda *a, **kw: calls.append((a[3] is not None, kw.get("causal", False))) or original(*a, **kw))
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            banded = attention_level.remapped_attention(query, key, value, allowed=lambda start, end: None, **common)
        torch.testing.assert_close(banded, masked, atol=1e-5, rtol=1e-5)
    assert banded.requires_grad
    assert (False, True) in calls  # causal triangles ran
    assert ((True, False) in calls) == (first_position > 0 and method in ("self-extend", "self-extend by-parts"))


@pytest.mark.parametrize("method", ["self-extend", "self-extend by-parts W=2048", "dual-chunk"])
def test_unpadded_remaps_make_no_masked_call_at_64k(method, monkeypatch):
    """At 64k with SmolLM2's L0 and each remap's default parameters, the CUDA query chunks make no
    masked call at all: every tile is a rectangle or a causal triangle of the fused kernels."""
    original, length = 8192, 65536
    params = {"original_max_position_embeddings": original, "factor": length / original}
    if method == "self-extend by-parts W=2048":
        params.update(neighbor_window=2048, far_positions="by-parts")
    remap = (attention_level.dual_chunk_remap if method == "dual-chunk" else attention_level.self_extend_remap)(params)
    tiny = torch.zeros(1, 1, length, 2)
    positions = torch.arange(length)[None]
    calls = []
    original_call = attention_level._partial_attention
    monkeypatch.setattr(attention_level, "_partial_attention",
                        lambda *a, **kw: calls.append((a[3] is not None, kw.get("causal", False))) or original_call(*a, **kw))
    with torch.no_grad():
        attention_level.remapped_attention(
            tiny, tiny, tiny, query_positions=positions, key_positions=positions, allowed=lambda a, b: None,
            remap=remap, inv_freq=torch.ones(1, dtype=torch.float64), scaling=1.0,
            query_chunk=attention_level.QUERY_CHUNK_CUDA,
        )
    assert calls and not any(masked for masked, _ in calls)
    assert sum(causal for _, causal in calls) > length // attention_level.QUERY_CHUNK_CUDA


def test_cut_query_chunks_give_the_unchunked_result():
    """Chunks of 13 queries, cut again at each group change, give what one uncut chunk of every query
    computes (float64)."""
    torch.manual_seed(0)
    query, key, value = (torch.randn(1, 2, LENGTH, 8, dtype=torch.float64) for _ in range(3))
    positions = torch.arange(LENGTH)[None]
    theta = 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    remap = attention_level.SelfExtendRemap(None, 8, L0)
    assert len(remap.query_breaks(0, LENGTH - 1)) >= 3
    common = dict(query_positions=positions, key_positions=positions, allowed=lambda a, b: None, remap=remap,
                  inv_freq=theta, scaling=0.3)
    class Uncut(attention_level.SelfExtendRemap):
        def query_breaks(self, q_lo, q_hi):
            return []

    with torch.no_grad():
        whole = attention_level.remapped_attention(
            query, key, value, query_chunk=LENGTH, **{**common, "remap": Uncut(None, 8, L0)}
        )
        cut = attention_level.remapped_attention(query, key, value, query_chunk=13, **common)
    # (the rotation tables are float32: the two orders of merging agree to that precision)
    torch.testing.assert_close(cut, whole, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "method, params, message",
    [
        ("self-extend", {"group_size": 0}, "group_size must be at least 2"),
        ("self-extend", {"group_size": 1}, "group_size must be at least 2"),
        ("self-extend", {"neighbor_window": L0}, "neighbor_window must be between 1"),
        ("self-extend", {"neighbor_window": 0}, "neighbor_window must be between 1"),
        ("self-extend", {"neighbor_window": 4.5}, "whole number"),
        ("self-extend", {"group_size": 2, "neighbor_window": 16}, "the smallest group_size that fits is"),
        # above the extended context (4 x 32 = 128) every far key shares position 0; 10**30 overflowed int64
        ("self-extend", {"group_size": 4 * L0 + 1}, "group_size must be at most the extended context \\(128"),
        ("self-extend", {"group_size": 10**30}, "group_size must be at most the extended context"),
        ("self-extend", {"group_size": 1e300}, "group_size must be at most the extended context"),
        ("self-extend", {"group_size": "4"}, "whole number"),
        ("self-extend", {"window": 8}, "accepts: group_size, neighbor_window"),
        ("self-extend", {"far_positions": "yarn"}, "far_positions must be one of"),
        ("self-extend", {"far_positions": None}, "far_positions must be one of"),
        ("dual-chunk", {"chunk_size": 30, "local_window": 4}, "chunk_size \\+ local_window <"),
        ("dual-chunk", {"chunk_size": 0}, "1 <= chunk_size"),
        ("dual-chunk", {"local_window": -1}, "local_window must be >= 0"),
    ],
)
def test_bad_parameters_are_refused_and_the_model_is_untouched(method, params, message):
    model = make_model("llama", attn_implementation="sdpa")
    ids = random_ids(LENGTH)
    with torch.no_grad():
        before = model(ids).logits
    with pytest.raises((ValueError, TypeError), match=message):
        patch_model(model, scale=4, method=method, **params)
    assert get_patch_info(model) is None
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def _smallest_fitting_group(original: int, window: int, target: int) -> int | None:
    """The paper's bound, by brute force: the smallest G whose farthest grouped distance,
    max over queries i < target of floor(i / G) + W - floor(W / G), stays below L0."""
    for group in range(2, target + 1):
        if all(i // group + window - window // group < original for i in range(original, target)):
            return group
    return None


@pytest.mark.parametrize("original, window, scale", [(64, 52, 4), (64, 60, 4), (64, 63, 4), (32, 6, 4), (17, 9, 3.5),
                                                      (32, 16, 4), (64, 8, 8)])
def test_a_too_small_group_size_is_refused_with_the_smallest_one_that_fits(original, window, scale):
    """The hint used to be ceil((T - W) / (L0 - W)) + 1, which ignores floor(W / G): following it
    gave the same error again (W=52 on 64 tokens x4: 18, refused) or a larger G than needed."""
    from hf_rope_ext import PatchSpec

    target = round(original * scale)
    needed = _smallest_fitting_group(original, window, target)
    assert needed is not None and needed > 2
    with pytest.raises(ValueError, match=f"reaches distance .* the smallest group_size that fits is {needed};"):
        PatchSpec("self-extend", scale, original, {"group_size": needed - 1, "neighbor_window": window})
    spec = PatchSpec("self-extend", scale, original, {"group_size": needed, "neighbor_window": window})
    assert spec.params["group_size"] == needed


def test_a_patch_spec_made_directly_checks_the_attention_level_parameters():
    """PatchSpec(...), dataclasses.replace and from_record refuse what patch_model refuses, when made:
    they used to be refused only when applied to a model."""
    import dataclasses

    from hf_rope_ext import PatchSpec
    from hf_rope_ext.spec import RecordError

    bad = [("self-extend", {"group_size": 0}, "group_size must be at least 2"),
           ("self-extend", {"far_positions": "bogus"}, "far_positions must be one of"),
           ("self-extend", {"group_size": 10**30}, "at most the extended context"),
           ("dual-chunk", {"chunk_size": L0}, "chunk_size \\+ local_window <"),
           ("self-extend-yarn", {"neighbor_window": L0}, "neighbor_window must be between 1"),
           ("self-extend-dca", {"chunk_size": L0}, "chunk_size \\+ local_window <")]
    for method, params, message in bad:
        with pytest.raises(ValueError, match=message):
            PatchSpec(method, 4, L0, params)
        with pytest.raises(ValueError, match=message):
            PatchSpec.create(method, 4, original_max_length=L0, **params)
    spec = PatchSpec("self-extend", 4, L0, {"group_size": 8}, original_rope_theta=10000.0)
    with pytest.raises(ValueError, match="group_size must be at least 2"):
        dataclasses.replace(spec, params={**spec.params, "group_size": 1})
    # group 8 covers 4 x 32 tokens (127 // 8 + 16 - 2 = 29 < 32), not 16 x 32 (511 // 8 + 14 = 77)
    with pytest.raises(ValueError, match="reaches distance 77 at 512 tokens"):
        dataclasses.replace(spec, scale=16)
    record = spec.to_record()
    record["params"]["group_size"] = 0
    with pytest.raises(RecordError, match="rope_patch.json has parameters method 'self-extend' does not accept: .*at least 2"):
        PatchSpec.from_record(record, source="rope_patch.json")


def test_a_fixed_group_size_warns_once_when_a_sequence_outgrows_it(caplog):
    """A fixed group keeps distances inside L0 up to the extended context it was checked for;
    a longer sequence reaches untrained distances: say so, once per patch."""
    model = make_model("llama", attn_implementation="sdpa")
    patch_model(model, scale=4, method="self-extend", group_size=8, neighbor_window=8)
    with caplog.at_level("WARNING", logger="hf_rope_ext.attention"), torch.no_grad():
        model(random_ids(4 * L0))  # 127 // 8 + 8 - 1 = 22: inside
        assert "beyond the trained" not in caplog.text
        model(random_ids(300))
        model(random_ids(300))
    farthest = 299 // 8 + 8 - 8 // 8  # the paper's grouped distance of the last query to key 0
    assert farthest >= L0
    messages = [r.getMessage() for r in caplog.records if "beyond the trained" in r.getMessage()]
    assert messages == [f"self-extend with group_size=8: a sequence of 300 tokens reaches relative distance {farthest}, "
                        f"beyond the trained {L0} (its parameters were checked for the patch's extended context only); "
                        "patch again with a larger scale, or leave group_size unset."]
    caplog.clear()
    patch_model(model, scale=4, method="self-extend")  # a group per query: fits at any length
    with caplog.at_level("WARNING", logger="hf_rope_ext.attention"), torch.no_grad():
        model(random_ids(600))
    assert "beyond the trained" not in caplog.text


def test_logn_attention_must_be_a_bool():
    model = make_model("llama")
    with pytest.raises(TypeError, match="logn_attention must be True or False"):
        patch_model(model, scale=4, method="yarn", logn_attention="yes")


def test_a_logn_suffix_with_logn_attention_false_is_refused():
    """``"ntk+logn"`` and ``logn_attention=False`` contradict each other: log-n was turned on silently."""
    model = make_model("llama")
    with pytest.raises(ValueError, match=r"'ntk\+logn' turns log-n attention on, but logn_attention=False"):
        patch_model(model, scale=2, method="ntk+logn", logn_attention=False)
    assert get_patch_info(model) is None
    for arguments in ({"method": "ntk+logn"}, {"method": "ntk+logn", "logn_attention": True},
                      {"method": "ntk", "logn_attention": True}):
        patch_model(model, scale=2, **arguments)
        assert get_patch_info(model).logn_attention is True
    for arguments in ({"method": "ntk", "logn_attention": False}, {"method": "ntk"}):
        patch_model(model, scale=2, **arguments)
        assert get_patch_info(model).logn_attention is False


def test_unsupported_attention_implementation_is_refused():
    model = make_model("llama", attn_implementation="sdpa")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="attn_implementation"):
        patch_model(model, scale=4, method="self-extend")
    assert get_patch_info(model) is None


def test_position_ids_with_a_gap_are_honoured():
    """Keys take the positions of their own tokens, also when the position ids jump."""
    model = make_model("llama", attn_implementation="sdpa")
    ids = random_ids(40)
    positions = torch.cat((torch.arange(20), torch.arange(80, 100)))[None]
    group, window = 6, 8

    def position_fn(i, j):
        pq, pk = self_extend_positions(int(positions[0, i]), int(positions[0, j]), group, window)
        return pq - int(positions[0, i]) + i, pk - int(positions[0, j]) + j  # same shifts, at index coordinates

    expected = reference_logits_at(model, ids, positions, position_fn)
    patch_model(model, scale=4, method="self-extend", group_size=group, neighbor_window=window)
    with torch.no_grad():
        actual = model(ids, position_ids=positions).logits
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)


# ----------------------------------------------------------------------------------------------
# Sliding windows and packed sequences, in every attention implementation
# ----------------------------------------------------------------------------------------------

SLIDING_WINDOW = 24  # < L0: the window cuts pairs inside and beyond the native context


def _as_flash_attention(model):
    """The model as transformers' flash-attention path calls it: masks that are None or a padding
    mask, the window and packed sequences passed as arguments. Beyond ``L0`` the patched attention
    never calls the flash kernel, so this runs on any device (calls inside ``L0`` would need it)."""
    model.config._attn_implementation = "flash_attention_2"
    return model


SLIDING_MODELS = {
    "mistral": dict(sliding_window=SLIDING_WINDOW),  # every layer
    "qwen2": dict(use_sliding_window=True, sliding_window=SLIDING_WINDOW, max_window_layers=1),  # layer 1 only
}


@pytest.mark.parametrize("case", ["self-extend", "dual-chunk"])
@pytest.mark.parametrize("implementation", ["eager", "sdpa", "flash_attention_2"])
@pytest.mark.parametrize("sliding_family", list(SLIDING_MODELS))
def test_sliding_window_matches_naive_reference(sliding_family, implementation, case):
    """A sliding-window model reads only its window, whichever implementation computes it."""
    model = make_model(sliding_family, attn_implementation="eager" if implementation == "eager" else "sdpa",
                       **SLIDING_MODELS[sliding_family])
    ids = random_ids(LENGTH)
    params, position_fn = PAPER_CASES[case]
    # the reference's window is transformers' own: unpatched, it gives the model's logits
    with torch.no_grad():
        unpatched = model(ids).logits
    torch.testing.assert_close(reference_logits(model, ids, lambda i, j: (i, j), window=True), unpatched,
                               atol=2e-5, rtol=1e-4)
    expected = reference_logits(model, ids, position_fn, window=True)
    unwindowed = reference_logits(model, ids, position_fn)
    assert (expected[:, SLIDING_WINDOW:] - unwindowed[:, SLIDING_WINDOW:]).abs().max() > 1e-2
    if implementation == "flash_attention_2":
        _as_flash_attention(model)
    patch_model(model, scale=4, method=case, **params)
    with torch.no_grad():
        actual = model(ids).logits
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("method", ["self-extend", "dual-chunk"])
def test_flash_attention_padding_mask_with_a_window_equals_sdpa(method):
    """Flash attention's padding mask (B, T) with the window as an argument reads what sdpa's
    4-D mask allows, row by row (left padding; transformers gives both the same positions)."""
    ids = random_ids(LENGTH, batch=2)
    mask = torch.ones_like(ids)
    mask[0, :9] = 0
    outputs = []
    for flash in (False, True):
        model = make_model("mistral", attn_implementation="sdpa", sliding_window=SLIDING_WINDOW)
        if flash:
            _as_flash_attention(model)
        patch_model(model, scale=4, method=method)
        with torch.no_grad():
            outputs.append(model(ids, attention_mask=mask).logits)
    torch.testing.assert_close(outputs[1][0, 9:], outputs[0][0, 9:], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(outputs[1][1], outputs[0][1], atol=2e-5, rtol=1e-4)


def test_flash_attention_with_a_window_generates_as_a_full_forward():
    """The window with a cache (transformers keeps only the window's keys) and flash-style masks."""
    model = make_model("mistral", attn_implementation="sdpa", sliding_window=SLIDING_WINDOW)
    patch_model(model, scale=4, method="self-extend", neighbor_window=8)
    twin = _as_flash_attention(make_model("mistral", attn_implementation="sdpa", sliding_window=SLIDING_WINDOW))
    patch_model(twin, scale=4, method="self-extend", neighbor_window=8)
    prompt = random_ids(L0 + 8)  # every call beyond L0: no flash kernel needed
    with torch.no_grad():
        out = twin.generate(prompt, max_new_tokens=LENGTH - prompt.shape[1], do_sample=False, output_logits=True,
                            return_dict_in_generate=True, pad_token_id=0)
        full = model(out.sequences).logits
    torch.testing.assert_close(torch.stack(out.logits, dim=1), full[:, prompt.shape[1] - 1 : -1], atol=5e-5, rtol=1e-4)


def _flash_stand_in(seen: list):
    """A stand-in for transformers' flash-attention function, which needs a GPU and the flash-attn
    package: it records the implementation name the module's config shows (the real function
    picks its kernel by it) and computes causal attention with transformers' sdpa function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def flash(module, query, key, value, attention_mask, **kwargs):
        seen.append(module.config._attn_implementation)
        assert attention_mask is None or bool(attention_mask.all())  # unpadded: what the tests give it
        kwargs.pop("sliding_window", None)  # the tests' model has no window
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)

    return flash


def test_flash_attention_inside_the_native_context_gets_its_own_implementation_name(monkeypatch):
    """Inside L0 the patched attention hands the call to the model's own flash-attention function,
    which reads its kernel's name from the module's config: it sees "flash_attention_2", not the
    patch's registry name; then generation across L0 equals a full forward."""
    seen = []
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flash_attention_2", _flash_stand_in(seen))
    model = _as_flash_attention(make_model("llama", attn_implementation="sdpa"))
    reference = make_model("llama", attn_implementation="sdpa")
    patch_model(model, scale=4, method="self-extend", neighbor_window=8)
    patch_model(reference, scale=4, method="self-extend", neighbor_window=8)
    prompt = random_ids(20)
    with torch.no_grad():
        torch.testing.assert_close(model(prompt).logits, reference(prompt).logits, atol=1e-6, rtol=1e-6)
        assert seen and set(seen) == {"flash_attention_2"}
        out = model.generate(prompt, max_new_tokens=LENGTH - 20, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        full = reference(out.sequences).logits
    torch.testing.assert_close(torch.stack(out.logits, dim=1), full[:, 19:-1], atol=5e-5, rtol=1e-4)
    assert set(seen) == {"flash_attention_2"}


PACKED_LENGTHS = (60, 20, 50)  # beyond L0, inside it, beyond it


@pytest.mark.parametrize("method", ["self-extend", "dual-chunk", "self-extend+logn"])
@pytest.mark.parametrize("packing", ["flash, position ids", "flash, cu_seq_lens", "sdpa, no cache", "sdpa, a cache"])
def test_packed_sequences_each_equal_their_own_forward(method, packing):
    """Sequences packed into one row (DataCollatorWithFlattening) never read each other, as
    transformers' own paths have it: sdpa through its block mask, flash attention through the
    position ids that restart or the ``cu_seq_lens`` arguments. With a cache (use_cache's
    default) sdpa gets no mask at all for a model without a window; the earlier sequences must
    still not see later tokens."""
    shape = {"family": "llama"} if packing == "sdpa, a cache" else {"family": "mistral", "sliding_window": SLIDING_WINDOW}
    model = make_model(attn_implementation="sdpa", **shape)
    patch_model(model, scale=4, method=method)
    packed_model = make_model(attn_implementation="sdpa", **shape)  # same weights
    kwargs = {}
    if packing == "sdpa, no cache":
        kwargs["use_cache"] = False  # transformers reads packing from position ids only without a cache
    elif packing.startswith("flash"):
        _as_flash_attention(packed_model)
    patch_model(packed_model, scale=4, method=method)
    sequences = [random_ids(n, seed=seed) for seed, n in enumerate(PACKED_LENGTHS)]
    ids = torch.cat(sequences, dim=1)
    positions = torch.cat([torch.arange(n) for n in PACKED_LENGTHS])[None]
    if packing == "flash, cu_seq_lens":
        bounds = torch.tensor([0, 60, 80, 130], dtype=torch.int32)
        kwargs.update(cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=60, max_length_k=60)
    with torch.no_grad():
        alone = torch.cat([model(sequence).logits for sequence in sequences], dim=1)
        packed = packed_model(ids, position_ids=positions, **kwargs).logits
    torch.testing.assert_close(packed, alone, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("method", ["self-extend-yarn", "self-extend", "dual-chunk"])
def test_static_cache_with_a_4d_mask_of_the_callers_own_equals_a_full_forward(method):
    """A 4-D mask passed in skips transformers' mask function, which records where the tokens sit in
    the cache: the slots are read from the mask then (a static cache is longer than its tokens),
    and never from an earlier forward's geometry."""
    from transformers import StaticCache

    model = make_model("llama", attn_implementation="sdpa")
    patch_model(model, scale=4, method=method)
    ids = random_ids(3 * L0 + 4, seed=2)
    length, size = ids.shape[1], 4 * L0
    causal = (torch.arange(size)[None, :] <= torch.arange(length)[:, None])[None, None]
    with torch.no_grad(), planned_length(model, length):
        full = model(ids).logits
        cache = StaticCache(config=model.config, max_cache_len=size)
        model(ids, past_key_values=cache)  # leaves the geometry of (length, size) behind
        cache = StaticCache(config=model.config, max_cache_len=size)
        prefill = length - 6
        out = [model(ids[:, :prefill], attention_mask=causal[:, :, :prefill], past_key_values=cache).logits]
        for step in range(prefill, length):  # a decode loop with the caller's masks
            out.append(model(ids[:, step : step + 1], attention_mask=causal[:, :, step : step + 1],
                             past_key_values=cache, position_ids=torch.tensor([[step]])).logits)  # fmt: skip
    torch.testing.assert_close(torch.cat(out, dim=1), full, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("prefill_positions", ["given", "taken from the cache", "cache made by the model"])
@pytest.mark.parametrize("method", ["self-extend", "dual-chunk", "self-extend-yarn"])
def test_continuing_a_cache_with_positions_that_jump_is_refused(method, prefill_positions):
    """The cached keys are taken to sit just before the new tokens (their positions are not kept):
    a continuation whose positions jump would be computed with wrong distances, so it is refused,
    the cache untouched; the positions that follow give the full forward's logits. A prefill
    without position ids (the model takes them from the cache) ends at known positions too: it was
    not checked, and the jump gave logits 0.65 off."""
    from transformers import DynamicCache

    model = make_model("llama", attn_implementation="sdpa")
    patch_model(model, scale=4, method=method)
    ids = random_ids(70, seed=2)
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), planned_length(model, 70):
        full = model(ids).logits[:, 60:]
        if prefill_positions == "given":
            model(ids[:, :60], position_ids=torch.arange(60)[None], past_key_values=cache)
        elif prefill_positions == "taken from the cache":
            model(ids[:, :60], past_key_values=cache)
        else:
            cache = model(ids[:, :60], use_cache=True).past_key_values
        with pytest.raises(ValueError, match=r"position_ids start at \[70\], not \[60\]"):
            model(ids[:, 60:], position_ids=torch.arange(70, 80)[None], past_key_values=cache)
        assert cache.get_seq_length() == 60
        step = model(ids[:, 60:], position_ids=torch.arange(60, 70)[None], past_key_values=cache).logits
    torch.testing.assert_close(step, full, atol=5e-5, rtol=1e-4)


def test_packed_sequences_with_other_key_boundaries_are_refused():
    model = _as_flash_attention(make_model("llama", attn_implementation="sdpa"))
    patch_model(model, scale=4, method="self-extend")
    ids = random_ids(80)  # beyond L0: no flash kernel needed
    with pytest.raises(ValueError, match="cu_seq_lens_k equal to cu_seq_lens_q"):
        model(ids, cu_seq_lens_q=torch.tensor([0, 40, 80]), cu_seq_lens_k=torch.tensor([0, 30, 80]))


@pytest.mark.slow
def test_real_model_at_12k_the_default_beats_yarn_beyond_8k():
    """SmolLM2-135M (native 8192): one 12,288-token forward of a novel, unpatched, with yarn x2 and with
    the default (at 12k Self-Extend by-parts, window 2048, on the trained frequencies), scale 2. Inside 8k the default is the unpatched model; beyond, the unpatched model
    degrades and the default reads better than yarn (numbers in README, "Results")."""
    from pathlib import Path

    from hf_rope_ext.data import read_text, tokenize
    from hf_rope_ext.evaluation.perplexity import bucket_perplexity
    from hf_rope_ext.loading import load_model
    from hf_rope_ext.patching import DEFAULT_METHOD

    book = Path(__file__).resolve().parents[2] / "shared" / "data" / "books" / "pg84.txt"
    if not book.is_file():
        pytest.skip(f"{book} not found")
    try:
        model, tokenizer = load_model("smollm2", device="cpu")
    except (FileNotFoundError, ImportError) as error:
        pytest.skip(f"SmolLM2 unavailable: {error}")
    ids = tokenize(tokenizer, read_text(book))
    edges = [0, 4096, 8192, 12288]

    def ppl_by_range(method=None, **params):
        if method is not None:
            patch_model(model, 2, method, **params)
        try:
            with torch.no_grad():
                result = bucket_perplexity(model, [ids], 12288, boundaries=edges)
        finally:
            if method is not None:
                unpatch_model(model)
        return [math.exp(total / count) for total, count in zip(result.nll_sums, result.token_counts)]

    unpatched, yarn, default = ppl_by_range(), ppl_by_range("yarn"), ppl_by_range(DEFAULT_METHOD)
    print(f"\nppl 0-4k / 4k-8k / 8k-12k: unpatched {unpatched}, yarn x2 {yarn}, {DEFAULT_METHOD} x2 {default}")
    assert default[:2] == pytest.approx(unpatched[:2], rel=1e-4)  # inside the native context: the same model
    assert unpatched[2] > 1.25 * default[2]  # the unpatched model degrades beyond 8192 ...
    assert default[2] < yarn[2]  # ... and the default reads beyond it better than yarn


def test_gradients_match_the_reference():
    """Fine-tuning through self-extend: the backward pass of the chunked kernel equals autograd through the reference."""
    ids = random_ids(LENGTH)
    reference = make_model("llama", attn_implementation="sdpa").train()
    theta_fn = lambda i, j: self_extend_positions(i, j, 6, 8)  # noqa: E731

    # the reference's loss, with its attention plugged in under a test-only name
    head_dim = reference.model.layers[0].self_attn.head_dim
    theta = 1.0 / reference.config.rope_parameters["rope_theta"] ** (
        torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    )
    AttentionInterface.register("test_naive_grad", naive_attention_factory(theta_fn, theta))
    AttentionMaskInterface.register("test_naive_grad", AttentionMaskInterface._global_mapping["sdpa"])
    reference.config._attn_implementation = "test_naive_grad"
    try:
        reference(ids, labels=ids).loss.backward()
    finally:
        reference.config._attn_implementation = "sdpa"
        del AttentionInterface._global_mapping["test_naive_grad"]
        del AttentionMaskInterface._global_mapping["test_naive_grad"]

    patched = make_model("llama", attn_implementation="sdpa").train()
    patch_model(patched, scale=4, method="self-extend", group_size=6, neighbor_window=8)
    patched(ids, labels=ids).loss.backward()
    for (name, expected), (_, actual) in zip(reference.named_parameters(), patched.named_parameters()):
        scale = expected.grad.abs().max()
        assert (actual.grad - expected.grad).abs().max() <= 1e-4 * scale, (name, (actual.grad - expected.grad).abs().max(), scale)


@pytest.mark.parametrize(
    "method",
    ["self-extend", "self-extend by-parts", "dual-chunk", "dual-chunk yarn x2", "yarn+logn", "dynamic-yarn-dca", "self-extend-dca",
     "self-extend-yarn"],
)
def test_saved_checkpoint_loads_back_into_the_same_patch(method, tmp_path):
    from hf_rope_ext.hub import load_patched, save_patched

    model = make_model("llama", attn_implementation="sdpa")
    params = {"self-extend by-parts": {"far_positions": "by-parts", "neighbor_window": 8},
              "dual-chunk yarn x2": {"frequencies": "yarn", "frequencies_scale": 2.0},
              "dynamic-yarn-dca": {"frequencies_scale": 1.5, "chunk_size": 20, "local_window": 4},
              "self-extend-dca": {"frequencies_scale": 2.5, "neighbor_window": 6},
              "self-extend-yarn": {"frequencies_scale": 1.5, "neighbor_window": 4}}.get(method, {})  # fmt: skip
    method = method.split()[0]
    patch_model(model, scale=4, method=method, **params)
    ids = random_ids(LENGTH)
    with torch.no_grad():
        expected = model(ids).logits
    save_patched(model, tmp_path / "checkpoint")
    loaded = load_patched(tmp_path / "checkpoint", attn_implementation="sdpa")
    info = get_patch_info(loaded)
    assert (info.method, info.logn_attention) == (method.removesuffix("+logn"), method.endswith("+logn"))
    assert {key: info.params[key] for key in params} == params
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, expected)


@pytest.mark.parametrize("method", ["dual-chunk", "dynamic-yarn-dca", "self-extend-dca", "self-extend-yarn"])
def test_plain_from_pretrained_of_an_attention_level_checkpoint_warns(method, tmp_path, caplog):
    """from_pretrained rebuilds only the frequencies of an attention-level patch: it says so, naming
    load_patched; load_patched itself restores the attention and does not warn."""
    from transformers import AutoModelForCausalLM

    from hf_rope_ext.hub import load_patched, save_patched

    model = make_model("llama", attn_implementation="sdpa")
    patch_model(model, scale=4, method=method)
    save_patched(model, tmp_path / "checkpoint")
    with caplog.at_level("WARNING", logger="hf_rope_ext.config_io"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint")
    assert f"attention-level patch '{method}'" in caplog.text and "load_patched" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_rope_ext.config_io"):
        load_patched(tmp_path / "checkpoint", attn_implementation="sdpa")
    assert "attention-level patch" not in caplog.text


def test_explicit_path_equals_fused_kernel_path():
    """Training (and non-CPU devices) use an explicit float32 computation; it equals the fused CPU kernel."""
    torch.manual_seed(0)
    query, key, value = torch.randn(1, 4, 70, 16), torch.randn(1, 2, 70, 16), torch.randn(1, 2, 70, 16)
    positions = torch.arange(70)[None]
    theta = 1.0 / 10000 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    common = dict(query_positions=positions, key_positions=positions, allowed=lambda a, b: None,
                  remap=attention_level.DualChunkRemap(20, 4, L0), inv_freq=theta, scaling=0.25, query_chunk=16)
    with torch.no_grad():
        fused = attention_level.remapped_attention(query, key, value, **common)
    explicit = attention_level.remapped_attention(query.requires_grad_(), key, value, **common)
    torch.testing.assert_close(explicit.detach(), fused, atol=1e-5, rtol=1e-5)


def test_evaluation_never_reuses_plain_results_for_attention_level_methods(tmp_path):
    """Their frequencies are the original ones: the evaluation's reuse of identical cases must look further."""
    from hf_rope_ext.evaluation.runner import EvalPlan, run_evaluation

    from test_evaluation import CharTokenizer

    model = make_model("llama", attn_implementation="sdpa")
    documents = {"doc": random_ids(80)[0]}
    plan = EvalPlan(methods=["none", "self-extend", "self-extend+logn", "dual-chunk"], scales=[2.0], ppl_lengths=[24, 64],
                    ppl_modes=["buckets"], bucket_size=8, retrieval_tasks=[], chunk_size=16)
    records = run_evaluation(model, CharTokenizer(), plan, tmp_path, documents=documents, progress=False)
    by_case = {(r["method"], r["context_length"]): r for r in records}
    for method in ("self-extend", "self-extend+logn", "dual-chunk"):
        # inside the native context: the unpatched model, reused; beyond it: computed
        assert by_case[(method, 24)]["reused_from"]["method"] == "none"
        assert by_case[(method, 64)]["reused_from"] is None
        assert by_case[(method, 64)]["ppl"] != by_case[("none", 64)]["ppl"]
    patch_model(model, 2.0, "self-extend")
    from hf_rope_ext.evaluation.perplexity import bucket_perplexity

    expected = bucket_perplexity(model, [documents["doc"]], 64, bucket_size=8, chunk_size=16).ppl
    assert by_case[("self-extend", 64)]["ppl"] == pytest.approx(expected, rel=1e-6)


def test_evaluation_reuses_dynamic_yarn_dca_only_where_it_has_no_remap(tmp_path):
    """Up to 2 x L0 the default is dynamic-yarn (its result is reused); beyond, dual chunk attention is on."""
    from hf_rope_ext.evaluation.runner import EvalPlan, run_evaluation

    from test_evaluation import CharTokenizer

    model = make_model("llama", attn_implementation="sdpa")
    documents = {"doc": random_ids(100)[0]}
    plan = EvalPlan(methods=["dynamic-yarn", "dynamic-yarn-dca"], scales=[4.0], ppl_lengths=[48, 96],
                    ppl_modes=["buckets"], bucket_size=8, retrieval_tasks=[], chunk_size=16)
    records = run_evaluation(model, CharTokenizer(), plan, tmp_path, documents=documents, progress=False)
    by_case = {(r["method"], r["context_length"]): r for r in records}
    assert by_case[("dynamic-yarn-dca", 48)]["reused_from"]["method"] == "dynamic-yarn"
    assert by_case[("dynamic-yarn-dca", 96)]["reused_from"] is None
    patch_model(model, 4.0, "dual-chunk", frequencies="yarn", frequencies_scale=2)
    from hf_rope_ext.evaluation.perplexity import bucket_perplexity

    expected = bucket_perplexity(model, [documents["doc"]], 96, bucket_size=8, chunk_size=16).ppl
    assert by_case[("dynamic-yarn-dca", 96)]["ppl"] == pytest.approx(expected, rel=1e-6)
    assert by_case[("dynamic-yarn-dca", 96)]["ppl"] != pytest.approx(by_case[("dynamic-yarn", 96)]["ppl"], rel=1e-4)


def test_dual_chunk_on_yarn_frequencies_matches_reference():
    """Combined with a frequency method (as Qwen2.5-1M runs DCA with YaRN): transformers' own yarn rotary
    module plus the naive dual-chunk attention over yarn's frequencies."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = make_model("qwen2", attn_implementation="sdpa")
    ids = random_ids(LENGTH)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L0}
    twin = native_twin(model, yarn, max_position_embeddings=4 * L0)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["yarn"](twin.config, "cpu")
    expected = reference_logits_at(twin, ids, None, lambda i, j: dual_chunk_positions(i, j, 20, 4), theta=inv_freq.double())
    patch_model(model, scale=4, method="dual-chunk", chunk_size=20, local_window=4, frequencies="yarn")
    with torch.no_grad():
        actual = model(ids).logits
    torch.testing.assert_close(actual, expected, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("method", ["dual-chunk", "self-extend"])
def test_frequencies_at_their_own_scale_match_reference(method):
    """``frequencies_scale=2`` on a x4 patch: transformers' yarn x2 rotary module, the naive remap over its
    frequencies at the x4 patch's length."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = make_model("llama", attn_implementation="sdpa")
    ids = random_ids(LENGTH)
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": L0}
    twin = native_twin(model, yarn, max_position_embeddings=2 * L0)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["yarn"](twin.config, "cpu")
    if method == "dual-chunk":
        params, position_fn = {"chunk_size": 20, "local_window": 4}, lambda i, j: dual_chunk_positions(i, j, 20, 4)
    else:
        params, position_fn = {"group_size": 6, "neighbor_window": 8}, lambda i, j: self_extend_positions(i, j, 6, 8)
    expected = reference_logits_at(twin, ids, None, position_fn, theta=inv_freq.double())
    patch_model(model, scale=4, method=method, frequencies="yarn", frequencies_scale=2, **params)
    assert get_patch_info(model).scale == 4
    with torch.no_grad():
        actual = model(ids).logits
    torch.testing.assert_close(actual, expected, atol=5e-5, rtol=1e-4)


def _yarn_twin(model, factor):
    """transformers' own yarn rotary module at ``factor`` on a copy of ``model``, and its frequencies."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    yarn = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": L0}
    twin = native_twin(model, yarn, max_position_embeddings=math.ceil(factor * L0))
    inv_freq, _ = ROPE_INIT_FUNCTIONS["yarn"](twin.config, "cpu")
    return twin, inv_freq.double()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_dynamic_yarn_dca_matches_references(family):
    """Inside L0 the unpatched model bitwise; up to 2 x L0 transformers' yarn at scale L / L0 with plain
    attention; beyond, transformers' yarn x2 with the naive dual chunk positions of the paper."""
    model = make_model(family, attn_implementation="sdpa")
    ids = random_ids(LENGTH)
    with torch.no_grad():
        unpatched = model(ids[:, :L0]).logits
    twin_long, inv_freq = _yarn_twin(model, 2.0)
    expected_long = reference_logits_at(twin_long, ids, None, lambda i, j: dual_chunk_positions(i, j, 20, 4), theta=inv_freq)
    middle = 50  # between L0 and 2 x L0
    twin_middle, _ = _yarn_twin(model, middle / L0)
    with torch.no_grad():
        expected_middle = twin_middle(ids[:, :middle]).logits
    patch_model(model, scale=4, method="dynamic-yarn-dca", chunk_size=20, local_window=4, steps_per_doubling=None)
    with torch.no_grad():
        assert torch.equal(model(ids[:, :L0]).logits, unpatched)
        torch.testing.assert_close(model(ids[:, :middle]).logits, expected_middle, atol=5e-5, rtol=1e-4)
        torch.testing.assert_close(model(ids).logits, expected_long, atol=5e-5, rtol=1e-4)
    # the long reference is not yarn x2 with plain attention (the remap is really on)
    with torch.no_grad():
        plain_x2 = twin_long(ids).logits
    assert (plain_x2[:, 2 * L0 :] - expected_long[:, 2 * L0 :]).abs().max() > 1e-2


@pytest.mark.parametrize("method", ["self-extend-dca", "self-extend-yarn"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_self_extend_defaults_match_references(family, method):
    """Inside L0 the unpatched model bitwise; up to 2 x L0 the trained frequencies with the naive
    Self-Extend by-parts positions (window L0 / 4, a group per query); beyond, transformers' yarn x2
    with the naive dual chunk positions of the paper (self-extend-dca) or the naive by-parts
    positions over yarn's frequencies (self-extend-yarn)."""
    model = make_model(family, attn_implementation="sdpa")
    ids = random_ids(LENGTH)
    head_dim = model.model.layers[0].self_attn.head_dim
    theta = 1.0 / model.config.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    with torch.no_grad():
        unpatched = model(ids[:, :L0]).logits
    middle = 2 * L0  # the settle length: still the first state
    expected_middle = reference_logits(model, ids[:, :middle], lambda i, j: self_extend_by_parts_positions(i, j, None, L0 // 4, theta))
    plain_middle = reference_logits(model, ids[:, :middle], lambda i, j: (i, j))
    twin_long, inv_freq = _yarn_twin(model, 2.0)
    if method == "self-extend-dca":
        params, position_fn = {"chunk_size": 20, "local_window": 4}, lambda i, j: dual_chunk_positions(i, j, 20, 4)
    else:
        params, position_fn = {}, lambda i, j: self_extend_by_parts_positions(i, j, None, L0 // 4, inv_freq)
    expected_long = reference_logits_at(twin_long, ids, None, position_fn, theta=inv_freq)
    patch_model(model, scale=4, method=method, **params)
    with torch.no_grad():
        assert torch.equal(model(ids[:, :L0]).logits, unpatched)
        actual_middle = model(ids[:, :middle]).logits
        torch.testing.assert_close(actual_middle, expected_middle, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(model(ids).logits, expected_long, atol=5e-5, rtol=1e-4)
    # the remap is really on below the settle length
    assert (actual_middle[:, L0:] - plain_middle[:, L0:]).abs().max() > 1e-2


@pytest.mark.parametrize(
    "method, beyond",
    [("self-extend-dca", dict(scale=4, method="dynamic-yarn-dca")),
     ("self-extend-yarn", dict(scale=4, method="self-extend", frequencies="yarn", frequencies_scale=2,
                               neighbor_window=L0 // 4, far_positions="by-parts"))],
)
def test_self_extend_defaults_equal_their_parts_bitwise(method, beyond):
    """Between L0 and 2 x L0 both compute what ``self-extend`` (by-parts, W = L0 / 4) at scale 2
    computes, and beyond 2 x L0 what the configuration they name computes, to the last bit: the
    measurements of those configurations on a real model hold for them."""
    model = make_model("llama", attn_implementation="sdpa")
    for length, twin in ((2 * L0, dict(scale=2, method="self-extend", neighbor_window=L0 // 4, far_positions="by-parts")),
                         (LENGTH, beyond)):
        ids = random_ids(length)
        patch_model(model, **twin)
        with torch.no_grad():
            expected = model(ids).logits
        patch_model(model, scale=4, method=method)
        with torch.no_grad():
            assert torch.equal(model(ids).logits, expected), length
        unpatch_model(model)


@pytest.mark.parametrize("method", ["self-extend-dca", "self-extend-yarn"])
def test_self_extend_defaults_refuse_bad_parameters(method):
    model = make_model("llama", attn_implementation="sdpa")
    with pytest.raises(ValueError, match=f"{method}: neighbor_window must be between 1 and"):
        patch_model(model, scale=4, method=method, neighbor_window=L0)
    with pytest.raises(TypeError, match=f"{method}: neighbor_window must be a whole number"):
        patch_model(model, scale=4, method=method, neighbor_window=2.5)
    with pytest.raises(ValueError, match="frequencies_scale must be a number above 1"):
        patch_model(model, scale=4, method=method, frequencies_scale=1)
    with pytest.raises(ValueError, match=f"steps_per_doubling does not apply to '{method}'"):
        patch_model(model, scale=4, method=method, steps_per_doubling=2)
    if method == "self-extend-dca":
        with pytest.raises(ValueError, match="chunk_size \\+ local_window <"):
            patch_model(model, scale=4, method=method, chunk_size=30, local_window=4)
    else:
        with pytest.raises(ValueError, match="accepts: beta_fast"):
            patch_model(model, scale=4, method=method, chunk_size=30)
    assert get_patch_info(model) is None and model.config._attn_implementation == "sdpa"


def test_dynamic_yarn_dca_bad_parameters_are_refused():
    model = make_model("llama", attn_implementation="sdpa")
    for bad in (1, 0.5):
        with pytest.raises(ValueError, match="frequencies_scale must be a number above 1"):
            patch_model(model, scale=4, method="dynamic-yarn-dca", frequencies_scale=bad)
    for bad in (True, "2", float("nan"), float("inf"), None):
        with pytest.raises(TypeError, match="'frequencies_scale' of method 'dynamic-yarn-dca' must be a finite number"):
            patch_model(model, scale=4, method="dynamic-yarn-dca", frequencies_scale=bad)
    with pytest.raises(ValueError, match="chunk_size \\+ local_window <"):
        patch_model(model, scale=4, method="dynamic-yarn-dca", chunk_size=30, local_window=4)
    with pytest.raises(ValueError, match="beta_fast > beta_slow"):
        patch_model(model, scale=4, method="dynamic-yarn-dca", beta_fast=1, beta_slow=2)
    assert get_patch_info(model) is None and model.config._attn_implementation == "sdpa"


def test_frequencies_must_name_a_static_frequency_method():
    model = make_model("llama")
    for bad in ("dynamic-yarn", "self-extend", "longrope", "nope", 3):
        with pytest.raises(ValueError, match="not a static frequency method"):
            patch_model(model, scale=4, method="self-extend", frequencies=bad)
    with pytest.raises(ValueError, match="give frequencies= too"):
        patch_model(model, scale=4, method="dual-chunk", frequencies_scale=2)
    for bad in (1, 0.5, True, "2", float("nan"), float("inf")):
        with pytest.raises(ValueError, match="frequencies_scale must be a number above 1"):
            patch_model(model, scale=4, method="dual-chunk", frequencies="yarn", frequencies_scale=bad)
    assert get_patch_info(model) is None


def test_decode_step_benchmark_times_real_steps_and_restores_the_model(monkeypatch):
    """examples/benchmark_speed.py's decode-step benchmark: every method is timed on a step over the
    prefilled cache beyond L0 (the attention-level function runs, with one query), and the model
    is left unpatched with its own attention."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "benchmark_speed.py"
    spec = importlib.util.spec_from_file_location("benchmark_speed", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = make_model("llama", attn_implementation="sdpa")
    ids = random_ids(3 * L0 + 1)
    query_lengths = []
    real = attention_level.remapped_attention

    def recording(query, *args, **kwargs):
        query_lengths.append(query.shape[2])
        return real(query, *args, **kwargs)

    monkeypatch.setattr(attention_level, "remapped_attention", recording)
    results = module.decode_step_benchmark(model, ids, ["self-extend", "dual-chunk"], 4.0, repeats=2)
    assert set(results) == {"none", "self-extend", "dual-chunk"}
    assert all(row["min_s"] > 0 and row["ratio"] > 0 for row in results.values())
    # 2 rounds of 2 patched methods, each an untimed prefill of its own (a cache filled under another
    # patch is refused) and the timed step: one call per decoder layer each, the step's with one query
    layers = model.config.num_hidden_layers
    assert query_lengths == ([ids.shape[1] - 1] * layers + [1] * layers) * (2 * 2)
    assert get_patch_info(model) is None and model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("method", ["self-extend", "dual-chunk", "self-extend-yarn"])
def test_a_training_step_after_an_inference_mode_forward_over_the_same_positions(method):
    """An evaluation under torch.inference_mode, then a training step over the same positions: the
    key rotation tables of the first must not reach the second (inference tensors cannot be saved for
    backward); its loss and gradients are those of a model that never ran the evaluation."""

    def training_step(model):
        model.train()
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.detach(), model.model.layers[0].self_attn.q_proj.weight.grad

    ids = random_ids(2 * L0 - 4)
    evaluated, fresh = (make_model("llama", attn_implementation="sdpa") for _ in range(2))
    for model in (evaluated, fresh):
        patch_model(model, scale=4, method=method)
    with torch.inference_mode():
        evaluated(ids)
    for got, expected in zip(training_step(evaluated), training_step(fresh)):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("method", ["self-extend", "dual-chunk", "self-extend-yarn"])
@pytest.mark.parametrize("operation, argument", [
    ("reorder_cache", torch.tensor([2, 0, 1])), ("reorder_cache", torch.tensor([1, 1, 0])),
    ("batch_select_indices", torch.tensor([2, 0])),
])  # fmt: skip
def test_continuing_a_cache_after_its_rows_moved_matches_full_forward(method, operation, argument):
    """Rows of a left-padded batch end at different positions; after the cache's rows move (beam
    search's reorder_cache, batch_select_indices), each row's continuation follows its own cached
    tokens: it is computed, equal to a full forward without a cache, not refused as a jump."""
    from transformers import DynamicCache

    model = make_model("llama", attn_implementation="sdpa")
    patch_model(model, scale=4, method=method)
    ids = random_ids(40, batch=3, seed=8)
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[0, :5] = 0
    mask[1, :2] = 0
    rows = argument.tolist()
    full_mask = torch.cat([mask[rows], torch.ones(len(rows), 1, dtype=torch.long)], 1)
    sequence = torch.cat([ids[rows], random_ids(1, batch=len(rows), seed=9)], 1)
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), planned_length(model, 41):
        model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), past_key_values=cache)
        getattr(cache, operation)(argument)
        step = model(sequence[:, 40:], attention_mask=full_mask, position_ids=positions[:, 40:], past_key_values=cache).logits
        full = model(sequence, attention_mask=full_mask, position_ids=positions, use_cache=False).logits[:, 40:]
    torch.testing.assert_close(step, full, atol=5e-5, rtol=1e-4)


def test_a_forward_on_another_thread_meanwhile_is_refused():
    """The per-forward state of an attention-level patch belongs to one forward: a second thread
    starting a forward while one runs is refused in one line (it computed wrong logits before),
    and the first forward's result is untouched; after it, the other thread may run."""
    model = make_model("llama", attn_implementation="sdpa")
    patch_model(model, scale=4, method="self-extend", neighbor_window=8)
    ids = random_ids(LENGTH)
    with torch.no_grad():
        expected = model(ids).logits
    # the first forward waits half way for the second thread's attempt
    with paused_on_a_thread(model.model.layers[1], lambda: model(ids).logits) as first:
        with torch.no_grad(), pytest.raises(RuntimeError, match="running a forward on another thread"):
            model(ids)
    # (another thread may split reductions over its own intra-op threads: not bitwise)
    torch.testing.assert_close(first["result"], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(on_a_thread(lambda: model(ids).logits)["result"], expected, atol=1e-5, rtol=1e-5)


def test_an_interrupted_forward_leaves_no_memo_on_after_the_next_one_and_copies_start_fresh():
    """Ctrl-C skips PyTorch's always-call hooks, so the interrupted forward stays counted: the next
    complete forward must still switch the memos off at its end (a layer called alone then sees a
    buffer changed in place), and a copy of the model must not inherit the count (it would refuse
    every other thread)."""
    import copy

    def layer(model, hidden, positions):
        return model.model.layers[0](hidden, attention_mask=None, position_ids=positions,
                                     position_embeddings=model.model.rotary_emb(hidden, positions))

    def interrupt(module, args, kwargs):
        raise KeyboardInterrupt

    model, fresh = (make_model("llama", attn_implementation="sdpa") for _ in range(2))
    for each in (model, fresh):
        patch_model(each, scale=4, method="self-extend", neighbor_window=8)
    ids = random_ids(60)
    handle = model.model.layers[1].register_forward_pre_hook(interrupt, with_kwargs=True)
    with pytest.raises(KeyboardInterrupt):
        model(ids)
    handle.remove()
    with torch.no_grad():
        model(ids)
    hidden = torch.randn(1, 60, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        positions = torch.arange(60)[None]
        layer(model, hidden, positions)
        positions += 40
        torch.testing.assert_close(layer(model, hidden, positions), layer(fresh, hidden, torch.arange(40, 100)[None]),
                                   atol=0, rtol=0)
    copied = copy.deepcopy(model)
    with torch.no_grad():
        torch.testing.assert_close(on_a_thread(lambda: copied(ids).logits)["result"], fresh(ids).logits,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["self-extend-dca", "dynamic-yarn-dca", "self-extend"])
def test_a_forward_run_inside_another_leaves_the_outer_one_its_own_length(method):
    """A hook that runs the model during its forward: methods that switch at a settle length
    read the current forward's length in every layer, and the inner forward's must not reach the
    outer forward's remaining layers (the outer logits equal a plain forward's)."""
    model, fresh = (make_model("llama", attn_implementation="sdpa") for _ in range(2))
    for each in (model, fresh):
        patch_model(each, scale=4, method=method)
    outer, inner = random_ids(80), random_ids(20, seed=2)  # beyond and below the settle length 2 x L0
    calls = []

    def run_inside(module, args, kwargs):
        if not calls:  # once: the inner forward passes this layer too
            calls.append(None)
            calls[0] = model(inner).logits

    handle = model.model.layers[1].register_forward_pre_hook(run_inside, with_kwargs=True)
    try:
        with torch.no_grad():
            actual = model(outer).logits
    finally:
        handle.remove()
    with torch.no_grad():
        torch.testing.assert_close(actual, fresh(outer).logits, atol=0, rtol=0)
        torch.testing.assert_close(calls[0], fresh(inner).logits, atol=0, rtol=0)


@pytest.mark.parametrize("method", ["self-extend-yarn", "self-extend-dca", "dynamic-yarn-dca", "self-extend-yarn+logn"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_gradient_checkpointing_recomputes_each_layer_with_its_own_forwards_regime(method, family):
    """Gradient checkpointing recomputes the layers during backward, after other forwards ran (an
    evaluation below the settle length, a second loss term): each recomputed layer must use the
    regime and frequencies of its own forward, so the gradients equal those without checkpointing."""
    long_ids, short_ids = random_ids(LENGTH), random_ids(40, seed=2)  # beyond and below the settle length 2 x L0

    def gradients(checkpointing: bool, between: str):
        model = make_model(family, attn_implementation="sdpa")
        patch_model(model, scale=8, method=method)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        loss = model(long_ids, labels=long_ids, use_cache=False).loss
        if between == "evaluation":  # a forward without gradients before the backward
            with torch.no_grad():
                model(short_ids[:, :20], use_cache=False)
        else:  # a second loss term, shorter, summed before one backward
            loss = loss + model(short_ids, labels=short_ids, use_cache=False).loss
        return torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])

    for between in ("evaluation", "second loss"):
        for actual, expected in zip(gradients(True, between), gradients(False, between)):
            torch.testing.assert_close(actual, expected, atol=0, rtol=0)


@pytest.mark.parametrize("method", ["self-extend-yarn", "self-extend-dca", "dual-chunk"])
def test_gradient_checkpointing_with_the_callers_own_position_ids_reused_or_refilled(method):
    """A caller's position_ids tensor given to several forwards before one backward: reused as it
    is by a forward of another regime (an evaluation planned beyond the settle length), or
    refilled in place for a second loss term (PoSE windows from one buffer). Each recomputed
    layer keeps its own forward's regime and positions: the gradients equal those without
    checkpointing."""
    first, second = random_ids(40), random_ids(LENGTH, seed=2)

    def gradients(checkpointing: bool, reuse: str):
        model = make_model("llama", attn_implementation="sdpa")
        patch_model(model, scale=8, method=method)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        if reuse == "as is":  # 40 tokens, below the settle length 2 x L0; then an evaluation planned for 200
            positions = torch.arange(40)[None]
            loss = model(first, labels=first, position_ids=positions, use_cache=False).loss
            with torch.no_grad(), planned_length(model, 200):
                model(first.flip(1), position_ids=positions, use_cache=False)
        else:  # one buffer, refilled in place between two loss terms
            positions = torch.arange(LENGTH)[None] + 50
            loss = model(second, labels=second, position_ids=positions, use_cache=False).loss
            positions.copy_(torch.arange(LENGTH)[None])
            loss = loss + model(second.flip(1), labels=second.flip(1), position_ids=positions, use_cache=False).loss
        return torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])

    for reuse in ("as is", "refilled"):
        for actual, expected in zip(gradients(True, reuse), gradients(False, reuse)):
            torch.testing.assert_close(actual, expected, atol=0, rtol=0)


def test_a_failed_forward_with_gradients_and_position_ids_leaves_no_state_behind():
    """The copy of position_ids a forward with gradients gets replaces the caller's in the call's
    own keyword dict, which the cache hooks know the call by: a forward that fails (an id outside
    the vocabulary) is counted out, and the rotary module goes back to its own frequencies."""
    from transformers import DynamicCache

    model = make_model("llama")
    patch_model(model, scale=4)  # the default: length-dependent and attention-level
    rotary = model.model.rotary_emb
    probe, probe_positions = torch.zeros(1, 5, 64), torch.arange(5)[None]
    before = rotary(probe, probe_positions)[0]
    with pytest.raises(IndexError):
        model(torch.full((1, LENGTH), 500), position_ids=torch.arange(LENGTH)[None])
    assert rotary.frequency_length is None
    torch.testing.assert_close(rotary(probe, probe_positions)[0], before, rtol=0, atol=0)
    # the same failure inside a forward (run by a hook, caught): the outer forward's cache continues
    ids, failed = random_ids(60), []

    def fail_inside(module, args, output):
        if not failed:
            failed.append(True)
            with contextlib.suppress(IndexError):
                model(torch.full((1, 3), 500), position_ids=torch.arange(3)[None])

    handle = model.model.layers[0].register_forward_hook(fail_inside)
    try:
        cache = model(ids[:, :50], past_key_values=DynamicCache(), use_cache=True).past_key_values
    finally:
        handle.remove()
    continued = model(ids[:, 50:], past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(continued, model(ids).logits[:, 50:], rtol=1e-5, atol=1e-5)


def test_a_layer_run_on_its_own_reads_the_current_regime_after_a_forward_with_its_position_ids():
    """A decoder layer called on its own, with a position tensor an earlier forward of the model
    was given (and which the caller refilled), computes as the same layer inside a full forward."""
    model = make_model("llama", attn_implementation="sdpa")
    patch_model(model, scale=8, method="self-extend-yarn")
    ids = random_ids(40)
    positions = torch.arange(40)[None]
    with torch.no_grad():
        model(ids, labels=ids, position_ids=positions)  # below the settle length
        positions.add_(60)  # 60 .. 99: beyond it
        seen = {}
        layer, rotary = model.model.layers[0], model.model.rotary_emb
        handle = layer.register_forward_hook(lambda module, args, output: seen.setdefault("full", output))
        model(ids, position_ids=torch.arange(60, 100)[None])
        handle.remove()
        hidden = model.model.embed_tokens(ids)
        alone = layer(hidden, position_ids=positions, position_embeddings=rotary(hidden, positions))
    torch.testing.assert_close(alone, seen["full"], atol=0, rtol=0)


def _tiny_model(model_type: str, attn_implementation: str = "eager", **overrides):
    """A tiny random model of a family outside conftest's four, with conftest's shapes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**TINY_SHAPE, "pad_token_id": 0, **overrides})
    return strengthen_weights(AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)).eval()


# Falcon's attention picked its kernel by name up to transformers 5.24; from 5.25 it calls the registry.
FALCON_CALLS_THE_REGISTRY = version.parse(transformers.__version__).release >= (5, 25)
FALCON = {"new_decoder_architecture": True, "num_kv_heads": 2}


@pytest.mark.parametrize("model_type, implementations, overrides", [
    pytest.param("falcon", ("eager", "sdpa"), FALCON, marks=pytest.mark.skipif(  # picks by name itself
        FALCON_CALLS_THE_REGISTRY, reason="transformers >= 5.25: falcon calls the registry (the test below)")),
    ("gpt_neox_japanese", ("eager",), {}),  # computes its own attention (transformers refuses sdpa for it)
])
@pytest.mark.parametrize("method", ["self-extend-yarn", "dual-chunk", "yarn+logn"])
def test_attention_level_methods_refuse_models_whose_attention_bypasses_the_registry(model_type, implementations,
                                                                                    overrides, method):
    """These families pass the rotary module's checks, but their attention never calls the function
    the patch registers: the remap was silently not applied beyond L0 (eager), or the model lost its
    own sdpa branch inside L0 (falcon: 0.29 off). Frequency methods still patch them."""
    for implementation in implementations:
        model = _tiny_model(model_type, implementation, **overrides)
        with pytest.raises(ValueError, match="does not go through transformers' attention registry"):
            patch_model(model, scale=4, method=method)
        assert get_patch_info(model) is None
        patch_model(model, scale=4, method="yarn")
        unpatch_model(model)


@pytest.mark.skipif(not FALCON_CALLS_THE_REGISTRY, reason="falcon calls transformers' registry from 5.25 on")
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_falcon_calling_the_registry_matches_the_papers_positions_and_the_cache(implementation):
    """From transformers 5.25 Falcon's attention goes through the registry: the attention-level
    methods then patch it, match the papers' position maps (float64 reference), continue a KV
    cache as full forwards do, and unpatch bitwise."""
    model = _tiny_model("falcon", implementation, **FALCON)
    ids = random_ids(LENGTH)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    theta = 1.0 / model.config.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    with torch.no_grad():
        plain = model(ids).logits
    for case, (params, position_fn) in PAPER_CASES.items():
        expected = reference_logits_at(model, ids, None, position_fn, theta=theta)
        assert (plain[:, L0:] - expected[:, L0:]).abs().max() > 1e-3  # the remap changes the output beyond L0
        patch_model(model, scale=4, method=case.split()[0], **params)
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, expected, atol=2e-5, rtol=1e-4)
        unpatch_model(model)
        with torch.no_grad():
            assert torch.equal(model(ids).logits, plain)
    patch_model(model, scale=4)  # the default, length-dependent: each step equals a full forward of its prefix
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids[:, : L0 - 3], past_key_values=cache)
        for position in range(L0 - 3, LENGTH):
            step = model(ids[:, position : position + 1], past_key_values=cache).logits[:, -1]
            if position % 9 == 0 or position == LENGTH - 1:
                torch.testing.assert_close(step, model(ids[:, : position + 1]).logits[:, -1], atol=2e-6, rtol=0)


def test_attention_level_methods_refuse_logit_softcapping_and_keep_each_familys_own_eager_kernel():
    """Gemma2 caps its attention logits: the patch's own kernels would drop the cap (2.2e-2 off a
    float64 reference with it), so a config with the cap is refused. Inside L0 the patch hands
    over to the model's own eager kernel, Gemma2's (which caps), not Llama's; beyond L0 a cap
    that appears after patching is refused, not dropped."""
    capped = _tiny_model("gemma2", head_dim=16, attn_logit_softcapping=5.0, final_logit_softcapping=None)
    with pytest.raises(ValueError, match=r"caps its attention logits \(attn_logit_softcapping=5.0\)"):
        patch_model(capped, scale=4)
    model = _tiny_model("gemma2", head_dim=16, attn_logit_softcapping=None, final_logit_softcapping=None)
    patch_model(model, scale=4)
    for layer in (*model.model.layers, *capped.model.layers):
        layer.self_attn.attn_logit_softcapping = 5.0
    capped.load_state_dict(model.state_dict())
    ids = random_ids(ORIGINAL_CONTEXT - 4)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, capped(ids).logits, atol=0, rtol=0)
        with pytest.raises(ValueError, match="passes softcap to its attention function"):
            model(random_ids(2 * ORIGINAL_CONTEXT))


@pytest.mark.parametrize("method", ["self-extend", "dual-chunk", "self-extend-yarn"])
def test_layers_without_rope_keep_their_own_attention(method):
    """SmolLM3 leaves RoPE out of some layers (no_rope_layers): there is no position to remap, so
    such a layer's attention is the unpatched one's, bitwise; the remap was applied to them before
    (0.95 off with no layer using RoPE). Layers with RoPE are still remapped."""
    ids = random_ids(3 * ORIGINAL_CONTEXT)
    for layers, remapped in (([0, 0], False), ([0, 1], True)):
        model, base = (_tiny_model("smollm3", "sdpa", no_rope_layers=layers) for _ in range(2))
        patch_model(model, scale=4, method=method)
        outputs = {}
        for name, each in (("patched", model), ("base", base)):
            handle = each.model.layers[0].self_attn.register_forward_hook(
                lambda module, args, output, name=name: outputs.update({name: output[0]}))
            with torch.no_grad():
                outputs[name + " logits"] = each(ids).logits
            handle.remove()
        torch.testing.assert_close(outputs["patched"], outputs["base"], atol=0, rtol=0)
        difference = (outputs["patched logits"] - outputs["base logits"]).abs().max().item()
        assert (difference > 1e-3) if remapped else difference == 0, (layers, difference)


@pytest.mark.parametrize("method", ["self-extend", "dual-chunk", "self-extend-yarn"])
def test_attention_level_methods_run_under_cpu_autocast(method):
    """Under torch.autocast the rotated queries and keys come out float32 and the values bf16: the
    fused kernels refused the mix beyond L0 (a raw dtype error). They now take all three in the
    autocast type, as the model's own attention does, and stay as close to the float32 forward
    (whose own accuracy the float64 references above check) as autocast keeps the unpatched model
    to its own float32 forward (3% of the largest logit here)."""
    model, unpatched = (make_model("llama", attn_implementation="sdpa") for _ in range(2))
    patch_model(model, scale=4, method=method)
    ids = random_ids(3 * L0)
    errors = []
    with torch.no_grad():
        for each in (model, unpatched):
            full = each(ids).logits
            with torch.autocast("cpu", dtype=torch.bfloat16):
                mixed = each(ids).logits.float()
            errors.append((mixed - full).abs().max().item() / full.abs().max().item())
    assert errors[0] < 2 * errors[1], errors


def test_position_ids_that_repeat_or_go_down_without_a_mask_are_refused():
    """Without a mask (sdpa's causal shortcut) the kernels tell earlier keys from later ones by
    position: a repeated position let token 10 see token 11 (its logits moved by 0.27 when only token 11
    changed). Such positions are refused beyond L0; packed sequences restarting at their smallest
    position, gaps, and a mask (which says causality by slot) are still taken."""
    model = make_model("llama", attn_implementation="sdpa")
    patch_model(model, scale=4, method="self-extend-yarn")
    ids = random_ids(12)
    with torch.no_grad():
        for positions in ([0, 1, 1, 2, 2, 2, 40, 41, 41, 50, 60, 60], [0, 1, 2, 3, 40, 39, 41, 42, 50, 51, 60, 61]):
            with pytest.raises(ValueError, match="need position_ids that increase along each sequence"):
                model(ids, position_ids=torch.tensor([positions]))
        # gaps, and packed sequences (restarting at 0) beyond L0
        for positions in ([0, 1, 2, 3, 40, 41, 42, 50, 51, 60, 61, 62], [0, 1, 2, 40, 41, 42, 0, 1, 2, 50, 51, 52]):
            model(ids, position_ids=torch.tensor([positions]))
        inside = [0, 1, 1, 2, 3, 3, 4, 5, 6, 7, 8, 9]  # inside L0 the model's own attention runs, as unpatched
        model(ids, position_ids=torch.tensor([inside]))
        # a batch packs no sequences in a row: the message names the row and where it goes down
        rows = torch.tensor([list(range(40, 52)), [40, 41, 42, 43, 44, 45, 0, 1, 2, 3, 4, 5]])
        with pytest.raises(ValueError, match="row 1 goes from 45 to 0 at token 6.*one row per batch"):
            model(ids.expand(2, -1), position_ids=rows)


def test_packed_sequences_given_by_cu_seq_lens_keep_their_own_positions():
    """Flash-style packing with cu_seq_lens: each sequence may keep its true offset (a continuation
    window starting at 5 or 3); it is cut where cu_seq_lens says, not where positions restart at the
    row's smallest, and equals each sequence run alone (it was refused as out of order)."""
    model = _as_flash_attention(make_model("llama", attn_implementation="sdpa"))
    alone = make_model("llama", attn_implementation="sdpa")
    for each in (model, alone):
        patch_model(each, scale=4, method="self-extend")
    segments = [list(range(5, 45)), list(range(0, 50)), list(range(3, 43))]
    positions = torch.tensor([sum(segments, [])])
    ids = random_ids(positions.shape[1])
    cuts = torch.tensor([0, 40, 90, 130], dtype=torch.int32)
    with torch.no_grad():
        packed = model(ids, position_ids=positions, cu_seq_lens_q=cuts, cu_seq_lens_k=cuts, max_length_q=50,
                       max_length_k=50).logits
        each = torch.cat([alone(ids[:, a:b], position_ids=torch.tensor([segment])).logits
                          for a, b, segment in zip(cuts[:-1], cuts[1:], segments)], dim=1)
    torch.testing.assert_close(packed, each, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["self-extend", "dual-chunk", "dynamic-yarn-dca", "self-extend-dca", "self-extend-yarn"])
def test_an_original_context_too_short_for_any_window_is_refused_naming_the_method(method):
    """With L0 = 1 no neighbour window or chunk fits below it: the refusal says so and names the
    method the user chose (dynamic-yarn-dca reported dual-chunk's chunk_size, which no one set)."""
    model = make_model("llama", max_position_embeddings=1)
    with pytest.raises(ValueError, match=rf"^{method} needs an original context of at least 2 tokens"):
        patch_model(model, scale=4, method=method)
    assert get_patch_info(model) is None


def test_a_users_subclass_of_a_registry_attention_is_patched():
    """A subclass whose forward calls super().forward goes through the registry by its base class:
    it was refused as bypassing it. It gives the same logits as the model without the subclass."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    class LoggedAttention(LlamaAttention):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    model, plain = (make_model("llama", attn_implementation="sdpa") for _ in range(2))
    for layer in model.model.layers:
        own = LoggedAttention(model.config, layer.self_attn.layer_idx)
        own.load_state_dict(layer.self_attn.state_dict())
        layer.self_attn = own
    ids = random_ids(3 * L0)
    for each in (model, plain):
        patch_model(each, scale=4, method="self-extend")
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, atol=0, rtol=0)


def test_a_users_subclass_with_an_attention_of_its_own_is_refused():
    """A subclass whose forward computes attention itself (no super().forward, no registry) never
    calls the patch's attention: it was accepted and the patch changed nothing beyond L0."""
    import torch.nn.functional as F
    from transformers.models.llama import modeling_llama

    class OwnAttention(modeling_llama.LlamaAttention):
        def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
            shape = (*hidden_states.shape[:2], -1, self.head_dim)
            q, k, v = (proj(hidden_states).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
            q, k = modeling_llama.apply_rotary_pos_emb(q, k, *position_embeddings)
            k, v = (t.repeat_interleave(self.num_key_value_groups, 1) for t in (k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
            return self.o_proj(out.reshape(*hidden_states.shape[:2], -1)), None

    model = make_model("llama", attn_implementation="sdpa")
    for layer in model.model.layers:
        layer.self_attn = OwnAttention(model.config, layer.self_attn.layer_idx)
    with pytest.raises(ValueError, match="does not go through transformers' attention registry"):
        patch_model(model, scale=4, method="self-extend")


@pytest.mark.parametrize("shared", [False, True], ids=["a copy of the config", "the config itself"])
def test_a_model_built_from_a_patched_models_config_is_refused(shared):
    """``from_config(patched.config)`` (or of a deepcopy of it) builds an unpatched model whose config
    carries the patched model's private attention name: its attention would run the other model's
    patch and state (generation then differed from a full forward). It is refused in one line, and
    the patched model is left exactly as a fresh patched model, then unpatched as the original."""
    import copy

    from transformers import AutoModelForCausalLM

    patched_model = patch_model(make_model("llama", attn_implementation="sdpa"), scale=4)
    fresh = patch_model(make_model("llama", attn_implementation="sdpa"), scale=4)
    unpatched = make_model("llama", attn_implementation="sdpa")  # same weights: the reference
    config = patched_model.config if shared else copy.deepcopy(patched_model.config)
    built = AutoModelForCausalLM.from_config(config).eval()
    built.load_state_dict(unpatched.state_dict())
    ids = random_ids(3 * L0)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"not part of the model patched as .*Build it from the original config"):
            built(ids)
        with pytest.raises(ValueError, match="not part of the model patched as"):
            built.generate(ids[:, :20], max_new_tokens=L0, do_sample=False, pad_token_id=0)
        assert torch.equal(patched_model(ids).logits, fresh(ids).logits)
        unpatch_model(patched_model)
        assert torch.equal(patched_model(ids).logits, unpatched(ids).logits)


def test_data_parallel_replicas_share_the_patch():
    """nn.DataParallel runs shallow replicas of the model's modules (torch.nn.parallel.replicate:
    ``_replicate_for_data_parallel``), which share its patch: they are not a model built from its
    config, and compute what the model computes (here replicated on the CPU as replicate does)."""

    def replicate(module):
        replica = module._replicate_for_data_parallel()
        for name, child in module._modules.items():
            replica._modules[name] = replicate(child)
        for name, parameter in module._parameters.items():  # replicate broadcasts them; a copy here
            replica._parameters[name] = None if parameter is None else parameter.detach().clone()
        return replica

    from transformers import AutoModelForCausalLM

    model = patch_model(make_model("llama", attn_implementation="sdpa"), scale=4, method="dual-chunk")
    ids = random_ids(3 * L0)
    with torch.no_grad():
        assert torch.equal(replicate(model)(ids).logits, model(ids).logits)
        # a replica of a model built from the patched config is that model: refused as it is
        built = AutoModelForCausalLM.from_config(model.config).eval()
        with pytest.raises(ValueError, match="not part of the model patched as"):
            replicate(built)(ids)
