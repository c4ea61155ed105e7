"""The documents perplexity is measured on, as token ids: text files or a ``datasets`` dataset,
each checked to be long enough for the plan and identified by a hash of its tokens."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from ..data import iter_dataset_texts, read_text, tokenize
from .plan import EvalPlan
from .records import EvaluationError

logger = logging.getLogger(__name__)

__all__ = ["check_documents", "document_hash", "documents_from_dataset", "documents_from_files"]


def document_hash(ids: torch.Tensor) -> str:
    """SHA-256 of a document's token ids (so also of the tokenizer that made them), 16 hex digits."""
    return hashlib.sha256(ids.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()).hexdigest()[:16]


def check_documents(plan: EvalPlan, documents: Mapping[str, torch.Tensor],
                    length_flags: str = "--ppl-lengths / --sliding-tokens") -> None:
    """Every document must hold the tokens the plan needs (``length_flags``: the options that set
    those lengths, named in the error)."""
    needed = plan.required_document_tokens()
    if needed and not documents:
        raise EvaluationError("Perplexity needs at least one document: pass --text-files (or --dataset).")
    short = {name: len(ids) for name, ids in documents.items() if len(ids) < needed}
    if short:
        listing = ", ".join(f"{name} ({count} tokens)" for name, count in short.items())
        raise EvaluationError(
            f"Document(s) shorter than the {needed} tokens requested: {listing}. Use longer documents, or shorter "
            f"{length_flags}."
        )


def documents_from_files(tokenizer, paths: Iterable[str | Path]) -> dict[str, torch.Tensor]:
    """Token ids of text files, named by file stem (Project Gutenberg headers stripped)."""
    documents: dict[str, torch.Tensor] = {}
    for path in map(Path, paths):
        name = path.stem
        if name in documents:
            raise EvaluationError(f"Two documents are named {name!r}; give files with different names.")
        documents[name] = tokenize(tokenizer, read_text(path))
        logger.info("%s: %d tokens", path, len(documents[name]))
    return documents


def documents_from_dataset(tokenizer, name: str, *, split: str = "test", text_field: str = "text",
                           config: str | None = None, count: int = 1, min_tokens: int = 0) -> dict[str, torch.Tensor]:
    """The first ``count`` texts of a ``datasets`` dataset with at least ``min_tokens`` tokens."""
    documents: dict[str, torch.Tensor] = {}
    for index, text in enumerate(iter_dataset_texts(name, split=split, text_field=text_field, config=config)):
        ids = tokenize(tokenizer, text)
        if len(ids) >= min_tokens:
            documents[f"{name.rsplit('/', 1)[-1]}#{index}"] = ids
        if len(documents) >= count:
            break
    if len(documents) < count:
        raise EvaluationError(
            f"Dataset {name} ({split}) has only {len(documents)} text(s) of at least {min_tokens} tokens; "
            f"{count} requested."
        )
    return documents
