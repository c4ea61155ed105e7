#!/usr/bin/env bash
# Set-up plus the demo on the real model (SmolLM2-135M-Instruct, offline): perplexity beyond the
# native 8192-token context and passkey retrieval at 12k tokens, before and after patch_model.
# About 8 minutes on 2 CPU cores; longer lengths on a GPU.
# Usage: bash scripts/demo.sh [TEXT_FILE]   (default: Frankenstein from ../shared/data/books)
set -euo pipefail
cd "$(dirname "$0")/.."
TEXT_FILE=${1:-../shared/data/books/pg84.txt}
bash scripts/setup.sh
exec .venv/bin/hf-rope-ext demo --text-file "$TEXT_FILE" --output-dir outputs/demo
