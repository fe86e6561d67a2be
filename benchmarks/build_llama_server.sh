#!/bin/sh
# Build llama-server from the llama-cpp-python sdist (the llama.cpp it vendors), for
# benchmarks/vs_llama_server.py. Needs cmake, a C++ compiler and the package index; ~15 min on 2 cores.
#   sh benchmarks/build_llama_server.sh [DIR]   (default DIR: ./llama-server-build); prints the binary's path
set -eu
dir=${1:-llama-server-build}
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
mkdir -p "$dir"
cd "$dir"
python3 -m pip download "llama-cpp-python==$version" --no-binary :all: --no-deps -d . >/dev/null
tar xzf "llama_cpp_python-$version.tar.gz"
src="llama_cpp_python-$version/vendor/llama.cpp"
# On CPUs with AMX (Sapphire Rapids and later) -march=native turns on ggml's AMX matmul, which dies
# with SIGILL at its first tilezero on the 2-core KVM machines here (llama.cpp 0c1e570; the kernel
# grants the tile permission, the tile config is not loaded in the thread that computes): build
# without AMX there, so llama-server runs its AVX512-VNNI kernels
flags=""
if grep -q amx_tile /proc/cpuinfo 2>/dev/null; then flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; fi
cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON \
      -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" >/dev/null
cmake --build "$src/build" --target llama-server -j "$(nproc)"
echo "$PWD/$src/build/bin/llama-server"
