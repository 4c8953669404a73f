#!/usr/bin/env bash
# A job longer than one machine call: started detached once, then waited for by this and later calls.
#
#   tools/gpu/detached.sh WAIT_S COMMAND [ARGS...]
#
# The first call starts COMMAND in its own session (setsid) with OUT=/tmp/kdakit-detached/out (its logs and reports
# go there) and records it; every call (the first included) waits up to WAIT_S seconds for it to end, copies its
# output folder into this call's $OUT, and prints the last lines of its console log. While it runs, a later call
# (with any COMMAND: the recorded job is the one waited for) keeps waiting; after it ended, the next call starts
# COMMAND afresh. The machine stays held only while calls follow each other, so call again at once.
# Exit status: COMMAND's when it ended within the wait, 3 while it is still running.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
[[ $# -ge 2 ]] || { sed -n '2,11p' "$0"; exit 2; }
wait_s=$1
shift
OUT=${OUT:-/tmp/kdakit-out}
job=${KDAKIT_DETACHED_DIR:-/tmp/kdakit-detached}
mkdir -p "$OUT"
running() { [[ -f $job/pid ]] && kill -0 "$(cat "$job/pid")" 2>/dev/null; }
if ! running; then
  if [[ -f $job/pid && ! -f $job/collected ]]; then
    echo "detached: the previous job ended (status $(cat "$job/status" 2>/dev/null || echo '?')); its output follows"
  else
    rm -rf "$job"
    mkdir -p "$job/out"
    printf '%q ' "$@" >"$job/command"
    # Its own stdio off the caller's: a job that kept it would hold a pipe the caller reads (`detached.sh ... | tail`)
    # open until the job ends.
    OUT=$job/out setsid bash -c '"$@" >"$0/console.log" 2>&1 </dev/null; echo $? >"$0/status"' "$job" "$@" \
      >/dev/null 2>&1 </dev/null &
    echo $! >"$job/pid"
    echo "detached: started $(cat "$job/command")"
  fi
fi
end=$((SECONDS + wait_s))
while running && ((SECONDS < end)); do sleep 1; done
cp -r "$job/out/." "$OUT/" 2>/dev/null
cp "$job/console.log" "$OUT/detached_console.log" 2>/dev/null
tail -n 40 "$job/console.log" 2>/dev/null
if running; then
  echo "detached: still running after ${wait_s} s: $(cat "$job/command")"
  exit 3
fi
touch "$job/collected"
status=$(cat "$job/status" 2>/dev/null || echo 1)
echo "detached: ended with status $status: $(cat "$job/command")"
exit "$status"
