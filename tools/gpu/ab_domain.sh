#!/usr/bin/env bash
# Puts a COPY of a kdakit tree's extension in the nanobind domain kdakit_base, so that its build can be imported beside
# another build of kdakit in one process (after tools/gpu/ab_rename.sh renames the package):
#
#   tools/gpu/ab_domain.sh SRC          (SRC/CMakeLists.txt patched in place: never pass the repository itself)
#
# nanobind keeps its C++ type registry per domain; two extensions built with different NB_DOMAIN names do not clash.
# The line `nanobind_add_module(_C NB_STATIC src/python/module.cpp)` gets `NB_DOMAIN kdakit_base` after NB_STATIC;
# exit 1 when the tree has no such line (edit the pattern here to the tree's nanobind_add_module line).
set -uo pipefail
cm=${1:?usage: ab_domain.sh SRC}/CMakeLists.txt
pattern='nanobind_add_module(_C NB_STATIC '
if ! grep -qF "$pattern" "$cm"; then
  echo "ab_domain: '$pattern' not found in $cm; cannot give the build its own nanobind domain" >&2
  grep -n nanobind_add_module "$cm" >&2
  exit 1
fi
sed -i 's|nanobind_add_module(_C NB_STATIC |nanobind_add_module(_C NB_STATIC NB_DOMAIN kdakit_base |' "$cm"
grep -qF 'nanobind_add_module(_C NB_STATIC NB_DOMAIN kdakit_base ' "$cm" \
  || { echo "ab_domain: patching $cm failed" >&2; exit 1; }
