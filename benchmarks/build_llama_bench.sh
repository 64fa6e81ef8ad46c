#!/usr/bin/env bash
# Builds llama.cpp's llama-bench for `engine_speed.py --llama-bench` / `npuchat bench --llama-bench`
# on a machine that reaches PyPI but not GitHub: the llama-cpp-python sdist carries llama.cpp's
# whole source tree. Prints the binary's path (built once into ~/.cache/npuchat-bench). Needs
# cmake and a C++ compiler; about 8 minutes on 2 cores. Usage: build_llama_bench.sh [VERSION]
# [--server]. With --server it also builds llama-server (for benchmarks/chat_race.py; about 10
# minutes more, without the web UI) and prints that binary's path instead. With --avx2 it builds
# for the AVX2 family only (no AVX-512, no VNNI) into a folder of its own: beside
# `NPUCHAT_KERNEL_ISA=avx2`, both sides on the code an AVX2-only machine runs (on this CPU's
# cores: a stand-in for such a machine, not a measurement of one).
# The sdist's Python bindings are kept beside the build ($dest/python-llama_cpp).
set -euo pipefail
server=OFF
avx2_only=0
positional=()
for arg in "$@"; do
    case "$arg" in
        --server) server=ON ;;
        --avx2) avx2_only=1 ;;
        *) positional+=("$arg") ;;
    esac
done
version="${positional[0]:-0.3.36}"
suffix=""
if [ "$avx2_only" = 1 ]; then suffix="-avx2"; fi
dest="${NPUCHAT_LLAMA_DIR:-$HOME/.cache/npuchat-bench/llama.cpp-$version$suffix}"
bin="$dest/build/bin/llama-bench"
server_bin="$dest/build/bin/llama-server"
# The server's web UI would be built with npm or downloaded from Hugging Face: neither is needed.
server_flags=(-DLLAMA_BUILD_SERVER="$server" -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF)
if [ -x "$bin" ] && [ -d "$dest/python-llama_cpp" ]; then
    if [ "$server" = OFF ]; then
        echo "$bin"
        exit 0
    fi
    if [ ! -x "$server_bin" ]; then  # add the server to the existing build
        cmake -S "$dest" -B "$dest/build" "${server_flags[@]}" >&2
        cmake --build "$dest/build" --target llama-server -j "$(nproc)" >&2
    fi
    echo "$server_bin"
    exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip download --quiet --disable-pip-version-check --no-deps --no-binary llama-cpp-python \
    "llama-cpp-python==$version" -d "$work" >&2
tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
mkdir -p "$(dirname "$dest")"
rm -rf "$dest"
mv "$work/llama_cpp_python-$version/vendor/llama.cpp" "$dest"
# GGML_NATIVE compiles for every feature the CPU lists; on CPUs that list AMX the resulting
# binary dies with SIGILL here (AMX tiles need kernel permission the build host may not grant),
# so there: no native build, the AVX family switched on explicitly, AMX off.
cpu_flags=(-DGGML_NATIVE=ON)
if grep -qw 'amx_tile\|amx_int8\|amx_bf16' /proc/cpuinfo 2>/dev/null; then
    has() { grep -qw "$1" /proc/cpuinfo && echo ON || echo OFF; }
    cpu_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2="$(has avx2)" -DGGML_FMA="$(has fma)"
        -DGGML_F16C="$(has f16c)" -DGGML_AVX512="$(has avx512f)"
        -DGGML_AVX512_VNNI="$(has avx512_vnni)" -DGGML_AVX512_BF16="$(has avx512_bf16)"
        -DGGML_AVX_VNNI="$(has avx_vnni)"
        -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    echo "CPU lists AMX: building without GGML_NATIVE, AMX off" >&2
fi
if [ "$avx2_only" = 1 ]; then
    cpu_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
        -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX512_VBMI=OFF
        -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
fi
# Shared libraries: benchmarks/llama_cpp_reference.py drives libllama through the sdist's
# ctypes bindings (llama_cpp/, LLAMA_CPP_LIB_PATH) to record llama.cpp's logits as test data.
cmake -S "$dest" -B "$dest/build" -DCMAKE_BUILD_TYPE=Release "${cpu_flags[@]}" \
    -DBUILD_SHARED_LIBS=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    "${server_flags[@]}" -DLLAMA_BUILD_TOOLS=ON >&2
targets=(llama-bench llama)
if [ "$server" = ON ]; then targets+=(llama-server); fi
cmake --build "$dest/build" --target "${targets[@]}" -j "$(nproc)" >&2
mv "$work/llama_cpp_python-$version/llama_cpp" "$dest/python-llama_cpp"
if [ "$server" = ON ]; then echo "$server_bin"; else echo "$bin"; fi
