#!/usr/bin/env bash
# One-shot GPU run: GPU tests, `sweep --grid large`, `bench` on the model shapes, and a
# short summary printed LAST (the device tool returns only the end of the output).
#
#   bash tools/h200_run.sh                 # from anywhere; runs in the repository root
#
# Needs only the machine's python3 with torch, triton, numpy (and pytest for the test steps); the
# repository is used through PYTHONPATH (no `pip install -e .`). rich / tqdm / matplotlib are used
# when present; without them tables and progress are plain text and the plot is skipped (it says so).
#
# Environment (all optional):
#   OUT         where results go (default: $OUT if set, else ./out)
#   TOTAL_S     wall-clock budget for the whole script in seconds (default 540; the device tool
#               stops a command at 600). The bench gets what the earlier steps leave, minus a reserve.
#   PYTHON      interpreter (default python3)
#   SKIP_TESTS  1: skip the two pytest steps
#   BENCH_ARGS  extra arguments for bench (e.g. "--quick", "--shapes square,llama3.1-8b")
#   SWEEP_ARGS  extra arguments for sweep
#
# Writes under $OUT: env.txt, pytest_all.log, pytest_gpu.log, harness_tests.log, sweep.log,
# sweep.json, bench.log, bench.json, bench.png, summary.txt.
set -u -o pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
TOTAL_S=${TOTAL_S:-540}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
STEPS=()

elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( TOTAL_S - $(elapsed) )); }
min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }

# run_step NAME LIMIT_S CMD...: output to $OUT/NAME.log, a one-line status here, the log's tail on failure
run_step() {
  local name=$1 limit=$2; shift 2
  if [ "$limit" -lt 10 ]; then
    echo "[$(elapsed)s] $name: SKIPPED (no time left)"; STEPS+=("$name: skipped, no time left"); return
  fi
  local t=$(date +%s)
  echo "[$(elapsed)s] $name (limit ${limit}s): $*"
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$? dt=$(( $(date +%s) - t ))
  local what="rc=$rc"
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && what="TIMED OUT after ${limit}s"
  echo "[$(elapsed)s] $name: $what (${dt}s)"
  if [ $rc -ne 0 ]; then tail -n 15 "$OUT/$name.log" | cut -c1-220; fi
  STEPS+=("$name: $what, ${dt}s, log $OUT/$name.log")
}

# ---- environment -------------------------------------------------------------------------------
$PY - > "$OUT/env.txt" 2>&1 <<'EOF'
import importlib, platform, torch
print("python", platform.python_version())
print("torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton; print("triton", triton.__version__)
except Exception as e:
    print("triton MISSING", e)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"sm_{p.major}{p.minor}", p.multi_processor_count, "SMs",
          getattr(p, "L2_cache_size", 0) // 2**20, "MiB L2", p.total_memory // 2**30, "GiB")
else:
    print("gpu NONE: everything below runs in the Triton interpreter")
missing = []
for m in ("numpy", "pytest", "rich", "tqdm", "matplotlib"):
    try:
        importlib.import_module(m)
    except Exception:
        missing.append(m)
print("optional packages missing:", ", ".join(missing) or "none",
      "(plain-text tables / no plot where missing)" if missing else "")
EOF
cat "$OUT/env.txt"

# ---- tests -------------------------------------------------------------------------------------
if [ "${SKIP_TESTS:-0}" != "1" ]; then
  run_step pytest_all "$(min 150 $(( $(left) - 330 )))" $PY -m pytest tests/kernels_triton -q -x -p no:cacheprovider
  run_step pytest_gpu "$(min 90 $(( $(left) - 300 )))" $PY -m pytest tests/kernels_triton -m gpu -q -p no:cacheprovider
fi
# the harness's own tests, now on the GPU (tiny shapes; exercises graph capture, do_bench, _scaled_mm)
run_step harness_tests "$(min 60 $(( $(left) - 270 )))" $PY -m pytest tests/dispatch/apps/test_sweep_bench.py -q -p no:cacheprovider

# ---- sweep -------------------------------------------------------------------------------------
SWEEP_LIMIT=$(min 130 $(( $(left) - 170 )))
run_step sweep "$SWEEP_LIMIT" $PY -m dispatch.apps.sweep --grid large --budget-s $(( SWEEP_LIMIT > 70 ? SWEEP_LIMIT - 40 : SWEEP_LIMIT / 2 )) \
  --json "$OUT/sweep.json" --no-progress ${SWEEP_ARGS:-}

# ---- bench -------------------------------------------------------------------------------------
# budget: start no new configuration after BUDGET s; a configuration (3 baselines + 11 timings,
# first-time compilation included) can take ~30 s, and the plot, JSON and summary need the rest.
BENCH_LIMIT=$(( $(left) - 20 ))
BUDGET=$(( BENCH_LIMIT - 75 ))
if [ $BUDGET -lt 30 ]; then BUDGET=30; fi
run_step bench "$BENCH_LIMIT" $PY -m dispatch.apps.bench --check --budget-s $BUDGET \
  --json "$OUT/bench.json" --plot "$OUT/bench.png" --no-progress ${BENCH_ARGS:-}

# ---- summary (last: the device tool returns the end of the output) -----------------------------
{
  echo
  echo "================ summary ($(elapsed)s) ================"
  cat "$OUT/env.txt"
  for f in pytest_all pytest_gpu harness_tests; do
    [ -f "$OUT/$f.log" ] && echo "$f: $(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT/$f.log" | tail -n 1)"
  done
  ARGS=()
  [ -f "$OUT/sweep.json" ] && ARGS+=(--sweep-json "$OUT/sweep.json")
  [ -f "$OUT/bench.json" ] && ARGS+=(--summarize "$OUT/bench.json")
  if [ ${#ARGS[@]} -gt 0 ]; then
    $PY -m dispatch.apps.bench "${ARGS[@]}" --plain 2>&1 | cut -c1-200
  else
    echo "no sweep.json / bench.json written"
  fi
  [ -f "$OUT/sweep.log" ] && grep -E "^sweep:|^skipped" "$OUT/sweep.log" | cut -c1-200
  echo "steps:"
  for s in "${STEPS[@]}"; do echo "  $s"; done
  echo "files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
} 2>&1 | tee "$OUT/summary.txt"
