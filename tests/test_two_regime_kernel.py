"""The one-pass two-regime attention kernel (hf_rope_ext.fused_attention) against a float64
softmax over explicit near/far logits, and patched models that run it against the papers'
position maps. On a GPU the kernel runs compiled; without one, in Triton's interpreter (see
conftest), with small blocks so that several blocks of every kind (far, straddling, near) occur."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from hf_rope_ext import patch_model, unpatch_model
from hf_rope_ext import attention as attention_level
from hf_rope_ext import compat
from hf_rope_ext import fused_attention

from conftest import make_model, random_ids
from test_attention import (L0, LENGTH, PAPER_CASES, _yarn_twin, reference_logits, reference_logits_at,
                            self_extend_by_parts_positions)

pytestmark = pytest.mark.skipif(not fused_attention.available(), reason="needs Triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter runs each program in numpy: small blocks keep it quick
BLOCKS = None if DEVICE == "cuda" else (16, 16)
# numpy, under the interpreter, has no bfloat16
HALF_AND_FULL = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def two_regime_reference(q_near, q_far, k_near, k_far, value, first_distance, window, scaling, max_distance=None):
    """Float64 softmax over ``where(d < window, q_near k_near, q_far k_far)``, ``d = first_distance + m - n``."""
    q_near, q_far, k_near, k_far, value = (x.double().cpu() for x in (q_near, q_far, k_near, k_far, value))
    repeat = q_near.shape[1] // k_near.shape[1]
    k_near, k_far, value = (x.repeat_interleave(repeat, dim=1) for x in (k_near, k_far, value))
    distance = first_distance + torch.arange(q_near.shape[2])[:, None] - torch.arange(k_near.shape[2])[None]
    scores = torch.where(distance < window, q_near @ k_near.transpose(-1, -2), q_far @ k_far.transpose(-1, -2)) * scaling
    allowed = distance >= 0
    if max_distance is not None:
        allowed &= distance <= max_distance
    return scores.masked_fill(~allowed, -math.inf).softmax(-1) @ value


# (batch, query heads, key heads, rows, keys, first distance, window, max distance)
SHAPES = {
    "square, grouped-query": (1, 4, 2, 70, 70, 0, 21, None),
    "queries after a cache": (2, 3, 1, 45, 130, 85, 40, None),
    "window below one block": (1, 2, 2, 50, 90, 40, 5, None),
    "sliding window": (1, 2, 1, 60, 110, 50, 17, 43),
    "window beyond every key": (1, 2, 2, 20, 60, 40, 100, None),
}


@pytest.mark.parametrize("dtype", HALF_AND_FULL)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernel_matches_a_float64_softmax_of_the_two_regimes(shape, dtype):
    batch, heads, key_heads, rows, keys, first, window, max_distance = SHAPES[shape]
    generator = torch.Generator().manual_seed(0)
    q_near, q_far = (torch.randn(batch, heads, rows, 16, generator=generator) for _ in range(2))
    k_near, k_far, value = (torch.randn(batch, key_heads, keys, 16, generator=generator) for _ in range(3))
    expected = two_regime_reference(q_near, q_far, k_near, k_far, value, first, window, 0.3, max_distance)
    tensors = [x.to(DEVICE, dtype) for x in (q_near, q_far, k_near, k_far, value)]
    # a transposed query layout, as transformers' projections give (strides, not a copy)
    tensors[0] = tensors[0].transpose(1, 2).contiguous().transpose(1, 2)
    actual = fused_attention.two_regime_attention(
        *tensors, first_distance=first, window=window, scaling=0.3, max_distance=max_distance, block_sizes=BLOCKS
    )
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual.double().cpu(), expected, atol=tolerance, rtol=tolerance)


def test_kernel_gives_each_group_of_rows_its_own_far_keys_in_one_launch():
    """far_rows: rows 0-4, 5-36 and 37-69 read three different far keys; groups shorter than a
    block and groups that start inside one are cut into their own blocks."""
    batch, heads, key_heads, rows, keys, first, window = 1, 4, 2, 70, 100, 30, 9
    far_rows = [0, 5, 37]
    generator = torch.Generator().manual_seed(1)
    q_near, q_far = (torch.randn(batch, heads, rows, 16, generator=generator) for _ in range(2))
    k_near, value = (torch.randn(batch, key_heads, keys, 16, generator=generator) for _ in range(2))
    far_keys = [torch.randn(batch, key_heads, keys, 16, generator=generator) for _ in far_rows]
    expected = torch.cat([
        two_regime_reference(q_near[:, :, lo:hi], q_far[:, :, lo:hi], k_near, k_far, value, first + lo, window, 0.3)
        for lo, hi, k_far in zip(far_rows, far_rows[1:] + [rows], far_keys)
    ], dim=2)
    device = lambda x: x.to(DEVICE)  # noqa: E731
    actual = fused_attention.two_regime_attention(
        device(q_near), device(q_far), device(k_near), [device(k) for k in far_keys], device(value), first_distance=first,
        window=window, scaling=0.3, far_rows=far_rows, block_sizes=BLOCKS,
    )
    torch.testing.assert_close(actual.double().cpu(), expected, atol=1e-5, rtol=1e-5)
    # the same keys for every group give the one-tensor call's result
    single = fused_attention.two_regime_attention(
        device(q_near), device(q_far), device(k_near), device(far_keys[0]), device(value), first_distance=first,
        window=window, scaling=0.3, block_sizes=BLOCKS,
    )
    grouped = fused_attention.two_regime_attention(
        device(q_near), device(q_far), device(k_near), [device(far_keys[0])] * 3, device(value), first_distance=first,
        window=window, scaling=0.3, far_rows=far_rows, block_sizes=BLOCKS,
    )
    torch.testing.assert_close(grouped, single, atol=1e-6, rtol=1e-6)
    # far_rows as an iterator (read once) gives the same result as the list
    from_iterator = fused_attention.two_regime_attention(
        device(q_near), device(q_far), device(k_near), [device(k) for k in far_keys], device(value), first_distance=first,
        window=window, scaling=0.3, far_rows=iter(far_rows), block_sizes=BLOCKS,
    )
    torch.testing.assert_close(from_iterator, actual, atol=0, rtol=0)


def test_kernel_reads_far_keys_that_are_slices_of_one_tensor_in_place(monkeypatch):
    """Slices ``stacked[i]`` of one tensor, in any order and with gaps, are read where they lie (the
    patch rotates its groups' keys into one tensor): the same result, and no stacked copy."""
    batch, heads, key_heads, rows, keys, first, window = 1, 4, 2, 70, 100, 30, 9
    far_rows = [0, 5, 37]
    generator = torch.Generator().manual_seed(2)
    q_near, q_far = (torch.randn(batch, heads, rows, 16, generator=generator).to(DEVICE) for _ in range(2))
    k_near, value = (torch.randn(batch, key_heads, keys, 16, generator=generator).to(DEVICE) for _ in range(2))
    stacked = torch.randn(5, batch, key_heads, keys, 16, generator=generator).to(DEVICE)
    slices = [stacked[3], stacked[1], stacked[4]]
    arguments = dict(first_distance=first, window=window, scaling=0.3, far_rows=far_rows, block_sizes=BLOCKS)
    copies = [[k.clone() for k in slices]]  # separate tensors: the wrapper stacks them
    expected = fused_attention.two_regime_attention(q_near, q_far, k_near, copies[0], value, **arguments)
    stacks = []
    real_stack = torch.stack
    monkeypatch.setattr(torch, "stack", lambda *args, **kwargs: stacks.append(1) or real_stack(*args, **kwargs))
    actual = fused_attention.two_regime_attention(q_near, q_far, k_near, slices, value, **arguments)
    assert stacks == []
    torch.testing.assert_close(actual, expected, atol=0, rtol=0)
    reference = torch.cat([
        two_regime_reference(q_near[:, :, lo:hi], q_far[:, :, lo:hi], k_near, k_far, value, first + lo, window, 0.3)
        for lo, hi, k_far in zip(far_rows, far_rows[1:] + [rows], slices)
    ], dim=2)
    torch.testing.assert_close(actual.double().cpu(), reference, atol=1e-5, rtol=1e-5)


def _bad_call(**changes):
    q, k = torch.zeros(1, 2, 8, 16, device=DEVICE), torch.zeros(1, 2, 8, 16, device=DEVICE)
    arguments = dict(q_near=q, q_far=q, k_near=k, k_far=k, value=k, first_distance=0, window=2, scaling=1.0)
    arguments.update(changes)
    return fused_attention.two_regime_attention(**arguments)


@pytest.mark.parametrize("changes, message", [
    (dict(q_near=torch.zeros(2, 8, 16)), "q_near must be a 4-D tensor"),
    (dict(value=torch.zeros(1, 2, 8, 16, dtype=torch.float16)), "pass all of them in one dtype"),
    ({name: torch.zeros(1, 2, 8, 16, dtype=torch.int64) for name in ("q_near", "q_far", "k_near", "k_far", "value")},
     "the kernel takes"),
    (dict(q_near=torch.zeros(1, 2, 8, 12), q_far=torch.zeros(1, 2, 8, 12)), "head size one of"),
    ({name: torch.zeros(1, 0, 8, 16) for name in ("k_near", "k_far", "value")}, "query heads a multiple of key heads"),
    (dict(q_far=torch.zeros(1, 1, 8, 16)), "matching shapes"),
    (dict(window=0), "window must be a whole number >= 1"),
    (dict(window=2.5), "window must be a whole number"),
    (dict(first_distance=1.5), "first_distance must be a whole number"),
    (dict(max_distance=1), "max_distance must be a whole number >= 2"),
    (dict(max_distance=math.inf), "max_distance must be a whole number"),
    (dict(block_sizes=(24, 16)), "powers of two >= 16"),
    (dict(block_sizes=(16,)), "block_sizes must be"),
    (dict(q_near=torch.zeros(1, 2, 8, 16, requires_grad=True)), "no backward"),
    (dict(k_far=[torch.zeros(1, 2, 8, 16)] * 2), "give far_rows"),
    (dict(far_rows=[0]), "k_far must be a non-empty list"),
    (dict(k_far=[torch.zeros(1, 2, 8, 16)] * 2, far_rows=[0]), "far_rows has 1 entries for 2"),
    (dict(k_far=[torch.zeros(1, 2, 8, 16)] * 2, far_rows=[1, 3]), "must start at 0 and increase strictly"),
    (dict(k_far=[torch.zeros(1, 2, 8, 16)] * 2, far_rows=[0, 0]), "must start at 0 and increase strictly"),
    (dict(k_far=[torch.zeros(1, 2, 8, 16)] * 2, far_rows=[0, 8]), "each below the 8 query rows"),
    (dict(k_far=[torch.zeros(1, 2, 8, 16)] * 2, far_rows=[0, 2.5]), "each entry of far_rows must be a whole number"),
    (dict(k_far=[torch.zeros(1, 2, 8, 16)] * 2, far_rows=3), "far_rows must be a sequence of whole numbers"),
    (dict(k_far=[torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 9, 16)], far_rows=[0, 4]), "matching shapes"),
    (dict(k_far=[torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16, dtype=torch.float16)], far_rows=[0, 4]),
     r"k_far\[1\] is torch.float16"),
])  # fmt: skip
def test_kernel_refuses_bad_arguments_in_one_line(changes, message):
    def on_device(value):
        if isinstance(value, list):
            return [on_device(item) for item in value]
        return value.detach().to(DEVICE).requires_grad_(value.requires_grad) if isinstance(value, torch.Tensor) else value

    changes = {name: on_device(value) for name, value in changes.items()}
    with pytest.raises(ValueError, match=message):
        _bad_call(**changes)


def test_kernel_takes_numpy_and_torch_integers():
    import numpy as np

    batch, heads, key_heads, rows, keys, first, window, max_distance = SHAPES["sliding window"]
    generator = torch.Generator().manual_seed(0)
    q_near, q_far = (torch.randn(batch, heads, rows, 16, generator=generator) for _ in range(2))
    k_near, k_far, value = (torch.randn(batch, key_heads, keys, 16, generator=generator) for _ in range(3))
    expected = two_regime_reference(q_near, q_far, k_near, k_far, value, first, window, 0.3, max_distance)
    tensors = [x.to(DEVICE) for x in (q_near, q_far, k_near, k_far, value)]
    actual = fused_attention.two_regime_attention(
        *tensors, first_distance=np.int64(first), window=torch.tensor(window), scaling=np.float32(0.3),
        max_distance=np.int32(max_distance), block_sizes=BLOCKS,
    )
    torch.testing.assert_close(actual.double().cpu(), expected, atol=1e-5, rtol=1e-5)


def test_kernel_refuses_cpu_tensors_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="runs on CUDA"):
        _bad_call(q_near=torch.zeros(1, 2, 8, 16), q_far=torch.zeros(1, 2, 8, 16), k_near=torch.zeros(1, 2, 8, 16),
                  k_far=torch.zeros(1, 2, 8, 16), value=torch.zeros(1, 2, 8, 16))


class KernelCalls(list):
    """The window of each kernel call, and in ``far_groups`` how many far-key groups it took."""

    def __init__(self):
        super().__init__()
        self.far_groups: list[int] = []
        self.one_storage: list[bool] = []  # whether its far keys lay in one tensor (read in place)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the kernel's calls; lets it run on the CPU (the interpreter) where there is no GPU."""
    calls = KernelCalls()
    original = fused_attention.two_regime_attention

    def counted(*args, **kwargs):
        calls.append(kwargs["window"])
        calls.far_groups.append(len(kwargs.get("far_rows") or [0]))
        far_keys = args[3] if isinstance(args[3], list) else [args[3]]
        calls.one_storage.append(len({k.untyped_storage().data_ptr() for k in far_keys}) == 1)
        return original(*args, **{**kwargs, "block_sizes": BLOCKS})

    monkeypatch.setattr(fused_attention, "two_regime_attention", counted)
    monkeypatch.setattr(attention_level, "_two_regime_device", lambda device: True)
    return calls


def _theta(model):
    head_dim = model.model.layers[0].self_attn.head_dim
    return 1.0 / model.config.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


CASES = {
    **{case: (params, lambda model, fn=fn: fn) for case, (params, fn) in PAPER_CASES.items() if case.startswith("self-extend")},
    "self-extend by-parts": ({"neighbor_window": 8, "far_positions": "by-parts"},
                             lambda model: lambda i, j: self_extend_by_parts_positions(i, j, None, 8, _theta(model))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_patched_model_through_the_kernel_matches_the_papers_positions(case, kernel_calls):
    ids = random_ids(LENGTH)
    params, position_fn = CASES[case]
    host = make_model("llama", attn_implementation="sdpa")
    expected = reference_logits(host, ids, position_fn(host))
    model = make_model("llama", attn_implementation="sdpa").to(DEVICE)
    patch_model(model, scale=4, method="self-extend", **params)
    try:
        with torch.no_grad():
            actual = model(ids.to(DEVICE)).logits
    finally:
        unpatch_model(model)
    assert kernel_calls, "the kernel never ran"
    assert set(kernel_calls) == {params["neighbor_window"]}
    assert not attention_level._TWO_REGIME_FAILED
    torch.testing.assert_close(actual.cpu(), expected, atol=1e-4, rtol=1e-4)


def test_the_default_through_the_kernel_matches_its_reference(kernel_calls):
    """self-extend-yarn beyond its settle length: by-parts positions (window L0 / 4, a group per
    query) over transformers' yarn x2 frequencies."""
    model = make_model("llama", attn_implementation="sdpa")
    ids = random_ids(LENGTH)
    twin_long, inv_freq = _yarn_twin(model, 2.0)
    expected = reference_logits_at(twin_long, ids, None, lambda i, j: self_extend_by_parts_positions(i, j, None, L0 // 4, inv_freq),
                                   theta=inv_freq)
    model = model.to(DEVICE)
    patch_model(model, scale=4, method="self-extend-yarn")
    with torch.no_grad():
        actual = model(ids.to(DEVICE)).logits
    assert kernel_calls and set(kernel_calls) == {L0 // 4}
    # one launch per layer, every group of queries beyond L0 in it (a group per query here)
    assert len(kernel_calls) == model.config.num_hidden_layers
    assert min(kernel_calls.far_groups) > 1
    assert all(kernel_calls.one_storage)  # the groups' keys were rotated into one tensor, not stacked per call
    torch.testing.assert_close(actual.cpu(), expected, atol=5e-5, rtol=1e-4)


def test_running_out_of_memory_in_the_kernel_call_is_raised_and_keeps_the_kernel_on(monkeypatch):
    """Memory is the forward's problem, as for any other allocation: the error reaches the caller,
    and the kernel is not switched off for the rest of the process (as a kernel that cannot run is)."""
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB")

    monkeypatch.setattr(fused_attention, "two_regime_attention", out_of_memory)
    monkeypatch.setattr(attention_level, "_two_regime_device", lambda device: True)
    monkeypatch.setattr(attention_level, "_TWO_REGIME_FAILED", False)
    model = make_model("llama", attn_implementation="sdpa")
    patch_model(model, scale=4, method="self-extend-yarn")
    with pytest.raises(torch.OutOfMemoryError), torch.no_grad():
        model(random_ids(LENGTH))
    assert not attention_level._TWO_REGIME_FAILED


def test_kernel_is_skipped_for_training_decode_steps_and_when_switched_off(kernel_calls, monkeypatch):
    model = make_model("llama", attn_implementation="sdpa").to(DEVICE)
    patch_model(model, scale=4, method="self-extend", group_size=6, neighbor_window=8)
    ids = random_ids(LENGTH).to(DEVICE)
    try:
        model(ids).logits.sum().backward()  # gradients: the differentiable path
        assert kernel_calls == []
        monkeypatch.setenv(attention_level.TWO_REGIME_SWITCH, "0")
        with torch.no_grad():
            model(ids)
        assert kernel_calls == []
        monkeypatch.delenv(attention_level.TWO_REGIME_SWITCH)
        with torch.no_grad():
            out = model(ids[:, :-1], use_cache=True)
            kernel_calls.clear()
            model(ids[:, -1:], **{compat.cache_argument_name(inspect.signature(model.forward).parameters): out.past_key_values})  # one query: the tiles
        assert kernel_calls == []
    finally:
        unpatch_model(model)


def test_a_kernel_failure_falls_back_once_with_a_warning(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(fused_attention, "two_regime_attention", broken)
    monkeypatch.setattr(attention_level, "_two_regime_device", lambda device: True)
    monkeypatch.setattr(attention_level, "_TWO_REGIME_FAILED", False)
    ids = random_ids(LENGTH)
    params, position_fn = PAPER_CASES["self-extend"]
    expected = reference_logits(make_model("llama", attn_implementation="sdpa"), ids, position_fn)
    model = make_model("llama", attn_implementation="sdpa")
    patch_model(model, scale=4, method="self-extend", **params)
    try:
        with torch.no_grad():
            actual = model(ids).logits
    finally:
        unpatch_model(model)
    assert attention_level._TWO_REGIME_FAILED
    assert sum("two-regime attention kernel failed" in r.message for r in caplog.records) == 1
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("value, runs", [("0", False), ("off", False), (" False ", False), ("no", False), ("1", True),
                                         ("on", True), ("YES", True)])
def test_the_switch_reads_the_usual_spellings(value, runs, kernel_calls, monkeypatch):
    monkeypatch.setenv(attention_level.TWO_REGIME_SWITCH, value)
    model = make_model("llama", attn_implementation="sdpa").to(DEVICE)
    patch_model(model, scale=4, method="self-extend", group_size=6, neighbor_window=8)
    with torch.no_grad():
        model(random_ids(LENGTH).to(DEVICE))
    assert bool(kernel_calls) == runs


def test_a_switch_value_it_does_not_know_is_refused(monkeypatch):
    monkeypatch.setenv(attention_level.TWO_REGIME_SWITCH, "maybe")
    model = make_model("llama", attn_implementation="sdpa")
    patch_model(model, scale=4, method="self-extend", group_size=6, neighbor_window=8)
    with torch.no_grad(), pytest.raises(ValueError, match="HF_ROPE_EXT_TWO_REGIME_KERNEL='maybe' is not understood"):
        model(random_ids(LENGTH))
