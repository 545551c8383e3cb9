"""``b12x-dual bench``: time every format x implementation x shape against baselines measured in the
same run, and (``--check``) re-check each timed configuration against the oracle.

Shapes (N x K, y[M, N] = x[M, K] . W[N, K]^T), from the models' config.json files:

    id                       model          layer                                   N       K
    square                   -              square 8192 x 8192 (the targets' shape)  8192    8192
    llama3.1-8b:qkv          Llama-3.1-8B   qkv_proj (32 q + 2 x 8 kv heads x 128)   6144    4096
    llama3.1-8b:gate_up      Llama-3.1-8B   gate_up_proj (2 x 14336)                 28672   4096
    llama3.1-8b:down         Llama-3.1-8B   down_proj                                4096    14336
    qwen3-32b:qkv            Qwen3-32B      qkv_proj (64 q + 2 x 8 kv heads x 128)   10240   5120
    qwen3-32b:gate_up        Qwen3-32B      gate_up_proj (2 x 25600)                 51200   5120
    qwen3-32b:down           Qwen3-32B      down_proj                                5120    25600
    deepseek-v3:q_a_kv_a     DeepSeek-V3    fused q_a (1536) + kv_a (512 + 64 rope)  2112    7168
    deepseek-v3:q_b          DeepSeek-V3    q_b_proj (128 heads x 192) from q_lora   24576   1536
    deepseek-v3:o            DeepSeek-V3    o_proj (128 heads x 128 -> hidden)       7168    16384
    deepseek-v3:mlp_gate_up  DeepSeek-V3    dense-layer gate_up (2 x 18432)          36864   7168   (not in "default")
    deepseek-v3:mlp_down     DeepSeek-V3    dense-layer down_proj                    7168    18432  (not in "default")
    tiny                     -              CPU interpreter smoke shape              64      128

(DeepSeek-V3's q_b_proj reads the 1536-wide q_lora latent, not the 7168 hidden state.) ``--shapes``
takes ids, model prefixes (llama3.1-8b, qwen3-32b, deepseek-v3, square), "default" (the first ten),
"all" (these and the MoE layers), or literal NxK; and the MoE layers (dispatch/apps/bench_moe.py):

    gpt-oss-20b:moe      gpt-oss-20b    32 experts, top-4, hidden 2880, intermediate 2880, swigluoai, mxfp4_w4a16
    qwen3-30b-a3b:moe    Qwen3-30B-A3B  128 experts, top-8, hidden 2048, intermediate 768, silu, nvfp4
    tiny-moe             -              CPU interpreter smoke layer (4 experts, top-2, 128, 128)

("moe" selects the two models' layers), each timed per implementation of the MoE table against a
bf16 baseline (torch._grouped_mm, else a loop over experts). M: decode {1, 16, 64} and prefill
{512, 4096}; the square shape adds M = 8192 (the 8192^3 GEMM targets) unless ``--m`` is given.

What is timed, per configuration (docs/bench.md has the full method):
  * linear  the whole layer: activation quantization + GEMM (x bf16 -> y bf16), as a user calls it;
  * gemm    the GEMM alone (backend.gemm) on operands quantized beforehand (backend.quantize_activation);
            not for W4A16, which has no separate quantizer;
  * baselines, same shapes, same run: torch bf16 F.linear (cuBLAS), torch._scaled_mm per-tensor FP8
    (use_fast_accum=False), torch._scaled_mm row-wise FP8 (per-token / per-channel scales: the
    fp8_channel recipe) and torch._scaled_mm blockwise FP8 (1x128 activation / 128x128 weight
    scales) where this torch supports it (else recorded as unsupported, with the error).
Timing: CUDA-graph replay for M <= 64 (the graph holds one call per rotated input set, so launch gaps
and Python overhead are out), triton.testing.do_bench medians otherwise (it zeroes a 256 MB buffer
before every call, flushing the L2); in both cases the calls rotate over enough distinct copies of
the weights and activations that they exceed 4x the L2 (weights come from HBM). Ceilings measured in
the same run: device-to-device copy bandwidth (bytes read + written), bf16 matmul and per-tensor FP8
_scaled_mm at 8192^3 on random data. Roofline time = max(FLOPs / compute ceiling, bytes / copy
bandwidth); "roof %" = roofline time / measured time. Bytes = weight (codes + scales) + activation
as the call consumes it (bf16 for linear, codes + scales for gemm) + bf16 output.

Without CUDA, the bench runs a tiny grid through Triton's interpreter with host timers: those
numbers are NOT performance numbers (it says so); it exists so that tests can check the harness.

    b12x-dual bench --quick --check --json out/bench.json --plot out/bench.png
    python -m dispatch.apps.bench --summarize out/bench.json [--sweep-json out/sweep.json]
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from dispatch.registry import VARIANTS

from . import _harness as H
from . import argtypes as A
from .bench_peers import PEERS, print_peers
from .bench_moe import print_moe_results, run_moe_bench, split_shapes
from .bench_plan import BASELINES, GRAPH_MAX_M, QUICK_M, QUICK_SHAPES, select_shapes
from .bench_record import plot, print_results, summarize
from .bench_run import BENCH_IMPLS, run_bench


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="time formats x implementations x model shapes against torch baselines",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def _shape_spec(value: str) -> str:
    """--shapes, checked against the tables at parse time (selected again when the run starts)."""
    try:
        dense, moe = split_shapes(value)
        if dense is not None or not moe:
            select_shapes(dense or value, gpu=True, quick=False)
    except ValueError as e:
        raise A.Invalid(f"invalid shape list {value!r} ({e})") from None
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--formats", type=A.choice_list(VARIANTS, "format"), default=None,
                   help=f"comma list from {list(VARIANTS)} (default: all)")
    p.add_argument("--impls", type=A.choice_list(BENCH_IMPLS, "implementation"), default=None,
                   help="comma list from triton,hopper,cute (default: all three; hopper runs on sm_90 only, "
                        "cute on SM12x only, each skips elsewhere with the registry's reason)")
    p.add_argument("--shapes", type=_shape_spec, default=None,
                   help="ids, model prefixes, 'default', 'all' or NxK (default: 'default' on GPU, 'tiny' on CPU)")
    p.add_argument("--m", type=A.int_list, default=None,
                   help="comma list of M (default: 1,16,64,512,4096 (+8192 square) on GPU)")
    p.add_argument("--baselines", type=A.choice_list(BASELINES, "baseline"), default=",".join(BASELINES),
                   help="comma list from " + ",".join(BASELINES))
    p.add_argument("--peers", type=A.choice_list(PEERS, "peer"), default=None,
                   help="comma list from " + ",".join(PEERS) + ": time other libraries' equivalents in the same run "
                        "(pip install b12x-dual[peers]; a peer that cannot run is a row with the reason)")
    p.add_argument("--quick", action="store_true", help=f"shapes {QUICK_SHAPES}, M {QUICK_M}")
    p.add_argument("--check", action="store_true",
                   help="re-check each timed configuration against formats.reference_linear (256 rows)")
    p.add_argument("--budget-s", type=A.nonnegative_float, default=None,
                   help="stop starting new configurations after this many seconds")
    p.add_argument("--warmup-ms", type=A.positive_float, default=10)
    p.add_argument("--rep-ms", type=A.positive_float, default=50)
    p.add_argument("--graph-max-m", type=A.nonnegative_int, default=GRAPH_MAX_M,
                   help="CUDA-graph replay for M up to this")
    p.add_argument("--seed", type=A.nonnegative_int, default=0)
    p.add_argument("--json", type=A.output_path, default=None, metavar="PATH")
    p.add_argument("--plot", type=A.output_path, default=None, metavar="PATH")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--plain", action="store_true", help="plain-text tables even when rich is installed")
    p.add_argument("--summarize", type=A.input_file, default=None, metavar="BENCH_JSON",
                   help="print the targets of a bench JSON (and --sweep-json's summary) and exit")
    p.add_argument("--sweep-json", type=A.input_file, default=None, metavar="SWEEP_JSON")


def run(args, *, extra_backends: Optional[dict[str, H.BackendFactory]] = None) -> int:
    """The bench with the parsed options (every value already checked by its ``type=``); 0 when
    every timed configuration ran and passed --check, 1 otherwise, 2 for a summary that cannot be read."""
    if args.summarize or args.sweep_json:
        try:
            summarize(args.summarize, args.sweep_json, plain=args.plain)
        except (OSError, ValueError, KeyError) as e:  # not a bench/sweep JSON: one line, no traceback
            print(f"b12x-dual bench: cannot summarize: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        return 0
    dense, moe_shapes = split_shapes(args.shapes)
    result = None
    if dense is not None or not moe_shapes:
        shapes = select_shapes(dense, gpu=H.on_gpu(), quick=args.quick) if dense else None
        result = run_bench(variants=args.formats, impls=args.impls, shapes=shapes, ms=args.m, quick=args.quick,
                           baselines=args.baselines, check=args.check, budget_s=args.budget_s,
                           warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, graph_max_m=args.graph_max_m,
                           seed=args.seed, progress=not args.no_progress, extra_backends=extra_backends,
                           peers=args.peers)
        print_results(result, plain=args.plain)
        print_peers(result, plain=args.plain)
    if moe_shapes:
        from .bench_run import Timer

        moe = run_moe_bench(moe_shapes, ms=args.m, variants=args.formats, impls=args.impls, check=args.check,
                            timer=Timer(gpu=H.on_gpu(), warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                                        graph_max_m=args.graph_max_m),
                            seed=args.seed, budget_s=args.budget_s, progress=not args.no_progress)
        print_moe_results(moe, plain=args.plain)
        if result is None:
            result = {"tool": "b12x-dual bench", "device": H.device_report(), "results": []}
        result["moe"] = moe
        moe_bad = [r for r in moe["results"] if r.get("error") or (r.get("check") and not r["check"]["ok"])]
        if moe_bad:
            print(f"bench: {len(moe_bad)} MoE rows raised or failed the re-check", file=sys.stderr)
    if args.plot and result.get("ceilings") is not None:
        why = plot(result, args.plot)
        print(why or f"wrote {args.plot}")
        result["plot"] = None if why else args.plot
    if args.json:
        H.write_json(args.json, result)
        print(f"wrote {args.json}")
    bad = [r for r in result["results"] if r["kind"] == "impl" and r.get("check") and not r["check"]["ok"]]
    errors = [r for r in result["results"] if r["kind"] == "impl" and r.get("error")]
    for r in result.get("moe", {}).get("results", []):
        if r["kind"] == "moe_impl" and r.get("check") and not r["check"]["ok"]:
            bad.append(r)
        if r.get("error"):
            errors.append(r)
    if bad or errors:
        print(f"bench: {len(bad)} timed configurations failed the re-check, {len(errors)} raised", file=sys.stderr)
        return 1
    return 0


def main(argv=None, *, extra_backends: Optional[dict[str, H.BackendFactory]] = None) -> int:
    p = argparse.ArgumentParser(prog="b12x-dual bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv), extra_backends=extra_backends)


if __name__ == "__main__":
    sys.exit(main())
