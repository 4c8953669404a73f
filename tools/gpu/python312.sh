#!/usr/bin/env bash
# Prints a Python 3.12 interpreter, the GPU machine's Python, for the builds made here for it (prepare_deps.sh's
# FlashKDA wheel, pack_build.sh's packs):
#
#   tools/gpu/python312.sh [CANDIDATE]      (CANDIDATE, e.g. $FK_PYTHON, is printed as it is when given)
#
# Else the first of python3.12 and python3 that runs as 3.12 (a pyenv shim of a version not selected does not).
# Exit status 1, printing nothing, when there is none.
set -uo pipefail
if [[ -n ${1:-} ]]; then
  echo "$1"
  exit 0
fi
for c in python3.12 python3; do
  if "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
    echo "$c"
    exit 0
  fi
done
exit 1
