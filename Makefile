# Every target builds or updates its own virtual environment first, so each works on a fresh machine.
# torch is pinned through constraints.txt: an unpinned torch would pull gigabytes of CUDA packages.
PYTHON ?= python3
VENV ?= .venv
LINT_VENV ?= .venv-lint
PY := $(VENV)/bin/python
DEMO_DIR ?= build/demo
DEMO_PORT ?= 8765
export TOKENIZERS_PARALLELISM := false
# GPTQModel defaults to one worker per core; a 2-core CI box wants no more than that.
export GPTQMODEL_CPU_WORKERS ?= 2

.PHONY: demo test lint venv system-deps clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $@

venv: $(VENV)/.installed

# systemd-analyze checks the rendered units in the tests (Debian/Ubuntu package `systemd`, >= 250).
system-deps:
	@command -v systemd-analyze >/dev/null 2>&1 || { \
	  echo "installing systemd (for systemd-analyze)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq systemd >/dev/null; }

test: venv system-deps
	$(PY) -m pytest -q

demo: venv
	$(PY) -m orin.devtools.demo --dir $(DEMO_DIR) --port $(DEMO_PORT)

$(LINT_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(LINT_VENV)
	$(LINT_VENV)/bin/pip install --quiet ruff
	touch $@

lint: $(LINT_VENV)/.installed
	$(LINT_VENV)/bin/ruff check orin quantize tests

clean:
	rm -rf build dist $(VENV) $(LINT_VENV) .pytest_cache
