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
    KBlockCodes           quantize_activation (and so run / apply) adds 1 to every non-zero element code of
                          K-block ``kb`` (one code-width step of its magnitude), in every row: the
                          activation departs first, in that K-block only
    IgnoresRowStride      quantize_activation (and so run / apply) reads x as if its rows were packed (row
                          stride K): right on a contiguous x, wrong from row 1 on for a column slice of
                          a wider tensor (the layout vLLM passes); the activation departs at row 1
    RowsFrom16            gemm and run (hence apply) halve output rows >= 16 in column tile ``tile`` (a second M
                          tile that forgets a step): invisible to calls of at most 16 rows
    TruncatedEpilogue     gemm and run (hence apply) round the fp32 result to bf16 toward zero (the low 16 bits
                          dropped) instead of to nearest even: within the bound, biased toward zero

``only_n`` of the last four is one N or a tuple of them.

MoE faults are real :class:`dispatch.moe.TritonMoE` backends (the lesson's kernels) with one defect,
registered in dispatch.moe's table (:func:`installed_moe`):

    FlippedExpertScale    prepare flips one block-scale byte of one expert's W2 (or W13) in the stacked
                          experts: that expert departs, at its W2 (W13) GEMM
    DropsRenormalize      run ignores ``renormalize``: each expert alone is right, the weighted combine is not
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


def _hits(only_n, n: int) -> bool:
    return only_n is None or n == only_n or (isinstance(only_n, tuple) and n in only_n)


class _QuantizerFault(TritonBackend):
    """run (hence apply) = gemm(quantize_activation(x)), so that a quantizer fault reaches the output too."""

    def run(self, x, prepared, bias=None, **act_opts):
        x2 = x.reshape(-1, x.shape[-1])
        y = self.gemm(self.quantize_activation(x2, **act_opts), prepared, bias, out_dtype=x.dtype)
        return y.reshape(*x.shape[:-1], -1)


class KBlockCodes(_QuantizerFault):
    kb, only_k = 3, None

    def quantize_activation(self, x, **act_opts):
        q = super().quantize_activation(x, **act_opts)
        if self.only_k not in (None, x.shape[-1]):
            return q
        bk = q.block_shape[1]
        d = q.data.clone()
        if d.dtype == torch.uint8:  # e2m1, two codes a byte: columns kb*bk .. of K are bytes kb*bk/2 ..
            cols = slice(self.kb * bk // 2, (self.kb + 1) * bk // 2)
            b = d[:, cols]
            lo, hi = b & 0x0F, b >> 4
            lo = torch.where((lo & 0x7) != 0, (lo & 0x8) | ((lo & 0x7) % 7 + 1), lo)
            hi = torch.where((hi & 0x7) != 0, (hi & 0x8) | ((hi & 0x7) % 7 + 1), hi)
            d[:, cols] = lo | (hi << 4)
        else:  # e4m3: one code a byte
            v = d.view(torch.uint8)[:, self.kb * bk:(self.kb + 1) * bk]
            mag = v & 0x7F
            v.copy_(torch.where((mag != 0) & (mag < 0x7E), v + 1, v))
        return replace(q, data=d)


class IgnoresRowStride(_QuantizerFault):
    def quantize_activation(self, x, **act_opts):
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(0) != x2.shape[1]:  # the bug: stride_xm taken to be K
            x2 = torch.as_strided(x2, x2.shape, (x2.shape[1], 1))
        return super().quantize_activation(x2, **act_opts)


class RowsFrom16(TritonBackend):
    tile, only_n = 0, None

    def _bad(self, y, n):
        y2 = y.reshape(-1, y.shape[-1])
        if _hits(self.only_n, n) and y2.shape[0] > 16:
            y = y.clone()
            y.reshape(-1, y.shape[-1])[16:, self.tile * 128:(self.tile + 1) * 128] *= 0.5
        return y

    def gemm(self, xq, prepared, bias=None, out_dtype=torch.bfloat16):
        return self._bad(super().gemm(xq, prepared, bias, out_dtype), prepared.rows)

    def run(self, x, prepared, bias=None, **act_opts):
        return self._bad(super().run(x, prepared, bias, **act_opts), prepared.rows)


def truncate_to_bf16(y: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16 rounding toward zero: the low 16 bits of each float32 dropped."""
    return (y.contiguous().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


class TruncatedEpilogue(TritonBackend):
    only_n = None

    def gemm(self, xq, prepared, bias=None, out_dtype=torch.bfloat16):
        if not _hits(self.only_n, prepared.rows) or out_dtype != torch.bfloat16:
            return super().gemm(xq, prepared, bias, out_dtype)
        return truncate_to_bf16(super().gemm(xq, prepared, bias, out_dtype=torch.float32))

    def run(self, x, prepared, bias=None, **act_opts):
        x2 = x.reshape(-1, x.shape[-1])
        y = self.gemm(self.quantize_activation(x2, **act_opts), prepared, bias, out_dtype=x.dtype)
        return y.reshape(*x.shape[:-1], -1)


@contextlib.contextmanager
def _installed_in(module, cls, variant: str, fields: dict):
    """Register ``cls(variant)`` (with ``fields`` set on it) as triton:<variant> in ``module``'s table
    (dispatch.registry's or dispatch.moe's: both have _TABLE, entries() and clear_cache()) for the block."""
    table = module._TABLE
    module.entries()  # build the table first
    key = ("triton", variant)
    old = table[key]
    b = cls(variant)
    for k, v in fields.items():
        setattr(b, k, v)
    table[key] = b
    module.clear_cache()
    try:
        yield b
    finally:
        table[key] = old
        module.clear_cache()


def installed(cls, variant: str, **fields):
    """Register ``cls(variant)`` (with ``fields`` set on it) as triton:<variant> for the block."""
    return _installed_in(registry, cls, variant, fields)


# ---------------------------------------------------------------------------------------------
# MoE: a real dispatch.moe.TritonMoE (the lesson's kernels) with one defect, in dispatch.moe's table
# ---------------------------------------------------------------------------------------------
from dispatch import moe as _dmoe  # noqa: E402


class FlippedExpertScale(_dmoe.TritonMoE):
    """prepare returns the stacked experts with one block-scale byte of expert ``expert``'s W2 (or
    W13, ``tensor``) changed at (row ``n``, K-block ``kb``): that expert's W2 GEMM departs in column
    tile n // 128 (W2's rows are the output columns), for every token routed to it whose K-block kb
    is not all zero."""

    expert, tensor, n, kb, only_h = 2, "w2", 5, 1, None

    def prepare(self, w13, w2, *, activation="silu"):
        p = super().prepare(w13, w2, activation=activation)
        if self.only_h is not None and p.hidden != self.only_h:
            return p
        data, block, per = getattr(p, self.tensor)
        block = block.clone()
        v = block.view(torch.uint8)
        v[self.expert, self.n, self.kb] ^= 0x08  # one exponent bit of an e4m3 / the 4th bit of an E8M0 byte
        return replace(p, **{self.tensor: (data, block, per)})


class FlippedExpertScaleOnChip(FlippedExpertScale):
    """FlippedExpertScale in a backend that exposes no steps (stages -> None), as hopper's and cute's
    kernels keep theirs on chip: diff can name the expert, not the step."""

    stages = _dmoe.MoEBackend.stages


class DropsRenormalize(_dmoe.TritonMoE):
    """run (hence apply) ignores ``renormalize`` (a router-weight bug): every expert alone is right
    (one expert per token, weight 1), the call is not: the weighted combine departs."""

    def run(self, x, prepared, topk_ids, topk_weights, **kw):
        return super().run(x, prepared, topk_ids, topk_weights, **{**kw, "renormalize": False})


def installed_moe(cls, variant: str, **fields):
    """Register ``cls(variant)`` (with ``fields`` set on it) as the MoE table's triton:<variant> for the block."""
    return _installed_in(_dmoe, cls, variant, fields)
