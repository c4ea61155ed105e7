"""One patch, as a value: method, scale, parameters, original context, length options.

:class:`PatchSpec` is what :func:`hf_rope_ext.get_patch_info` reports about a patched model,
what :func:`hf_rope_ext.config_io.verify_record` reads back from a saved config, what
:func:`hf_rope_ext.runtimes.runtime_settings` translates and what fine-tuning writes to
``rope_patch.json``. It is checked once, when it is made; :meth:`PatchSpec.to_record` and
:meth:`PatchSpec.from_record` are the one JSON form (the ``hf_rope_ext`` entry of config.json).

    spec = PatchSpec.create("yarn", 4, original_max_length=8192, beta_fast=32)
    spec.apply(model)                       # = patch_model(model, 4, "yarn", ...)
    spec = PatchSpec.from_record(json.load(open("rope_patch.json")))
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .methods import (
    COMMON_PARAMS,
    LOGN_SUFFIX,
    RopeMethod,
    _check_json,
    get_method,
    list_methods,
    plain_value,
    resolve_params,
)
from .validation import MAX_CONTEXT, check_context, check_length, check_scale, check_steps, is_finite

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_STEPS_PER_DOUBLING",
    "NOT_GIVEN",
    "PatchSpec",
    "RecordError",
    "extended_length",
    "method_spec",
    "resolve_scale",
    "split_method_spec",
    "whole_token_scale",
]

# Length-dependent methods use the frequencies of the exact (planned) length by default: a
# forward over L tokens those of L, generate those of prompt + max_new_tokens, chosen once
# before the prefill, so generation recomputes nothing (README, "Speed"). An integer n rounds
# every length up to L0 * 2 ** (k / n) instead (fewer recomputations in decode loops that
# announce no plan, at some cost in quality).
DEFAULT_STEPS_PER_DOUBLING = None


class _NotGiven:
    def __repr__(self) -> str:
        return "<not given>"


# "steps_per_doubling not given" (None is a meaningful value: the exact length). Giving it at all
# for a static method is an error, so that a wrong method name does not pass silently.
NOT_GIVEN: Any = _NotGiven()

_RECORD_KEYS = ("method", "scale", "original_max_position_embeddings", "original_rope_theta", "params")
_OPTIONAL_RECORD_KEYS = ("version", "steps_per_doubling", "logn_attention")


def extended_length(original: int, scale: float) -> int:
    """The extended context ``original * scale`` in tokens.

    ``patch_model`` makes ``original * scale`` a whole number (up to float rounding, absorbed
    here); a fractional product, from checkpoints written before that rule, is rounded up as
    they were.
    """
    return int(math.ceil(original * scale - 1e-6))


def whole_token_scale(scale: float, original_length: int) -> float:
    """The scale, rounded so that the extended context ``L0 * scale`` is a whole number of tokens.

    The rule: the extended context is ``L0 * scale`` rounded to the nearest token, and the scale
    becomes ``extended / L0`` (so ``factor`` and ``max_position_embeddings / L0`` agree, as
    transformers checks). A warning says when this changes the scale by more than float
    rounding. A scale that extends the context by less than half a token is refused.
    """
    target = original_length * scale
    # Checked as rounded below: (2**31 - 1) / L0 * L0, a few ulps above the limit, rounds to it.
    if not target < MAX_CONTEXT + 0.5:  # NaN and inf too
        check_context(target, f"scale={scale!r} on an original context of {original_length} tokens")
    extended = int(math.floor(target + 0.5))
    if extended <= original_length:
        raise ValueError(
            f"scale={scale!r} extends the original context of {original_length} tokens by "
            f"{target - original_length:.3g} tokens, less than half a token; the smallest extension is "
            f"scale={(original_length + 1) / original_length!r} (max_length={original_length + 1})."
        )
    whole = extended / original_length
    if not math.isclose(whole, scale, rel_tol=1e-9):
        logger.warning(
            "scale %r gives %.6g tokens over the original %d; using scale %r (%d tokens) so that the extended context "
            "is a whole number of tokens.", scale, target, original_length, whole, extended,
        )  # fmt: skip
    return whole


def resolve_scale(scale: Any, max_length: Any, original_length: int) -> float:
    """The scale of a patch from ``scale`` or ``max_length`` (exactly one), checked and rounded so
    that ``original_length * scale`` is a whole number of tokens (see :func:`whole_token_scale`).
    Every entry point (patching, fine-tuning, runtime settings) resolves its target through this."""
    if scale is not None and max_length is not None:
        raise ValueError(
            f"Give either scale or max_length, not both (got scale={scale!r}, max_length={max_length!r}); "
            "scale = max_length / original context."
        )
    if scale is None and max_length is None:
        raise ValueError("patch_model needs scale= (e.g. scale=4) or max_length= (the context you want, in tokens).")
    if max_length is not None:
        max_length = check_length(max_length, "max_length")
        check_context(max_length, "max_length")
        if max_length <= original_length:
            raise ValueError(
                f"max_length={max_length} is not beyond the model's original context of {original_length} tokens; "
                "nothing to extend."
            )
        return check_scale(max_length / original_length, "max_length / original context")
    return whole_token_scale(check_scale(scale), original_length)


def split_method_spec(method: Any, logn_attention: Any = None) -> tuple[Any, bool]:
    """``"yarn+logn"`` -> ``("yarn", True)``: the method name and whether log-n attention is on.
    ``logn_attention`` None: not given (off unless the suffix turns it on)."""
    if logn_attention is not None and not isinstance(logn_attention, bool):
        raise TypeError(f"logn_attention must be True or False, got {logn_attention!r}.")
    if isinstance(method, str) and method.endswith(LOGN_SUFFIX):
        bare = method[: -len(LOGN_SUFFIX)]
        if bare.endswith(LOGN_SUFFIX):
            raise ValueError(f"method {method!r} repeats the {LOGN_SUFFIX!r} suffix; give it once.")
        if not bare:
            raise ValueError(
                f"method {method!r} names no method: {LOGN_SUFFIX!r} goes after one, e.g. 'yarn{LOGN_SUFFIX}'."
            )
        if logn_attention is False:
            raise ValueError(
                f"method {method!r} turns log-n attention on, but logn_attention=False; give one or the other."
            )
        return bare, True
    return method, bool(logn_attention)


def method_spec(method: str, logn_attention: bool) -> str:
    """The inverse of :func:`split_method_spec`."""
    return method + LOGN_SUFFIX if logn_attention else method


def _hashable(value: Any) -> Any:
    """``value`` (a field of a spec) as a hashable equal-for-equal form: lists become tuples,
    mappings frozensets of items (so ``{"a": 2}`` and ``{"a": 2.0}``, equal, hash alike)."""
    if isinstance(value, Mapping):
        return frozenset((key, _hashable(item)) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(item) for item in value)
    return value


def _check_params_belong_to(method: RopeMethod, params: Mapping[str, Any]) -> None:
    """Refuse, with the fix, the parameters of another method: what ``dataclasses.replace(spec,
    method=...)`` passes on (resolve_params would list them as unknown, with odd hints)."""
    if params and set(params) - set(method.defaults):
        owner = next((name for name in list_methods()
                      if name != method.name and set(get_method(name).defaults) == set(params)), None)  # fmt: skip
        if owner is not None:
            raise ValueError(
                f"params are the parameters of method {owner!r}, not of {method.name!r}; when changing the method "
                f"(dataclasses.replace(spec, method={method.name!r})), pass its own params, or params={{}} for its "
                "defaults."
            )


def _check_position_remaps(method: RopeMethod, resolved: Mapping[str, Any]) -> None:
    """Run an attention-level method's own checks (group_size, neighbor_window, chunk_size ...
    against the original and extended contexts), which need the scale that resolve_params lacks."""
    for make_remap in (method.attention, method.attention_below_settle):
        if make_remap is not None:
            make_remap(resolved)


class RecordError(ValueError):
    """A patch record (``config.hf_rope_ext``, ``rope_patch.json``) that cannot be read; ``problem``
    completes the sentence "the record ..."."""

    def __init__(self, problem: str, source: str = "config.json"):
        self.problem = problem
        super().__init__(
            f"The hf_rope_ext patch record in {source} {problem} Restore the file hf_rope_ext wrote, or patch the "
            "model again."
        )


@dataclass(frozen=True)
class PatchSpec:
    """One patch: everything :func:`hf_rope_ext.patch_model` needs to apply it again, exactly.

    Attributes:
        method: registered method name; a ``+logn`` suffix given here is stored as
            ``logn_attention=True`` (the field holds the bare name).
        scale: the context multiplier (> 1), ``L0 * scale`` a whole number of tokens.
        original_max_position_embeddings: the context the model was trained on (``L0``).
        params: the method's own parameters, defaults filled in (plain JSON values).
        steps_per_doubling: length-dependent methods only: None uses the frequencies of the
            exact length, n rounds lengths up to ``L0 * 2 ** (k / n)``. Always None for static
            methods.
        logn_attention: log-n attention on top of the method (given as None: off, unless
            ``method`` has the suffix; always True or False once made).
        original_rope_theta, rotary_dim, kept: facts of the model the patch is for (its RoPE
            base, rotated dimensions per head, and the original ``rope_parameters`` keys the patch
            keeps, such as ``partial_rotary_factor``); None / empty for a spec not tied to a model.
        module_name: where the rotary module sits in the patched model ("" when not patched).

    Making one checks every field (``ValueError``/``TypeError`` naming the field and the fix),
    turns a ``"+logn"`` suffix of ``method`` into ``logn_attention=True`` (refused with
    ``logn_attention=False``) and rounds ``scale`` so that ``L0 * scale`` is a whole number of
    tokens, as ``patch_model`` does (:func:`whole_token_scale`); :meth:`create` also resolves
    ``max_length``.

    The fields cannot be reassigned; ``params`` and ``kept`` are plain dicts, the spec's own
    copies (``get_patch_info`` hands out a deep copy of the live patch's spec, so editing one
    changes only that copy). A spec is hashable: the hash follows the contents, dicts and lists
    included, so equal specs hash alike, and a spec edited after being put in a set or used as
    a key is, as for any mutable value, not found there any more.
    """

    method: str
    scale: float
    original_max_position_embeddings: int
    params: dict[str, Any] = field(default_factory=dict)
    steps_per_doubling: int | None = None
    logn_attention: bool | None = None  # None: not given (off unless ``method`` ends in "+logn")
    original_rope_theta: float | None = None
    rotary_dim: int | None = None
    kept: dict[str, Any] = field(default_factory=dict)
    module_name: str = ""
    # (scale, original context) as from_record read them: a checkpoint written before the
    # whole-token rule keeps its scale (its extended context rounds up, see extended_length) as
    # long as neither changes; a copy that changes either (dataclasses.replace) is rounded.
    _recorded_scale: tuple[float, int] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        method, logn_attention = split_method_spec(self.method, self.logn_attention)
        rope_method = get_method(method)  # unknown names: ValueError with the valid ones
        set_field = object.__setattr__  # frozen: normalised values are written once, here
        set_field(self, "method", rope_method.name)
        set_field(self, "logn_attention", logn_attention)
        set_field(self, "scale", check_scale(self.scale))
        set_field(self, "original_max_position_embeddings",
                  check_length(self.original_max_position_embeddings, "original_max_length"))  # fmt: skip
        # less extended_length's allowance for float rounding: max_length / L0 * L0 may land just above
        original = self.original_max_position_embeddings  # beyond the limit alone: an int too large for a float
        if original > MAX_CONTEXT:
            check_context(original, "original_max_length")
        if (self.scale, original) != self._recorded_scale:
            set_field(self, "_recorded_scale", None)
            # as patch_model does (the same function, which checks the rounded context; a whole
            # scale, such as max_length / L0, is kept)
            set_field(self, "scale", whole_token_scale(self.scale, original))
        else:  # a recorded scale, kept as written
            check_context(self.scale * original - 1e-6, f"scale={self.scale!r} on an original context of {original} tokens")
        if self.rotary_dim is not None:
            rotary_dim = check_length(self.rotary_dim, "rotary_dim", "number of dimensions")
            if rotary_dim % 2:
                raise ValueError(f"rotary_dim must be even (pairs of dimensions rotate together), got {rotary_dim}.")
            set_field(self, "rotary_dim", rotary_dim)
        if self.original_rope_theta is not None:
            # Finite too: inf would reach runtimes as JSON's invalid Infinity and `--rope-freq-base inf`.
            if not is_finite(self.original_rope_theta) or not self.original_rope_theta > 0:
                raise ValueError(f"rope_theta must be a finite number > 0, got {self.original_rope_theta!r}.")
            set_field(self, "original_rope_theta", float(self.original_rope_theta))
        if not isinstance(self.params, Mapping):
            raise TypeError(f"params must be a mapping of the method's parameters, got {type(self.params).__name__}.")
        _check_params_belong_to(rope_method, self.params)
        set_field(self, "params", resolve_params(rope_method, self.rotary_dim, self.params))
        _check_position_remaps(rope_method, self.resolved_params())
        if rope_method.length_dependent:
            set_field(self, "steps_per_doubling", check_steps(self.steps_per_doubling))
            if self.steps_per_doubling is not None and rope_method.attention_below_settle is not None:
                raise ValueError(
                    f"steps_per_doubling does not apply to {self.method!r}: its frequencies change only once, at "
                    "frequencies_scale x the original context; leave it unset."
                )
        elif self.steps_per_doubling is not None:
            raise ValueError(
                f"steps_per_doubling only applies to length-dependent methods; {self.method!r} is static."
            )
        if not isinstance(self.kept, Mapping) or not all(isinstance(key, str) for key in self.kept):
            raise TypeError(
                "kept must be a mapping of the rope_parameters keys the patch keeps (e.g. {'partial_rotary_factor': "
                f"0.5}}, or {{}}), got {self.kept!r:.80}."
            )
        kept = {key: plain_value(value) for key, value in self.kept.items()}
        for key, value in kept.items():  # written to the patched config
            _check_json(value, f"kept[{key!r}]")
        set_field(self, "kept", kept)
        if not isinstance(self.module_name, str):
            raise TypeError(
                f"module_name must be a string (the rotary module's path in the model, '' when not patched), got "
                f"{self.module_name!r}."
            )

    def __hash__(self) -> int:  # the contents (the dataclass's generated hash fails on the dicts)
        return hash(tuple(_hashable(getattr(self, item.name)) for item in fields(self) if item.compare))

    # -- making one ------------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        method: str,
        scale: float | None = None,
        *,
        original_max_length: int,
        max_length: int | None = None,
        steps_per_doubling: Any = NOT_GIVEN,
        logn_attention: bool | None = None,
        rope_theta: float | None = None,
        rotary_dim: int | None = None,
        kept: Mapping[str, Any] | None = None,
        **params: Any,
    ) -> PatchSpec:
        """A spec from :func:`hf_rope_ext.patch_model`'s arguments (same meaning, same checks).

        ``scale`` (or ``max_length``) is rounded so that the extended context is a whole number
        of tokens; ``method`` may carry a ``+logn`` suffix; ``steps_per_doubling`` not given means
        the default for length-dependent methods, and is an error for static ones.
        """
        original = check_length(original_max_length, "original_max_length")
        scale = resolve_scale(scale, max_length, original)
        method, logn_attention = split_method_spec(method, logn_attention)
        rope_method = get_method(method)
        if rope_method.length_dependent:
            steps = DEFAULT_STEPS_PER_DOUBLING if steps_per_doubling is NOT_GIVEN else steps_per_doubling
        elif steps_per_doubling is not NOT_GIVEN:
            raise ValueError(f"steps_per_doubling only applies to length-dependent methods; {method!r} is static.")
        else:
            steps = None
        kept = dict(kept or {})
        return cls(method, scale, original, dict(params), steps, logn_attention, rope_theta, rotary_dim, kept)

    @classmethod
    def for_configuration(
        cls, method: str, scale: float, *, original_max_length: int, steps_per_doubling: int | None = NOT_GIVEN
    ) -> PatchSpec:
        """One configuration of a run that sets ``steps_per_doubling`` once for several methods
        (evaluation, benchmarks): the setting applies to the length-dependent methods; static
        methods have none, so it is not passed to them (``create`` refuses it there, as a sign of
        a wrong method name in a single call)."""
        length_dependent = get_method(split_method_spec(method)[0]).length_dependent
        options = {"steps_per_doubling": steps_per_doubling} if length_dependent else {}
        return cls.create(method, scale, original_max_length=original_max_length, **options)

    def bound_to(self, rotary_dim: int, rope_theta: float, kept: Mapping[str, Any], module_name: str = "") -> PatchSpec:
        """This spec for a model with these RoPE facts; refuses a spec made for another model."""
        for name, mine, theirs in (("rotary_dim", self.rotary_dim, rotary_dim),
                                   ("rope_theta", self.original_rope_theta, rope_theta)):  # fmt: skip
            if mine is not None and not math.isclose(mine, theirs, rel_tol=1e-9):
                raise ValueError(
                    f"This patch was made for a model with {name}={mine!r}, this one has {theirs!r}; "
                    "patch the model it was made for, or make a new patch for this one."
                )
        return replace(self, rotary_dim=rotary_dim, original_rope_theta=float(rope_theta), kept=dict(kept),
                       module_name=module_name)  # fmt: skip

    def at_module(self, module_name: str) -> PatchSpec:
        """This spec with ``module_name`` set. Not checked again: the spec was checked when made,
        and its method may have been unregistered since (the model still runs it)."""
        located = copy.deepcopy(self)  # nothing shared with the live patch (nested lists included)
        object.__setattr__(located, "module_name", module_name)
        return located

    # -- derived values --------------------------------------------------------------------------

    @property
    def rope_method(self) -> RopeMethod:
        return get_method(self.method)

    @property
    def label(self) -> str:
        """The method as ``patch_model`` takes it: ``"yarn+logn"`` when log-n attention is on."""
        return method_spec(self.method, self.logn_attention)

    @property
    def extended_context(self) -> int:
        """The context the patch targets, ``original * scale`` (also for length-dependent methods,
        whose config keeps the original ``max_position_embeddings``)."""
        return extended_length(self.original_max_position_embeddings, self.scale)

    @property
    def max_position_embeddings(self) -> int:
        """The same as :attr:`extended_context` (the name ``PatchInfo`` used)."""
        return self.extended_context

    def resolved_params(self) -> dict[str, Any]:
        """The parameters as ``method.compute`` and the config writers take them."""
        return {
            **self.params,
            "factor": self.scale,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }

    def original_rope_config(self) -> tuple[dict[str, Any], int]:
        """``(rope_parameters, max_position_embeddings)`` of the model before the patch."""
        return (
            {"rope_type": "default", "rope_theta": self._rope_theta("original_rope_config"), **self.kept},
            self.original_max_position_embeddings,
        )

    def _rope_theta(self, what: str) -> float:
        if self.original_rope_theta is None:
            raise ValueError(f"{what} needs the model's rope_theta; make the spec with rope_theta= (or from a model).")
        return self.original_rope_theta

    def patch_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :func:`hf_rope_ext.patch_model` that apply this patch."""
        options = {"steps_per_doubling": self.steps_per_doubling} if self.rope_method.length_dependent else {}
        return {
            "scale": self.scale,
            "method": self.method,
            "original_max_length": self.original_max_position_embeddings,
            "logn_attention": self.logn_attention,
            **options,
            **self.params,
        }

    def apply(self, model):
        """Patch ``model`` with this spec (:func:`hf_rope_ext.patch_model`); returns the model."""
        from .patching import apply_spec  # patching builds on this module

        return apply_spec(model, self)

    # -- the record ------------------------------------------------------------------------------

    def to_record(self) -> dict[str, Any]:
        """The JSON form: the ``config.hf_rope_ext`` entry, enough to rebuild the patch exactly."""
        from . import __version__

        record = {
            "method": self.method,
            "scale": self.scale,
            "original_max_position_embeddings": self.original_max_position_embeddings,
            "original_rope_theta": self._rope_theta("to_record"),
            "params": {key: plain_value(value) for key, value in self.params.items() if key not in COMMON_PARAMS},
            "version": __version__,
        }
        if self.rope_method.length_dependent:
            record["steps_per_doubling"] = self.steps_per_doubling
        if self.logn_attention:
            record["logn_attention"] = True
        return record

    @classmethod
    def from_record(
        cls,
        record: Any,
        *,
        rotary_dim: int | None = None,
        kept: Mapping[str, Any] | None = None,
        source: str = "config.json",
    ) -> PatchSpec:
        """Read and check a record written by :meth:`to_record`.

        Raises :class:`RecordError` (a ``ValueError``, one line) naming the field when the record
        is malformed, and a ``ValueError`` saying how to register it when it names a method this
        process does not know. ``rotary_dim`` (when the model is known) also checks the method's
        parameters against it; ``source`` names the file in that message.
        """
        if not isinstance(record, Mapping):
            raise RecordError(f"must be a JSON object, got {type(record).__name__}.", source)
        missing = [key for key in _RECORD_KEYS if key not in record]
        if missing:
            raise RecordError(f"lacks {missing}.", source)
        unknown = sorted(str(key) for key in record if key not in _RECORD_KEYS + _OPTIONAL_RECORD_KEYS)
        if unknown:
            # A misspelt key (logn_atention) would otherwise be dropped without a word.
            raise RecordError(
                f"has unknown keys {unknown} (the keys are {list(_RECORD_KEYS + _OPTIONAL_RECORD_KEYS)}).", source
            )
        logn = record.get("logn_attention", False)
        if not isinstance(logn, bool):
            raise RecordError(f"has logn_attention={logn!r}; it must be true or false.", source)
        if isinstance(record["method"], str) and record["method"].endswith(LOGN_SUFFIX):
            # The spelling patch_model accepts; the record keeps the flag apart, and both must agree.
            if record.get("logn_attention") is False:
                raise RecordError(
                    f"has method={record['method']!r} but logn_attention=false; they contradict each other.", source
                )
            logn = True
        if not isinstance(record["method"], str):  # an edited record, not a method to register
            raise RecordError(f"has method={record['method']!r}; it must be a string (a method name).", source)
        try:
            method = get_method(record["method"])
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"{source} was written with hf_rope_ext method {record['method']!r}, which is not registered in this "
                "process. Register it with hf_rope_ext.register_method (same name, same frequency function) before "
                f"loading. ({error})"
            ) from None
        scale = record["scale"]
        original = record["original_max_position_embeddings"]
        base = record["original_rope_theta"]
        if not is_finite(scale) or scale <= 1:
            raise RecordError(f"has scale={scale!r}; it must be a number > 1.", source)
        if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
            raise RecordError(f"has original_max_position_embeddings={original!r}; it must be an integer > 0.", source)
        # the bound patch_model sets (inf included), as extended_length rounds; an original context
        # beyond it alone is refused before the product (an int too large for a float)
        if original > MAX_CONTEXT or scale * original - 1e-6 > MAX_CONTEXT:
            if original > MAX_CONTEXT:
                raise RecordError(f"has original_max_position_embeddings of about 10^{len(str(original)) - 1} tokens, "
                                  f"beyond the {MAX_CONTEXT} positions models and runtimes index.", source)  # fmt: skip
            raise RecordError(
                f"has scale={scale!r}, which on its original context of {original} tokens gives {scale * original:.4g} "
                f"tokens, beyond the {MAX_CONTEXT} positions models and runtimes index.", source
            )  # fmt: skip
        if not is_finite(base) or base <= 0:
            raise RecordError(f"has original_rope_theta={base!r}; it must be a number > 0.", source)
        if not isinstance(record["params"], Mapping):
            raise RecordError(f"has params={record['params']!r}; it must be a JSON object.", source)
        steps = record.get("steps_per_doubling")
        if method.length_dependent:
            if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0):
                raise RecordError(f"has steps_per_doubling={steps!r}; it must be a positive integer or null.", source)
            if steps is not None and method.attention_below_settle is not None:
                raise RecordError(
                    f"has steps_per_doubling={steps!r}, but {method.name!r} changes its frequencies only once (at "
                    "frequencies_scale x the original context); hf_rope_ext writes null there.", source
                )
        elif steps is not None:
            raise RecordError(f"has steps_per_doubling={steps!r}, but {method.name!r} is a static method.", source)
        try:
            params = resolve_params(method, rotary_dim, record["params"])
        except (TypeError, ValueError) as error:
            raise RecordError(f"has parameters method {method.name!r} does not accept: {error}", source) from None
        try:
            _check_position_remaps(method, {**params, "factor": float(scale), "original_max_position_embeddings": original})
        except (TypeError, ValueError) as error:
            raise RecordError(f"has parameters method {method.name!r} does not accept: {error}", source) from None
        return cls(method.name, float(scale), original, params, steps, logn, float(base), rotary_dim, dict(kept or {}),
                   _recorded_scale=(float(scale), original))


