#!/usr/bin/env bash
# Run a command on this CPU as if it had no native bf16 and nothing past AVX2 (root, Linux):
#
#   sudo benchmarks/as_avx2.sh raytrain-eks train
#   sudo benchmarks/as_avx2.sh python -m pytest -q
#
# Inside a private mount namespace, /proc/cpuinfo is replaced by a copy without the avx512* and amx* flags (what
# `precision: auto` reads, so it picks fp32), and oneDNN and PyTorch's own kernels are held to AVX2
# (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY), so a bf16 product is emulated as on such a CPU. Clock, cores and
# caches stay this machine's: a figure from here is an emulation, not a measurement on an AVX2-only machine.
# torch.compile's kernels go to a cache of their own (TORCHINDUCTOR_CACHE_DIR): kernels built here, found later by
# an unheld process in the shared cache, aborted it.
set -euo pipefail
if [ "$#" -eq 0 ]; then
    echo "usage: $0 COMMAND [ARGS...]" >&2
    exit 2
fi
if [ "$(id -u)" != 0 ]; then
    echo "$0: needs root (a private mount namespace to replace /proc/cpuinfo)" >&2
    exit 2
fi
cpuinfo="$(mktemp)"
trap 'rm -f "$cpuinfo"' EXIT
sed -E '/^flags/ s/ (avx512[a-z0-9_]*|amx[a-z0-9_]*)//g' /proc/cpuinfo >"$cpuinfo"
# shellcheck disable=SC2016 # expanded by the inner shell
unshare --mount bash -c 'mount --bind "$0" /proc/cpuinfo && exec env ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 TORCHINDUCTOR_CACHE_DIR="${TMPDIR:-/tmp}/torchinductor_avx2_$(id -un)" "$@"' \
    "$cpuinfo" "$@"
