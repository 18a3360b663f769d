#!/usr/bin/env bash
# One prepared GPU check (for a session lent the CUDA machine): the CUDA tests, then the
# n=65536 side-by-side comparison and the large bench grid with FlexAttention exact as the
# reference. Everything it writes goes to $OUT (default ./gpu_out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
python -c "import torch" 2>/dev/null || pip install -q "torch>=2.6"
pip install -q -e ".[test]" >"$OUT/install.log" 2>&1
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
python -m pytest -q -m gpu tests/ 2>&1 | tee "$OUT/pytest_gpu.txt"
poslsh bench n=[65536] heads=8 head_dim=64 s=[8] methods=[exact,poslsh,windowed] window_sigmas=[4] \
  device=cuda dtype=bfloat16 exact_max_n=65536 out="$OUT/n65536" 2>&1 | tail -20 | tee "$OUT/n65536.txt"
timeout 420 poslsh bench experiment=bench_gpu_paper s=[2,8,32] window_sigmas=[1,4,16] repeats=3 \
  out="$OUT/grid" 2>&1 | tail -30 | tee "$OUT/grid.txt"
poslsh plot "$OUT/n65536" "$OUT/grid" >/dev/null 2>&1 || true
