#!/usr/bin/env bash
# Set-up plus the full test suite (CPU, under 30 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q tests "$@"
