#!/usr/bin/env bash
# Runs `make` targets one after the other, as `make test` does, and prints how long each took at the end
# (also when one fails: the phases so far, and which one failed). Exit status: the failing phase's.
#
#   scripts/phases.sh build lint test-unit ...
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
names=() times=() status=0 failed=""
start_all=$SECONDS
for phase in "$@"; do
    start=$SECONDS
    "${MAKE:-make}" --no-print-directory "$phase"
    status=$?
    names+=("$phase")
    times+=($((SECONDS - start)))
    if [ "$status" -ne 0 ]; then
        failed=$phase
        break
    fi
done
echo
echo "make test: time per phase (s)"
for i in "${!names[@]}"; do
    printf '  %-12s %6d\n' "${names[$i]}" "${times[$i]}"
done
printf '  %-12s %6d\n' total $((SECONDS - start_all))
if [ -n "$failed" ]; then
    echo "make test: $failed FAILED (exit $status)"
fi
exit "$status"
