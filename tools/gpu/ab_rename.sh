#!/usr/bin/env bash
# Turns a copy of a kdakit package built with `NB_DOMAIN kdakit_base` into the importable package `kdakit_base`:
#
#   tools/gpu/ab_rename.sh SITE          (SITE/kdakit_base: the copy, renamed in place)
#
# Absolute self-references -> kdakit_base: the lazy import table ("kdakit.chunk"), `import kdakit` (bound to the name
# kdakit, so the module body stays valid), `import kdakit as x`, `import kdakit.x [as y]` (a bare `import kdakit.x` is
# renamed too: the one in the package is an example in a docstring), `from kdakit.x import`, `from kdakit import`, and
# the torch custom-op namespace ("kdakit::op", torch.ops.kdakit.op), which would otherwise be registered twice.
# Anything left that would import or call into the current package is an error (exit 1), so that an A/B never runs
# the current build twice without saying so.
set -uo pipefail
pkg=${1:?usage: ab_rename.sh SITE}/kdakit_base
[[ -d $pkg ]] || { echo "ab_rename: no package at $pkg" >&2; exit 2; }
find "$pkg" -name __pycache__ -prune -exec rm -rf {} +
find "$pkg" -name '*.py' -print0 | xargs -0 sed -i -E \
  -e 's/(["'"'"'])kdakit\./\1kdakit_base./g' \
  -e 's/(["'"'"'])kdakit::/\1kdakit_base::/g' \
  -e 's/torch\.ops\.kdakit\./torch.ops.kdakit_base./g' \
  -e 's/^([[:space:]]*)import kdakit([[:space:]]*(#.*)?)$/\1import kdakit_base as kdakit\2/' \
  -e 's/^([[:space:]]*)import kdakit\.([A-Za-z_][A-Za-z0-9_.]*) as /\1import kdakit_base.\2 as /' \
  -e 's/^([[:space:]]*)import kdakit as /\1import kdakit_base as /' \
  -e 's/^([[:space:]]*)import kdakit\.([A-Za-z_][A-Za-z0-9_.]*)([[:space:]]*)$/\1import kdakit_base.\2\3/' \
  -e 's/^([[:space:]]*)from kdakit([. ])/\1from kdakit_base\2/'
left=$(grep -rnE '^[[:space:]]*(import|from)[[:space:]]+kdakit([. ]|$)|["'"'"']kdakit(\.|::)|torch\.ops\.kdakit\.' \
         --include='*.py' "$pkg" | grep -vE 'import kdakit_base as kdakit([[:space:]]|$)')
if [[ -n $left ]]; then
  echo "ab_rename: self-references to kdakit left in $pkg (extend the sed in tools/gpu/ab_rename.sh):" >&2
  echo "$left" >&2
  exit 1
fi
