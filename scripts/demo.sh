#!/usr/bin/env bash
# Set-up plus the demo on the real model (SmolLM2-135M-Instruct, offline): perplexity beyond the
# native 8192-token context and passkey retrieval at 12k tokens, before and after patch_model.
# About 8 minutes on 2 CPU cores; longer lengths on a GPU.
# Usage: bash scripts/demo.sh [TEXT_FILE]   (default: Frankenstein from ../shared/data/books)
set -euo pipefail
# A relative TEXT_FILE is relative to where the script was called from, not to the repository.
if [ $# -ge 1 ]; then
    case "$1" in
        /*) TEXT_FILE=$1 ;;
        *) TEXT_FILE=$PWD/$1 ;;
    esac
fi
cd "$(dirname "$0")/.."
TEXT_FILE=${TEXT_FILE:-$PWD/../shared/data/books/pg84.txt}
# Checked before the set-up, which takes minutes (a pipe such as <(zcat book.gz) is fine too).
if [ ! -f "$TEXT_FILE" ] && [ ! -p "$TEXT_FILE" ]; then
    echo "error: text file not found: $TEXT_FILE. Usage: bash scripts/demo.sh [TEXT_FILE]" >&2
    exit 2
fi
bash scripts/setup.sh
exec .venv/bin/hf-rope-ext demo --text-file "$TEXT_FILE" --output-dir outputs/demo
