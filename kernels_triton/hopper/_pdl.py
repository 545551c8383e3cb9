"""Programmatic dependent launch (PDL) for the kernels of one decode linear.

At decode (M <= 16) a whole linear is a chain of small launches: the activation quantizer's amax
and quantize kernels, the GEMM, and split-K's reduction. In a CUDA graph each of them still costs
a few microseconds of launch latency and grid ramp before its first load. Hopper (sm_90) and later
let a kernel launched with the programmatic-stream-serialization attribute start while its
predecessor in the stream is still running: the predecessor's programs signal
``griddepcontrol.launch_dependents`` once their main loop is done, the next grid is scheduled onto
the SMs they free, and its programs block in ``griddepcontrol.wait`` until the predecessor has
completed and its memory is visible.

Why this cannot change a result: every chain kernel calls ``pdl_wait`` in every program before its
first global load or store (only index arithmetic comes before it), and that wait returns only
after the whole predecessor grid has finished with its writes flushed. So no kernel's memory
accesses overlap its predecessor's, and as the predecessor itself waited for its own predecessor
before touching memory, the order holds down the whole chain (quantize -> GEMM -> reduce -> the
next linear's quantize). What overlaps is the launch and the programs' start-up, nothing that reads
or writes memory; the arithmetic, and so every bit of the output, is the same as without PDL.
A kernel launched without the attribute (torch's, cuBLAS, b12x's) waits for its predecessor as
usual, whatever the predecessor signalled, and a chain kernel after it simply starts when it ends.
The rule for a new kernel: launch it with ``**pdl_launch(device)`` only if every program calls
``pdl_wait(USE_PDL)`` before its first global load or store.

``B12X_PDL=0`` turns it off (default: on where it applies). Under the interpreter, on CPU tensors
and on GPUs older than sm_90 it never applies: ``USE_PDL`` is False, the branches below are never
taken, and ``tl.extra.cuda`` is never reached.

Source: CUDA C++ Programming Guide, "Programmatic Dependent Launch and Synchronization"; PTX ISA,
``griddepcontrol``; Triton's ``tl.extra.cuda.gdc_wait`` / ``gdc_launch_dependents`` and its
``launch_pdl`` launch option (python/tutorials/11-programmatic-dependent-launch.py).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from .._common import device_capability

PDL_ENV = "B12X_PDL"
PDL_VALUES = ("", "0", "1")  # "" (unset) and "1": on where it applies; "0": off


def pdl_enabled(device) -> bool:
    """Whether the chain kernels launch with PDL on ``device`` (a torch device or a string): a CUDA
    device of capability >= 9 (sm_90 Hopper, SM12x), not under the interpreter, ``B12X_PDL`` not 0.

    Raises:
        ValueError: ``B12X_PDL`` set to something other than 0 or 1 (naming the variable, the value
            and what is allowed).
    """
    value = os.environ.get(PDL_ENV, "").strip()
    if value not in PDL_VALUES:
        raise ValueError(f"{PDL_ENV}={value!r} is not allowed; allowed: 0 (off) or 1 / unset (on where it applies)")
    if value == "0":
        return False
    cap = device_capability(device)  # None on CPU and under the interpreter
    return cap is not None and cap[0] >= 9


def pdl_launch(device) -> dict:
    """The keyword arguments a chain kernel's launch adds: its ``USE_PDL`` constexpr and Triton's
    ``launch_pdl`` option, both ``pdl_enabled(device)`` (the interpreter ignores ``launch_pdl``)."""
    on = pdl_enabled(device)
    return {"USE_PDL": on, "launch_pdl": on}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Block until the predecessor grid has completed and its writes are visible (PDL only)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_launch_dependents(USE_PDL: tl.constexpr):
    """Let the next grid in the stream be scheduled once every program has called this (PDL only)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
