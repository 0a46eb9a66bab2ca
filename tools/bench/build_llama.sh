#!/usr/bin/env bash
# Build llama.cpp's llama-bench, llama-quantize, llama-server, llama-imatrix, llama-perplexity and
# llama-tokenize (the reference engine of the benchmarks; llama-server for
# tools/bench/serve_load.py; the last three for tools/bench/quant_vs_llama.py) from
# the llama.cpp vendored in the llama-cpp-python sdist on PyPI, and install gguf-py (what
# convert_hf_to_gguf.py needs). Everything goes to $BENCH_CACHE (default /work/bench_cache);
# a finished build is reused.
#
#   bash tools/bench/build_llama.sh            # JOBS=2 by default
#
# Build: Release, GGML_NATIVE=ON (the machine's own ISA: AVX-512/VNNI/BF16 where present),
# CPU only (no CUDA/Metal/Vulkan/BLAS), OpenMP on (llama.cpp's default), LLAMA_CURL=OFF.
#
#   ISA=avx2 bash tools/bench/build_llama.sh   # AVX2 + FMA + F16C + BMI2 only, into llama.cpp-build-avx2:
#                                              # what an AVX2-only host (AMD Zen 3) runs, on a newer one
#                                              # (compare with Colibri under COLIBRI_ISA=avx2 COLIBRI_INT_STEP=avx2)
#   ISA=avx512 bash tools/bench/build_llama.sh # llama-bench only, into llama.cpp-build-avx512: AVX-512 (F, BW,
#                                              # DQ, VL, CD) with VNNI, VBMI and BF16, no AVX-VNNI and no AMX (its
#                                              # AMX path dies with SIGILL on the lent VMs): a portable build that
#                                              # runs on Zen 4 and Sapphire Rapids alike, carried to the lent AMX
#                                              # machine (amx_engine.py --llama-bench)
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${BENCH_CACHE:-/work/bench_cache}"
JOBS="${JOBS:-2}"
SRC="$CACHE/llama_cpp_python-$VERSION"     # the sdist unpacks here
ISA="${ISA:-native}"
case "$ISA" in
    native) BUILD="$CACHE/llama.cpp-build"; ISA_FLAGS="-DGGML_NATIVE=ON" ;;
    avx2)   BUILD="$CACHE/llama.cpp-build-avx2"
            ISA_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF" ;;
    avx512) BUILD="$CACHE/llama.cpp-build-avx512"
            ISA_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" ;;
    *)      echo "[build_llama] ISA=$ISA: choose native, avx2 or avx512" >&2; exit 2 ;;
esac
mkdir -p "$CACHE/sdist"

TARGETS="llama-bench llama-quantize llama-server llama-imatrix llama-perplexity llama-tokenize"
[ "$ISA" = avx512 ] && TARGETS="llama-bench"
built=1
for t in $TARGETS; do [ -x "$BUILD/bin/$t" ] || built=0; done
if [ "$built" = 1 ]; then
    echo "[build_llama] already built: $BUILD/bin"
else
    if [ ! -d "$SRC/vendor/llama.cpp" ]; then
        if ! ls "$CACHE/sdist/llama_cpp_python-$VERSION".tar.gz >/dev/null 2>&1; then
            python -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE/sdist"
        fi
        tar -xzf "$CACHE/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE"
    fi
    cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release $ISA_FLAGS \
        -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF -DGGML_OPENMP=ON \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_TOOLS=ON -DBUILD_SHARED_LIBS=OFF
    cmake --build "$BUILD" --target $TARGETS -j "$JOBS"
fi

# convert_hf_to_gguf.py's imports: gguf (from the same tree, so versions match), numpy,
# sentencepiece, safetensors, transformers (AutoTokenizer) and torch — all but gguf are already
# here; --no-deps so that pip never touches torch.
if ! python -c "import gguf" 2>/dev/null; then
    python -m pip install --no-deps "$SRC/vendor/llama.cpp/gguf-py"
fi
echo "[build_llama] llama-bench:    $BUILD/bin/llama-bench"
[ -x "$BUILD/bin/llama-quantize" ] && echo "[build_llama] llama-quantize: $BUILD/bin/llama-quantize"
echo "[build_llama] converter:      $SRC/vendor/llama.cpp/convert_hf_to_gguf.py"
