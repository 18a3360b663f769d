# poslsh: every set-up step is here, so a fresh machine needs only `make <target>`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# CPU wheel of PyTorch used when the environment has no torch yet (a GPU user's build is kept)
TORCH  ?= torch==2.13.0
RUNS   ?= runs

.PHONY: install test test-fast reproduce-all reproduce-matrix reproduce-blocks reproduce-output \
	bench bench-matrix bench-attention bench-gpu clean-venv

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

test: install
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

# Every experiment that exists so far, at the defaults in conf/, then the plots.
# Fixed run directories: interrupted and started again, it resumes where it stopped.
reproduce-all: install reproduce-matrix reproduce-blocks reproduce-output
	@echo "figures: $(RUNS)/reproduce/*/figures/"

reproduce-matrix: install
	$(BIN)/poslsh matrix-error out=$(RUNS)/reproduce/matrix_error
	$(BIN)/poslsh matrix-error n=[256,1024,2048] sigma=[4,16] s=[1,4,16,64] trials=2 method=both \
		out=$(RUNS)/reproduce/matrix_error_dense_check
	$(BIN)/poslsh plot $(RUNS)/reproduce/matrix_error $(RUNS)/reproduce/matrix_error_dense_check

reproduce-blocks: install
	$(BIN)/poslsh block-stats out=$(RUNS)/reproduce/block_stats
	$(BIN)/poslsh sample n=256 sigma=8 s=32 out=$(RUNS)/reproduce/sample_heatmap
	$(BIN)/poslsh plot $(RUNS)/reproduce/block_stats $(RUNS)/reproduce/sample_heatmap

reproduce-output: install
	$(BIN)/poslsh output-error out=$(RUNS)/reproduce/output_error_minilm
	$(BIN)/poslsh plot $(RUNS)/reproduce/output_error_minilm

# Speed and memory targets, measured side by side in one run each and reported as ratios.
bench: bench-matrix bench-attention

bench-attention: install
	$(BIN)/poslsh bench out=$(RUNS)/bench/attention_cpu
	$(BIN)/poslsh plot $(RUNS)/bench/attention_cpu

# The large grid for a CUDA machine (FlexAttention exact as the reference).
bench-gpu: install
	$(BIN)/poslsh bench n=[4096,8192,16384,32768,65536,131072] device=cuda dtype=bfloat16 \
		exact_max_n=131072 out=$(RUNS)/bench/attention_gpu
	$(BIN)/poslsh plot $(RUNS)/bench/attention_gpu

bench-matrix: install
	rm -rf $(RUNS)/bench/matrix
	$(BIN)/poslsh matrix-error n=4096 sigma=16 s=64 trials=3 method=both out=$(RUNS)/bench/matrix/n4096
	$(BIN)/poslsh matrix-error n=65536 sigma=16 s=64 trials=3 out=$(RUNS)/bench/matrix/n65536
	$(BIN)/poslsh matrix-error n=1048576 sigma=16 s=16 trials=1 out=$(RUNS)/bench/matrix/n1048576
	$(BIN)/python scripts/matrix_bench_report.py $(RUNS)/bench/matrix

clean-venv:
	rm -rf $(VENV)
