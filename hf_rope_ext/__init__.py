"""hf_rope_ext: extend the context window of RoPE language models in transformers.

    from hf_rope_ext import patch_model
    patch_model(model, scale=4)              # 4x the original context, default method
    patch_model(model, scale=4, method="yarn", beta_fast=32)
    patch_model(model, scale=2, method="auto", calibration_ids=ids)  # the best candidate, measured
"""

from __future__ import annotations

import logging

from . import config_io as _config_io
from .cache_consistency import planned_length
from .methods import RopeMethod, get_method, list_methods, register_method, unregister_method
from .patching import DEFAULT_METHOD, PatchInfo, get_patch_info, patch_model, patched, unpatch_model
from .spec import PatchSpec

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_METHOD",
    "PatchInfo",
    "PatchSpec",
    "RopeMethod",
    "get_method",
    "get_patch_info",
    "list_methods",
    "patch_model",
    "patched",
    "planned_length",
    "register_method",
    "unpatch_model",
    "unregister_method",
]

logging.getLogger(__name__).addHandler(logging.NullHandler())

for _name in list_methods():
    _config_io.register_with_transformers(get_method(_name))
