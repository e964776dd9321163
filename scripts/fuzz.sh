#!/usr/bin/env bash
# make fuzz: fuzz the filter's pure parsers and the whole module.
#
#   1. stable: the property tests of tests/fuzz (proptest; the same checks as the libFuzzer targets) with
#      FUZZ_CASES cases per property;
#   2. nightly only: the coverage-guided libFuzzer targets of fuzz/ (cargo-fuzz, installed once, quietly),
#      FUZZ_RUNS executions per target (default 10^7), spread over FUZZ_JOBS processes; skipped with a
#      message when no nightly toolchain is installed;
#   3. the whole module in the host emulator, both builds (tests/host/tests/fuzz_module.rs),
#      FUZZ_MODULE_ITERATIONS configurations per build, on dist/ artifacts when they exist;
#   4. the interleavings model of the request path against a real redis-server
#      (src/filter/interleavings.rs), FUZZ_INTERLEAVINGS cases per configuration.
#
# Settings (environment): FUZZ_RUNS (10000000), FUZZ_JOBS (nproc), FUZZ_TARGETS ("resp config keys"),
# FUZZ_CASES (20000), FUZZ_MODULE_ITERATIONS (300), FUZZ_SEED (random; replays the module run),
# FUZZ_INTERLEAVINGS (5000), FUZZ_SKIP ("" or any of: stable libfuzzer module interleavings).
# A crash leaves its input in fuzz/artifacts/<target>/; replay it with
#   cargo +nightly fuzz run -O -s none --no-trace-compares <target> fuzz/artifacts/<target>/<file>
# and keep it as a regression test in tests/fuzz/main.rs (checks::<target>(&bytes)).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD

RUNS=${FUZZ_RUNS:-10000000}
JOBS=${FUZZ_JOBS:-$(nproc)}
TARGETS=${FUZZ_TARGETS:-resp config keys}
CASES=${FUZZ_CASES:-20000}
MODULE_ITERATIONS=${FUZZ_MODULE_ITERATIONS:-300}
INTERLEAVINGS=${FUZZ_INTERLEAVINGS:-5000}
SKIP=${FUZZ_SKIP:-}
CARGO_FUZZ_VERSION=0.13.2
# One set of flags for every target (another set rebuilds everything): no sanitizer (safe Rust; the
# checks measure the heap themselves), no trace-compares (3x the executions per second on the
# configuration parser; the structure-aware inputs bring the field names and values themselves).
FUZZ_FLAGS=(-O -s none --no-trace-compares)

summary=()
say() { printf 'fuzz: %s\n' "$*"; }
skipped() { [[ " $SKIP " == *" $1 "* ]]; }

if ! skipped stable; then
    say "stable: property tests, $CASES cases per property"
    start=$SECONDS
    ERL_FUZZ_CASES=$CASES cargo test -q --no-default-features --test fuzz
    summary+=("$(printf '%-22s %14s %10ss' 'proptest (stable)' "$CASES/property" $((SECONDS - start)))")
fi

if ! skipped libfuzzer; then
    if ! rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
        say "SKIPPED the coverage-guided targets: they need a nightly toolchain (rustup toolchain install nightly)"
        summary+=("libFuzzer              skipped: no nightly toolchain")
    else
        if [[ "$(cargo fuzz --version 2>/dev/null)" != "cargo-fuzz $CARGO_FUZZ_VERSION" ]]; then
            say "installing cargo-fuzz $CARGO_FUZZ_VERSION (once)"
            cargo install -q --locked --force cargo-fuzz --version "$CARGO_FUZZ_VERSION"
        fi
        (cd fuzz && cargo +nightly fuzz build "${FUZZ_FLAGS[@]}" 2>&1 | grep -v '^\s*\(Compiling\|Finished\)' || true)
        bin="$root/fuzz/target/$(rustc +nightly -vV | sed -n 's/^host: //p')/release"
        per_job=$(( (RUNS + JOBS - 1) / JOBS ))
        for target in $TARGETS; do
            corpus="$root/fuzz/corpus/$target" artifacts="$root/fuzz/artifacts/$target" logs="$root/target/fuzz-logs/$target"
            mkdir -p "$corpus" "$artifacts" "$logs"
            rm -f "$logs"/fuzz-*.log
            say "$target: $RUNS executions in $JOBS process(es)"
            start=$SECONDS
            # -jobs: JOBS independent processes, each of per_job executions, sharing the corpus; logs per job.
            (cd "$logs" && "$bin/$target" "$corpus" "$root/fuzz/seeds/$target" -runs="$per_job" -jobs="$JOBS" \
                -workers="$JOBS" -artifact_prefix="$artifacts/" -print_final_stats=1 -timeout=20 -rss_limit_mb=2048 \
                >/dev/null 2>&1) || true
            elapsed=$((SECONDS - start))
            runs=$(cat "$logs"/fuzz-*.log | sed -n 's/^Done \([0-9]*\) runs in.*/\1/p' | awk '{s += $1} END {print s + 0}')
            if grep -l 'ERROR: libFuzzer\|panicked at' "$logs"/fuzz-*.log >/dev/null 2>&1 || [[ "$runs" -eq 0 ]]; then
                say "$target FAILED: see $logs/ and the input in $artifacts/"
                grep -h -A4 'panicked at' "$logs"/fuzz-*.log | head -20 || true
                exit 1
            fi
            summary+=("$(printf '%-22s %14s %10ss %10s exec/s' "libFuzzer $target" "$runs" "$elapsed" $((runs / (elapsed > 0 ? elapsed : 1))))")
        done
    fi
fi

if ! skipped module; then
    say "module: $MODULE_ITERATIONS configurations per build in the host emulator"
    [[ -f dist/edge-rate-limiter-envoy.wasm ]] && export ERL_WASM=$root/dist/edge-rate-limiter-envoy.wasm
    [[ -f dist/edge-rate-limiter-higress.wasm ]] && export ERL_WASM_HOST_REDIS=$root/dist/edge-rate-limiter-higress.wasm
    start=$SECONDS
    mkdir -p target/fuzz-logs
    log=target/fuzz-logs/module.log
    status=0
    env ERL_FUZZ_ITERATIONS="$MODULE_ITERATIONS" ${FUZZ_SEED:+ERL_FUZZ_SEED=$FUZZ_SEED} \
        cargo test -q -p proxy-wasm-host-emulator --test host fuzz_module:: -- --nocapture >"$log" 2>&1 || status=$?
    grep '^fuzz_module' "$log" || true
    if [[ $status -ne 0 ]]; then
        say "module FAILED (the seed and the failing request are in $log):"
        grep -A12 'panicked at' "$log" | head -40 || true
        exit 1
    fi
    summary+=("$(printf '%-22s %14s %10ss' 'module (emulator)' "$MODULE_ITERATIONS/build" $((SECONDS - start)))")
fi

if ! skipped interleavings; then
    say "interleavings: $INTERLEAVINGS cases per configuration against a real redis-server"
    start=$SECONDS
    INTERLEAVING_CASES=$INTERLEAVINGS cargo test -q --lib --no-default-features interleavings
    summary+=("$(printf '%-22s %14s %10ss' 'interleavings model' "$INTERLEAVINGS/config" $((SECONDS - start)))")
fi

say "summary (target, executions, time, rate):"
printf '  %s\n' "${summary[@]}"
