# Tandem: `make serve` serves the demo model, `make test` runs the whole suite.
# Both install everything into .venv first (torch==2.13.0 before anything that needs torch).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MODEL ?= models/demo-llama
PORT ?= 30000
HOST ?= 127.0.0.1
PYTEST_ARGS ?=

.PHONY: install serve test demo-model clean

install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $@

models/demo-llama/config.json: | install
	$(PY) -m tandem.tools.make_tiny_model --arch llama --out models/demo-llama

demo-model: models/demo-llama/config.json

serve: install $(if $(filter models/demo-llama,$(MODEL)),demo-model)
	$(PY) -m tandem.launch_server --model-path $(MODEL) --host $(HOST) --port $(PORT)

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

clean:
	rm -rf $(VENV) models .pytest_cache

# Side-by-side comparison with vLLM, SGLang (when ../shared/peers/setup.sh installed them) and HF
# transformers; writes docs/benchmarks.md and docs/benchmarks.png. Takes about an hour on 2 cores.
# BENCH_ARGS="--quick --models 7m" for a smoke run.
BENCH_ARGS ?=
.PHONY: bench-compare
bench-compare: install
	$(PY) -m pip install --quiet -r requirements-bench.txt
	$(PY) benchmarks/compare.py $(BENCH_ARGS)
