"""Faults injected into one real backend, for the tests of ``b12x-dual diff`` and the watchdog.

Each class is a real :class:`dispatch.backends.TritonBackend` (the Triton kernels run: the
interpreter on the CPU) with one deliberate defect, registered in the registry's table in place
of ``triton:<variant>`` for one test (:func:`installed`). A defect applies only to weights with
``only_n`` rows (activations with ``only_k`` columns), so that one layer of a model is wrong and the
others are not:

    FlippedWeightScale    prepare returns a copy of the weight with one block-scale byte changed
                          (row ``n``, K-block ``kb``): the GEMM departs in column tile n // 128
    FlippedActivationScale  quantize_activation (and so run, hence apply) changes one activation block-scale
                          byte (row ``m``, K-block ``kb``): the activation quantization departs first
    ScaledRow             gemm and run (hence apply) multiply output row ``m`` by 1.5: the GEMM departs in row m
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from dispatch import registry
from dispatch.backends import TritonBackend


def _flip_scale(q, row: int, kb: int):
    s = q.scale.clone()
    v = s.view(torch.uint8)
    v[row, kb] = v[row, kb] ^ 0x08  # one exponent bit of an e4m3 / the 4th bit of an E8M0 byte
    return replace(q, scale=s)


class FlippedWeightScale(TritonBackend):
    n, kb, only_n = 130, 1, None

    def prepare(self, qweight, into=None):
        q = super().prepare(qweight, into)
        if self.only_n is not None and q.rows != self.only_n:
            return q
        return _flip_scale(q, self.n, self.kb)


class FlippedActivationScale(TritonBackend):
    m, kb, only_k = 2, 1, None

    def quantize_activation(self, x, **act_opts):
        q = super().quantize_activation(x, **act_opts)
        return q if self.only_k not in (None, x.shape[-1]) else _flip_scale(q, self.m, self.kb)

    def run(self, x, prepared, bias=None, **act_opts):
        x2 = x.reshape(-1, x.shape[-1])
        y = self.gemm(self.quantize_activation(x2, **act_opts), prepared, bias, out_dtype=x.dtype)
        return y.reshape(*x.shape[:-1], -1)


class ScaledRow(TritonBackend):
    m, only_n = 3, None

    def _bad(self, y, prepared):
        if (self.only_n is None or prepared.rows == self.only_n) and y.reshape(-1, y.shape[-1]).shape[0] > self.m:
            y = y.clone()
            y.reshape(-1, y.shape[-1])[self.m] *= 1.5
        return y

    def gemm(self, xq, prepared, bias=None, out_dtype=torch.bfloat16):
        return self._bad(super().gemm(xq, prepared, bias, out_dtype), prepared)

    def run(self, x, prepared, bias=None, **act_opts):
        return self._bad(super().run(x, prepared, bias, **act_opts), prepared)


@contextlib.contextmanager
def installed(cls, variant: str, **fields):
    """Register ``cls(variant)`` (with ``fields`` set on it) as triton:<variant> for the block."""
    table = registry._TABLE
    registry.entries()  # build the table first
    key = ("triton", variant)
    old = table[key]
    b = cls(variant)
    for k, v in fields.items():
        setattr(b, k, v)
    table[key] = b
    registry.clear_cache()
    try:
        yield b
    finally:
        table[key] = old
        registry.clear_cache()
