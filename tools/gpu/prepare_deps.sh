#!/usr/bin/env bash
# Fills the ignored folder .deps/ on a NETWORKED machine, for the offline GPU machine (carry `.deps` along):
#
#   tools/gpu/prepare_deps.sh [BASE_COMMIT]          (BASE_COMMIT default 3abe6b1)
#
#   .deps/cutlass/include/  CUTLASS / CuTe headers (cute/, cutlass/) from the nvidia-cutlass==4.2.0.0 wheel's
#                           cutlass_library/source/include; check.sh and ab_build.sh export it as KDAKIT_CUTLASS_DIR
#   .deps/googletest/       copy of /usr/src/googletest (when present here), for the C++ tests offline
#   .deps/wheels/           flash-linear-attention and fla-core wheels (peers of the side-by-side tests and benchmark),
#                           nvidia-cudnn-frontend 1.32.0 and apache-tvm-ffi (cuDNN's Hopper KDA engine, a benchmark peer)
#   .deps/ab/base/          `git archive BASE_COMMIT` of this repository: the base tree of tools/gpu/run compare / ab.sh
#   .deps/peers/            with FLA_GIT=<a git directory of fla-org/flash-linear-attention> (clone or mirror): at its
#                           HEAD, FLA's package (peers/fla_src/fla), tests/ops/test_kda.py and tests/conftest.py
#                           (peers/fla_tests), the commit (peers/fla.commit): the peer suite of tools/gpu/run fla-suite
#   .deps/wheels/flash_kda-*.whl  with FK_GIT=<a git directory of MoonshotAI/FlashKDA>: FlashKDA (the benchmark's
#                           FlashKDA column) built here for sm_90a against torch $FK_TORCH (default 2.11.0, the GPU
#                           machine's) in a virtual environment of Python 3.12 ($FK_PYTHON, else python3.12 or
#                           python3 if 3.12), on the CUTLASS headers above (its pinned submodule is not needed); a few
#                           minutes on two cores
#
# Idempotent: what is already there (same version, same commit) is kept; prints what it put where.
set -euo pipefail
cd "$(dirname "$0")/../.."
CUTLASS_VERSION=4.2.0.0
BASE_COMMIT=${1:-3abe6b1}
mkdir -p .deps
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# --- CUTLASS / CuTe headers
if [[ -d .deps/cutlass/include/cute && -d .deps/cutlass/include/cutlass \
      && $(cat .deps/cutlass/VERSION 2>/dev/null) == "$CUTLASS_VERSION" ]]; then
  echo "cutlass:    .deps/cutlass/include (nvidia-cutlass $CUTLASS_VERSION) already there"
else
  python3 -m pip download -q --no-deps "nvidia-cutlass==$CUTLASS_VERSION" -d "$tmp/cutlass"
  whl=$(ls "$tmp"/cutlass/*.whl | head -n 1)
  unzip -q "$whl" 'cutlass_library/source/include/*' -d "$tmp/cutlass/x"
  for d in cute cutlass; do
    [[ -d $tmp/cutlass/x/cutlass_library/source/include/$d ]] || { echo "no include/$d in $whl" >&2; exit 1; }
  done
  rm -rf .deps/cutlass
  mkdir -p .deps/cutlass
  mv "$tmp/cutlass/x/cutlass_library/source/include" .deps/cutlass/include
  echo "$CUTLASS_VERSION" >.deps/cutlass/VERSION
  echo "cutlass:    .deps/cutlass/include <- $(basename "$whl") (cutlass_library/source/include)"
fi

# --- GoogleTest sources
if [[ -d .deps/googletest ]]; then
  echo "googletest: .deps/googletest already there"
elif [[ -d /usr/src/googletest ]]; then
  cp -a /usr/src/googletest .deps/googletest
  echo "googletest: .deps/googletest <- /usr/src/googletest"
else
  echo "googletest: /usr/src/googletest not here (apt install googletest); C++ tests on the GPU machine need it"
fi

# --- peer wheels (the platform flags select wheels for the GPU machine's Python 3.12)
mkdir -p .deps/wheels
for pkg in flash-linear-attention fla-core nvidia-cudnn-frontend==1.32.0 apache-tvm-ffi; do
  stem=${pkg%%==*}
  stem=${stem//-/_}
  if compgen -G ".deps/wheels/${stem}-*.whl" >/dev/null; then
    echo "wheels:     $(cd .deps/wheels && ls "${stem}"-*.whl | tr '\n' ' ')already there"
    continue
  fi
  if ! python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
         --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any \
         -d .deps/wheels "$pkg" 2>"$tmp/pip.err"; then
    echo "wheels:     $pkg: no wheel for those platforms ($(tail -n 1 "$tmp/pip.err")); trying without platform flags"
    python3 -m pip download -q --no-deps --only-binary=:all: -d .deps/wheels "$pkg"
  fi
  echo "wheels:     .deps/wheels/$(cd .deps/wheels && ls "${stem}"-*.whl | head -n 1) <- $pkg"
done

# --- the base tree of the A/B tools
full=$(git rev-parse --verify "$BASE_COMMIT^{commit}")
if [[ -d .deps/ab/base && $(cat .deps/ab/base.commit 2>/dev/null) == "$full" ]]; then
  echo "ab base:    .deps/ab/base (git archive $BASE_COMMIT = ${full:0:12}) already there"
else
  rm -rf .deps/ab/base
  mkdir -p .deps/ab/base
  git archive "$full" | tar -x -C .deps/ab/base
  echo "$full" >.deps/ab/base.commit
  echo "ab base:    .deps/ab/base <- git archive $BASE_COMMIT (${full:0:12})"
fi

# --- FLA's KDA test file and package at one commit (the peer suite)
if [[ -n ${FLA_GIT:-} ]]; then
  fla_commit=$(git --git-dir="$FLA_GIT" rev-parse HEAD)
  if [[ -f .deps/peers/fla_tests/test_kda.py && $(cat .deps/peers/fla.commit 2>/dev/null) == "$fla_commit" ]]; then
    echo "peers:      .deps/peers (FLA ${fla_commit:0:12}) already there"
  else
    rm -rf .deps/peers/fla_src .deps/peers/fla_tests
    mkdir -p .deps/peers/fla_src .deps/peers/fla_tests
    git --git-dir="$FLA_GIT" archive HEAD fla | tar -x -C .deps/peers/fla_src
    git --git-dir="$FLA_GIT" show HEAD:tests/ops/test_kda.py >.deps/peers/fla_tests/test_kda.py
    git --git-dir="$FLA_GIT" show HEAD:tests/conftest.py >.deps/peers/fla_tests/conftest.py
    echo "$fla_commit" >.deps/peers/fla.commit
    echo "peers:      .deps/peers <- FLA ${fla_commit:0:12} (fla/, tests/ops/test_kda.py, tests/conftest.py)"
  fi
else
  echo "peers:      FLA_GIT not set: .deps/peers (the fla-suite's test file) left as it is"
fi

# --- FlashKDA, built from source (a peer of the forward benchmark)
if [[ -n ${FK_GIT:-} ]]; then
  fk_commit=$(git --git-dir="$FK_GIT" rev-parse HEAD)
  if compgen -G ".deps/wheels/flash_kda-*.whl" >/dev/null && [[ $(cat .deps/wheels/flash_kda.commit 2>/dev/null) == "$fk_commit" ]]; then
    echo "flashkda:   .deps/wheels/flash_kda-*.whl (FlashKDA ${fk_commit:0:12}) already there"
  else
    venv=$tmp/fk-venv root=$PWD
    py=$(tools/gpu/python312.sh "${FK_PYTHON:-}") \
      || { echo "flashkda:   no Python 3.12 found (FK_PYTHON=<python3.12>)" >&2; exit 1; }
    "$py" -m venv "$venv"
    "$venv/bin/pip" install -q "torch==${FK_TORCH:-2.11.0}" setuptools wheel ninja numpy
    mkdir -p "$tmp/fk"
    git --git-dir="$FK_GIT" archive HEAD | tar -x -C "$tmp/fk"
    rm -rf "$tmp/fk/cutlass" && mkdir -p "$tmp/fk/cutlass"
    ln -s "$root/.deps/cutlass/include" "$tmp/fk/cutlass/include"
    rm -f .deps/wheels/flash_kda-*.whl
    (cd "$tmp/fk" && FLASH_KDA_CUDA_ARCHS=90a MAX_JOBS=${MAX_JOBS:-2} NVCC_THREADS=2 \
       "$venv/bin/pip" wheel -q --no-build-isolation --no-deps -w "$root/.deps/wheels" .)
    echo "$fk_commit" >.deps/wheels/flash_kda.commit
    echo "flashkda:   .deps/wheels/$(cd .deps/wheels && ls flash_kda-*.whl) <- FlashKDA ${fk_commit:0:12} (sm_90a)"
  fi
else
  echo "flashkda:   FK_GIT not set: no FlashKDA wheel built (the benchmark's FlashKDA column stays empty)"
fi

echo
du -sh .deps/* | sed 's/^/  /'
du -sh .deps | sed 's/^/  total /'
