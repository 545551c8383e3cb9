#!/usr/bin/env bash
# The lent H200's calls for a change to kernels, launchers or dispatch, in one script:
#   bash tools/h200_session.sh tests    # the GPU suite: tests/kernels_triton tests/formats tests/dispatch
#   bash tools/h200_session.sh tests_kernels; ... tests_dispatch  # the same in two calls (each < 600 s)
#   bash tools/h200_session.sh debug    # b12x-dual diff of a tiny transformers Llama (built here, random
#                                       # weights) across reference / triton / hopper, and the watchdog's cost
#   bash tools/h200_session.sh bench    # bench --shapes square --m 1,16,4096 --impls hopper,triton --peers gemlite
#   bash tools/h200_session.sh bench_channel  # fp8_channel and mxfp8_w8a16 (hopper / triton) against
#                                       # torch._scaled_mm row-wise and bf16 cuBLAS
#   bash tools/h200_session.sh w8a16    # hopper mxfp8 W8A16: its tests, then its probe (oracle + timing)
#   bash tools/h200_session.sh moe_tests moe_probe  # hopper MoE: its tests; its probe (oracle, bench --shapes moe)
# Results go under $OUT (default ./out); each step prints a short table last. gemlite must be staged in
# .gemlite (docs/bench.md) and carried for the bench.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/.gemlite${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -c "import torch, triton, platform; print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name(0))" | tee "$OUT/env.txt"
git log -1 --format='commit %H' 2>/dev/null | tee -a "$OUT/env.txt" || true
for step in "$@"; do
case "$step" in
tests|tests_kernels|tests_dispatch)
  # -v: each result is logged as it completes, so a run stopped by its time limit still names its
  # failures. The whole suite takes about 10 minutes on an H200 with -n 16 (the warmup-key walks, one
  # worker for ~8 minutes, are the long pole): over one device call's limit, so split it in two calls
  # on a warm machine: tests_kernels (tests/kernels_triton tests/formats), then tests_dispatch.
  case "$step" in
    tests) paths="tests/kernels_triton tests/formats tests/dispatch" ;;
    tests_kernels) paths="tests/kernels_triton tests/formats" ;;
    tests_dispatch) paths="tests/dispatch" ;;
  esac
  timeout -k 10 ${TESTS_S:-560} python3 -m pytest -v -n ${NPROC:-16} --dist loadgroup --durations=12 -p no:cacheprovider -rs \
    $paths > "$OUT/pytest_$step.log" 2>&1
  echo "pytest $step rc=$?"
  grep -E "^(FAILED|ERROR) |\] (FAILED|ERROR) " "$OUT/pytest_$step.log" | sed -E 's/^\[gw[0-9]+\] \[ *[0-9]+%\] //; s/ +$//' | sort -u | head -30
  for r in PASSED FAILED SKIPPED ERROR; do printf "%s %s  " "$r" "$(grep -cE "\] $r " "$OUT/pytest_$step.log")"; done; echo
  tail -n 1 "$OUT/pytest_$step.log" ;;
debug)
  python3 - "$OUT/llama" <<'PY'
import sys, torch, transformers
cfg = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=2, num_attention_heads=8,
                               num_key_value_heads=4, vocab_size=1024, max_position_embeddings=256)
torch.manual_seed(0)
transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[1])
PY
  for f in nvfp4 mxfp4 mxfp8 fp8_block fp8_tensor nvfp4_w4a16 mxfp4_w4a16; do
    timeout -k 5 60 python3 -m dispatch.apps.cli diff "$OUT/llama" --format $f --tokens 16 --device cuda --no-progress --plain \
      --json "$OUT/diff_$f.json" > "$OUT/diff_$f.log" 2>&1; echo "diff $f rc=$?"; done
  timeout -k 5 120 python3 tools/watchdog_cost.py --variants nvfp4,fp8_block,mxfp8,mxfp4_w4a16 \
    --shapes 16x4096x4096,128x4096x4096 --json "$OUT/watchdog.json" > "$OUT/watchdog.log" 2>&1; echo "watchdog rc=$?"
  tail -n 12 "$OUT/watchdog.log"; tail -n 4 "$OUT/diff_nvfp4.log" ;;
bench)
  timeout -k 10 ${BENCH_S:-540} python3 -m dispatch.apps.bench --shapes square --m 1,16,4096 --impls hopper,triton \
    --peers gemlite --budget-s ${BUDGET_S:-480} --json "$OUT/bench.json" --plot "$OUT/bench.png" > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"; tail -n 45 "$OUT/bench.log" | cut -c1-200 ;;
bench_channel)
  timeout -k 10 ${BENCH_S:-300} python3 -m dispatch.apps.bench --formats fp8_channel,mxfp8_w8a16 \
    --shapes ${SHAPES:-square,llama3.1-8b} --m ${MS:-1,16,64,128,256,4096} --impls hopper,triton \
    --baselines torch_bf16,torch_fp8_channel --budget-s ${BUDGET_S:-240} \
    --json "$OUT/bench_channel.json" > "$OUT/bench_channel.log" 2>&1
  echo "bench_channel rc=$?"; tail -n 40 "$OUT/bench_channel.log" | cut -c1-200 ;;
w8a16)
  timeout -k 5 200 python3 -m pytest -q -n ${NPROC:-8} -p no:cacheprovider tests/kernels_triton/hopper/test_hopper_mxfp8_w8a16.py \
    tests/kernels_triton/hopper/test_hopper_mxfp8.py > "$OUT/w8a16_tests.log" 2>&1; echo "w8a16 tests rc=$?"
  grep -E "^(FAILED|ERROR)" "$OUT/w8a16_tests.log" | head -10; tail -n 1 "$OUT/w8a16_tests.log"
  timeout -k 5 150 python3 tools/probes/hopper_mxfp8_w8a16_gpu.py --json "$OUT/mxfp8_w8a16.json" > "$OUT/w8a16_probe.log" 2>&1
  echo "w8a16 probe rc=$?"; tail -n 22 "$OUT/w8a16_probe.log" ;;
moe_tests)
  timeout -k 5 240 python3 -m pytest -q -n ${NPROC:-8} -p no:cacheprovider tests/kernels_triton/hopper/test_hopper_moe.py \
    > "$OUT/moe_tests.log" 2>&1; echo "moe tests rc=$?"
  grep -E "^(FAILED|ERROR)" "$OUT/moe_tests.log" | head -10; tail -n 1 "$OUT/moe_tests.log" ;;
moe_probe)
  timeout -k 5 ${MOE_PROBE_S:-240} python3 tools/probes/hopper_moe_gpu.py ${MOE_PROBE_ARGS:-} > "$OUT/moe_probe.log" 2>&1
  echo "moe probe rc=$?"; tail -n 30 "$OUT/moe_probe.log" ;;
*) echo "unknown step $step (tests, tests_kernels, tests_dispatch, debug, bench, bench_channel, w8a16, moe_tests, moe_probe)"; exit 2 ;;
esac
done
