"""Bad input as a new user gives it: each case is refused with one clear message, or works.

Tiny random Llama models (see conftest); every test here failed before the fix it covers.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import ORIGINAL_CONTEXT, make_model, random_ids

import hf_rope_ext
from hf_rope_ext import get_patch_info, patch_model
from hf_rope_ext.methods import default_inv_freq

L0 = ORIGINAL_CONTEXT


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
