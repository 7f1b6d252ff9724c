# The two Quickstart commands: `make serve` and `make test`. Both create and use .venv at the repo root.
VENV := .venv
PY := $(VENV)/bin/python
# CPU machines get this pinned CPU build; GPU users install their own torch into .venv first.
TORCH_PIN ?= torch==2.13.0

.PHONY: serve test lint clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

serve: $(VENV)/.installed
	$(VENV)/bin/conveyor serve

test: $(VENV)/.installed
	bash .ci/services
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -ra

lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
