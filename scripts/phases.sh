#!/usr/bin/env bash
# Runs `make` targets one after the other, as `make test` does, and prints how long each took at the end
# (also when one fails: the phases so far, and which one failed). Exit status: the failing phase's.
#
#   scripts/phases.sh build lint test-unit ...
#
# A phase of several targets joined by `+` (`build+emulator`) runs them side by side, as separate `make`
# runs, and ends when all have; it fails if one does. Use it for builds that keep different cores busy (the
# module's link-time optimisation runs on one core while the emulator's dependencies compile), and that
# lock different directories of target/ (cargo waits for a build of the same profile and target).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
names=() times=() status=0 failed=""
start_all=$SECONDS
for phase in "$@"; do
    start=$SECONDS
    pids=()
    IFS=+ read -ra targets <<<"$phase"
    for target in "${targets[@]}"; do
        "${MAKE:-make}" --no-print-directory "$target" &
        pids+=($!)
    done
    status=0
    for pid in "${pids[@]}"; do
        wait "$pid" || { code=$?; [ "$status" -eq 0 ] && status=$code; }
    done
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
    printf '  %-16s %6d\n' "${names[$i]}" "${times[$i]}"
done
printf '  %-16s %6d\n' total $((SECONDS - start_all))
if [ -n "$failed" ]; then
    echo "make test: $failed FAILED (exit $status)"
fi
exit "$status"
