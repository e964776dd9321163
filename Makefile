# edge-rate-limiter: build, test and run the proxy-wasm filter.
#
#   make            = make build
#   make setup      install what the machine lacks (scripts/setup.sh; quiet and quick when nothing is)
#   make build      the .wasm artifacts in dist/, checked by scripts/postbuild.py (wasm-tools.toml)
#   make test       build, lint-source, then unit tests (native, then wasm32 under Node), then end-to-end
#                   tests in Envoy (PYTEST_ARGS="-k burst -x" passes arguments to pytest); every native
#                   test and the emulator are compiled by clippy's driver, so they are linted as make lint does
#   make run        build, then Redis + webdis + Envoy + an upstream and a burst (make run RUN_ONCE=1);
#                   make run HOST=higress: the Higress build in the host emulator, Redis without a bridge
#   make lint       clippy (warnings are errors) on both wasm builds, the native core and its tests, the host
#                   emulator, erl-admin and the test support crate; then lint-source: rustfmt --check; no import cycle
#                   between modules and imports only down src/'s floors (scripts/check_imports.py); no file of
#                   src/ over 500 lines before its tests, no function over 80 (scripts/check_layout.py); every
#                   relative link and anchor of README.md
#                   and docs/, and every citation of a docs section in the code (scripts/check_links.py)
#   make bench      build, then benchmarks, each figure next to a baseline measured in the same run (~13 min)
#   make soak       build, then memory under 10^6 new keys and keys that expire (bench/soak.py, not in CI,
#                   ~13 min; SOAK_SECONDS=60 SOAK_KEYS=100000 for ~2 min)
#   make fuzz       the parsers (10^7 executions each, libFuzzer with a nightly toolchain, else property
#                   tests), the whole module in the emulator and the interleavings model of the request
#                   path (5,000 cases per configuration) (scripts/fuzz.sh, not in CI)
#   make oci        build, then an OCI image of each artifact, tagged with Cargo.toml's version, in dist/oci/
#                   (scripts/oci.py: the compat variant Istio pulls; Higress's plugin image layout); prints digests
#   make push       oci, then copies the images to REGISTRY=host[:port]/path (REGISTRY_TLS_VERIFY=false for a
#                   plain-HTTP registry; skopeo login first if it asks for credentials); prints each reference
#                   pinned by digest, for a WasmPlugin's `url: oci://...`
#   make clean      remove target/ and dist/; make distclean also removes .venv/ and .tools/

SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := build
# cargo parallelises itself; artifact builds share target/ and must not interleave.
.NOTPARALLEL:
.SUFFIXES:

# Tools installed by scripts/setup.sh in .tools/bin: twiggy, for make bench.
export PATH := $(CURDIR)/.tools/bin:$(HOME)/.cargo/bin:$(PATH)

CARGO ?= cargo
# Native tests and the emulator are compiled by clippy's driver, with warnings as errors: what `cargo clippy
# -- -D warnings` runs (cargo-clippy sets these two variables for `cargo check`), here for `cargo test`.
# Compiling them lints them, and make test does not check every dependency a second time for clippy
# (~150 s on 2 cores: clippy's checks and the tests' builds share no artifacts). Only the workspace's own
# crates go through the driver; release builds of the module never do.
LINTED = RUSTC_WORKSPACE_WRAPPER=$(shell PATH="$(PATH)" rustc --print sysroot)/bin/clippy-driver \
	CLIPPY_ARGS=-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__
PYTHON := $(CURDIR)/.venv/bin/python
POSTBUILD := python3 scripts/postbuild.py
WASM_TARGET := wasm32-wasip1
WASM_BUILT := target/$(WASM_TARGET)/release/edge_rate_limiter.wasm

# The artifacts: dist/edge-rate-limiter-<profile>.wasm, built with CARGO_FLAGS_<profile> and checked with
# [artifact.<profile>] of wasm-tools.toml. Adding one is one line here (and its section there).
ARTIFACTS := envoy
CARGO_FLAGS_envoy :=
ARTIFACTS += higress
CARGO_FLAGS_higress := --no-default-features --features host-redis
# The same two with regular expressions in `rates_by_value` (the engine doubles the module).
ARTIFACTS += envoy-regex
CARGO_FLAGS_envoy-regex := --features regex
ARTIFACTS += higress-regex
CARGO_FLAGS_higress-regex := --no-default-features --features host-redis,regex

DIST := $(ARTIFACTS:%=dist/edge-rate-limiter-%.wasm)

.PHONY: build setup test test-unit test-wasm test-parity test-host test-e2e run lint lint-source bench soak fuzz java-share clean \
	distclean oci push

build: setup $(DIST)

setup:
	@scripts/setup.sh

# What an artifact is built from. Rebuilt only when one of these is newer: the four artifacts share
# $(WASM_BUILT), so asking cargo each time would relink and re-optimise all four on every `make build`
# (~50 s on 2 cores, and test-host and test-e2e each run it). The artifacts are built one after the other.
WASM_INPUTS := $(shell find src -type f) build.rs Cargo.toml Cargo.lock .cargo/config.toml wasm-tools.toml \
	scripts/postbuild.py
dist/edge-rate-limiter-%.wasm: $(WASM_INPUTS) | setup
	$(CARGO) build -q --release --target $(WASM_TARGET)$(if $(CARGO_FLAGS_$*), $(CARGO_FLAGS_$*))
	@$(POSTBUILD) --profile $* $(WASM_BUILT) $@

# The phases one after the other, each timed; the times are printed at the end (scripts/phases.sh).
test:
	@MAKE="$(MAKE)" scripts/phases.sh setup build lint-source test-unit test-wasm test-parity test-host test-e2e

# The hostcall-free core with the regex feature (the interleavings model of the request path,
# src/filter/interleavings.rs, against a real redis-server) and the operator tool, natively; then the fuzz
# smoke (tests/fuzz: the property tests of make fuzz, bounded) and the key-safety properties
# (tests/key_safety.rs), and the calendar periods against Python's zoneinfo (tests/calendar_zoneinfo.rs). The core without the regex feature is tested by test-wasm (the same tests but the
# native-only ones, on wasm32): one native build of the tests less (make lint lints both).
test-unit: setup
	$(LINTED) $(CARGO) test -q --lib --no-default-features --features regex
	$(LINTED) $(CARGO) test -q -p erl-admin
	$(LINTED) $(CARGO) test -q --no-default-features --test fuzz --test key_safety --test calendar_zoneinfo

# The same tests on wasm32-wasip1, the module's own target, under Node's WASI (scripts/wasi-run.mjs, cargo's
# runner for that target): libtest runs them one after the other. Debug info off: the test module is
# smaller and loads faster.
WASM_TEST_ARGS := --lib --no-default-features --target $(WASM_TARGET)
test-wasm: export CARGO_PROFILE_DEV_DEBUG := false
test-wasm: export CARGO_TARGET_WASM32_WASIP1_RUNNER := node --no-warnings $(CURDIR)/scripts/wasi-run.mjs
test-wasm: setup
	$(CARGO) test -q $(WASM_TEST_ARGS)

# The project's Lua scripts against an independent model of Redisson's RRateLimiter on a real redis-server:
# property tests over thousands of random steps (PROPTEST_CASES scales them) and real-time scenarios.
test-parity: setup
	$(LINTED) $(CARGO) test -q --no-default-features --test parity

# The proxy-wasm host emulator (tests/host, on wasmi) against real Redis and webdis, running both built
# artifacts (dist/), and checked against Envoy 1.40 observations; and the test support crate's own tests.
test-host: build
	ERL_WASM=$(CURDIR)/dist/edge-rate-limiter-envoy.wasm ERL_WASM_HOST_REDIS=$(CURDIR)/dist/edge-rate-limiter-higress.wasm \
		$(LINTED) $(CARGO) test -q -p proxy-wasm-host-emulator -p erl-test-support

# target/debug/wasm-host, built as its own tests build it: `cargo build -p proxy-wasm-host-emulator` (without
# the dev-dependencies' features) or together with erl-admin (the Redis client's features) would unify the
# dependencies' features differently and compile them a second and a third time; built this way, after
# test-host it costs nothing.
WASM_HOST := $(LINTED) $(CARGO) test -q --no-run -p proxy-wasm-host-emulator -p erl-test-support

# make bench's emulator: on wasmtime (exact fuel, one unit per wasm instruction, and the function profile;
# tests/host/src/engine.rs), in a target directory of its own so that it and make test's (on wasmi) never
# rebuild each other. About 230 s to build the first time. Its function profile's exactness test runs first:
# sections 10 and 11 rest on it.
BENCH_HOST_DIR := $(CURDIR)/target/bench-host
BENCH_HOST := $(CARGO) test -q --target-dir $(BENCH_HOST_DIR) -p proxy-wasm-host-emulator -p erl-test-support \
	--features proxy-wasm-host-emulator/wasmtime

# Real redis-server, webdis and Envoy with dist/edge-rate-limiter-envoy.wasm, the emulator and the operator
# tool (built on its own, for the same reason). The modules that measure no time run first, two at a time
# (pytest-xdist; tests/e2e/conftest.py, SIDE_BY_SIDE), then the others one at a time; pytest's exit status 5
# (PYTEST_ARGS selected none of a run's tests) is no failure.
test-e2e: build
	$(WASM_HOST)
	$(LINTED) $(CARGO) build -q -p erl-admin
	$(PYTHON) -m pytest -q -n 2 --dist loadfile -m side_by_side tests/e2e $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(PYTHON) -m pytest -q -m "not side_by_side" tests/e2e $(PYTEST_ARGS) || [ $$? -eq 5 ]

# RUN_ONCE=1 on the command line reaches scripts/run.py through the environment (make exports
# command-line variables).
# HOST=higress: the Higress build in the host emulator (tests/host) instead of the stock build in Envoy.
run: build
	$(if $(filter higress,$(HOST)),$(WASM_HOST))
	$(PYTHON) scripts/run.py

# make test lints the native code as it compiles the tests ($(LINTED)); make lint checks it with clippy.
lint: lint-source
	$(CARGO) clippy -q --no-default-features --lib --tests -- -D warnings
	$(CARGO) clippy -q --no-default-features --features regex --lib --tests -- -D warnings
	$(CARGO) clippy -q -p proxy-wasm-host-emulator -p erl-admin -p erl-test-support --all-targets -- -D warnings
	$(CARGO) clippy -q --target-dir $(BENCH_HOST_DIR) -p proxy-wasm-host-emulator --features wasmtime --all-targets -- -D warnings

# What make test lints before the tests: both wasm builds (clippy), formatting, the module layout and the
# docs' links.
lint-source: setup
	$(CARGO) clippy -q --target $(WASM_TARGET) $(CARGO_FLAGS_envoy) -- -D warnings
	$(CARGO) clippy -q --target $(WASM_TARGET) $(CARGO_FLAGS_higress) -- -D warnings
	$(CARGO) fmt --all --check
	python3 scripts/check_imports.py src tools/admin/src
	python3 scripts/check_layout.py src tools/admin/src
	python3 scripts/check_links.py --self-test && python3 scripts/check_links.py

# Gateway overhead (Envoy with and without the filter, under wrk), Redis cost per decision (ACQUIRE vs
# Redisson's tryAcquire), Redis round trips per request, module sizes: bench/bench.py, which also lists its
# BENCH_* settings (e.g. make bench BENCH_DURATION=10 BENCH_ONLY=1,3).
# Section 9's peer rate limit services (bench/rls, not in the workspace, and envoyproxy/ratelimit by
# bench/ratelimit/build.sh) are built when 9 runs; if one does not build, section 9 says why and skips its rows.
bench: export SETUP_BENCH := 1
bench: export ERL_WASM_HOST_BIN := $(BENCH_HOST_DIR)/debug/wasm-host
bench: build
	$(BENCH_HOST) --lib profile::
	$(BENCH_HOST) --no-run
	@only="$${BENCH_ONLY:-9}"; if [[ ",$${only// /}," == *,9,* ]]; then \
		bench/rls/build.sh || echo "bench: bench/rls/build.sh failed; section 9 skips the limitador rows" >&2; \
		bench/ratelimit/build.sh || echo "bench: bench/ratelimit/build.sh failed; section 9 skips the ratelimit rows" >&2; fi
	$(PYTHON) bench/bench.py

# Long runs, not in CI: memory over time (bench/soak.py) and fuzzing (scripts/fuzz.sh).
soak: build
	$(WASM_HOST)
	$(PYTHON) bench/soak.py

fuzz: build
	scripts/fuzz.sh

# Java's Redisson and the gateway on one limiter, 10 runs of 5 s (one run is in make test): the worst sliding
# window by the permits' scores beside Java's alone, and how far calls arrive out of their stamps' order
# (docs/redisson.md, "Clocks").
java-share: build
	ERL_SHARE_RUNS=10 $(PYTHON) -m pytest -q -s tests/e2e/test_redisson_java.py -k go_no_further_over_the_rate

# OCI images of the artifacts (scripts/oci.py says what they hold and where each fact comes from).
oci: build
	$(PYTHON) scripts/oci.py build

REGISTRY_TLS_VERIFY ?= true
ifneq ($(filter push,$(MAKECMDGOALS)),)
ifndef REGISTRY
$(error make push needs REGISTRY=host[:port]/path, e.g. make push REGISTRY=127.0.0.1:5000/gateway REGISTRY_TLS_VERIFY=false)
endif
endif
push: oci
	$(PYTHON) scripts/oci.py push $(REGISTRY) --tls-verify $(REGISTRY_TLS_VERIFY)

clean:
	rm -rf target dist

distclean: clean
	rm -rf .venv .tools

