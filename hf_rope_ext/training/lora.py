"""LoRA on a (patched) causal LM with peft; targets found by structure, not by family names.

LoRA (Hu et al., ICLR 2022, arXiv 2106.09685) learns ``W + (alpha / r) * B A`` with rank-``r``
matrices ``A``, ``B`` for each targeted linear layer. LongLoRA (Chen et al., ICLR 2024,
arXiv 2309.12307) found that for large context extensions LoRA alone falls short of full
fine-tuning unless the input embeddings and the normalization layers are trained as well
("LoRA+"); :func:`apply_lora` offers both through peft's ``modules_to_save``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import nn

from ..validation import is_finite

logger = logging.getLogger(__name__)

__all__ = ["LoraSettings", "apply_lora", "check_tied_targets", "default_lora_targets", "embedding_module_names",
           "norm_module_names"]


@dataclass
class LoraSettings:
    """What to train.

    Attributes:
        rank: LoRA rank ``r``.
        alpha: LoRA ``alpha``; the update is scaled by ``alpha / r``.
        dropout: dropout on the LoRA branch input.
        target_modules: leaf names of the linear layers to adapt; default: every linear layer
            except the output head (the attention and MLP projections).
        train_embeddings: also train the input embeddings (and a tied output head with them).
        train_norms: also train every normalization layer.
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] | None = None
    train_embeddings: bool = False
    train_norms: bool = False
    resolved_targets: list[str] = field(default_factory=list, init=False)
    modules_to_save: list[str] = field(default_factory=list, init=False)

    def validate(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank must be a positive integer, got {self.rank!r}.")
        if not is_finite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"LoRA alpha (--lora-alpha) must be a finite number > 0, got {self.alpha!r}.")
        if isinstance(self.target_modules, (str, bytes)):  # would be read character by character
            raise TypeError(f"target_modules must be a list, e.g. [{self.target_modules!r}], got a single string.")
        if not is_finite(self.dropout) or not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}.")


def _leaf_name(name: str) -> str:
    return name.rpartition(".")[2]


def default_lora_targets(model: nn.Module) -> list[str]:
    """Leaf names of all ``nn.Linear`` layers except the output head, e.g.
    ``["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]``.

    Found by structure: the output head is ``model.get_output_embeddings()``. Raises if a
    target leaf name is also the head's, since peft matches targets by name suffix.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_names = {_leaf_name(name) for name, module in model.named_modules() if head is not None and module is head}
    linear = {
        _leaf_name(name)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and module is not head and name
    }
    clash = linear & head_names
    if clash:
        raise ValueError(
            f"Linear layers named {sorted(clash)} share their name with the output head; pass target_modules explicitly."
        )
    if not linear:
        raise ValueError(f"{type(model).__name__} has no linear layers besides its output head; nothing for LoRA to adapt.")
    return sorted(linear)


def norm_module_names(model: nn.Module) -> list[str]:
    """Full names of the normalization layers, found by structure.

    A normalization layer here is a leaf module (no children) whose parameters are all 1-D
    (RMSNorm's scale, LayerNorm's scale and bias): the only such modules in these models.
    """
    names = []
    for name, module in model.named_modules():
        if not name or any(True for _ in module.children()):
            continue
        params = list(module.parameters(recurse=False))
        if params and all(p.dim() == 1 for p in params) and not isinstance(module, (nn.Linear, nn.Embedding)):
            names.append(name)
    if not names:
        raise ValueError(f"{type(model).__name__}: no normalization layers found (leaf modules with only 1-D weights).")
    return names


def embedding_module_names(model: nn.Module) -> list[str]:
    """The full name of the input embedding (``model.get_input_embeddings()``)."""
    embeddings = model.get_input_embeddings()
    names = [name for name, module in model.named_modules() if module is embeddings and name]
    if not names:
        raise ValueError(f"{type(model).__name__}: input embeddings not found among its submodules.")
    return names[:1]


def _adaptable(module: nn.Module) -> bool:
    """A layer peft's LoRA can wrap (4-bit linear layers subclass nn.Linear; GPT-2 style Conv1D too)."""
    kinds = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention)
    return isinstance(module, kinds) or type(module).__name__ == "Conv1D"


def _ties_output_head(model: nn.Module) -> bool:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head is not None and head.weight is model.get_input_embeddings().weight


def check_tied_targets(model: nn.Module, settings: LoraSettings) -> None:
    """Refuse LoRA targets on an output head tied to the input embeddings (``ValueError``).

    LoRA on one of the pair changes one use of the shared matrix only, but ``merge_and_unload``
    writes the update into the shared matrix, so the merged model would differ from the adapter
    model (peft only warns). ``model`` may be a skeleton on the meta device: only its structure is read.
    """
    if not settings.target_modules or not _ties_output_head(model):
        return
    pair = {module: role for module, role in ((model.get_output_embeddings(), "output head"),
                                              (model.get_input_embeddings(), "input embeddings"))}
    tied = {}  # leaf name -> role, for the leaf names of the tied pair
    for name, module in model.named_modules():
        if name and module in pair:
            tied[_leaf_name(name)] = pair[module]
    named = [target for target in settings.target_modules if target in tied]
    if named:
        which = ", ".join(f"{target} (the {tied[target]})" for target in named)
        raise ValueError(
            f"--lora-target-modules names {which}, whose weight this model shares between input embeddings and "
            "output head (tie_word_embeddings=True): merged/ would carry the LoRA update in both and differ from "
            f"adapter/. Drop {', '.join(named)} from --lora-target-modules; use --train-embeddings to train the "
            "shared matrix (it stays tied)."
        )


def apply_lora(model: nn.Module, settings: LoraSettings):
    """Wrap ``model`` with peft LoRA as ``settings`` say; returns the ``PeftModel``.

    Fills ``settings.resolved_targets`` and ``settings.modules_to_save``. With tied input and
    output embeddings, ``train_embeddings`` keeps them tied (peft's ``ensure_weight_tying``).
    """
    from peft import LoraConfig, get_peft_model

    settings.validate()
    check_tied_targets(model, settings)
    targets = list(settings.target_modules) if settings.target_modules else default_lora_targets(model)
    modules_to_save: list[str] = []
    if settings.train_embeddings:
        modules_to_save += embedding_module_names(model)
    if settings.train_norms:
        modules_to_save += norm_module_names(model)
    present, other = set(), {}  # every leaf name; leaf name -> classes of its modules LoRA cannot wrap
    for name, module in model.named_modules():
        present.add(_leaf_name(name))
        if not _adaptable(module):
            other.setdefault(_leaf_name(name), set()).add(type(module).__name__)
    missing = [target for target in targets if target not in present]
    if missing:
        raise ValueError(
            f"LoRA target modules {missing} are not in {type(model).__name__}; it has linear layers "
            f"{default_lora_targets(model)}."
        )
    # peft refuses other modules (blocks, norms) with a message that dumps the whole module.
    unsupported = [f"{target} ({'/'.join(sorted(other[target]))})" for target in targets if target in other]
    if unsupported:
        adaptable = sorted(leaf for leaf in present - set(other) if leaf)
        raise ValueError(
            f"LoRA can adapt only linear, embedding and convolution layers, not {', '.join(unsupported)}; "
            f"pick from {adaptable}."
        )
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        modules_to_save=modules_to_save or None,
        ensure_weight_tying=bool(settings.train_embeddings and _ties_output_head(model)),
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    settings.resolved_targets = targets
    settings.modules_to_save = modules_to_save
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    logger.info(
        "LoRA r=%d alpha=%g on %s%s: %d trainable parameters of %d (%.2f%%).",
        settings.rank,
        settings.alpha,
        ", ".join(targets),
        f", also training {len(modules_to_save)} embedding/norm modules" if modules_to_save else "",
        trainable,
        total,
        100.0 * trainable / total,
    )
    return peft_model
