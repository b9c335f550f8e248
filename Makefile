# `make run`  : create .venv, install silodp and its data packages, run the built-in demo.
# `make test` : create .venv, install silodp with test extras, run the whole test suite.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
OUT    ?= runs/demo
FASHION_MNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
# A local wheel directory (e.g. holding the CPU build of torch) is used when present.
WHEELS := $(wildcard /opt/wheels)
PIP_FLAGS := --quiet $(if $(WHEELS),--find-links $(WHEELS))

.PHONY: run test test-fast install system-deps browser-deps lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install $(PIP_FLAGS) -e '.[test]'
	touch $(STAMP)

system-deps:
	@if [ ! -f $(FASHION_MNIST) ]; then \
	  echo "Installing Debian package dataset-fashion-mnist"; \
	  SUDO=$$( [ "$$(id -u)" -eq 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq dataset-fashion-mnist; \
	fi

# Debian's chromium and its driver: the HTML report's browser test (tests only)
browser-deps:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  echo "Installing Debian packages chromium and chromium-driver"; \
	  SUDO=$$( [ "$$(id -u)" -eq 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium chromium-driver; \
	fi

install: system-deps $(STAMP)

run: install
	$(BIN)/silodp run --out $(OUT) --overwrite

test: install browser-deps
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=30

test-fast: install
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder -m "not slow"

lint: install
	$(BIN)/ruff check src tests
	$(BIN)/mypy

clean:
	rm -rf $(VENV) runs .pytest_cache
