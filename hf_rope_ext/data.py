"""Long documents as token ids: text files (Project Gutenberg books, PG-19) or a datasets dataset."""

from __future__ import annotations

import codecs
import itertools
import logging
import re
import stat
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_GUTENBERG_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG EBOOK.*?\*\*\*\s*$", re.M | re.I)
_GUTENBERG_END = re.compile(r"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG EBOOK", re.M | re.I)


def strip_gutenberg(text: str) -> str:
    """The book without Project Gutenberg's header and licence, if they are there."""
    start = _GUTENBERG_START.search(text)
    end = _GUTENBERG_END.search(text)
    begin = start.end() if start else 0
    finish = end.start() if end and end.start() > begin else len(text)
    return text[begin:finish].strip()


# Share of bytes that may fail to decode as UTF-8 (a stray Latin-1 character) before a file is
# refused as not UTF-8 text at all.
MAX_UNDECODABLE_FRACTION = 0.001


# Byte-order marks of the UTF-16/32 encodings (Windows "Unicode" text): their NUL bytes would
# otherwise make the file look binary. UTF-32 first: its little-endian mark starts like UTF-16's.
_WIDE_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
              (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"))


def _check_path(path: Path) -> None:
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder, not a text file; pass the text file(s) inside it.")
    if not path.exists():
        raise FileNotFoundError(f"Text file not found: {path}.")
    mode = path.stat().st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
        raise ValueError(f"{path} is not a regular file (a device or socket); pass a text file.")


def _decode(path: Path, data: bytes) -> tuple[str, int]:
    """The text of ``data`` with each undecodable byte as a lone surrogate, and their count; refuses
    what is not UTF-8 text."""
    wide = next((name for bom, name in _WIDE_BOMS if data.startswith(bom)), None)
    if wide is not None:
        raise ValueError(
            f"{path} is {wide} text (it starts with a {wide} byte-order mark), not UTF-8. Convert it first, e.g. "
            f"iconv -f {wide.lower()} -t utf-8 {path} > {path.stem}.utf8.txt"
        )
    if b"\x00" in data:
        raise ValueError(f"{path} is a binary file (it holds NUL bytes), not UTF-8 text.")
    # surrogateescape maps each undecodable byte to one lone surrogate: count, then replace them.
    # utf-8-sig drops a byte-order mark, which would otherwise hide a Gutenberg header behind it.
    text = data.decode("utf-8-sig", errors="surrogateescape")
    undecodable = sum(1 for char in text if "\udc80" <= char <= "\udcff")
    if undecodable > MAX_UNDECODABLE_FRACTION * len(data):
        raise ValueError(
            f"{path}: {undecodable} of its {len(data)} bytes are not valid UTF-8, so it is not UTF-8 text (another "
            "encoding, or a binary file). Convert it first, e.g. iconv -f latin1 -t utf-8."
        )
    return text, undecodable


def check_text_file(path: str | Path) -> None:
    """Refuse what :func:`read_text` cannot read, naming the cause: a missing path, a folder, a
    device or socket, a file that is not UTF-8 text. Cheap next to loading a model, so commands
    call it first. A named pipe passes unread (it can be read only once)."""
    path = Path(path)
    _check_path(path)
    if stat.S_ISREG(path.stat().st_mode):
        _decode(path, path.read_bytes())


def read_text(path: str | Path, strip_header: bool = True) -> str:
    """Read a UTF-8 text file; raises a clear error if it is missing, empty or not UTF-8 text.

    A UTF-8 byte-order mark is dropped. Binary files (with NUL bytes), UTF-16/32 files and files
    of which more than :data:`MAX_UNDECODABLE_FRACTION` of the bytes are not UTF-8 (another
    encoding) are refused; a few undecodable bytes are replaced by U+FFFD with a warning that
    gives their count. A named pipe (``<(zcat book.gz)``) is read once, like a file.
    """
    path = Path(path)
    _check_path(path)
    text, undecodable = _decode(path, path.read_bytes())
    if undecodable:
        logger.warning("%s: %d byte(s) are not valid UTF-8 and were replaced by U+FFFD.", path, undecodable)
        text = "".join("\ufffd" if "\udc80" <= char <= "\udcff" else char for char in text)
    if strip_header:
        text = strip_gutenberg(text)
    if not text.strip():
        raise ValueError(f"{path} contains no text.")
    return text


def tokenize(tokenizer, text: str, add_bos: bool = True) -> torch.Tensor:
    """Token ids of a whole document (1-D), optionally starting with the BOS token."""
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    bos = getattr(tokenizer, "bos_token_id", None)
    if add_bos and bos is not None:
        ids = [bos] + ids
    return torch.tensor(ids, dtype=torch.long)


def iter_dataset_texts(name: str, split: str = "test", text_field: str = "text", config: str | None = None,
                       limit: int | None = None) -> Iterator[str]:
    """Texts of a ``datasets`` dataset (e.g. ``emozilla/pg19-test``), streamed; needs Hub access.

    The dataset is opened and its first row checked for ``text_field`` when this is called, not
    at the first ``next``, so a wrong name or field is refused before a caller loads its model.
    A row whose text is null gives an empty text (skipped, as empty rows are) and a warning.
    """
    try:
        import datasets
    except ImportError as error:
        raise ImportError("Reading a dataset needs the datasets package: pip install datasets") from error
    try:
        dataset = datasets.load_dataset(name, config, split=split, streaming=True)
        rows = iter(dataset)
        first = next(rows, None)  # streaming datasets connect on the first row
    except Exception as error:  # offline (ConnectionError), unknown name, wrong split or config, ...
        message = " ".join(str(error).split()).rstrip(".")
        if Path(name).exists():  # a local folder: the Hub is not involved
            hint = "Check the folder's splits (--dataset-split) and configuration (--dataset-config)."
        elif name.startswith(("/", ".", "~")):  # a path, not a Hub id
            hint = "There is no such local folder; check the path."
        else:
            hint = ("Datasets are streamed from the Hugging Face Hub, which needs a network connection; pass local "
                    "files with --text-files instead.")
        raise OSError(f"Dataset {name!r} (split {split!r}) could not be read: {type(error).__name__}: {message}. {hint}") from error
    if first is not None and text_field not in first:
        raise ValueError(
            f"Dataset {name} has no field {text_field!r}; its fields are {sorted(first)}. Pass one of them with "
            "--text-field."
        )
    return _texts(name, itertools.chain([first] if first is not None else [], rows), text_field, limit)


def check_dataset(name: str, split: str = "test", text_field: str = "text", config: str | None = None) -> None:
    """Refuse a dataset that cannot be read or lacks ``text_field`` (reads its first row only)."""
    iter_dataset_texts(name, split, text_field, config, limit=0)


def _texts(name: str, rows: Iterator[dict], text_field: str, limit: int | None) -> Iterator[str]:
    for index, row in enumerate(rows):
        if limit is not None and index >= limit:
            break
        if text_field not in row:
            raise ValueError(f"Dataset {name} row {index} has no field {text_field!r}; fields: {sorted(row)}.")
        text = row[text_field]
        if text is None:
            logger.warning("Dataset %s row %d: field %r is null; the row is skipped as empty.", name, index, text_field)
            text = ""
        elif not isinstance(text, str):
            raise ValueError(
                f"Dataset {name} row {index}: field {text_field!r} holds {type(text).__name__}, not text; pass the "
                "column that holds the documents with --text-field."
            )
        yield text
