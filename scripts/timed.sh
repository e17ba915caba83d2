#!/usr/bin/env bash
# Run a command and print its wall time afterwards, whatever its exit status:
#   scripts/timed.sh LABEL COMMAND...
# (make test's parts: CI's log shows how long each took, and the machine's load.)
set -uo pipefail
label=$1; shift
start=$EPOCHREALTIME
"$@"
rc=$?
awk -v s="$start" -v e="$EPOCHREALTIME" -v l="$label" -v rc="$rc" -v load="$(cut -d' ' -f1-3 /proc/loadavg)" \
  'BEGIN { printf "[make] %s: %.1f s wall, exit %d (load average %s)\n", l, e - s, rc, load }'
exit $rc
