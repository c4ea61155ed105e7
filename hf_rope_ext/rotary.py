"""The rotary module that replaces a model's own: frequencies from a registered method, cos/sin out.

Interface (the one transformers' Llama/Mistral/Qwen2/Qwen3 rotary modules have):
``forward(x, position_ids) -> (cos, sin)``, each ``(batch, seq, rotary_dim)`` in ``x.dtype``,
laid out as ``cat(freqs, freqs)`` (rotate-half layout, not interleaved pairs) and multiplied by
the attention factor. ``x`` is only read for its dtype and device.

Numerics: the angle ``m * theta_i`` is formed in float64 and reduced modulo 2 pi before it is
cast to float32, so cos/sin are accurate to float32 rounding at any position. Plain float32
``m * theta_i`` (transformers) is off by up to 0.0039 rad at positions below 131072 (half a
float32 step of the product), twice bfloat16's rounding of cos/sin (0.002). The frequencies
stay float32/float64 whatever dtype the model is cast to: forward reads them from a float64
master that no cast reaches, not from the module's buffers (FSDP's ``buffer_dtype`` casts
buffers in place, without ``_apply``).
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .methods import RopeMethod, checked_frequencies, default_inv_freq

logger = logging.getLogger(__name__)

TWO_PI = 2 * math.pi
# Devices without float64 (Apple MPS) use an exact float32 range reduction instead:
# m = q * ANGLE_BLOCK + r, and q * theta_i is replaced by q * ((ANGLE_BLOCK * theta_i) mod 2 pi).
ANGLE_BLOCK = 1024


def supports_float64(device: torch.device) -> bool:
    return torch.device(device).type != "mps"


def rope_angles(position_ids: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Angles ``m * theta_i mod 2 pi`` in float32, shape ``position_ids.shape + (rotary_dim // 2,)``.

    ``inv_freq`` is float64: the product is exact to float64 rounding and the reduction keeps
    the float32 result within one float32 rounding of the true angle.
    """
    return torch.remainder(position_ids[..., None].to(torch.float64) * inv_freq, TWO_PI).to(torch.float32)


def rope_angles_float32(position_ids: torch.Tensor, inv_freq: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
    """Float32-only version of :func:`rope_angles` (error ~1e-4 rad up to m = 131072).

    Exact identity: ``m * theta = q * (B * theta) + r * theta`` with ``m = q * B + r`` and ``q``
    an integer, so ``q * phase`` with ``phase = (B * theta) mod 2 pi`` (from float64) gives the
    same cos/sin while every float32 product stays small.
    """
    positions = position_ids.long()
    blocks = torch.div(positions, ANGLE_BLOCK, rounding_mode="floor")
    within = positions - blocks * ANGLE_BLOCK
    return blocks[..., None].float() * phase + within[..., None].float() * inv_freq


@dataclass
class _Frequencies:
    """One set of frequencies: a float64 master on CPU, and device copies made on demand."""

    inv_freq_f64: torch.Tensor
    attention_factor: float
    on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inv_freq float32, exact)``: ``exact`` is float64 inv_freq, or the float32 block
        phase on devices without float64."""
        device = torch.device(device)
        if device not in self.on_device:
            if supports_float64(device):
                exact = self.inv_freq_f64.to(device)
            else:
                exact = torch.remainder(self.inv_freq_f64 * ANGLE_BLOCK, TWO_PI).to(device=device, dtype=torch.float32)
            self.on_device[device] = (self.inv_freq_f64.to(device=device, dtype=torch.float32), exact)
        return self.on_device[device]



def effective_length(
    seq_len: int | None, original_length: int, steps_per_doubling: int | None, length_dependent: bool = True
) -> int | None:
    """The length whose frequencies a sequence of ``seq_len`` tokens uses.

    None inside the original context (and for static methods): the frequencies do not depend
    on the length there. Beyond it, the smallest ``ceil(L0 * 2 ** (k / n))`` that is at least
    ``seq_len`` (n = ``steps_per_doubling``), or ``seq_len`` itself when n is None.
    """
    if not length_dependent or seq_len is None or int(seq_len) <= original_length:
        return None
    seq_len = int(seq_len)
    if steps_per_doubling is None:
        return seq_len
    k = max(1, math.ceil(steps_per_doubling * math.log2(seq_len / original_length) - 1e-9))
    length = math.ceil(original_length * 2 ** (k / steps_per_doubling))
    while length < seq_len:  # guard against rounding in log2
        k += 1
        length = math.ceil(original_length * 2 ** (k / steps_per_doubling))
    # The grid values are rounded up, so the step below may already cover seq_len (46 for
    # L0 = 32, n = 4): take it, so that a grid value maps to itself.
    while k > 1 and math.ceil(original_length * 2 ** ((k - 1) / steps_per_doubling)) >= seq_len:
        k -= 1
        length = math.ceil(original_length * 2 ** (k / steps_per_doubling))
    return length


def angles_for(position_ids: torch.Tensor, inv_freq: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Angles from the pair returned by ``_Frequencies.tensors``."""
    if exact.dtype == torch.float64:
        return rope_angles(position_ids, exact)
    return rope_angles_float32(position_ids, inv_freq, exact)


def attention_dropout_message(label: str, dropout: float) -> str:
    """Why an attention-level patch refuses to train a model with attention dropout."""
    return (
        f"attention-level methods ({label!r}) cannot train with attention dropout, and this model has "
        f"config.attention_dropout={dropout:g}; load it with attention_dropout=0.0 "
        "(from_pretrained(..., attention_dropout=0.0)) to train it, or use the model in eval mode."
    )


class ExtendedRotaryEmbedding(nn.Module):
    """Rotary position embedding with frequencies from a registered scaling method.

    Replaces a model's rotary module instance (kept in ``original_rotary`` for
    :func:`hf_rope_ext.unpatch_model`). Static methods compute their frequencies once.
    Length-dependent methods use the frequencies of the length ``frequency_length`` when it is
    set (the cache guard sets it for each forward: generate's planned length, or the length the
    KV cache's states were computed with), else of ``L = max(position_ids) + 1`` over the whole batch (every row gets the longest
    row's frequencies, as in transformers); beyond the
    original context the length is rounded up to one of ``steps_per_doubling`` geometric steps
    per doubling (``L0 * 2 ** (k / n)``, not rounded when n is None). Keeping a KV cache
    consistent with these frequencies is the job of :mod:`hf_rope_ext.cache_consistency`.
    """

    def __init__(
        self,
        original: nn.Module,
        method: RopeMethod,
        params: dict[str, Any],
        rotary_dim: int,
        base: float,
        steps_per_doubling: int | None = None,
    ):
        super().__init__()
        # Kept out of the module tree: not moved twice, not re-initialised by `init_weights`,
        # no extra entries in `named_modules()`.
        self.__dict__["original_rotary"] = original
        self.method = method
        self.params = params
        self.rotary_dim = rotary_dim
        self.base = base
        self.steps_per_doubling = steps_per_doubling
        self.original_max_seq_len = int(params["original_max_position_embeddings"])
        # The patched model's own copy of its config, and the object it replaced (set by patch_model).
        self.config = getattr(original, "config", None)
        self.original_config = self.config
        # The model's attention dropout: attention-level methods cannot train with it (set by patch_model).
        self.attention_dropout = 0.0
        self.rope_type = method.name
        self._frequencies: dict[int | None, _Frequencies] = {}
        # Length whose frequencies the next forward uses (at least its own length); set and
        # cleared around each forward by the cache guard.
        self.frequency_length: int | None = None
        self.cache_guard = None  # set by patch_model: PrefixRecompute (length-dependent), CacheRecord (static)
        self.spec = None  # the PatchSpec applied (get_patch_info), set by patch_model
        self.attention_patch = None  # set by patch_model for attention-level methods and log-n attention
        # (module, attribute, config) for each copy of the model's config that patch_model replaced
        # with the patched one (a layer peft's modules_to_save copied), put back by unpatch_model.
        self.config_copies: list = []
        # True in a copy made apart from its model (copy.deepcopy of this module alone, as peft's
        # modules_to_save makes): the model's hooks, which keep the patch's state, do not reach it.
        self.copied_apart = False
        settle = method.settle_length
        self.settle_length: int | None = int(settle(params)) if settle is not None and method.length_dependent else None
        # A method with a remap below its settle length keeps the trained frequencies up to it
        # (checked below): one state from 0 to the settle length.
        self.one_state_below_settle = self.settle_length is not None and method.attention_below_settle is not None
        # Length whose frequencies the last forward used (length-dependent methods): it says
        # whether a settle-length method's remap is on in that forward's attention.
        self.current_length: int | None = None

        initial = self._frequencies_for_length(None)
        # Inside the original context a length-dependent method may still differ from plain RoPE
        # (longrope: short_factor and its attention factor), and an attention-level method combined
        # with a frequency method does; only where it does not is the original module's own
        # output used there.
        self.original_inside_context = (
            torch.equal(initial.inv_freq_f64, default_inv_freq(rotary_dim, base)) and initial.attention_factor == 1.0
        )
        if self.one_state_below_settle:
            below = checked_frequencies(method, rotary_dim, base, params, self.settle_length)
            if not (self.original_inside_context and torch.equal(below[0], initial.inv_freq_f64) and below[1] == 1.0):
                raise ValueError(
                    f"RoPE method {method.name!r} has a position remap below its settle length ({self.settle_length}) "
                    "but changes the frequencies there; such a method must keep the trained frequencies up to it."
                )
        inv_freq, exact = initial.tensors(original.inv_freq.device)
        # Buffers, so that the module's device shows (`_apply` rebuilds them with their dtypes);
        # forward reads `self._current`, which casts of the buffers themselves cannot reach.
        self.register_buffer("inv_freq", inv_freq.clone(), persistent=False)
        self.register_buffer("inv_freq_exact", exact.clone(), persistent=False)
        self.attention_scaling = initial.attention_factor
        self._current = initial
        # Whether the original module may stand in for this one inside the original context
        # (updated by `_apply`, which casts the original module too).
        self.original_module_exact = self._original_frequencies_exact()

    # -- frequencies -------------------------------------------------------------------------

    def frequencies(self, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """``(inv_freq float64, attention_factor)`` this module uses for a sequence of ``seq_len``."""
        freqs = self._frequencies_for_length(seq_len)
        return freqs.inv_freq_f64.clone(), freqs.attention_factor

    def effective_length(self, seq_len: int | None) -> int | None:
        """The length whose frequencies a sequence of ``seq_len`` tokens uses (see :func:`effective_length`).

        Beyond a method's settle length every length has the same frequencies: they are all
        keyed ``settle + 1`` (see :meth:`covered_length`).
        """
        length = effective_length(seq_len, self.original_max_seq_len, self.steps_per_doubling, self.method.length_dependent)
        if length is not None and self.settle_length is not None and length > self.settle_length:
            return self.settle_length + 1
        if self.one_state_below_settle:
            return None  # the trained frequencies serve every length up to the settle length
        return length

    def covered_length(self, effective: int | None) -> float:
        """How many tokens the frequencies of the effective length ``effective`` serve unchanged."""
        if effective is None:
            return self.settle_length if self.one_state_below_settle else self.original_max_seq_len
        if self.settle_length is not None and effective > self.settle_length:
            return math.inf
        return effective

    def remap_applies(self, length: int | None = None) -> bool:
        """Whether an attention-level method's position remap is on for a sequence of ``length``
        tokens (default: the current forward's); always, unless the method has a settle length."""
        if self.settle_length is None:
            return True
        length = self.current_length if length is None else length
        return length is not None and length > self.settle_length

    def _frequencies_for_length(self, seq_len: int | None) -> _Frequencies:
        key = self.effective_length(seq_len)
        cached = self._frequencies.get(key)
        if cached is None:
            inv_freq, attention_factor = checked_frequencies(self.method, self.rotary_dim, self.base, self.params, key)
            if inv_freq.is_meta:
                raise ValueError(
                    f"RoPE method {self.method.name!r} returned frequencies on the meta device (no values); compute "
                    "them on the CPU (outside a torch.device('meta') context)."
                )
            cached = _Frequencies(inv_freq, attention_factor)
            if len(self._frequencies) >= 64:  # token-exact lengths visit many values; keep the newest
                self._frequencies.pop(next(iter(self._frequencies)))
            self._frequencies[key] = cached
        return cached

    _FREQUENCY_BUFFERS = ("inv_freq", "inv_freq_exact")

    def _apply(self, fn, recurse=True):
        # `model.to(torch.bfloat16)` would cast the frequency buffers (and float64 cannot go to
        # every device): take them out, move the rest, and rebuild them from the float64 master
        # on the new device.
        old_device = self.inv_freq.device
        saved = {name: self._buffers.pop(name) for name in self._FREQUENCY_BUFFERS}
        try:
            super()._apply(fn, recurse)
            device = fn(torch.zeros((), device=old_device)).device
        except BaseException:
            self._buffers.update(saved)
            raise
        inv_freq, exact = self._current.tensors(device)
        self.register_buffer("inv_freq", inv_freq.clone(), persistent=False)
        self.register_buffer("inv_freq_exact", exact.clone(), persistent=False)
        # The original module is outside the module tree: cast and move it as the unpatched model
        # would be, so that patch, cast, unpatch gives what the cast alone gives.
        self.original_rotary._apply(fn, recurse)
        self.original_module_exact = self._original_frequencies_exact()
        return self

    # -- copying and pickling ----------------------------------------------------------------

    def __reduce_ex__(self, protocol):
        # The cache guard and the attention patch hold hooks, weak references and entries in
        # transformers' attention registry, which a pickle cannot carry to another process.
        if self.method.length_dependent or self.attention_patch is not None:
            label = self.spec.label if self.spec is not None else self.method.name
            raise TypeError(
                f"A model patched with {label!r} cannot be pickled (torch.save(model), pickle): its KV-cache and "
                "attention hooks hold live state. Save it with hf_rope_ext.hub.save_patched (or save_pretrained and "
                "load_patched), or call unpatch_model first."
            )
        return super().__reduce_ex__(protocol)

    # What the copy module does by default, without __reduce_ex__ (which refuses some patches):
    # copy.deepcopy(model) works with every patch.
    def __copy__(self) -> ExtendedRotaryEmbedding:
        copied = type(self).__new__(type(self))
        copied.__setstate__(self.__getstate__())
        return copied

    def __deepcopy__(self, memo: dict) -> ExtendedRotaryEmbedding:
        # Copying the model reaches this module through the hook tables of the module that calls it
        # (their hooks refer to it) or after them (its submodules come after its hook tables): when
        # none of them is being copied, this module is copied alone.
        tables = self._hook_tables()
        apart = bool(tables) and not any(id(table) in memo for table in tables)
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        if apart:
            copied.copied_apart = True
            # The copied handles point at copies of the model's hook tables that nothing holds:
            # once those are gone, copying the copy again would fail (weak reference to None).
            for owner, attribute in ((copied.cache_guard, "handles"), (copied.attention_patch, "hooks")):
                if isinstance(getattr(owner, attribute, None), list):
                    setattr(owner, attribute, [])
        return copied

    def _hook_tables(self) -> list[Any]:
        """The hook tables (dicts of a module) that the patch's forward hooks are registered in."""
        handles = list(getattr(self.cache_guard, "handles", None) or ())
        handles += list(getattr(self.attention_patch, "hooks", None) or ())
        tables = []
        for handle in handles:
            reference = getattr(handle, "hooks_dict_ref", None)
            table = reference() if callable(reference) else None
            if table is not None:
                tables.append(table)
        return tables

    def _original_frequencies_exact(self) -> bool:
        """Whether the original module's frequencies are this module's own, to float32 rounding.

        Decided by value, not dtype: a cast to fp16/bf16 and back leaves them float32 but rounded
        (the original module would then rotate the keys cached inside the original context
        otherwise than this module rotates beyond it), and a cast to float64 leaves them float64
        with their float32 values unchanged.
        """
        inv_freq = self.original_rotary.inv_freq
        exact = self._frequencies_for_length(None).inv_freq_f64
        if not self.original_inside_context or inv_freq.is_meta or inv_freq.shape != exact.shape:
            return False
        # A float32 `base ** -x` (transformers' formula) is off by about ln(base) float32 roundings,
        # its exponent being rounded; bf16/fp16 round by 2^-9 / 2^-12, far more.
        tolerance = (max(math.log(self.base), 0.0) + 8) * torch.finfo(torch.float32).eps
        return torch.allclose(inv_freq.detach().to("cpu", torch.float64), exact, rtol=tolerance, atol=0)

    # -- forward -----------------------------------------------------------------------------

    def _check_attention_patch(self) -> None:
        """Refuse a forward that the attention patch cannot compute as patched, before it runs."""
        patch = self.attention_patch
        label = self.spec.label if self.spec is not None else self.method.name
        implementation = getattr(self.config, "_attn_implementation", None)
        if implementation != patch.name:
            raise ValueError(
                f"config._attn_implementation was changed to {implementation!r} after patching "
                f"(set_attn_implementation?), which bypasses the attention of the {label!r} patch; call unpatch_model, "
                "change the attention implementation, then patch_model again."
            )
        if self.training and self.attention_dropout:
            raise ValueError(attention_dropout_message(label, self.attention_dropout))

    def _check_not_copied_apart(self) -> None:
        """Refuse to run a copy of this module made without its model when the patch keeps state in
        the model's hooks (length-dependent and attention-level patches): the copy would run with the
        state of a module that is never called (wrong logits, wrong cached generation)."""
        if self.copied_apart and (self.method.length_dependent or self.attention_patch is not None):
            label = self.spec.label if self.spec is not None else self.method.name
            raise ValueError(
                f"This rotary module is a copy of a {label!r}-patched model's rotary embedding made apart from the "
                "model (peft's modules_to_save=['rotary_emb'] makes one), which the patch's hooks do not reach; leave "
                "the rotary module out of modules_to_save (it has no weights to train), or copy the whole model."
            )

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if getattr(self, "copied_apart", False):
            self._check_not_copied_apart()
        if self.attention_patch is not None:
            self._check_attention_patch()
        if self.method.length_dependent:
            # One host sync per forward, as in transformers' dynamic types.
            length = int(position_ids.max()) + 1
            if self.frequency_length is not None:
                length = max(length, self.frequency_length)
            self.current_length = length
            if length <= self.original_max_seq_len and self.original_module_exact:
                # Inside the original context the method is the original RoPE: use the original
                # module itself, so outputs are bitwise those of the unpatched model.
                self._current, self.attention_scaling = self._frequencies_for_length(None), 1.0
                return self.original_rotary(x, position_ids)
            freqs = self._frequencies_for_length(length)
            inv_freq, exact = freqs.tensors(x.device)
            attention_factor = freqs.attention_factor
            self._current, self.attention_scaling = freqs, attention_factor
        else:
            if (
                self.method.attention is not None
                and self.original_module_exact
                and int(position_ids.max()) < self.original_max_seq_len
            ):
                # Attention-level methods that keep the trained frequencies: inside the original
                # context the original module gives the unpatched model's outputs bitwise.
                return self.original_rotary(x, position_ids)
            inv_freq, exact = self._current.tensors(x.device)
            attention_factor = self.attention_scaling
        angles = angles_for(position_ids.to(x.device), inv_freq, exact)
        emb = torch.cat((angles, angles), dim=-1)
        cos = emb.cos() * attention_factor
        sin = emb.sin() * attention_factor
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

    def extra_repr(self) -> str:
        extra = f", steps_per_doubling={self.steps_per_doubling}" if self.method.length_dependent else ""
        return (
            f"method={self.method.name!r}, scale={self.params['factor']:g}, "
            f"original_max_position_embeddings={self.original_max_seq_len}, rotary_dim={self.rotary_dim}{extra}"
        )
