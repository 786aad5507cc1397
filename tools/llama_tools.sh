#!/usr/bin/env bash
# Builds llama.cpp's own command-line tools (llama-perplexity, llama-bench, llama-server) from
# the llama.cpp source vendored in the llama-cpp-python sdist, for side-by-side measurements.
#   tools/llama_tools.sh [BUILD_DIR]        (default build/llama.cpp)
# The build is cached: a second run with the binaries present only prints where they are.
# Prints the bin directory as its last line. About 8 minutes on 2 cores.
# LLAMA_TOOLS_CPU=avx2 builds for AVX2 without AVX-512 (GGML_NATIVE off) instead of the host's
# native flags: the same llama.cpp on another SIMD path, the fidelity report's control of how
# far llama.cpp is from itself (docs/fidelity.md). Use a separate BUILD_DIR for it.
# LLAMA_CPP_PYTHON_VERSION pins the sdist (default: the version installed in build/venv when
# there is one, so the tools and the Python reference share one llama.cpp, else the newest).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$root/build/llama.cpp}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
bin="$dir/build/bin"
tools=(llama-perplexity llama-bench llama-server)
[ "${LLAMA_TOOLS_CPU:-native}" = avx2 ] && tools=(llama-perplexity llama-bench)

have_all=1
for t in "${tools[@]}"; do [ -x "$bin/$t" ] || have_all=0; done
if [ "$have_all" = 1 ]; then
    echo "llama_tools: cached in $bin"
    echo "$bin"
    exit 0
fi

version=${LLAMA_CPP_PYTHON_VERSION:-}
if [ -z "$version" ] && [ -x "$root/build/venv/bin/python" ]; then
    version=$("$root/build/venv/bin/python" -c \
        'import importlib.metadata as m; print(m.version("llama_cpp_python"))' 2>/dev/null || true)
fi
spec=llama-cpp-python${version:+==$version}

src=$(ls -d "$dir"/llama_cpp_python-*/vendor/llama.cpp 2>/dev/null | head -n 1 || true)
if [ -z "$src" ]; then
    echo "llama_tools: downloading the $spec sdist"
    python3 -m pip download -q --no-deps --no-binary :all: "$spec" -d "$dir/sdist"
    tarball=$(ls "$dir"/sdist/llama_cpp_python-*.tar.gz | head -n 1)
    tar -C "$dir" -xzf "$tarball"
    src=$(ls -d "$dir"/llama_cpp_python-*/vendor/llama.cpp | head -n 1)
fi
echo "llama_tools: building ${tools[*]} from $src"
cpu_flags=(-DGGML_NATIVE=ON)
if [ "${LLAMA_TOOLS_CPU:-native}" = avx2 ]; then
    cpu_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
               -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF)
fi
cmake -S "$src" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release "${cpu_flags[@]}" -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DCMAKE_RUNTIME_OUTPUT_DIRECTORY="$bin" >"$dir/cmake.log" 2>&1 ||
    { echo "llama_tools: cmake configure failed, see $dir/cmake.log" >&2; exit 1; }
cmake --build "$dir/build" -j"${JOBS:-2}" --target "${tools[@]}" >"$dir/build.log" 2>&1 ||
    { echo "llama_tools: build failed, see $dir/build.log" >&2; exit 1; }
for t in "${tools[@]}"; do
    [ -x "$bin/$t" ] || { echo "llama_tools: $t missing after the build" >&2; exit 1; }
done
echo "$bin"
