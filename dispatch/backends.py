"""The four implementations as registry backends: reference (the formats/ oracle), triton (the
readable kernels of kernels_triton), hopper (kernels_triton.hopper, the sm_90 production kernels)
and cute (kernels_cute over b12x).

Each class serves every variant of its implementation; :func:`make` builds the table cell for one
(impl, variant), an :class:`~dispatch.contract.UnsupportedEntry` where an implementation has no
kernel for a variant. The verbs are those of :class:`~dispatch.contract.Backend`: ``apply``
validates and runs; ``run``, what each class here implements, is the trusted path that calls the
kernel module's ``linear_unchecked`` (its ``linear`` minus the argument checks). The kernel
packages are imported where a verb first needs them; b12x and CuTe DSL load on the first verb that
needs them: building the table imports kernels_cute's adapters (torch and formats only, to learn
what they serve) and nothing of b12x.
"""

from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass
from typing import Optional

import torch

from formats import QuantizedTensor, quantize, reference_linear, spec
from formats.validate import check_weight

from .contract import Backend, ImplementationUnavailable, Problem, UnsupportedEntry
from .devices import CPU, DeviceInfo, current_device, interpreting
from .contract import variant as _variant

from kernels_triton import Route, record_launches  # noqa: F401  (re-exported for tests and apps)

INSTALL_CUTE = "pip install 'b12x-dual[cute]'"

MXFP8_W8A16_GPU_RAN = True
"""Whether kernels_triton.hopper.mxfp8's W8A16 route (linear(a16=True)) has passed its tests on an
sm_90 GPU: True since its tests (tests/kernels_triton/hopper/test_hopper_mxfp8_w8a16.py) and
tools/probes/hopper_mxfp8_w8a16_gpu.py passed on the H200 (docs/results.md, 2026-12-05, third
session). False makes the (hopper, mxfp8_w8a16) cell a named gap again (``triton_gap``: written, not
yet run on a GPU; sm_90 then serves mxfp8_w8a16 with the lesson): the switch a new sm_90 route starts
behind."""


def _dtype_ok(problem: Problem, allowed) -> tuple[bool, str]:
    if problem.dtype in allowed:
        return True, ""
    names = ", ".join(str(d).replace("torch.", "") for d in allowed)
    return False, f"activation dtype must be one of {names}, got {str(problem.dtype).replace('torch.', '')}"


def _k_ok(problem: Problem) -> tuple[bool, str]:
    mult = spec(problem.fmt).k_multiple
    if problem.K <= 0 or problem.K % mult:
        return False, f"{problem.fmt} needs K to be a positive multiple of {mult}, got K={problem.K}"
    if problem.M < 0 or problem.N <= 0:
        return False, f"M must be >= 0 and N > 0, got M={problem.M} N={problem.N}"
    return True, ""


def _layout(q: QuantizedTensor) -> str:
    """'nvfp4 (128, 256), scale_layout linear: data uint8 (128, 128), scale float8_e4m3fn (128, 16), ...'"""
    parts = [f"{k} {str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}" for k, t in q.tensors().items()]
    return f"{q.fmt} {q.shape}, scale_layout {q.scale_layout}: " + ", ".join(parts)


def copy_quantized_into(into: QuantizedTensor, new: QuantizedTensor) -> QuantizedTensor:
    """Copy ``new``'s tensors into ``into``'s storage (same format, shape, tensor dtypes and shapes)
    and return ``into``: a reload that keeps every data_ptr().

    Raises:
        ValueError: ``into`` is not a weight QuantizedTensor; its layout differs from ``new``'s (the
            message gives both layouts: format, shape, scale layout and each tensor's dtype and
            shape); its storage is on the meta device (a copy there would go nowhere).
    """
    if not isinstance(into, QuantizedTensor):
        raise ValueError(f"into= must be a {new.fmt} weight QuantizedTensor prepared earlier, "
                         f"got {type(into).__name__}")
    a, b = into.tensors(), new.tensors()
    if (into.fmt, into.shape, into.scale_layout) != (new.fmt, new.shape, new.scale_layout) or a.keys() != b.keys() or any(
            a[k].shape != b[k].shape or a[k].dtype != b[k].dtype for k in a):
        raise ValueError(f"into= must be a {new.fmt} weight of shape {new.shape} with the same tensor layout "
                         f"({_layout(new)}), got {_layout(into)}")
    meta = [k for k, t in a.items() if t.is_meta]
    if meta:
        raise ValueError(f"into= has storage on the meta device ({', '.join(meta)}): the new weight would go "
                         "nowhere; prepare into a materialized weight (cpu or cuda)")
    with torch.no_grad():
        for k in a:
            if a[k].data_ptr() != b[k].data_ptr():
                a[k].copy_(b[k])
    return into


# ---------------------------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------------------------
class ReferenceBackend(Backend):
    """The formats/ oracle: dequantize both operands, float64 matmul, one rounding."""

    impl = "reference"
    extra_options = ("out_dtype",)

    def is_supported(self, device: DeviceInfo) -> tuple[bool, str]:
        return True, "the formats/ oracle runs on every device"

    def can_implement(self, problem: Problem) -> tuple[bool, str]:
        for ok, why in (_dtype_ok(problem, self.act_dtypes), _k_ok(problem)):
            if not ok:
                return False, f"reference: {why}"
        return True, "float64 oracle (formats.reference_linear)"

    def route(self, problem: Problem, device: DeviceInfo, **act_opts) -> Route:
        return Route("reference", (), "", 1, "formats.reference_linear: dequantize both operands, float64 matmul, "
                     "one rounding (torch on the host or device, no kernel of ours)")

    def prepare(self, qweight, into=None):
        check_weight(qweight, self.fmt)
        return qweight if into is None else copy_quantized_into(into, qweight)

    def run(self, x, prepared, bias=None, **act_opts):
        return reference_linear(x, prepared, bias, a16=self.a16, **act_opts)

    def quantize_activation(self, x, **act_opts):
        return quantize(x, self.fmt, role="activation", **act_opts)

    def gemm(self, xq, prepared, bias=None, out_dtype=torch.bfloat16):
        return reference_linear(xq, prepared, bias, out_dtype=out_dtype)


STATIC_SCALE_OPTIONS = ("scale", "global_scale")
"""Activation options that replace the dynamic (amax) activation scale by a static one."""


@functools.lru_cache(maxsize=None)
def _route_parameters(mod) -> frozenset[str]:
    return frozenset(inspect.signature(mod.route).parameters)


def check_call(backend: Backend, x, prepared, bias) -> None:
    """The old name of ``backend.validate_call(x, prepared, bias, {})`` (x and bias as
    formats.validate says), kept for one release (docs/dispatch.md)."""
    backend.validate_call(x, prepared, bias, {})


def _linear_unchecked(mod):
    """A kernel module's trusted entry: ``linear_unchecked`` (its ``linear`` minus the argument
    checks, for a caller that validated them), or ``linear`` where the module has none yet."""
    return getattr(mod, "linear_unchecked", mod.linear)


class _KernelBackend(Backend):
    """What the two kernel packages' backends share: each format module has linear (with
    ``a16=True`` for W4A16) and its trusted twin linear_unchecked, quantize_activation and gemm."""

    def _module(self):
        raise NotImplementedError

    def _run_linear(self, mod, x, prepared, bias, act_opts):
        linear = _linear_unchecked(mod)
        if self.a16:
            return linear(x, prepared, bias, a16=True, **act_opts)
        return linear(x, prepared, bias, **act_opts)

    def quantize_activation(self, x, **act_opts):
        self.validate_device(x)
        return self._module().quantize_activation(x, **act_opts)

    def gemm(self, xq, prepared, bias=None, out_dtype=torch.bfloat16):
        self.validate_device(xq.data)
        return self._module().gemm(xq, prepared, bias, out_dtype=out_dtype)

    def validate_device(self, x: torch.Tensor) -> None:
        """Raise before any kernel when ``x`` lives where this backend's kernels cannot run (the
        Triton backends check; b12x checks its own operands)."""

    def check_tensor_device(self, x: torch.Tensor) -> None:
        """The old name of :meth:`validate_device`, kept for one release (docs/dispatch.md)."""
        self.validate_device(x)

    @staticmethod
    def _route_args(device: DeviceInfo) -> dict:
        """The device's part of a kernel module's route(): capability (None: the CPU interpreter) and SMs."""
        if device.kind == "cpu":
            return {"capability": None, "sm_count": 1}
        return {"capability": tuple(device.capability), "sm_count": max(int(device.sm_count), 1)}

    def route(self, problem: Problem, device: DeviceInfo, **act_opts) -> Route:
        """The kernel module's own ``route(M, N, K, capability=, sm_count=, a16=)`` (what its linear
        executes), with the device's capability and SM count; where the module's route takes them,
        ``x_dtype`` (the problem's dtype), the activation options by name (a static fp8_tensor
        ``scale`` or nvfp4 ``global_scale`` drops the amax kernel), or ``dynamic_scale`` (False
        when ``act_opts`` hold a static scale)."""
        mod = self._module()
        kw = self._route_args(device)
        if self.a16:
            kw["a16"] = True
        takes = _route_parameters(mod)
        if "x_dtype" in takes:
            kw["x_dtype"] = problem.dtype
        kw.update({k: v for k, v in act_opts.items() if k in takes and k not in kw})
        if "dynamic_scale" in takes:
            kw["dynamic_scale"] = all(act_opts.get(k) is None for k in STATIC_SCALE_OPTIONS)
        return mod.route(problem.M, problem.N, problem.K, **kw)


# ---------------------------------------------------------------------------------------------
# triton
# ---------------------------------------------------------------------------------------------
def _present(package, fmt: str) -> bool:
    """Whether ``package`` (kernels_triton or kernels_triton.hopper) has a module for ``fmt``: its
    ``module(fmt)`` imports; only the absence of that very module reads as "not present"."""
    try:
        package.module(fmt)
    except ModuleNotFoundError as e:
        if e.name != f"{package.__name__}.{fmt}":
            raise
        return False
    return True


@functools.lru_cache(maxsize=None)
def _triton_module_present(fmt: str) -> bool:
    import kernels_triton

    return _present(kernels_triton, fmt)


class TritonBackend(_KernelBackend):
    """kernels_triton.<fmt>: any CUDA GPU, and CPU tensors through Triton's interpreter."""

    impl = "triton"

    def _module(self):
        import kernels_triton

        return kernels_triton.module(self.fmt)

    def is_supported(self, device: DeviceInfo) -> tuple[bool, str]:
        if not _triton_module_present(self.fmt):
            return False, f"kernels_triton.{self.fmt} is not in this installation"
        if device.kind == "cpu":
            import kernels_triton  # noqa: F401  (sets TRITON_INTERPRET=1 when there is no GPU)

            if not interpreting():
                value = os.environ.get("TRITON_INTERPRET", "")
                return False, (f"CPU tensors need Triton's interpreter but TRITON_INTERPRET={value!r}; set "
                               "TRITON_INTERPRET=1 before kernels_triton is imported, or move the inputs to the GPU")
            return True, "Triton interpreter on CPU (TRITON_INTERPRET=1)"
        return True, f"Triton kernels on {device.arch}"

    def can_implement(self, problem: Problem) -> tuple[bool, str]:
        for ok, why in (_dtype_ok(problem, self.act_dtypes), _k_ok(problem)):
            if not ok:
                return False, f"triton: {why}"
        mode = (" W4A16" if spec(self.fmt).element == "e2m1" else " W8A16") if self.a16 else ""
        return True, f"kernels_triton.{self.fmt}{mode}"

    def validate_device(self, x: torch.Tensor) -> None:
        """ImplementationUnavailable (naming this implementation, the device and why) when ``x``
        lives where these kernels cannot run: CPU tensors without Triton's interpreter (a GPU
        machine), or CUDA tensors while the interpreter is on. Checked before any kernel, so Triton's
        "Pointer argument cannot be accessed from Triton" never reaches the caller."""
        if not isinstance(x, torch.Tensor):
            return
        on_cpu = x.device.type == "cpu"
        if on_cpu and not interpreting():
            ok, why = self.is_supported(CPU)
            raise ImplementationUnavailable(self.impl, CPU, why if not ok else
                                            "the tensors are on the CPU and Triton's interpreter is off")
        if not on_cpu and interpreting():
            raise ImplementationUnavailable(self.impl, current_device(x.device), (
                f"Triton's interpreter is on (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}), so the "
                f"kernels take CPU tensors only; got a tensor on {x.device}: unset TRITON_INTERPRET or move the "
                "inputs to the CPU"))

    def prepare(self, qweight, into=None):
        check_weight(qweight, self.fmt)
        return qweight if into is None else copy_quantized_into(into, qweight)

    def run(self, x, prepared, bias=None, **act_opts):
        self.validate_device(x)  # where x lives, not what it is: the door cannot know the interpreter's state
        return self._run_linear(self._module(), x, prepared, bias, act_opts)

    def _tiles(self, M: int, N: int, K: int, device: DeviceInfo) -> dict:
        """The tuned tiles of a call on ``device`` (kernels_triton.tuning: the SM12x tables, the
        quantizer's decode tile), as the lessons' ``tile=`` / ``quant_tile=``; {} on the CPU."""
        from kernels_triton import tuning

        return tuning.tiles(self.fmt, M, N, K, capability=self._route_args(device)["capability"], a16=self.a16)

    def route(self, problem: Problem, device: DeviceInfo, **act_opts) -> Route:
        return super().route(problem, device, **act_opts, **self._tiles(problem.M, problem.N, problem.K, device))

    def _run_linear(self, mod, x, prepared, bias, act_opts):
        n, k = prepared.shape
        return super()._run_linear(mod, x, prepared, bias, {**act_opts, **self._tiles(x.numel() // k, n, k,
                                                                                       current_device(x.device))})

    def gemm(self, xq, prepared, bias=None, out_dtype=torch.bfloat16):
        self.validate_device(xq.data)
        tile = self._tiles(xq.rows, *prepared.shape, current_device(xq.device)).get("tile")
        return self._module().gemm(xq, prepared, bias, out_dtype=out_dtype, **({"tile": tile} if tile else {}))


# ---------------------------------------------------------------------------------------------
# hopper
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _hopper_module_present(fmt: str) -> bool:
    from kernels_triton import hopper

    return _present(hopper, fmt)


class HopperBackend(TritonBackend):
    """kernels_triton.hopper.<fmt>: the sm_90 production kernels (swapped-wgmma decode GEMMs for
    M <= 16, the TMA prefill, split-K, PDL), on sm_90 only; W4A16 / W8A16 through ``linear(a16=True)``."""

    impl = "hopper"

    def _module(self):
        from kernels_triton import hopper

        return hopper.module(self.fmt)

    def _tiles(self, M: int, N: int, K: int, device: DeviceInfo) -> dict:
        return {}  # the hopper modules choose their own sm_90 tiles

    def is_supported(self, device: DeviceInfo) -> tuple[bool, str]:
        if device.kind == "cpu":
            return False, "hopper needs an sm_90 GPU; this call runs on the CPU"
        if not device.is_sm90:
            return False, f"hopper needs an sm_90 GPU; {device.name} is {device.arch}"
        if not _hopper_module_present(self.fmt):
            return False, f"kernels_triton.hopper.{self.fmt} is not in this installation"
        ok, why = self._module().supported(tuple(device.capability))
        return ok, why

    def can_implement(self, problem: Problem) -> tuple[bool, str]:
        for ok, why in (_dtype_ok(problem, self.act_dtypes), _k_ok(problem)):
            if not ok:
                return False, f"hopper: {why}"
        mode = (" W4A16" if spec(self.fmt).element == "e2m1" else " W8A16") if self.a16 else ""
        return True, f"kernels_triton.hopper.{self.fmt}{mode}"


# ---------------------------------------------------------------------------------------------
# cute
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class B12xProbe:
    """Result of importing b12x once: the module (None if absent), its version, the import error."""

    module: object
    version: Optional[str]
    error: Optional[str]


@functools.lru_cache(maxsize=1)
def b12x_probe() -> B12xProbe:
    """Import b12x lazily, once (importing it pulls in CuTe DSL; nothing else here needs it)."""
    try:
        import b12x as mod
    except Exception as e:  # noqa: BLE001  (any import failure means "not usable", with the reason)
        return B12xProbe(None, None, f"{type(e).__name__}: {e}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("b12x")
    except PackageNotFoundError:
        ver = getattr(mod, "__version__", "?")
    return B12xProbe(mod, ver, None)


def _is_running_device(device: DeviceInfo) -> bool:
    return device.kind == "cuda" and torch.cuda.is_available() and current_device() == device


class CuteBackend(_KernelBackend):
    """kernels_cute.<fmt>: b12x's CuTe DSL GEMMs on SM120/SM121 with our CuTe DSL quantizers.

    ``apply(..., quantizer="triton")`` composes the Triton activation quantizer with the CuTe GEMM
    (for debugging a mismatch between the two paths: same GEMM, other quantizer).
    """

    impl = "cute"
    extra_options = ("quantizer",)

    def _module(self):
        import kernels_cute

        return kernels_cute.module(self.fmt)

    def is_supported(self, device: DeviceInfo) -> tuple[bool, str]:
        if device.kind == "cpu":
            return False, "cute needs an SM120/SM121 GPU; this call runs on the CPU"
        if not device.is_sm12x:
            return False, f"cute needs an SM120/SM121 GPU; {device.name} is {device.arch}"
        probe = b12x_probe()
        if probe.module is None:
            return False, f"b12x is not installed ({probe.error}); install it with: {INSTALL_CUTE}"
        import kernels_cute
        from kernels_cute import _common

        err = _common.b12x_import_error()  # b12x's GEMMs need CuTe DSL
        if err:
            return False, err
        if _is_running_device(device):
            ok, why = kernels_cute.device_gate(self.variant)
            if not ok:
                return False, why
            return True, f"b12x {probe.version} supports {device.arch}"
        return True, f"b12x {probe.version} targets {device.arch} (described device, not probed)"

    def can_implement(self, problem: Problem) -> tuple[bool, str]:
        ok, why = _dtype_ok(problem, self.act_dtypes)
        if not ok:
            return False, f"cute: {why}"
        mod = self._module()
        if self.a16:
            return mod.supported(problem.M, problem.N, problem.K, a16=True, dtype=problem.dtype)
        return mod.supported(problem.M, problem.N, problem.K)

    def route(self, problem: Problem, device: DeviceInfo, *, quantizer: str = "cute", **act_opts) -> Route:
        """What kernels_cute says its linear launches (``kernels_cute.route``: our CuTe DSL
        quantizer, then the b12x function the format module calls); b12x picks the tile in its plan."""
        import kernels_cute

        kernels, tile, why = kernels_cute.route(self.variant, problem.M, problem.N, problem.K, quantizer=quantizer)
        return Route("cute", kernels, tile, 1, why)

    def prepare(self, qweight, into=None):
        check_weight(qweight, self.fmt)
        return self._module().prepare_weight(qweight, into=into, a16=self.a16)

    def validate_options(self, opts: dict) -> None:
        """The base check (names), then ``quantizer``'s value: "cute", or "triton" where there is
        an activation to quantize (W4A4 / W8A8)."""
        super().validate_options(opts)
        quantizer = opts.get("quantizer", "cute")
        if quantizer not in ("cute", "triton") or (quantizer == "triton" and self.a16):
            allowed = "'cute' (W4A16 quantizes no activation)" if self.a16 else "'cute' or 'triton'"
            raise ValueError(f"{self.name}: quantizer must be {allowed}, got {quantizer!r}")

    def run(self, x, prepared, bias=None, *, quantizer: str = "cute", **act_opts):
        mod = self._module()
        if quantizer == "triton" and not self.a16:
            import kernels_triton
            from kernels_triton import tuning

            x2 = x.reshape(-1, x.shape[-1])
            xq = kernels_triton.module(self.fmt).quantize_activation(
                x2, quant_tile=tuning.quant_tile(self.fmt, *x2.shape), **act_opts)
            y = mod.gemm(xq, prepared, bias, out_dtype=x.dtype)
            return y.reshape(*x.shape[:-1], y.shape[-1])
        return self._run_linear(mod, x, prepared, bias, act_opts)


_CLASSES = {"reference": ReferenceBackend, "triton": TritonBackend, "hopper": HopperBackend, "cute": CuteBackend}


def triton_gap(impl: str, variant: str) -> Optional[str]:
    """Why a Triton implementation ("triton", "hopper") has no kernel for ``variant``, or None: the
    hopper module of its format is not in this installation (sm_90 then runs the lesson), the
    module's route refuses ``a16=True`` (no weight-only path there yet), or the path is written but
    not yet run on a GPU (hopper's mxfp8_w8a16 while MXFP8_W8A16_GPU_RAN is False). Read from the
    modules themselves (a pure route() call), so a path that lands lifts the gap without an edit
    here, once it has run on a GPU."""
    v = _variant(variant)
    if impl == "hopper" and not _hopper_module_present(v.fmt):
        return (f"kernels_triton.hopper.{v.fmt} is not in this installation: on sm_90 {variant} runs the "
                f"lesson (kernels_triton.{v.fmt})")
    if not v.a16:
        return None
    if impl == "hopper" and variant == "mxfp8_w8a16" and not MXFP8_W8A16_GPU_RAN:
        return ("kernels_triton.hopper.mxfp8 W8A16 is written, not yet run on a GPU (dispatch.backends."
                "MXFP8_W8A16_GPU_RAN is False): on sm_90 mxfp8_w8a16 runs the lesson (kernels_triton.mxfp8)")
    import kernels_triton
    from kernels_triton import hopper

    mod, where = (hopper.module(v.fmt), (9, 0)) if impl == "hopper" else (kernels_triton.module(v.fmt), None)
    try:
        mod.route(1, 8, spec(v.fmt).k_multiple, capability=where, sm_count=1, a16=True)
    except ValueError as e:
        return f"{mod.__name__} has no weight-only path for {variant} yet (its route refuses a16=True: {e})"
    return None


def make(impl: str, variant: str):
    """The table cell of (impl, variant): a Backend, or an UnsupportedEntry with its reason (cute:
    what kernels_cute says it has no kernel for, e.g. b12x has no MXFP4 W4A16 GEMM; triton and
    hopper: triton_gap's reason)."""
    if impl == "cute":
        import kernels_cute

        why = kernels_cute.not_served(variant)
        if why is not None:
            return UnsupportedEntry(impl, variant, why)
    if impl in ("triton", "hopper"):
        why = triton_gap(impl, variant)
        if why is not None:
            return UnsupportedEntry(impl, variant, why)
    return _CLASSES[impl](variant)


__all__ = ["B12xProbe", "CuteBackend", "HopperBackend", "ReferenceBackend", "Route", "TritonBackend", "b12x_probe",
           "check_call", "copy_quantized_into", "make", "record_launches"]
