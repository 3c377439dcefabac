# Two commands on a fresh machine with only Python:  make demo  |  make test
# Both create (once) and reuse the virtual environment .venv.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-gpu bench docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# With an NVIDIA GPU take the default (CUDA) torch; otherwise only PyTorch's CPU build, never a multi-GB CUDA one.
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  $(PY) -m pip install "torch>=2.4"; \
	else \
	  $(PY) -m pip install "torch==2.13.0+cpu" || \
	  $(PY) -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu; \
	fi
	$(PY) -m pip install -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m attention_dispatch demo

# No reruns: a test that fails once is a bug to fix, not to retry.
# ruff is pinned (pyproject's dev extra): another version may format differently.
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	TRITON_INTERPRET=1 $(PY) -m pytest -n 2 -q tests

# On a GPU machine: the same tests at realistic shapes.
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu tests

# On a GPU machine: the benchmark grid side by side with PyTorch's kernels, FlexAttention and
# flash-attn 4 (benchmarks/README.md; ~9 minutes on an H100), rewriting docs/benchmarks.md.
# BENCH_ARGS="--quick" for the smaller grid; without a GPU bench.py says so and exits 2.
BENCH_STAMP := $(VENV)/.installed-bench
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -e ".[dev,bench]"
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) benchmarks/bench.py $(BENCH_ARGS)

docs: $(STAMP)
	$(PY) -m attention_dispatch info --markdown > docs/backends.md

clean:
	rm -rf $(VENV)
