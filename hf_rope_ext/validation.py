"""Checks of the numbers a patch is made of, shared by every entry point (one message per mistake)."""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["MAX_CONTEXT", "check_context", "check_length", "check_scale", "check_steps", "is_finite", "is_real"]


def is_real(value: Any) -> bool:
    """A real number (int, float, Fraction, numpy scalar), not a bool; tensors are not numbers here."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_finite(value: Any) -> bool:
    """A real number (see :func:`is_real`) that is neither infinite nor NaN."""
    return is_real(value) and math.isfinite(value)


def check_scale(scale: Any, name: str = "scale") -> float:
    """``scale`` as a float > 1; the errors say how to fix it."""
    if not is_real(scale):
        raise TypeError(f"{name} must be a number (e.g. {name}=4), got {type(scale).__name__} {scale!r}.")
    try:
        scale = float(scale)
    except OverflowError:  # an int or Fraction beyond float range
        raise ValueError(f"{name} must be finite, got a number beyond float range ({scale!r:.40}...).") from None
    if not math.isfinite(scale):
        raise ValueError(f"{name} must be finite, got {scale}.")
    if scale <= 0:
        raise ValueError(f"{name} must be > 1 (how many times longer than the original context), got {scale}.")
    if scale < 1:
        raise ValueError(
            f"{name}={scale} is below 1, which would shrink the context the model handles; "
            "hf_rope_ext only extends. Use scale > 1 (e.g. 2, 4, 8)."
        )
    if scale == 1:
        raise ValueError(f"{name}=1 leaves the model unchanged; use scale > 1 (e.g. 2, 4, 8).")
    return scale


# Positions are int32 in runtimes (llama.cpp) and kernels; no context reaches this.
MAX_CONTEXT = 2**31 - 1


def check_context(tokens: float, name: str) -> None:
    """Refuse an extended context of ``tokens`` beyond :data:`MAX_CONTEXT` (or not finite)."""
    if tokens > MAX_CONTEXT or not math.isfinite(tokens):  # the comparison first: huge ints overflow isfinite
        shown = f"{tokens:.4g}" if isinstance(tokens, float) else f"about 10^{len(str(int(tokens))) - 1}"
        raise ValueError(
            f"{name} gives a context of {shown} tokens, beyond the {MAX_CONTEXT} positions models and runtimes "
            "index; use a smaller value."
        )


def check_length(value: Any, name: str, what: str = "number of tokens") -> int:
    """``value`` as a positive int; the errors say it is a positive integer ``what``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if isinstance(value, float) and value.is_integer():
            return check_length(int(value), name, what)
        raise TypeError(f"{name} must be a positive integer {what}, got {value!r}.")
    if value <= 0:
        raise ValueError(f"{name} must be a positive {what}, got {value}.")
    return int(value)


def check_steps(value: Any) -> int | None:
    """``steps_per_doubling``: a positive integer, or None (the exact length)."""
    if value is None:
        return None
    return check_length(value, "steps_per_doubling", "number of frequency steps per doubling of the length (or None)")
