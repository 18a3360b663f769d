#!/usr/bin/env bash
# One prepared GPU check (about 7 minutes on one H200): a smoke test of the compiled kernels, the
# attention bench grid (exact, windowed, Positional LSH on the union and per-mask routes; n up to
# 131072, both directions, s = 8 and 32), forward + backward at n = 131072, the union against the
# per-mask route at s = 8, 32, 100, training steps at the paper's setting (L = 8192, sigma = 256
# every head, s = 100, a 13.8M-parameter model, bfloat16) and at L = 65536 (step-bench defaults),
# a profile of one exact-ALiBi and one RoPE step, then the CUDA tests. Every step logs to
# $OUT/<step>.log under a time limit; $OUT/summary.txt has one line per step and the key tables,
# $OUT/gpu_check.tar.gz every log, run directory and report.
#
#   scripts/gpu_check.sh                       # on the CUDA machine (results in $OUT)
#   DEVICE=cpu scripts/gpu_check.sh            # dry run on the CPU at small sizes (no tests), in runs/gpu_check
#
# Python: $PY, else the project's .venv when there is one (make install), else python3. Missing
# packages travel as wheels in .whl/ (installed to /tmp/site when hydra is absent).
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-runs/gpu_check}
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
failed=0
T0=$SECONDS

if ! $PY -c "import hydra" 2>/dev/null && [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 MPLBACKEND=Agg HF_HUB_OFFLINE=1
POSLSH="$PY -m poslsh_cli"

STEPS=${STEPS:-smoke grid step_paper bwd step_long svs pytest_gpu profile}  # the steps to run, by name

step() {  # step NAME LIMIT COMMAND...: run under a time limit, log to $OUT/NAME.log, one line in the summary
  local name=$1 limit=$2; shift 2
  case " $STEPS " in *" $name "*) ;; *) return ;; esac
  local t0=$SECONDS left=$((BUDGET - (SECONDS - T0)))
  if [ "$left" -lt 30 ]; then
    echo "SKIP $name (the check's $BUDGET s are spent)" | tee -a "$SUMMARY"
    failed=1
    return
  fi
  limit=$((limit * SCALE))
  [ "$limit" -gt "$left" ] && limit=$left
  if timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; then
    echo "PASS $name ($((SECONDS - t0)) s)" | tee -a "$SUMMARY"  # live progress, and the summary
  else
    local rc=$?
    echo "FAIL $name (exit $rc, $((SECONDS - t0)) s; see $name.log)" | tee -a "$SUMMARY"
    tail -n 8 "$OUT/$name.log" | sed 's/^/     /' >>"$SUMMARY"
    failed=1
  fi
}

if [ "$DEVICE" = cuda ]; then
  DT=bfloat16 PREC=bf16 N="[8192,32768,131072]" NBIG=131072 NS=32768 LP=8192 LL=65536
  MODEL="hidden=512 layers=4 heads=8 kv_heads=8 head_dim=64 intermediate=1536"
  PROFILE="--hidden 512 --layers 4 --heads 8 --head-dim 64 --intermediate 1536"
  BUDGET=${BUDGET:-540}  # seconds for every step together: a step gets what is left of it
  SCALE=${LIMIT_SCALE:-1}  # each step's limit times this
else
  # FlexAttention runs uncompiled on the CPU (every score of a call materialised): the per-mask route
  # of svs at a length and s where its calls stay within seconds
  DT=float32 PREC=fp32 N="[1024,2048]" NBIG=2048 NS=512 LP=256 LL=512
  MODEL="hidden=64 layers=2 heads=8 kv_heads=8 head_dim=8 intermediate=128"
  PROFILE="--hidden 64 --layers 2 --heads 8 --head-dim 8 --intermediate 128"
  BUDGET=${BUDGET:-1500}
  SCALE=${LIMIT_SCALE:-4}  # each step's limit times this: CPU steps run uncompiled, often beside other work
fi
METHODS=${METHODS:-[exact,poslsh,windowed]} PATHS=${PATHS:-[auto]} N=${GRID_N:-$N}
BENCH=(device="$DEVICE" dtype="$DT" heads=8 head_dim=64 repeats=3 warmup=1 "window_sigmas=[4]")

report() {  # the report of every run made here, and the key columns of each results.csv
  local runs=()
  for r in grid bwd svs step_paper step_long; do [ -f "$OUT/$r/results.csv" ] && runs+=("$OUT/$r"); done
  [ ${#runs[@]} -gt 0 ] || return 0
  $POSLSH report "${runs[@]}" --out "$OUT" >"$OUT/report.log" 2>&1 || echo "report failed (see report.log)" >>"$SUMMARY"
  grep -E "^\| (bench|step-bench)" "$OUT/report.md" 2>/dev/null | grep -E "CUDA|paper's setting|RoPE" | cut -c1-600
  for r in "${runs[@]}"; do
    echo "-- $(basename "$r")"
    $PY - "$r/results.csv" <<'PY'
import sys
import pandas as pd
df = pd.read_csv(sys.argv[1])
cols = ["method", "position", "backend", "attention_path", "n", "seq_len", "causal", "backward", "s", "window_sigmas",
        "seconds", "sample_seconds", "step_seconds", "peak_mem_mb", "rel_fro", "max_err_f64", "precision"]
print(df[[c for c in cols if c in df.columns]].to_string(index=False, float_format=lambda x: f"{x:.4g}"))
PY
  done
}

step smoke 240 $PY scripts/gpu_smoke.py "$DEVICE"
# the grid that met more than eight shapes (it fell back to the unfused kernel and asked for 256 GiB)
step grid 240 $POSLSH bench "n=$N" "causal=[true,false]" "s=[8,32]" "methods=$METHODS" \
  "partition_backends=$PATHS" exact_max_n=$NBIG "${BENCH[@]}" out="$OUT/grid"
step step_paper 150 $POSLSH step-bench "seq_len=[$LP]" "position=[rope,alibi,poslsh]" "s=[100]" "backend=[auto]" \
  batch=2 sigma=256 precision=$PREC steps=3 warmup=2 device=$DEVICE $MODEL out="$OUT/step_paper"
step bwd 90 $POSLSH bench "n=[$NBIG]" "causal=[true]" "s=[8]" "methods=[exact,poslsh]" backward=true \
  "partition_backends=[union]" exact_max_n=$NBIG "${BENCH[@]}" out="$OUT/bwd"
step step_long 120 $POSLSH step-bench "seq_len=[$LL]" "position=[rope,alibi,poslsh]" "s=[10]" "backend=[auto]" \
  batch=1 steps=3 warmup=1 device=$DEVICE out="$OUT/step_long"
step svs 90 $POSLSH bench "n=[$NS]" "causal=[true]" "s=[8,32,100]" "methods=[exact,poslsh]" \
  "partition_backends=[union,flex]" exact_max_n=$NS "${BENCH[@]}" out="$OUT/svs"
if [ "$DEVICE" = cuda ]; then
  step pytest_gpu 180 $PY -m pytest -q -rs -m gpu -n 4 -p no:cacheprovider tests/
fi
step profile 90 $PY scripts/profile_step.py --seq-len $LP --positions rope alibi --precision fp32 --batch 2 \
  --sigma 256 --steps 2 --device $DEVICE $PROFILE
{ echo; echo "wall $((SECONDS - T0)) s"; report; } >>"$SUMMARY" 2>&1
tar -czf "$OUT/gpu_check.tar.gz" --exclude=gpu_check.tar.gz -C "$OUT" . 2>/dev/null
sed -n '/^wall /,$p' "$SUMMARY"  # the step lines were printed as they came
exit "$failed"
