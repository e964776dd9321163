#!/usr/bin/env bash
# Builds envoyproxy/ratelimit, the rate limit service most Envoy users deploy, for `make bench` section 9
# (quiet): bench/ratelimit/target/ratelimit. Run by `make bench` only; rerunning it is cheap (the binary is
# kept while its stamp names the pinned version).
#
# `go install github.com/envoyproxy/ratelimit/src/service_cmd@VERSION` from the Go module proxy, its module
# cache (GOPATH), build cache (GOCACHE) and output all in bench/ratelimit/target (gitignored; -modcacherw, so
# `rm -rf target` removes it). envoyproxy/ratelimit has no tagged release after v1.4.0: VERSION is the
# pseudo-version of its main branch that the proxy served as latest (commit 3fb702589d36, 2026-01-22).
# Its go.mod asks for Go 1.25.6; the machine's Go (1.26) builds it, GOTOOLCHAIN=local (no download).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
module=github.com/envoyproxy/ratelimit
version=v1.4.1-0.20260122083618-3fb702589d36
target="$here/target"
binary="$target/ratelimit"
stamp="$target/ratelimit.version"

# target/build.status: "ok", or what failed (bench/peer_bench.py prints it and skips the ratelimit rows).
mkdir -p "$target"
status="$target/build.status"
rm -f "$status"
step="finding go"
trap 'code=$?; [ "$code" = 0 ] || echo "$step (exit $code)" > "$status"' EXIT

go=$(command -v go || true)
[ -n "$go" ] || go=/usr/local/go/bin/go
if [ ! -x "$go" ]; then
    echo "bench/ratelimit/build.sh: no go on PATH nor in /usr/local/go/bin" >&2
    exit 1
fi

if [ -x "$binary" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$module@$version" ]; then
    echo ok > "$status"
    exit 0
fi

# Quiet: go's output goes to target/build.log and is shown only when the build fails.
log="$target/build.log"
step="go install $module/src/service_cmd@$version (bench/ratelimit/target/build.log)"
rm -f "$binary" "$stamp" "$target/bin/service_cmd"
if ! env GOPATH="$target/gopath" GOMODCACHE="$target/gopath/pkg/mod" GOCACHE="$target/gocache" \
        GOBIN="$target/bin" GOTOOLCHAIN=local GOFLAGS="-modcacherw -buildvcs=false -trimpath" CGO_ENABLED=0 \
        "$go" install "$module/src/service_cmd@$version" > "$log" 2>&1; then
    tail -40 "$log" >&2
    echo "bench/ratelimit/build.sh: go install failed (whole output: $log)" >&2
    exit 1
fi
mv "$target/bin/service_cmd" "$binary"
echo "$module@$version" > "$stamp"
echo ok > "$status"
