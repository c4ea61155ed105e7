"""Per-architecture facts, keyed by ``config.model_type``.

Patching never depends on this table: the rotary module is found by structure (a module with an
``inv_freq`` buffer whose output is ``cat(freqs, freqs)``) and checked numerically. The table
only says which families are tested, and gives the reason when a known family cannot work, so
the error names the model type and the cause.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FamilyInfo:
    supported: bool
    tested: bool = False
    note: str = ""
    # Whether the family's rotary module rotates head_dim * partial_rotary_factor dimensions.
    # transformers' Llama-style modules ignore the factor and rotate the whole head.
    partial_rotary: bool = False
    # A boolean config field that, when true, gives the model another position scheme: its rotary
    # module is then built but never used (Falcon's `alibi`), so there is nothing to extend.
    rope_off_when: str | None = None


FAMILIES: dict[str, FamilyInfo] = {
    # Tested in tests/ on tiny random models: one `model.rotary_emb`, rotate-half layout,
    # keys cached after rotation.
    "llama": FamilyInfo(True, tested=True, note="one rotary module for all layers"),
    "mistral": FamilyInfo(True, tested=True, note="sliding-window layers share the same cos/sin"),
    "qwen2": FamilyInfo(True, tested=True, note="optional sliding window on some layers"),
    "qwen3": FamilyInfo(True, tested=True, note="q/k RMSNorm before RoPE; does not change RoPE itself"),
    "gemma": FamilyInfo(True, tested=True, note="one rotary module for all layers"),
    "granite": FamilyInfo(True, tested=True, note="Llama layout with extra multipliers"),
    "olmo2": FamilyInfo(True, tested=True, note="q/k norm before RoPE"),
    "starcoder2": FamilyInfo(True, tested=True, note="one rotary module for all layers"),
    "qwen3_moe": FamilyInfo(True, tested=True, note="mixture-of-experts MLP; same rotary module"),
    "stablelm": FamilyInfo(True, tested=True, note="partial rotary dimension (partial_rotary_factor)", partial_rotary=True),
    "gpt_neox": FamilyInfo(True, tested=True, note="partial rotary dimension (rotary_pct)", partial_rotary=True),
    "phi3": FamilyInfo(True, tested=True, note="its config accepts only rope_type longrope", partial_rotary=True),
    # Works when the config uses RoPE; not in tests' family grid (fused qkv, `transformer.h` layers).
    "falcon": FamilyInfo(True, note="ALiBi attention biases instead of RoPE", rope_off_when="alibi"),
    # Known not to fit.
    "gpt2": FamilyInfo(False, note="learned absolute position embeddings, no RoPE"),
    "gpt_neo": FamilyInfo(False, note="learned absolute position embeddings, no RoPE"),
    "opt": FamilyInfo(False, note="learned absolute position embeddings, no RoPE"),
    "bert": FamilyInfo(False, note="absolute position embeddings, no RoPE"),
    "t5": FamilyInfo(False, note="relative position bias, no RoPE"),
    "bloom": FamilyInfo(False, note="ALiBi attention biases, no RoPE"),
    "mpt": FamilyInfo(False, note="ALiBi attention biases, no RoPE"),
    "gptj": FamilyInfo(False, note="RoPE computed inside attention on interleaved pairs"),
    "codegen": FamilyInfo(False, note="RoPE computed inside attention on interleaved pairs"),
    "cohere": FamilyInfo(False, note="interleaved (repeat_interleave) cos/sin layout"),
    "gemma3": FamilyInfo(False, note="separate RoPE settings for local and global layers"),
    "gemma3_text": FamilyInfo(False, note="separate RoPE settings for local and global layers"),
    "qwen2_vl": FamilyInfo(False, note="multimodal 3-D RoPE (mrope)"),
    "qwen2_5_vl": FamilyInfo(False, note="multimodal 3-D RoPE (mrope)"),
}


def family_info(model_type: str | None) -> FamilyInfo | None:
    return FAMILIES.get(model_type) if isinstance(model_type, str) else None


def rotates_partial(model_type: str | None) -> bool:
    """Whether the family's rotary module honours ``partial_rotary_factor``, for reads of a config
    alone (unknown families: assumed, as transformers' generic rope functions do). With the module
    at hand, its ``inv_freq`` says (:func:`hf_rope_ext.config_io.kept_rope_fields`)."""
    info = family_info(model_type)
    return info is None or info.partial_rotary


def tested_families() -> list[str]:
    return [name for name, info in FAMILIES.items() if info.tested]


def check_supported(model_type: str | None, config: Any = None) -> None:
    """Refuse a model type known not to work (its note says why), or a ``config`` of a known family
    set to a position scheme other than RoPE; one message for every entry point."""
    info = family_info(model_type)
    if info is not None and not info.supported:
        raise ValueError(
            f"model_type {model_type!r} is not supported: {info.note}. hf_rope_ext works on RoPE models "
            f"with a shared rotary module, such as {', '.join(tested_families())}."
        )
    flag = info.rope_off_when if info is not None else None
    if flag and getattr(config, flag, False):  # read by truth, as the model's forward reads it
        raise ValueError(
            f"model_type {model_type!r} with {flag}={getattr(config, flag)!r} is not supported: its config uses "
            f"{info.note}, so its rotary module is never called and there is nothing to extend; hf_rope_ext "
            f"patches models that use RoPE ({flag}=False)."
        )
