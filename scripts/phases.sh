#!/usr/bin/env bash
# Runs `make` targets one after the other, as `make test` does, and prints how long each took at the end
# (also when one fails: the phases so far, and which one failed). Exit status: the failing phase's.
#
#   scripts/phases.sh build lint test-unit ...
#
# `bg:TARGET` starts `make TARGET` in the background (its output in .tools/logs/TARGET.log) and goes on;
# `wait:TARGET` waits for it there (a failure is that phase's, with the log's tail). The times list the
# background phase's own time and how long `wait:` waited for it. A background phase still running when a
# foreground one fails is stopped.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
names=() times=() status=0 failed=""
declare -A bg_pid=() bg_start=()
start_all=$SECONDS
logs=.tools/logs
stop_background() {
    for target in "${!bg_pid[@]}"; do
        kill -- "-${bg_pid[$target]}" 2>/dev/null || kill "${bg_pid[$target]}" 2>/dev/null
    done
}
trap stop_background EXIT
for phase in "$@"; do
    start=$SECONDS
    case "$phase" in
        bg:*)
            target=${phase#bg:}
            mkdir -p "$logs"
            # Its own process group (set -m), so that stopping it stops cargo and rustc too.
            set -m
            "${MAKE:-make}" --no-print-directory "$target" >"$logs/$target.log" 2>&1 &
            bg_pid[$target]=$!
            set +m
            bg_start[$target]=$SECONDS
            continue
            ;;
        wait:*)
            target=${phase#wait:}
            wait "${bg_pid[$target]}"
            status=$?
            names+=("$target (background, from its start)")
            times+=($((SECONDS - bg_start[$target])))
            names+=("$phase")
            unset "bg_pid[$target]"
            if [ "$status" -ne 0 ]; then
                tail -n 40 "$logs/$target.log"
            fi
            ;;
        *)
            "${MAKE:-make}" --no-print-directory "$phase"
            status=$?
            names+=("$phase")
            ;;
    esac
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
