"""kernels_triton.hopper: the Triton production kernels for Hopper (sm_90), an implementation of
their own next to the readable lessons of ``kernels_triton``.

sm_90 has no block-scaled MMA, and its wgmma needs 64 rows on the MMA's M side, so the lessons'
kernels (16-row decode tiles, one program per output tile) leave the H200 idle at decode and
re-dequantize every weight tile at prefill. The kernels here are what the H200 runs instead:

    decode (M <= 16)  swapped-operand wgmma GEMMs (the weight on the MMA's M side), the FP4 and
                      MXFP8 weights dequantized in registers (_fp4_decode, _e4m3_decode, _fp8_decode)
    prefill           the TMA-descriptor fp8 kernel (_fp8_prefill), or a dequantizing pre-pass and
                      a bf16 GEMM (_twopass)
    split-K           fp32 partials reduced in a fixed order (_twopass)
    PDL               programmatic dependent launch between the kernels of one linear (_pdl)
    tiles             the sm_90 tile tables (_tiles); TileConfig with split-K and the pre-pass,
                      Route with its launch options (_route)

Each format module ``kernels_triton.hopper.<fmt>`` has ``supported(capability)``,
``route(M, N, K, *, capability, sm_count, ...)`` and ``quantize_activation``/``gemm``/``linear``
with the lessons' arguments. Where it has no kernel of its own for a shape it launches the lesson's;
the lessons never import this package.
"""

from __future__ import annotations

import importlib
from typing import Optional

from formats import FORMAT_NAMES

from .._common import device_capability

SM90 = (9, 0)


def supported(capability: Optional[tuple[int, int]]) -> tuple[bool, str]:
    """(ok, reason): whether the Hopper kernels run on a device of ``capability`` ((major, minor),
    or None for no CUDA device / the interpreter). True only for sm_90: the kernels use wgmma, TMA
    descriptors and sm_90 tile tables."""
    if capability is None:
        return False, "no CUDA device (the Triton interpreter): the Hopper kernels need an sm_90 GPU"
    major, minor = int(capability[0]), int(capability[1])
    if (major, minor) != SM90:
        return False, f"sm_{major}{minor} is not sm_90: the Hopper kernels use wgmma and TMA tiles sized for sm_90"
    return True, "sm_90: wgmma, TMA and the sm_90 tile tables"


def is_sm90(device) -> bool:
    """Whether ``device`` is a Hopper (sm_90) GPU: False on the CPU and under the interpreter
    (device_capability), where the Hopper kernels never run."""
    cap = device_capability(device)
    return cap is not None and cap[0] == 9


def module(fmt: str):
    """The kernels_triton.hopper.<fmt> module; ValueError naming the formats for an unknown one."""
    if fmt not in FORMAT_NAMES:
        raise ValueError(f"fmt must be one of {FORMAT_NAMES}, got {fmt!r}")
    return importlib.import_module(f"{__name__}.{fmt}")
