#!/usr/bin/env bash
# Builds two kdakit source trees so that both can be imported in ONE Python process (tools/gpu/ab_compare.py):
#
#   tools/gpu/ab_build.sh BASE_TREE CURRENT_TREE PREFIX
#
#   PREFIX/cur             CURRENT_TREE built as is (pip install --target), package `kdakit`
#   PREFIX/base            a patched copy of BASE_TREE (PREFIX/base-src), package `kdakit`, extension in the
#                          nanobind domain `kdakit_base`
#   PREFIX/site/kdakit     copy of PREFIX/cur/kdakit
#   PREFIX/site/kdakit_base  copy of PREFIX/base/kdakit with its self-references renamed (tools/gpu/ab_rename.sh:
#                          imports, the lazy import table, the torch custom-op namespace kdakit:: -> kdakit_base::);
#                          use PYTHONPATH=PREFIX/site
#
# Why: nanobind keeps its C++ type registry per domain; two extensions built with different NB_DOMAIN names do not
# clash. The base copy's CMakeLists.txt gets `NB_DOMAIN kdakit_base` (tools/gpu/ab_domain.sh). The repository and
# BASE_TREE are never modified. The extension keeps its file name _C*.so (its PyInit__C works as kdakit_base._C).
#
# KDAKIT_AB_PLAIN=1: no patch and no PREFIX/site, just the two builds in PREFIX/base and PREFIX/cur (tools/gpu/ab.sh,
# which runs a command against each build in its own process).
#
# The two trees build in parallel, each with CMAKE_BUILD_PARALLEL_LEVEL=$(nproc); KDAKIT_CUTLASS_DIR is passed through
# (set from .deps/cutlass/include of this checkout when unset and present). CURRENT_TREE builds in place (its
# build/ folder, as `pip install .` does); the base copy keeps its build/ folder between calls while BASE_TREE's
# contents stay the same (a fingerprint of the files decides). Build logs: $OUT/ab-build-{base,cur}.log
# (OUT default /tmp/kdakit-out).
set -uo pipefail
if [[ $# -ne 3 ]]; then
  sed -n '2,25p' "$0"
  exit 2
fi
here=$(cd "$(dirname "$0")/../.." && pwd)
base_tree=$(cd "$1" && pwd) || exit 2
cur_tree=$(cd "$2" && pwd) || exit 2
mkdir -p "$3" || exit 2
prefix=$(cd "$3" && pwd)
OUT=${OUT:-/tmp/kdakit-out}
mkdir -p "$OUT"
plain=${KDAKIT_AB_PLAIN:-0}
if [[ -z ${KDAKIT_CUTLASS_DIR:-} && -d $here/.deps/cutlass/include ]]; then
  export KDAKIT_CUTLASS_DIR=$here/.deps/cutlass/include
fi
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
echo "== ab_build: base $base_tree, current $cur_tree -> $prefix${KDAKIT_CUTLASS_DIR:+ (KDAKIT_CUTLASS_DIR=$KDAKIT_CUTLASS_DIR)}"

# --- the base copy (sources replaced on every call; build/ kept while the tree's contents are the same)
src=$prefix/base-src
mkdir -p "$src"
excl=(--exclude=./build --exclude=./.deps --exclude=./.git --exclude=./.venv --exclude=./.whl --exclude=./out
      --exclude=./_skbuild --exclude=./dist)
fingerprint=$( (cd "$base_tree" && find . \( -path ./build -o -path ./.deps -o -path ./.git -o -path ./.venv \
  -o -path ./.whl -o -path ./out -o -path ./_skbuild -o -path ./dist \) -prune -o -type f -print0 \
  | LC_ALL=C sort -z | xargs -0 md5sum) | md5sum | cut -d' ' -f1)
fingerprint="$fingerprint plain=$plain"
if [[ -f $src/.ab-fingerprint && $(cat "$src/.ab-fingerprint") == "$fingerprint" ]]; then
  keep=1
else
  keep=0
fi
find "$src" -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +
[[ $keep == 0 ]] && rm -rf "$src/build"
(cd "$base_tree" && tar "${excl[@]}" -cf - .) | (cd "$src" && tar -xf -) || { echo "copying $base_tree failed"; exit 1; }
if [[ $plain != 1 ]]; then
  "$here/tools/gpu/ab_domain.sh" "$src" || exit 1
  echo "   base copy: $(grep -F 'NB_DOMAIN kdakit_base' "$src/CMakeLists.txt" | sed 's/^ *//')"
fi
echo "$fingerprint" >"$src/.ab-fingerprint"
[[ $keep == 1 ]] && echo "   base copy: same files as last time, build folder kept" \
  || echo "   base copy: new or changed tree, building from scratch"

# --- both builds in parallel
build() {  # build LABEL TREE: pip install TREE into $prefix/LABEL, log in $OUT/ab-build-LABEL.log
  local label=$1 tree=$2 t0=$SECONDS
  rm -rf "${prefix:?}/$label"
  if (cd "$tree" && python3 -m pip install -v --no-build-isolation --no-deps --target "$prefix/$label" .) \
       >"$OUT/ab-build-$label.log" 2>&1; then
    echo "   $label built in $((SECONDS - t0)) s ($tree)"
  else
    echo "== build of $label FAILED ($tree), last lines of $OUT/ab-build-$label.log:"
    tail -n 30 "$OUT/ab-build-$label.log"
    return 1
  fi
}
build base "$src" &
pid_base=$!
build cur "$cur_tree" &
pid_cur=$!
status=0
wait "$pid_base" || status=1
wait "$pid_cur" || status=1
[[ $status == 0 ]] || exit 1
[[ $plain == 1 ]] && exit 0

# --- PREFIX/site: kdakit (current) and kdakit_base (base, renamed)
site=$prefix/site
rm -rf "$site"
mkdir -p "$site"
cp -a "$prefix/cur/kdakit" "$site/kdakit"
cp -a "$prefix/base/kdakit" "$site/kdakit_base"
"$here/tools/gpu/ab_rename.sh" "$site" || exit 1
echo "   $site/kdakit      <- $cur_tree"
echo "   $site/kdakit_base <- $base_tree (nanobind domain kdakit_base)"
