#!/bin/bash
# The extra compiler arguments that let weenv-devserve fetch chunks from frame sources itself
# (-DWEENV_DECODE, zstd, BLAKE3's C implementation), printed one per line; nothing when zstd's
# header or BLAKE3's C sources are missing (the server then leaves every fetch to the daemon).
# Used by scripts/setup.sh and setup.py, so both build the same program.
#
# BLAKE3: the official C implementation as Debian's librust-blake3-dev ships it (the Rust
# crate's c/ folder); the x86-64 builds add its SSE2/SSE4.1/AVX2/AVX-512 kernels (chosen at run
# time by blake3_dispatch.c), which hash 1 MiB in ~0.17 ms here, as fast as Python's binding.
set -euo pipefail
blake3=$( (find /usr/share/cargo/registry -maxdepth 2 -path '*/blake3-*/c' -type d 2>/dev/null \
    || true) | sort -V | tail -n 1)
if [[ -z $blake3 || ! -f $blake3/blake3.c || ! -f /usr/include/zstd.h ]]; then
    exit 0
fi
printf '%s\n' -DWEENV_DECODE "-I$blake3" "$blake3/blake3.c" "$blake3/blake3_dispatch.c" \
    "$blake3/blake3_portable.c"
if [[ $(uname -m) == x86_64 ]]; then
    for kernel in sse2 sse41 avx2 avx512; do
        printf '%s\n' "$blake3/blake3_${kernel}_x86-64_unix.S"
    done
else
    printf '%s\n' -DBLAKE3_NO_SSE2 -DBLAKE3_NO_SSE41 -DBLAKE3_NO_AVX2 -DBLAKE3_NO_AVX512
    if [[ $(uname -m) == aarch64 ]]; then
        printf '%s\n' -DBLAKE3_USE_NEON=1 "$blake3/blake3_neon.c"
    fi
fi
printf '%s\n' -lzstd
