"""Compile-only sm_90 builds for the hopper tests, with no GPU: a script or tool run in a child
process with the Triton interpreter off, so that Triton really compiles for GPUTarget("cuda", 90, 32)
and the test reads the PTX counts the child writes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # this checkout: its packages, not another install's

PRELUDE = r'''
import json, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
T = GPUTarget("cuda", 90, 32)
i32 = lambda names: {n: "i32" for n in names.split()}
def build(fn, sig, ce, **opt):
    k = triton.compile(ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in ce}}, constexprs=ce),
                       target=T, options=opt)
    ptx = k.asm["ptx"]
    return {"wgmma": ptx.count("wgmma.mma_async"), "tma": ptx.count("cp.async.bulk.tensor"),
            "pdl": ptx.count("griddepcontrol"), "bf16": ptx.count(".bf16"), "shared": k.metadata.shared}
rows = {}
'''
"""The start of a build script (then ``rows[name] = build(kernel, signature, constexprs, **options)``
lines, then ``json.dump(rows, open(sys.argv[1], "w"))``): ``build`` compiles one kernel for sm_90 and
counts its PTX's wgmma, TMA copies, griddepcontrol (PDL) and .bf16 instructions and its shared memory."""


def run_sm90_build(argv: list, tmp_path: Path, *, timeout: int = 600) -> None:
    """Run ``python *argv`` in this checkout with TRITON_INTERPRET=0, a fresh Triton cache under
    ``tmp_path`` and the checkout first on PYTHONPATH; asserts it exits 0 (showing its stderr tail)."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, *map(str, argv)], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
