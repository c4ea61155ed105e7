#!/usr/bin/env bash
# Check the llama.cpp settings `hf-rope-ext runtimes` prints by running llama.cpp itself.
#
#   scripts/check_runtimes.sh                       # every case (about 1 h on 2 CPU cores)
#   scripts/check_runtimes.sh --cases yarn-x4,converted-yarn-x4 --tokens 4096
#
# 1. Builds llama-cpp-python 0.3.36 from its PyPI source distribution (it vendors llama.cpp,
#    convert_hf_to_gguf.py and gguf-py) into its own venv under the package cache,
#    ${HF_ROPE_EXT_CACHE:-~/.cache/hf_rope_ext}/runtimes/ (about 10-30 min once; reused after).
# 2. Runs scripts/check_runtimes.py with the project's python (.venv): transformers losses,
#    conversions with llama.cpp's converter, llama.cpp losses (scripts/llama_cpp_worker.py, run by
#    the runtime's python), and writes outputs/runtimes/llama_cpp.{md,json}. Finished cases are
#    cached under outputs/runtimes/work/, so a rerun only does what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PROJECT_PYTHON=${PROJECT_PYTHON:-.venv/bin/python}
# The arguments first: a typo must not wait for the download and build below (10-30 min).
"$PROJECT_PYTHON" scripts/check_runtimes.py --check-args "$@"
BASE_PYTHON=${RUNTIME_BASE_PYTHON:-python3}  # the interpreter the runtime venv is made from
VERSION=0.3.36
ROOT=$("$PROJECT_PYTHON" -c "from hf_rope_ext.loading import cache_dir; print(cache_dir() / 'runtimes')")
VENV="$ROOT/llama-cpp"
SDIST="$ROOT/sdist/llama_cpp_python-$VERSION.tar.gz"
mkdir -p "$ROOT/sdist"

if [ ! -f "$SDIST" ]; then
  "$BASE_PYTHON" -m pip download --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$ROOT/sdist"
fi
if [ ! -f "$ROOT/sdist/llama_cpp_python-$VERSION/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then
  tar xzf "$SDIST" -C "$ROOT/sdist"  # the converter and gguf-py come from the same sources
fi
if ! "$VENV/bin/python" -c "import llama_cpp; assert llama_cpp.__version__ == '$VERSION'" 2>/dev/null; then
  echo "Building llama-cpp-python $VERSION in $VENV (log: $ROOT/build.log) ..."
  "$BASE_PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q numpy
  # CPU build for this machine; no curl, and none of llama.cpp's own programs or the multimodal library.
  CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF" \
  CMAKE_BUILD_PARALLEL_LEVEL=2 nice -n 5 "$VENV/bin/pip" install -v --no-binary llama-cpp-python "$SDIST" \
    > "$ROOT/build.log" 2>&1 || { tail -20 "$ROOT/build.log"; exit 1; }
fi
if [ ! -d "$ROOT/convert-extra/sentencepiece" ]; then
  # convert_hf_to_gguf.py's Llama vocabulary code imports sentencepiece first; kept beside the
  # runtime (PYTHONPATH while converting) rather than in the project's environment.
  "$PROJECT_PYTHON" -m pip install -q --target "$ROOT/convert-extra" sentencepiece
fi

OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} nice -n 5 "$PROJECT_PYTHON" scripts/check_runtimes.py "$@"
