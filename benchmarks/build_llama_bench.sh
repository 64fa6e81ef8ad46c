#!/usr/bin/env bash
# Builds llama.cpp's llama-bench for `engine_speed.py --llama-bench` / `npuchat bench --llama-bench`
# on a machine that reaches PyPI but not GitHub: the llama-cpp-python sdist carries llama.cpp's
# whole source tree. Prints the binary's path (built once into ~/.cache/npuchat-bench). Needs
# cmake and a C++ compiler; about 8 minutes on 2 cores. Usage: build_llama_bench.sh [VERSION]
set -euo pipefail
version="${1:-0.3.36}"
dest="${NPUCHAT_LLAMA_DIR:-$HOME/.cache/npuchat-bench/llama.cpp-$version}"
bin="$dest/build/bin/llama-bench"
if [ -x "$bin" ]; then
    echo "$bin"
    exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
    "llama-cpp-python==$version" -d "$work" >&2
tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
mkdir -p "$(dirname "$dest")"
rm -rf "$dest"
mv "$work/llama_cpp_python-$version/vendor/llama.cpp" "$dest"
cmake -S "$dest" -B "$dest/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON >&2
cmake --build "$dest/build" --target llama-bench -j "$(nproc)" >&2
echo "$bin"
