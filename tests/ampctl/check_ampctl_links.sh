#!/bin/sh
# Holds ampctl to its dependencies: the proto, the codec, gRPC and abseil,
# never the engine or a backend. Two views of the binary:
#  - its dynamic dependencies (ldd): no OpenBLAS, no CUDA runtime or cuBLAS;
#  - its symbols (nm -C): no code from the engine, the kernels or the rpc
#    layer, and no BLAS or CUDA entry points linked in statically (the
#    linker keeps only what is referenced, so a static archive on the link
#    line shows up here, not in ldd).
# Usage: check_ampctl_links.sh PATH_TO_AMPCTL. Exits 77 (CTest's skip) when
# a tool it needs is missing, 1 on a forbidden dependency.
set -u
binary="$1"
if [ ! -x "$binary" ]; then
  echo "not an executable: $binary" >&2
  exit 1
fi
for tool in ldd nm; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "SKIP: $tool is not installed; cannot inspect $binary" >&2
    exit 77
  fi
done

status=0
libs=$(ldd "$binary") || { echo "ldd failed on $binary" >&2; exit 1; }
forbidden_libs=$(printf '%s\n' "$libs" | grep -E 'lib(openblas|blas|cudart|cublas|cublasLt|cuda)\.so' || true)
if [ -n "$forbidden_libs" ]; then
  echo "ampctl depends on a backend library:" >&2
  printf '%s\n' "$forbidden_libs" >&2
  status=1
fi

symbols=$(nm -C "$binary") || { echo "nm failed on $binary" >&2; exit 1; }
forbidden_symbols=$(printf '%s\n' "$symbols" |
  grep -E 'ampd::(engine|kernels|rpc)::|[^A-Za-z_](cblas_|cuda[A-Z]|cublas)' | head -20 || true)
if [ -n "$forbidden_symbols" ]; then
  echo "ampctl holds engine, backend or rpc code (first 20 symbols):" >&2
  printf '%s\n' "$forbidden_symbols" >&2
  status=1
fi

if [ "$status" -eq 0 ]; then
  echo "ampctl links neither the engine nor a backend:"
  printf '%s\n' "$libs"
fi
exit "$status"
