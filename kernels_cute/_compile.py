"""Compile-only checks of kernels_cute's b12x plans for sm_120a / sm_121a on a host without one.

This is the one module that calls b12x private API (PRIVATE_API lists every symbol, including the
``Plan._device`` field that kernels_cute/_common.py sets;
``check_private_api()`` and tests/kernels_cute/test_compile_sm12x.py fail loudly, naming the symbol,
when a b12x release moves one).

How it works (b12x 1.5.1). b12x compiles its kernels in GPU-less worker processes: the worker
initializer ``b12x._lib.compile_pool._initialize_worker`` hides CUDA, fakes ``torch.cuda``'s
capability / properties / stream for a described device, installs an offline Triton driver and sets
CuTe DSL's target arch (sm_120a / sm_121a). Calling it in a fresh process of our own turns that
process into such a worker; after it:

    dev   = b12x.preparation.detect_device()                  (public; returns the described GPU)
    plan  = b12x.gemm.blockscaled.plan(<fmt>.make_query(...)) (public; the plan linear() uses)
    conf  = plan.contract.configure(plan.query, device=dev.identity)   (public contract object)
    jobs  = plan._compile_jobs(config, dev)                   (private: what PreparationSession runs)
    plans = [compile_pool.describe_compilation(j) for j in jobs]      (private)
    compile_pool.compile_in_process(plans)                    (private; PreparationSession with
                                                               compile_workers=0 does the same)

One process holds one offline target (b12x refuses to change it), so each arch gets its own
process; the two arch processes run in parallel. Artifacts go to ``B12X_COMPILE_CACHE_DIR`` as
``<key[:2]>/<key>.o`` (an x86-64 object embedding the cubin and ptxas's option string
``-arch sm_120a``, which ``CompileReport.targets`` reads back).

Run by hand:  python -m kernels_cute._compile --arch sm_120a --fmt nvfp4 --m 1,8 --n 4096 --k 4096
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Iterable, Optional

# (module, attribute path) of every private b12x symbol used here.
PRIVATE_API = (
    ("b12x._lib.compile_pool", "_initialize_worker"),
    ("b12x._lib.compile_pool", "describe_compilation"),
    ("b12x._lib.compile_pool", "compile_in_process"),
    ("b12x._lib.compile_plan", "compiled_program_available"),
    ("b12x.preparation.types", "Plan._compile_jobs"),  # a dataclass field of every Plan
    ("b12x.preparation.types", "Plan._device"),  # set by kernels_cute._common.get_plan (see there)
)

FAKE_UUID = "GPU-00000000-0000-0000-0000-000000000000"


@dataclass(frozen=True)
class Target:
    """A described SM12x GPU: capability, SM count, product name, smem per block / per SM."""

    capability: tuple[int, int]
    sm_count: int
    name: str
    smem_per_block: int = 101_376  # 99 KiB opt-in
    smem_per_sm: int = 102_400


TARGETS = {
    "sm_120a": Target((12, 0), 188, "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"),
    "sm_121a": Target((12, 1), 48, "NVIDIA GB10"),
}


@dataclass
class CompileReport:
    """One compile attempt: which plan, for which target, and what came out.

    variant: "ours" (the plan kernels_cute.<fmt>.linear uses for M rows) or "b12x_default" (the
        plan b12x builds itself when mm_* is called without plan=: capacity next_pow2(M)).
    cap: the plan's row capacity. ok / error: compile result. seconds: plan + compile wall time.
    programs: "<dialect>:<name>" of every compiled program. targets: the -arch found in each CuTe
    artifact. lowering: tile_k / tile shape / split-K b12x chose.
    """

    fmt: str  # a kernels_cute variant ("nvfp4", "nvfp4_w4a16", ...)
    M: int
    N: int
    K: int
    arch: str
    variant: str = "ours"
    cap: int = 0
    ok: bool = False
    error: str = ""
    seconds: float = 0.0
    programs: list = field(default_factory=list)
    targets: list = field(default_factory=list)
    lowering: dict = field(default_factory=dict)


def check_private_api() -> list[str]:
    """The private b12x symbols this module needs that are missing ([] when all are present)."""
    missing = []
    for mod_name, attr in PRIVATE_API:
        try:
            obj = importlib.import_module(mod_name)
        except Exception as e:  # noqa: BLE001
            missing.append(f"{mod_name} ({type(e).__name__}: {e})")
            continue
        head, _, tail = attr.partition(".")
        if not hasattr(obj, head):
            missing.append(f"{mod_name}.{attr}")
            continue
        if tail:
            import dataclasses

            cls = getattr(obj, head)
            names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(dir(cls))
            if tail not in names:
                missing.append(f"{mod_name}.{attr}")
    return missing


# ---------------------------------------------------------------------------------------------
# Child process: one arch
# ---------------------------------------------------------------------------------------------
def _lowering(job) -> dict:
    for arg in job.args:
        if isinstance(arg, dict) and "mma_tiler_mn" in arg:
            return {"tile_k": arg.get("tile_k"), "tile_mn": list(arg["mma_tiler_mn"]),
                    "split_k": arg.get("policy", {}).get("split_k_slices")}
    return {}


def _artifact_arch(key: str) -> str:
    path = Path(os.environ["B12X_COMPILE_CACHE_DIR"]) / key[:2] / f"{key}.o"
    if not path.is_file():
        return "missing"
    found = sorted({m.decode() for m in re.findall(rb"-arch (sm_\d+[af]?)", path.read_bytes())})
    return ",".join(found) or "?"


def _child(arch: str, cells: list[dict]) -> None:
    """Turn this process into a b12x compile worker for ``arch`` and compile every cell; one JSON
    line per cell on stdout."""
    import multiprocessing as mp

    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from b12x._lib import compile_pool as cp

    t = TARGETS[arch]
    cp._initialize_worker(0, t.capability, FAKE_UUID, t.name, t.sm_count, t.smem_per_block, t.smem_per_sm,
                          mp.Array("q", (0, 0)))
    from b12x._lib.compile_plan import compiled_program_available
    from b12x.gemm import blockscaled as bs
    from b12x.preparation import detect_device

    import kernels_cute
    from kernels_cute._common import next_pow2

    dev = detect_device()
    for cell in cells:
        rep = CompileReport(cell["fmt"], cell["M"], cell["N"], cell["K"], arch, cell.get("variant", "ours"))
        t0 = time.perf_counter()
        try:
            mod = kernels_cute.module(rep.fmt)
            rep.cap = (mod.cap_for(rep.M, rep.K) if rep.variant == "ours" else next_pow2(rep.M))
            make_query = kernels_cute.query_maker(rep.fmt)  # fmt may be a W4A16 variant
            plan = bs.plan(make_query(rep.cap, rep.N, rep.K, cell.get("out_dtype", "bfloat16")))
            conf = plan.contract.configure(plan.query, device=dev.identity, override=plan.override)
            config = conf.pinned if conf.pinned is not None else conf.default
            jobs = plan._compile_jobs(config, dev)
            descs = [cp.describe_compilation(j) for j in jobs]
            programs = [pk for d in descs for pk in d.programs]
            rep.lowering = _lowering(jobs[0]) if jobs else {}
            cp.compile_in_process(descs)
            rep.programs = [f"{pk.dialect}:{pk.name}" for pk in programs]
            rep.targets = [_artifact_arch(pk.key) for pk in programs if pk.dialect == "cute"]
            missing = [pk.name for pk in programs if not compiled_program_available(pk)]
            rep.ok = not missing
            rep.error = f"not in the cache after compiling: {missing}" if missing else ""
        except Exception as e:  # noqa: BLE001  (a failed compile is a result, not a crash)
            rep.error = f"{type(e).__name__}: {str(e)[:400]}"
        rep.seconds = round(time.perf_counter() - t0, 3)
        print("REPORT " + json.dumps(asdict(rep)), flush=True)


# ---------------------------------------------------------------------------------------------
# Child process: kernels_cute.moe (b12x's fused MoE)
# ---------------------------------------------------------------------------------------------
def _moe_query(c, nonlinearity: str):
    """The b12x ``MoeDecodeQuery`` that ``b12x.moe.fused_moe.Caps.__post_init__`` builds from the
    Caps ``c`` (b12x 1.5.1 _compat.py; it keeps only the configured result). _moe_child checks that
    lowering this query gives back c's fields, so a b12x change that makes them differ fails."""
    from b12x.moe.fused_moe import _impl
    from b12x.moe.fused_moe._compat import _codec_scalar, _control_snapshot
    from b12x.moe.fused_moe._tuning import MoeDecodeQuery

    w = c.weight_plan
    limit, alpha, beta = _impl._normalize_swiglu_params(w.activation, c.swiglu_limit, c.swiglu_alpha, c.swiglu_beta)
    return MoeDecodeQuery(
        quant_mode=c.quant_mode, quant_modes=tuple(sorted(w.quant_modes)), source_format=w.source_format,
        activation=w.activation, io_dtype=w.io_dtype, num_experts=w.num_experts, hidden_size=w.hidden_size,
        intermediate_size=w.intermediate_size, top_k=c.num_topk, num_tokens=c.max_tokens,
        routed_rows=c.max_tokens * c.num_topk, route_num_experts=c.route_num_experts, route_logits_dtype=None,
        apply_router_weight_on_input=c.apply_router_weight_on_input, collect_activation_amax=c.collect_activation_amax,
        deterministic_output=c.deterministic_output, swiglu_limit=_codec_scalar(limit),
        swiglu_alpha=_codec_scalar(alpha), swiglu_beta=_codec_scalar(beta), w13_layout=w.w13_layout,
        weight_layouts=tuple(sorted(layout.value for layout in w.weight_layouts)),
        w4a16_weight_layout=w.w4a16_weight_layout, w4a16_scale_format=w.w4a16_scale_format,
        w4a16_block_size_m=c.w4a16_block_size_m, fast_math=c.w4a16_fast_math, numerical_recipe=None,
        controls=_control_snapshot())


def _moe_child(arch: str, cells: list[dict]) -> None:
    """Compile, for ``arch``, the b12x programs of the calls kernels_cute.moe.fused_moe makes: per
    cell (variant, activation, M, E, top_k, H, I) the weight plan and Caps of kernels_cute.moe
    (``weight_plan``, ``caps``: what fused_moe plans), then b12x's own compile job for that
    declaration (``b12x.moe.fused_moe._preparation:compile_fused_moe``, what its PreparationSession
    runs in its GPU-less workers), plus its dynamic route-plan jobs. One JSON line per cell."""
    import multiprocessing as mp

    import torch

    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from b12x._lib import compile_pool as cp

    t = TARGETS[arch]
    cp._initialize_worker(0, t.capability, FAKE_UUID, t.name, t.sm_count, t.smem_per_block, t.smem_per_sm,
                          mp.Array("q", (0, 0)))
    from b12x._lib.compile_plan import compiled_program_available
    from b12x._lib.compile_pool import CompileJob
    from b12x.moe.fused_moe import _preparation as prep
    from b12x.moe.fused_moe._tuning import TUNING
    from b12x.preparation import detect_device

    from kernels_cute import moe

    dev = detect_device()
    cuda0 = torch.device("cuda", 0)
    for cell in cells:
        rep = CompileReport(f"moe:{cell['variant']}:{cell['activation']}", cell["M"], cell["H"], cell["I"], arch)
        t0 = time.perf_counter()
        try:
            dtype = getattr(torch, cell.get("dtype", "bfloat16"))
            wp, _, _ = moe.weight_plan(cell["variant"], cell["activation"], dtype, cell["E"], cell["H"], cell["I"])
            recipe = moe.SERVED[cell["variant"]][0]
            nonlin = moe.B12X_ACTIVATION[cell["activation"]]
            c = moe.caps(wp, recipe, nonlin, cuda0, cell["M"], cell["top_k"], moe.SWIGLU_ALPHA, moe.SWIGLU_LIMIT)
            query = _moe_query(c, nonlin)
            config = TUNING.configure(query, device=dev.identity, search=False).default
            if config != c.decode_config:
                raise RuntimeError(f"the rebuilt b12x query configures {config}, fused_moe's Caps {c.decode_config}")
            lowered = prep._lower_caps(query, config, wp, cuda0)
            for f in ("max_tokens", "num_topk", "quant_mode", "core_token_counts", "route_num_experts",
                      "apply_router_weight_on_input", "swiglu_limit", "swiglu_alpha", "swiglu_beta",
                      "w4a16_fast_math", "deterministic_output"):
                if getattr(lowered, f) != getattr(c, f):
                    raise RuntimeError(f"b12x's lowering of the rebuilt query differs from fused_moe's Caps in {f}: "
                                       f"{getattr(lowered, f)!r} vs {getattr(c, f)!r}")
            weight_payload = prep._weight_payload(SimpleNamespace(plan=SimpleNamespace(_impl=wp)))
            jobs = [CompileJob.create("b12x.moe.fused_moe._preparation:compile_fused_moe",
                                      TUNING.encode_query(query), TUNING.encode_config(config), weight_payload,
                                      (cell["E"], cell["E"]), 0)]
            launch_plan = prep.plan_tp_moe_scratch(lowered, prewarm_launches=False).launch_plan
            jobs += [CompileJob.create("b12x.moe.fused_moe._preparation:compile_dynamic_route_plan", payload, 0)
                     for payload in prep._dynamic_route_plan_payloads(launch_plan, lowered)]
            rep.lowering = {"implementation": launch_plan.implementation, "backend": config.backend,
                            "tile_m": launch_plan.execution.tile_m, "jobs": len(jobs)}
            descs = [cp.describe_compilation(j) for j in jobs]
            programs = [pk for d in descs for pk in d.programs]
            cp.compile_in_process(descs)
            rep.programs = [f"{pk.dialect}:{pk.name}" for pk in programs]
            rep.targets = sorted({_artifact_arch(pk.key) for pk in programs if pk.dialect == "cute"})
            missing = [pk.name for pk in programs if not compiled_program_available(pk)]
            rep.ok = bool(programs) and not missing
            rep.error = (f"not in the cache after compiling: {missing}" if missing
                         else "" if programs else "b12x's jobs declared no program")
        except Exception as e:  # noqa: BLE001  (a failed compile is a result, not a crash)
            rep.error = f"{type(e).__name__}: {str(e)[:600]}"
        rep.seconds = round(time.perf_counter() - t0, 3)
        print("REPORT " + json.dumps(asdict(rep)), flush=True)


# ---------------------------------------------------------------------------------------------
# Parent: run one child per arch, in parallel
# ---------------------------------------------------------------------------------------------
def compile_many(cells_by_arch: dict[str, list[dict]], *, cache_dir: Optional[str] = None,
                 timeout: float = 3000.0, moe: bool = False) -> tuple[list[CompileReport], dict[str, float]]:
    """Compile cells for several arches, one subprocess per arch, all at once.

    Args:
        cells_by_arch: arch -> list of {"fmt", "M", "N", "K", optional "variant"}; with ``moe``,
            kernels_cute.moe calls {"variant", "activation", "M", "E", "top_k", "H", "I"} (_moe_child).
        cache_dir: B12X_COMPILE_CACHE_DIR / TRITON_CACHE_DIR parent (a fresh temp dir if None).
    Returns:
        (reports, wall seconds per arch process). RuntimeError with the child's stderr tail when a
        child dies before reporting every cell (e.g. a private symbol moved).
    """
    root = Path(cache_dir or tempfile.mkdtemp(prefix="kernels-cute-compile-"))
    procs = {}
    for arch, cells in cells_by_arch.items():
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", B12X_COMPILE_CACHE_DIR=str(root / "b12x"),
                   TRITON_CACHE_DIR=str(root / "triton"), CUTE_DSL_DUMP_DIR=str(root / "dump"))
        env.pop("TRITON_INTERPRET", None)
        repo = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, "-m", "kernels_cute._compile", "--arch", arch, "--cells", json.dumps(cells)]
        if moe:
            cmd.append("--moe")
        procs[arch] = (time.perf_counter(), subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                                              stderr=subprocess.PIPE, text=True, cwd=repo))
    reports, walls = [], {}
    for arch, (t0, p) in procs.items():
        out, err = p.communicate(timeout=timeout)
        walls[arch] = round(time.perf_counter() - t0, 1)
        got = [CompileReport(**json.loads(line[7:])) for line in out.splitlines() if line.startswith("REPORT ")]
        if len(got) != len(cells_by_arch[arch]):
            raise RuntimeError(f"compile worker for {arch} exited {p.returncode} after {len(got)} of "
                               f"{len(cells_by_arch[arch])} cells; stderr tail:\n{err[-3000:]}")
        reports += got
    return reports, walls


def compile_check(fmt: str, M: int, N: int, K: int, arch: str = "sm_120a", *, variant: str = "ours",
                  cache_dir: Optional[str] = None) -> CompileReport:
    """Compile the plan kernels_cute.<fmt>.linear would use for an M-row call, for ``arch``, in a
    fresh subprocess. Returns its CompileReport (ok=False with the error when it fails)."""
    if arch not in TARGETS:
        raise ValueError(f"arch must be one of {tuple(TARGETS)}, got {arch!r}")
    reports, _ = compile_many({arch: [{"fmt": fmt, "M": M, "N": N, "K": K, "variant": variant}]}, cache_dir=cache_dir)
    return reports[0]


def grid(fmts: Iterable[str], ms: Iterable[int], ns: Iterable[int], ks: Iterable[int]) -> list[dict]:
    return [{"fmt": f, "M": m, "N": n, "K": k} for f in fmts for k in ks for n in ns for m in ms]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_120a", choices=tuple(TARGETS))
    ap.add_argument("--cells", help="JSON list of cells (internal: used by compile_many)")
    ap.add_argument("--fmt", default="nvfp4")
    ap.add_argument("--m", default="1,8,128,2048")
    ap.add_argument("--n", default="4096")
    ap.add_argument("--k", default="4096")
    ap.add_argument("--variant", default="ours", choices=("ours", "b12x_default"))
    ap.add_argument("--moe", action="store_true", help="cells are kernels_cute.moe calls (internal)")
    a = ap.parse_args(argv)
    if a.cells is not None:
        (_moe_child if a.moe else _child)(a.arch, json.loads(a.cells))
        return 0
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    cells = [dict(c, variant=a.variant) for c in grid(a.fmt.split(","), ints(a.m), ints(a.n), ints(a.k))]
    reports, walls = compile_many({a.arch: cells})
    for r in reports:
        print(json.dumps(asdict(r)))
    print(f"# {a.arch}: {sum(r.ok for r in reports)}/{len(reports)} compiled in {walls[a.arch]} s")
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
