#!/usr/bin/env bash
# Attention-call timings of README "On a GPU": one layer's remapped attention against one causal
# sdpa call on the same tensors (scripts/time_remapped_attention.py), bf16 on CUDA, at 16k and 64k,
# for this checkout and, if given, another one (run alternately, the same inputs: compare checksums).
#
#   bash scripts/gpu_attention_speed.sh [OTHER_CHECKOUT]
#
# Runs with the project's .venv/bin/python if there is one, else python3 (PYTHON overrides).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
# the project's venv (scripts/setup.sh) unless PYTHON names another interpreter
py=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && [ -x "$repo/.venv/bin/python" ]; then py=$repo/.venv/bin/python; fi
if [[ $py == */* && $py != /* ]]; then py=$(cd "$(dirname "$py")" && pwd)/$(basename "$py"); fi  # before the cd below
other=${1:-}
if [ -n "$other" ]; then
  # Only prepended to PYTHONPATH: a folder without the package would fall through to this
  # checkout's installed one and time the same code twice as "other checkout".
  if [ ! -f "$other/hf_rope_ext/__init__.py" ]; then
    echo "error: $other is not a checkout of this project (no hf_rope_ext/__init__.py in it); pass the other checkout's root folder" >&2
    exit 2
  fi
  other=$(cd "$other" && pwd)  # absolute: the script runs from this checkout's root
fi
cd "$repo" || exit 1
"$py" -c "import sys, torch
sys.exit(0 if torch.cuda.is_available() else 'error: no CUDA GPU visible; on the CPU run scripts/time_remapped_attention.py')" || exit 1
for tokens in 16384 65536; do
  for method in self-extend-by-parts dual-chunk self-extend; do
    [ -n "$other" ] && PYTHONPATH="$other${PYTHONPATH:+:$PYTHONPATH}" "$py" scripts/time_remapped_attention.py "$method" --tokens $tokens \
        --device cuda --dtype bf16 --repeats 3 | sed "s|^|other checkout: |"
    # self-extend's regimes also run with the one-pass kernel switched off (--both-paths)
    both=(); [ "$method" = dual-chunk ] || both=(--both-paths)
    PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" "$py" scripts/time_remapped_attention.py "$method" --tokens $tokens --device cuda --dtype bf16 --repeats 3 "${both[@]}"
  done
done
