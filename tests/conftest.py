"""Tiny random models built from configs, so nothing is downloaded."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import threading
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels (hf_rope_ext.fused_attention) run in Triton's interpreter on the
# CPU; it is chosen when triton is first imported, so before any test imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

ORIGINAL_CONTEXT = 32  # max_position_embeddings of the tiny models
VOCAB = 128

# Sizes of every tiny model (the four families below and the other families tested by type)
TINY_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=ORIGINAL_CONTEXT,
)
_COMMON = dict(
    **TINY_SHAPE,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

CONFIGS = {
    "llama": lambda **kw: LlamaConfig(**{**_COMMON, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, **kw}),
    # sliding_window longer than every test sequence unless a test asks for a short one
    "mistral": lambda **kw: MistralConfig(**{**_COMMON, "sliding_window": 4096, **kw}),
    "qwen2": lambda **kw: Qwen2Config(**{**_COMMON, "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}, **kw}),
    "qwen3": lambda **kw: Qwen3Config(**{**_COMMON, "head_dim": 16, **kw}),
}
FAMILIES = list(CONFIGS)


def make_config(family: str, **overrides):
    return CONFIGS[family](**overrides)


def make_model(family: str = "llama", seed: int = 0, attn_implementation: str = "eager", **overrides):
    torch.manual_seed(seed)
    config = make_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return strengthen_weights(model).eval()


def strengthen_weights(model):
    """Larger-than-default projection weights make attention depend on position strongly
    enough that a wrong rotation shows up in the logits."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "proj" in name and parameter.dim() == 2:
                parameter.normal_(0, 0.15)
    return model


def native_twin(model, rope_parameters: dict, max_position_embeddings: int | None = None):
    """The same weights in a model built by transformers itself with the given RoPE settings."""
    config = copy.deepcopy(model.config)
    for attribute in ("hf_rope_ext",):
        if hasattr(config, attribute):
            delattr(config, attribute)
    base = dict(config.rope_parameters)
    kept = {key: base[key] for key in ("rope_theta", "partial_rotary_factor") if key in base}
    config.rope_parameters = {**kept, **rope_parameters}
    if max_position_embeddings is not None:
        config.max_position_embeddings = max_position_embeddings
    config.standardize_rope_params()
    config.validate_rope()
    twin = AutoModelForCausalLM.from_config(config, attn_implementation=model.config._attn_implementation)
    twin.load_state_dict(model.state_dict())
    return twin.eval()


def random_ids(length: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


# Tests marked `runtimes` run real inference runtimes (llama.cpp, built by scripts/check_runtimes.sh):
# minutes each, so the default `pytest -q tests` skips them; `-m runtimes` (or
# HF_ROPE_EXT_RUNTIME_TESTS=1) runs them.
RUNTIMES_OPT_IN = "HF_ROPE_EXT_RUNTIME_TESTS"


def pytest_collection_modifyitems(config, items):
    markexpr = config.getoption("markexpr", "") or ""
    wanted = ("runtimes" in markexpr and "not runtimes" not in markexpr) or os.environ.get(RUNTIMES_OPT_IN) == "1"
    if wanted:
        return
    skip = pytest.mark.skip(
        reason=f"runs a real runtime (llama.cpp); opt in with `pytest -m runtimes tests/test_runtimes_real.py` or "
        f"{RUNTIMES_OPT_IN}=1, after building it with scripts/check_runtimes.sh"
    )
    for item in items:
        if "runtimes" in item.keywords:
            item.add_marker(skip)


def on_a_thread(run) -> dict:
    """``run()`` (under no_grad) on a thread of its own, waited for: ``{"result": ...}``, or
    ``{"error": ...}`` where it raised a RuntimeError (a refusal)."""
    outcome = {}

    def work():
        try:
            with torch.no_grad():
                outcome["result"] = run()
        except RuntimeError as error:
            outcome["error"] = error

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    return outcome


@contextlib.contextmanager
def thread_paused_at(run, install):
    """Start ``run()`` (under no_grad) on a thread of its own, which waits where it calls the
    ``pause`` that ``install(pause)`` puts in place (``install`` returns how to remove it) until
    the block ends; yields the dict its result goes in (``"result"``, there once the block ended)."""
    inside, release, outcome = threading.Event(), threading.Event(), {}

    def pause(*_):
        if threading.current_thread() is thread:
            inside.set()
            release.wait(timeout=30)

    def work():
        with torch.no_grad():
            outcome["result"] = run()

    remove = install(pause)
    thread = threading.Thread(target=work)
    thread.start()
    try:
        assert inside.wait(timeout=30)
        yield outcome
    finally:
        release.set()
        thread.join()
        remove()


def paused_on_a_thread(module, run):
    """:func:`thread_paused_at`, pausing when the thread reaches ``module`` (a forward pre-hook)."""
    return thread_paused_at(run, lambda pause: module.register_forward_pre_hook(pause, with_kwargs=True).remove)


def smollm2_tokenizer():
    """SmolLM2's tokenizer (the passkey prompts need a real one); the test is skipped without it."""
    try:
        from transformers import AutoTokenizer

        from hf_rope_ext.loading import smollm2_checkpoint

        return AutoTokenizer.from_pretrained(smollm2_checkpoint())
    except (FileNotFoundError, ImportError) as error:
        pytest.skip(f"SmolLM2 tokenizer unavailable: {error}")


def save_tiny_llama(folder: Path, native_context: int) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer saved in ``folder``, for the commands."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer = smollm2_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=native_context,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


REPO = Path(__file__).resolve().parents[1]


def load_repo_script(folder: str, name: str, module_name: str | None = None):
    """``examples/NAME.py`` or ``scripts/NAME.py`` imported as a module (they are no package)."""
    spec = importlib.util.spec_from_file_location(module_name or name, REPO / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
