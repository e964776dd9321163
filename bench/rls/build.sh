#!/usr/bin/env bash
# Builds erl-peer-rls, the peer rate limit service of `make bench` section 9 (release, quiet):
# bench/rls/target/release/erl-peer-rls. Run by `make bench` only; rerunning it is cheap.
#
# 1. limitador 0.14.0 from crates.io, unpacked into target/limitador-0.14.0 with two lines removed: the
#    `#[cfg(feature = "disk_storage")]` in front of `pub mod bin` (src/storage/keys.rs) and of
#    `Counter::variables_for_key` (src/counter.rs), which code built without that feature calls. Cargo.toml's
#    [patch.crates-io] points there.
# 2. pkg-config and libssl-dev if the machine lacks them (limitador's Redis client is built with native-tls,
#    so openssl-sys links the system's OpenSSL).
# 3. cargo build --release, its output in target/build.log.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
version=0.14.0
patched="$here/target/limitador-$version"
cfg_line='#[cfg(feature = "disk_storage")]'

# target/build.status: "ok", or what failed (bench/peer_bench.py prints it and skips section 9).
mkdir -p "$here/target"
status="$here/target/build.status"
rm -f "$status"
step="unpacking limitador $version"
trap 'code=$?; [ "$code" = 0 ] || echo "$step (exit $code)" > "$status"' EXIT

if [ ! -f "$patched/.erl-patched" ]; then
    fetch="$here/target/fetch-limitador"
    mkdir -p "$fetch/src"
    printf '[package]\nname = "fetch-limitador"\nversion = "0.0.0"\nedition = "2021"\npublish = false\n\n[workspace]\n\n[dependencies]\nlimitador = { version = "=%s", default-features = false }\n' \
        "$version" > "$fetch/Cargo.toml"
    : > "$fetch/src/lib.rs"
    cargo fetch -q --manifest-path "$fetch/Cargo.toml"
    crate=$(find "${CARGO_HOME:-$HOME/.cargo}/registry/cache" -name "limitador-$version.crate" -print -quit)
    if [ -z "$crate" ]; then
        echo "bench/rls/build.sh: cargo fetch left no limitador-$version.crate in the registry cache" >&2
        exit 1
    fi
    rm -rf "$patched" "$patched.tmp"
    mkdir -p "$patched.tmp"
    tar xzf "$crate" -C "$patched.tmp" --strip-components=1
    # Each line removed must be the only such line right before the item: anything else means the source is
    # not the one this patch was written for.
    uncfg() {
        local file="$patched.tmp/$1" item=$2
        if [ "$(grep -B1 -F -x -- "$item" "$file" | head -1 | sed 's/^ *//')" != "$cfg_line" ] ||
            [ "$(grep -c -F -x -- "$item" "$file")" != 1 ]; then
            echo "bench/rls/build.sh: $1 is not as expected ('$cfg_line' before '$item')" >&2
            exit 1
        fi
        awk -v cfg="$cfg_line" -v item="$item" \
            '{ if (held != "") { if ($0 != item) print held; held = "" } t = $0; sub(/^ +/, "", t)
               if (t == cfg) held = $0; else print }
             END { if (held != "") print held }' "$file" > "$file.new"
        mv "$file.new" "$file"
    }
    uncfg src/storage/keys.rs "pub mod bin {"
    uncfg src/counter.rs "    pub(crate) fn variables_for_key(&self) -> Vec<(&str, &str)> {"
    touch "$patched.tmp/.erl-patched"
    mv "$patched.tmp" "$patched"
fi

step="installing pkg-config and libssl-dev"
if ! command -v pkg-config > /dev/null || ! pkg-config --exists openssl; then
    echo "bench/rls/build.sh: installing pkg-config and libssl-dev (openssl-sys)" >&2
    apt-get install -y -qq --no-install-recommends pkg-config libssl-dev > /dev/null ||
        { apt-get update -qq && apt-get install -y -qq --no-install-recommends pkg-config libssl-dev > /dev/null; }
fi

# Quiet: cargo's output (limitador's own warnings included: a path dependency's are not capped) goes to
# target/build.log and is shown only when the build fails.
log="$here/target/build.log"
step="cargo build (bench/rls/target/build.log)"
if ! cargo build --release --manifest-path "$here/Cargo.toml" > "$log" 2>&1; then
    { grep -E -A12 '^error' "$log" || tail -40 "$log"; } | head -80 >&2
    echo "bench/rls/build.sh: cargo build failed (whole output: $log)" >&2
    exit 1
fi
echo ok > "$status"
