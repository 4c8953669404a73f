#!/usr/bin/env bash
# Builds a kdakit tree on a NETWORKED machine into a package folder that the offline GPU machine imports as it is, so
# that an A/B there costs no build time (tools/gpu/run compare-packs):
#
#   tools/gpu/pack_build.sh TREE NAME [--base]
#
#   .deps/packs/NAME/kdakit/       TREE's package with its extension (sm_90a kernels, the GPU machine's Python 3.12)
#   .deps/packs/NAME/kdakit_base/  with --base: a copy of TREE built in the nanobind domain kdakit_base and renamed
#                                  (tools/gpu/ab_rename.sh), importable beside another pack's kdakit in one process
#
# Carry .deps/packs/NAME (about 25 MB each). The extension is built for $PACK_GENCODE (default sm_90a only) with the
# CUTLASS headers of .deps/cutlass/include (tools/gpu/prepare_deps.sh), in a virtual environment of Python 3.12
# (.deps/pack-venv from $PACK_PYTHON, else python3.12, or python3 if it is 3.12) with scikit-build-core, nanobind,
# cmake and ninja from PyPI.
# Build folders stay in .deps/pack-build/, one per tree path (and --base), so a later build of the same tree compiles
# only what changed. TREE itself is never modified (--base builds a copy in .deps/pack-src/).
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
[[ $# -ge 2 ]] || { sed -n '2,16p' "$0"; exit 2; }
tree=$(cd "$1" && pwd)
name=$2
base=0
if [[ $# -gt 2 ]]; then
  [[ $# -eq 3 && $3 == --base ]] || { echo "pack_build: after TREE NAME only --base, got: ${*:3}" >&2; exit 2; }
  base=1
fi
deps=$here/.deps
if [[ ! -d $deps/cutlass/include/cute ]]; then
  echo "pack_build: no CUTLASS headers in $deps/cutlass (tools/gpu/prepare_deps.sh)" >&2
  exit 2
fi
venv=$deps/pack-venv
if [[ ! -x $venv/bin/python ]]; then
  py=$("$here/tools/gpu/python312.sh" "${PACK_PYTHON:-}") \
    || { echo "pack_build: no Python 3.12 found (PACK_PYTHON=<a python3.12>)" >&2; exit 2; }
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q scikit-build-core nanobind cmake ninja
fi
key=$(printf '%s' "$tree" | md5sum | cut -c1-12)
[[ $base == 1 ]] && key=$key-base
src=$tree
if [[ $base == 1 ]]; then  # a copy in the domain kdakit_base (tools/gpu/ab_domain.sh)
  src=$deps/pack-src/$key
  mkdir -p "$src"
  find "$src" -mindepth 1 -maxdepth 1 -exec rm -rf {} +
  (cd "$tree" && tar --exclude=./build --exclude=./.deps --exclude=./.git --exclude=./.venv -cf - .) \
    | (cd "$src" && tar -xf -)
  "$here/tools/gpu/ab_domain.sh" "$src"
fi
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
t0=$SECONDS
(cd "$src" && KDAKIT_CUDA=ON KDAKIT_CUTLASS_DIR=$deps/cutlass/include \
   CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
   "$venv/bin/pip" wheel -q --no-build-isolation --no-deps -w "$wheels" \
   --config-settings=cmake.define.KDAKIT_CUDA_GENCODE="${PACK_GENCODE:--gencode=arch=compute_90a,code=sm_90a}" \
   --config-settings=build-dir="$deps/pack-build/$key" .)
out=$deps/packs/$name
rm -rf "$out"
mkdir -p "$out"
python3 -m zipfile -e "$wheels"/*.whl "$wheels/x"
if [[ $base == 1 ]]; then
  cp -a "$wheels/x/kdakit" "$out/kdakit_base"
  "$here/tools/gpu/ab_rename.sh" "$out"
else
  cp -a "$wheels/x/kdakit" "$out/kdakit"
fi
git -C "$tree" rev-parse --short HEAD >"$out/commit" 2>/dev/null || true
pkg=kdakit
[[ $base == 1 ]] && pkg=kdakit_base
dirty=""
[[ -n $(git -C "$tree" status --porcelain 2>/dev/null || true) ]] && dirty=" + uncommitted changes"
echo "pack_build: $out/$pkg <- $tree ($(cat "$out/commit" 2>/dev/null || true)$dirty) in $((SECONDS - t0)) s"
