# replaykit: `make test` (CPU suite, what CI runs) and `make demo` (replay vs eager on the device present).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# The model zoo's packages (replaykit/testing/zoo), matching TORCH_SPEC. The index's torchvision is a
# CUDA build: --no-deps keeps it from pulling a CUDA torch, and --target keeps it out of the venv's
# site-packages (beside a CPU torch it breaks `import lightning`); the zoo finds it in zoo-site.
ZOO_SPEC ?= torchvision==0.28.0 timm==1.0.31
# The transformers zoo (replaykit/testing/zoo/hf.py): installed into the venv itself; it requires no
# torch, so the CPU build stays (the version the H200 host has).
HF_SPEC ?= transformers==5.17.0
STAMP := $(VENV)/.installed
# No byte-compiling at install (half the venv's time: every module of torch, transformers, jupyter);
# Python compiles what the tests import, once, at their first import.
PIP := $(BIN)/python -m pip install -q --no-compile
# One intra-op thread per test process: two workers on two cores with torch's default of one thread
# per core oversubscribe them, and the suite's small tensors gain nothing from threads (a test file
# ran 2.3x faster so on a loaded 2-core machine). Kernels and child processes inherit it.
TEST_ENV := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

.PHONY: venv test oldest-torch e2e demo demo-core colab-sim gpu lint bench clean nbcheck nbstrip

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(PIP) "$(TORCH_SPEC)"
	$(PIP) -e ".[dev,testing,workflow,notebooks]"
	$(BIN)/python -c "import torch; print(torch.__version__)" > $(VENV)/.torch-version
	$(PIP) "$(HF_SPEC)"
	$(BIN)/python -c "import torch; print(torch.__version__)" | cmp -s - $(VENV)/.torch-version \
		|| (echo "installing $(HF_SPEC) changed torch" && exit 1)
	rm -rf $(VENV)/zoo-site
	$(PIP) --no-deps --target $(VENV)/zoo-site $(ZOO_SPEC)
	touch $(STAMP)

# pytest and nbval in one run on two workers: a file's tests (a notebook's cells: one kernel) share
# one worker; files with slow tests and the notebooks go first (tests/conftest.py orders them;
# xdist's reorder by test count would put them last). nbval runs each notebook with its CPU-quick
# parameters (notebooks/conftest.py edits the parameters cell). Tests marked env, e2e or ddp (rank
# processes): `make e2e`.
test: $(STAMP)
	$(BIN)/ruff check replaykit tests scripts
	$(BIN)/ruff format --check replaykit tests scripts
	$(BIN)/python -m replaykit.workflow.nbclean --check notebooks/*.ipynb
	$(TEST_ENV) $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=10 \
		-m "not env and not e2e and not ddp" \
		--nbval-lax --nbval-current-env --nbval-sanitize-with notebooks/nbval_sanitize.cfg \
		tests notebooks

# The oldest torch pyproject.toml allows (torch>=2.4), on the CPU: the core tests (not cuda) and the
# README's examples against PyPI's torch 2.4.1 in its own venv (a CUDA build: ~5 GB with its
# nvidia-* wheels, which it needs to import even on a CPU). Not part of `make test`.
OLDEST_VENV ?= $(HOME)/.cache/replaykit/torch24
OLDEST_PY ?= python3.12
oldest-torch:
	test -x $(OLDEST_VENV)/bin/python || $(OLDEST_PY) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install -q torch==2.4.1 "numpy<2" pytest tqdm
	$(OLDEST_VENV)/bin/python -m pip install -q -c $(CURDIR)/tests/oldest-torch.txt lightning
	PYTHONPATH=$(CURDIR) $(TEST_ENV) $(OLDEST_VENV)/bin/python -m pytest -q -p no:cacheprovider \
		-m "not cuda and not e2e and not ddp" tests/core

# The main job: the parity notebook on the device present, saved under runs/ with its summary.
demo: $(STAMP)
	$(BIN)/python scripts/demo.py

# The tests that build Python environments (marker `env`) or run the harness end to end in child
# processes (marker `e2e`; the compiled and DDP benches), not in `make test`: minutes each. The
# four notebooks as Colab's Run all runs them, in a venv of what Colab preinstalls (cached under
# ~/.cache/replaykit/colab-runtime/, keyed by tests/workflow/colab-runtime.txt: a CI job keeps that
# folder), and the README's offline recipe (a wheelhouse, a venv of torch and lightning only).
e2e: $(STAMP)
	$(TEST_ENV) $(BIN)/python -m pytest -q -n 2 --dist loadfile -m "env or e2e or ddp"

colab-sim: $(STAMP)
	$(BIN)/python -m pytest -q tests/workflow/test_colab.py

# Replay vs eager with plain PyTorch (no notebook): a parity table and a journal.
demo-core: $(STAMP)
	$(BIN)/python -m replaykit.testing.demo

# On a GPU host with torch already installed: the CUDA tests, no venv.
gpu:
	$(PY) -m pytest -q -m cuda

bench:
	$(PY) scripts/bench_replay.py

# Committed notebooks carry no outputs (Jupyter started here strips them on save: jupyter_server_config.py).
nbcheck: $(STAMP)
	$(BIN)/python -m replaykit.workflow.nbclean --check notebooks/*.ipynb

nbstrip: $(STAMP)
	$(BIN)/python -m replaykit.workflow.nbclean notebooks/*.ipynb

lint: $(STAMP)
	$(BIN)/ruff check replaykit tests scripts
	$(BIN)/ruff format --check replaykit tests scripts

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
