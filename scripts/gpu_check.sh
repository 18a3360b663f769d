#!/usr/bin/env bash
# One prepared GPU check for a session lent the CUDA machine: install, the CUDA tests, then the
# n=65536 side-by-side comparison and a short bench grid with FlexAttention exact as the
# reference. Every step's log goes to $OUT (default ./gpu_out); $OUT/summary.txt holds one line
# per step and the key numbers. Exits non-zero when any step fails.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
GRID_TIMEOUT=${GRID_TIMEOUT:-300}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
failed=0

step() {  # step NAME COMMAND...: run, log to $OUT/NAME.log, one PASS/FAIL line in the summary
  local name=$1; shift
  local t0=$SECONDS
  if "$@" >"$OUT/$name.log" 2>&1; then
    echo "PASS $name ($((SECONDS - t0)) s)" | tee -a "$SUMMARY"
  else
    local rc=$?
    echo "FAIL $name (exit $rc, $((SECONDS - t0)) s; see $name.log)" | tee -a "$SUMMARY"
    tail -n 5 "$OUT/$name.log" | sed 's/^/     /' >>"$SUMMARY"
    failed=1
  fi
}

install() {
  python -c "import torch" 2>/dev/null || pip install -q "torch>=2.6"
  pip install -q -e ".[test,finetune]"
  python -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print(torch.__version__, torch.cuda.get_device_name(0))"
}

gpu_tests() {  # every gpu-marked test must run here: a skip (no CUDA) or nothing run (exit 5) fails
  python -m pytest -q -rs -m gpu tests/ && ! grep -q "skipped" "$OUT/pytest_gpu.log"
}

step install install
step nvidia_smi nvidia-smi
step pytest_gpu gpu_tests
step bench_n65536 poslsh bench "n=[65536]" heads=8 head_dim=64 "s=[8]" "methods=[exact,poslsh,windowed]" \
  "window_sigmas=[4]" device=cuda dtype=bfloat16 exact_max_n=65536 repeats=3 out="$OUT/n65536"
step bench_grid timeout "$GRID_TIMEOUT" poslsh bench experiment=bench_gpu_quick out="$OUT/grid"
step plot poslsh plot "$OUT/n65536" "$OUT/grid"

{
  echo
  grep -E "passed|failed|error" "$OUT/pytest_gpu.log" | tail -n 2
  for run in n65536 grid; do
    [ -f "$OUT/$run/results.csv" ] || continue
    echo "-- $run: method backend n s seconds sample_seconds rel_fro peak_mem_mb"
    python - "$OUT/$run/results.csv" <<'PY'
import sys
import pandas as pd
df = pd.read_csv(sys.argv[1])
cols = ["method", "backend", "n", "s", "window_sigmas", "seconds", "sample_seconds", "rel_fro", "peak_mem_mb"]
print(df[[c for c in cols if c in df.columns]].to_string(index=False, float_format=lambda x: f"{x:.4g}")[:2500])
PY
  done
} >>"$SUMMARY" 2>&1
cat "$SUMMARY"
exit "$failed"
