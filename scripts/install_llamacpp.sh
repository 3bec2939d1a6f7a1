#!/bin/sh
# Install llama-cpp-python, the optional llama.cpp peer of `specgraph bench` (same as the
# `llamacpp` extra, but built for this CPU). It compiles llama.cpp from its source distribution:
# about 5 minutes on 2 free cores, longer on a busy machine.
#   sh scripts/install_llamacpp.sh            # extra pip arguments pass through, e.g. --force-reinstall
#
# Why the flags are chosen here and not left to llama.cpp: its default native build (-march=native)
# turns on AMX wherever the CPU advertises it, and on the VMs this project runs on AMX segfaults
# on the first decode (the guest lists the AMX flags, yet its tile state is not usable). So the
# build is not native: each instruction set is switched on only when /proc/cpuinfo lists it
# (AVX-512 and its VNNI/VBMI/BF16 parts on the Xeons, only up to AVX2 on the EPYCs, where an
# AVX-512 build would die of an illegal instruction), and AMX is always off.
# A CMAKE_ARGS already set in the environment is used as it is; CPUINFO=FILE reads the flags from FILE.
set -eu
PY=${PYTHON:-python3}
VERSION=0.3.36
CPUINFO=${CPUINFO:-/proc/cpuinfo}

if [ -z "${CMAKE_ARGS:-}" ] && [ "$(uname -m)" = x86_64 ] && [ -r "$CPUINFO" ]; then
    FLAGS=" $(grep -m1 '^flags' "$CPUINFO" | cut -d: -f2) "
    has() {
        for flag in "$@"; do
            case "$FLAGS" in *" $flag "*) ;; *) return 1 ;; esac
        done
    }
    on() { if has "$@"; then echo ON; else echo OFF; fi; }
    CMAKE_ARGS="-DGGML_NATIVE=OFF"
    CMAKE_ARGS="$CMAKE_ARGS -DGGML_SSE42=$(on sse4_2) -DGGML_BMI2=$(on bmi2)"
    CMAKE_ARGS="$CMAKE_ARGS -DGGML_AVX=$(on avx) -DGGML_AVX2=$(on avx2) -DGGML_AVX_VNNI=$(on avx_vnni)"
    CMAKE_ARGS="$CMAKE_ARGS -DGGML_FMA=$(on fma) -DGGML_F16C=$(on f16c)"
    # GGML_AVX512 compiles with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw: all five must be there
    AVX512=$(on avx512f avx512cd avx512vl avx512dq avx512bw)
    CMAKE_ARGS="$CMAKE_ARGS -DGGML_AVX512=$AVX512"
    if [ "$AVX512" = ON ]; then
        CMAKE_ARGS="$CMAKE_ARGS -DGGML_AVX512_VBMI=$(on avx512vbmi) -DGGML_AVX512_VNNI=$(on avx512_vnni)"
        CMAKE_ARGS="$CMAKE_ARGS -DGGML_AVX512_BF16=$(on avx512_bf16)"
    else
        CMAKE_ARGS="$CMAKE_ARGS -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF"
    fi
    # never AMX, even where the CPU lists it: see above
    CMAKE_ARGS="$CMAKE_ARGS -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
fi
export CMAKE_ARGS="${CMAKE_ARGS:-}"
echo "building llama-cpp-python==$VERSION with CMAKE_ARGS=\"$CMAKE_ARGS\"" >&2
$PY -m pip install --no-cache-dir "llama-cpp-python==$VERSION" "$@"
$PY -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'installed')"
