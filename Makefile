# poslsh: every set-up step is here, so a fresh machine needs only `make <target>`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# CPU wheel of PyTorch used when the environment has no torch yet (a GPU user's build is kept)
TORCH  ?= torch==2.13.0
RUNS   ?= runs
# where make reproduce-* runs its presets: local (one after another), joblib (in parallel on this
# machine) or slurm (each preset a SLURM job; needs the launchers extra and sbatch)
LAUNCHER ?= local
# opt-in presets make reproduce-* runs as well (poslsh reproduce --with): train_long perplexity_long (the long-context CPU runs), or all
WITH ?=
# run only these presets, or every preset of these commands (poslsh reproduce --only): e.g.
# ONLY="train perplexity passkey eval" for the language-model part; empty: every preset
ONLY ?=
# presets make reproduce-quick runs at once (each with its share of the cores and its own log)
QUICK_JOBS ?= 2
# the reproduce root make publish publishes, and where (docs/RESULTS.md, docs/figures, docs/results)
FROM ?= $(RUNS)/reproduce/paper
DOCS ?= docs

.PHONY: install test test-slow test-all publish publish-again reproduce-all reproduce-quick bench bench-matrix bench-attention \
	bench-gpu clean-venv

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test,launchers,finetune,eval,tracking]"
	touch $@

# The fast tier (what a change is checked with); test-slow is the rest (larger sizes, every fault
# point, every launcher); test-all both. CI runs test and test-slow.
test: install
	$(BIN)/python -m pytest -q -m "not slow" -n auto --dist worksteal --durations=10

test-slow: install
	$(BIN)/python -m pytest -q -m slow -n auto --dist worksteal --durations=10

test-all: install
	$(BIN)/python -m pytest -q -n auto --dist worksteal --durations=10

# docs/RESULTS.md, docs/figures/ and the README's results block from a reproduce root (FROM=...),
# each section stamped with the run, commit and machine it came from; publish-again regenerates
# them from the committed snapshot docs/results/ (tests/test_publish.py checks they agree).
publish: install
	$(BIN)/poslsh report $(FROM) --publish $(DOCS) --readme README.md

publish-again: install
	$(BIN)/poslsh report $(DOCS)/results/* --publish $(DOCS) --readme README.md

# Every experiment of the paper (conf/experiment/*_paper.yaml), its figures and the report
# runs/reproduce/paper/report.{md,html}. Fixed run directories: interrupted and started again,
# it resumes where it stopped. Large-model presets run only with their checkpoint and a GPU.
reproduce-all: install
	$(BIN)/poslsh reproduce --scale paper --runs $(RUNS)/reproduce --launcher $(LAUNCHER) $(foreach w,$(WITH),--with $(w)) $(foreach o,$(ONLY),--only $(o))

reproduce-quick: install
	$(BIN)/poslsh reproduce --scale quick --runs $(RUNS)/reproduce --launcher $(LAUNCHER) --jobs $(QUICK_JOBS) $(foreach w,$(WITH),--with $(w)) $(foreach o,$(ONLY),--only $(o))

# Speed and memory targets, measured side by side in one run each and reported as ratios.
bench: bench-matrix bench-attention

bench-attention: install
	$(BIN)/poslsh bench out=$(RUNS)/bench/attention_cpu
	$(BIN)/poslsh plot $(RUNS)/bench/attention_cpu

# The large grid for a CUDA machine (FlexAttention exact as the reference).
bench-gpu: install
	$(BIN)/poslsh bench experiment=bench_gpu_paper out=$(RUNS)/bench/attention_gpu
	$(BIN)/poslsh plot $(RUNS)/bench/attention_gpu

bench-matrix: install
	rm -rf $(RUNS)/bench/matrix
	$(BIN)/poslsh matrix-error n=4096 sigma=16 s=64 trials=3 method=both memory=true out=$(RUNS)/bench/matrix/n4096
	$(BIN)/poslsh matrix-error n=65536 sigma=16 s=64 trials=3 memory=true out=$(RUNS)/bench/matrix/n65536
	$(BIN)/poslsh matrix-error n=1048576 sigma=16 s=16 trials=1 memory=true out=$(RUNS)/bench/matrix/n1048576
	$(BIN)/python scripts/matrix_bench_report.py $(RUNS)/bench/matrix

clean-venv:
	rm -rf $(VENV)
