# make demo: install what the demo uses and ragvit, run the main job (GPU when present, else CPU).
# make test: install the test requirements, build, run the whole pytest suite.
# make lint: the style checks alone (ruff, clang-format; the pre-commit hooks run the same).
# make sanitize: the suite against an ASan+UBSan CPU-only build in build/sanitize
#   (scripts/sanitize_cpu.sh; SANITIZE_ARGS: pytest arguments, default the whole suite).
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: demo test lint sanitize install build demo-deps test-deps gpu-check clean

demo: demo-deps install
	HF_HUB_OFFLINE=1 $(PYTHON) -m ragvit.demo

install:
	$(PIP) install -q "setuptools>=64" wheel "numpy>=2.0"
	$(PIP) install -q --no-build-isolation --no-deps -e .

demo-deps:
	$(PIP) install -q -r requirements-demo.txt

test-deps:
	$(PIP) install -q -r requirements-test.txt

build:
	RAGVIT_WERROR=1 $(PYTHON) setup.py -q build_ext --inplace

test: test-deps build
	$(PYTHON) -m pytest -q

lint: test-deps
	$(PYTHON) -m pytest -q tests/test_style.py

sanitize: test-deps
	PYTHON=$(PYTHON) bash scripts/sanitize_cpu.sh $(SANITIZE_ARGS)

gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf build *.egg-info ragvit/_C*.so
