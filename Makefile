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

# The compat environment runs the device runtime's tests on the oldest Python and torch it supports (JetPack 6's
# Python 3.10, torch 2.8) with no transformers, GPTQModel, optimum or Triton, on checkpoints that the main
# environment writes into COMPAT_FIXTURES (building them needs transformers and GPTQModel).
PYENV_ROOT ?= $(HOME)/.pyenv
PYTHON310 ?= $(or $(lastword $(sort $(wildcard $(PYENV_ROOT)/versions/3.10.*/bin/python3.10))),python3.10)
COMPAT_VENV ?= .venv-py310
COMPAT_TORCH ?= 2.8.0
COMPAT_FIXTURES ?= build/compat-fixtures
CPY := $(COMPAT_VENV)/bin/python
# The runtime's tests: the engine and its decode path, INT4, the server (protocol, media, admission, metrics,
# systemd notify) and the smoke check, the own processor and model modules, the checkpoint reader, the device-side
# CLI; and the own GPTQ solver's batches (quantize's solver where GPTQModel does not install: the board). Their
# HF-oracle parts skip themselves there (tests/conftest.py).
COMPAT_TESTS ?= $(addprefix tests/,test_engine.py test_decode.py test_int4.py test_generate_cli.py \
	test_server.py test_server_keepalive.py test_server_lifecycle.py test_chat_api.py test_media.py \
	test_admission.py test_metrics.py test_sdnotify.py test_smoke.py test_inputs.py test_positions.py \
	test_audio_encoder.py test_vision_encoder.py test_code2wav.py test_model.py test_checkpoint_layout.py \
	test_manifest.py test_plan.py test_cli.py test_time_sliced.py test_block_reader.py test_residency.py \
	test_packed_cache.py test_video.py test_video_model.py test_video_api.py test_vad.py test_realtime.py \
	test_audio_api.py test_deferred_captures.py test_continued_turns.py test_quantize_batched_solve.py \
	test_weight_arena.py test_device_profile.py test_int4_experts.py test_arena_faults.py \
	test_out_of_memory.py test_allocation_ceiling.py)

.PHONY: demo test test-compat venv venv-compat system-deps clean wheel

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $@

venv: $(VENV)/.installed

# PyPI's torch is a CUDA build: torch alone first (--no-deps: its metadata asks for 14 nvidia-* packages and
# Triton, 3.7 GB for 2.8.0), then the 11 nvidia-* libraries a CPU run loads (tests/compat_env.py), one at a time,
# each pruned of the parts a CPU run never loads right after it lands, so the disk never holds all their wheels
# and all their files at once; then orin-omni with --no-deps and its device-side extras listed from its metadata
# (naming torch again would make pip resolve torch's full CUDA set). pip then reports torch's cuSOLVER, NVRTC, NVTX
# and Triton as missing: they are, on purpose, so `compat_env.py pip` drops that report and says so in one line.
# The last step fails if transformers & co. got in. About 2 minutes and 4.3 GB (5 GB free are asked for first, with
# a clear error); pip's cache saves nothing here (the registry sends no caching headers), and the download is a few
# seconds of that anyway.
$(COMPAT_VENV)/.installed: pyproject.toml tests/compat_env.py
	rm -rf $(COMPAT_VENV)
	$(PYTHON310) tests/compat_env.py room $(COMPAT_VENV)
	$(PYTHON310) -m venv $(COMPAT_VENV)
	$(CPY) -m pip install --quiet --upgrade pip packaging
	$(CPY) -m pip install --quiet --no-deps torch==$(COMPAT_TORCH)
	$(CPY) tests/compat_env.py prune
	$(CPY) tests/compat_env.py torch-libs > $(COMPAT_VENV)/torch-libs.txt
	while read -r lib; do \
	  $(CPY) -m pip install --quiet --no-deps "$$lib" && $(CPY) tests/compat_env.py prune || exit 1; \
	done < $(COMPAT_VENV)/torch-libs.txt
	$(CPY) -m pip install --quiet --no-deps -e .
	$(CPY) tests/compat_env.py requirements > $(COMPAT_VENV)/requirements.txt
	$(CPY) tests/compat_env.py pip install --quiet -r $(COMPAT_VENV)/requirements.txt
	$(CPY) tests/compat_env.py torch-dependents > $(COMPAT_VENV)/torch-dependents.txt
	$(CPY) -m pip install --quiet --no-deps -r $(COMPAT_VENV)/torch-dependents.txt
	$(CPY) tests/compat_env.py check $(COMPAT_TORCH)
	touch $@

venv-compat: $(COMPAT_VENV)/.installed

# systemd-analyze checks the rendered units in the tests (Debian/Ubuntu package `systemd`, >= 250); espeak-ng
# speaks the real speech the voice tests (VAD, Realtime API, transcriptions) send.
system-deps:
	@command -v systemd-analyze >/dev/null 2>&1 && command -v espeak-ng >/dev/null 2>&1 || { \
	  echo "installing systemd (for systemd-analyze) and espeak-ng (speech for the voice tests)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq systemd espeak-ng >/dev/null; }

# The compat environment is built first: a failed download should not wait for the main suite. The main suite runs
# in TEST_WORKERS pytest-xdist workers (a whole file each, so a module's fixtures are built once) with the compat
# run beside them: its output waits in build/test-compat.log and follows the main suite's; either failing fails
# make. One torch thread per process: the processes keep the cores busy already, and on the tiny model's short ops
# a second thread mostly spin-waits.
TEST_WORKERS ?= 2
test: export OMP_NUM_THREADS = 1
test: venv venv-compat system-deps
	@mkdir -p build
	@echo "$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile   (and make test-compat alongside)"
	@$(MAKE) --no-print-directory test-compat > build/test-compat.log 2>&1 & compat=$$!; \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile; main=$$?; \
	wait $$compat; status=$$?; echo "make test-compat (ran alongside):"; cat build/test-compat.log; \
	[ $$main = 0 ] && [ $$status = 0 ]

# The checkpoints are written afresh each time: ones left by older code would be read as current. What writing them
# prints goes to build/compat-fixtures.log, shown only if it fails.
test-compat: venv venv-compat
	$(PY) tests/fixture_checkpoints.py $(COMPAT_FIXTURES)
	$(CPY) -m pytest -q --fixtures-dir $(COMPAT_FIXTURES) $(COMPAT_TESTS)

demo: venv
	$(PY) -m devtools.demo --dir $(DEMO_DIR) --port $(DEMO_PORT)

# The wheel for a machine without a checkout (the board): dist/orin_omni-VERSION-py3-none-any.whl, installed there
# with its extras, e.g. pip install './orin_omni-0.1.0-py3-none-any.whl[serve,jetson]' (docs/jetson.md).
wheel: venv
	$(PY) -m pip wheel --no-deps -w dist .

$(LINT_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(LINT_VENV)
	$(LINT_VENV)/bin/pip install --quiet ruff
	touch $@

lint: $(LINT_VENV)/.installed
	$(LINT_VENV)/bin/ruff check orin quantize tests

clean:
	rm -rf build dist $(VENV) $(LINT_VENV) $(COMPAT_VENV) .pytest_cache
