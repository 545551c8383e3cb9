"""Per-channel FP8 (fp8_channel) on SM120/SM121: not served by kernels_cute, and why.

**Strategy.** None: b12x 1.5.1 has no GEMM that applies one fp32 scale per weight row (output
channel) and one per activation row (token), which is what fp8_channel's epilogue is
(formats/fp8_channel.py: ``y = (xq . wq^T) * sx[m] * sw[n]``). What b12x has, and why none fits
exactly:

    blockscaled.pack_weight(w, scale)    tensor_fp8: ONE fp32 scale (the combined in*w scale);
                                         mxfp8: E8M0 (power-of-two) scales per 32 elements
    blockscaled.mm_block_fp8             fp32 weight scales per 128x128 block (rows share a scale)
    FixedBlockscaledQuery.alpha_mode     "unit" or "tensor" (one scalar alpha)
    _lib/dense_gemm row_scale            an (M,) epilogue scale, wired for the MX-FP6 path only

Applying sw[n] after b12x's bf16 output would round twice (b12x writes bf16/fp16 only), outside
the one-rounding bound every implementation here is held to (formats/bounds.py).

So the registry's cute cell for fp8_channel is an UnsupportedEntry carrying :data:`UNSUPPORTED`,
and auto on SM12x serves fp8_channel with the readable Triton kernels (kernels_triton.fp8_channel,
whose native path is the same full-rate block-scaled MMA with unit scales and a per-row/per-column
fp32 epilogue).

**References.** formats/fp8_channel.py; b12x/gemm/blockscaled/_linear.py::pack_weight,
api.py::mm_block_fp8, _tuning.py::FixedBlockscaledQuery; b12x/_lib/dense_gemm.py (row_scale).
"""

FMT = "fp8_channel"
UNSUPPORTED = ("b12x 1.5.1 has no per-channel FP8 GEMM: pack_weight takes one fp32 tensor scale (tensor_fp8) or "
               "E8M0 blocks (mxfp8), mm_block_fp8 one fp32 scale per 128x128 weight block, alpha_mode is 'unit' or "
               "one 'tensor' scalar, and the dense engine's row_scale is wired for MX-FP6 only; fp8_channel runs on "
               "Triton")
