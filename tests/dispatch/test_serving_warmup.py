"""No compile while serving: after the vLLM plugin's warmup (dispatch/vllm_plugin/warmup.py), calls
of any token count M up to max_num_batched_tokens compile nothing.

On the CPU nothing compiles (Triton's interpreter, torch), so the guarantee is checked there as a
policy: for M = 1..max_tokens, every (GEMM tile, activation-quantizer tile, Triton specialization
of M) the kernel modules' tile functions pick is one that warmup runs. On a GPU, warmup runs and
then Triton's post-compile hook and b12x's kernel-resolution guard count real compiles while the
plugin's op serves prompts of varied lengths: zero.
"""

from __future__ import annotations

import types

import pytest
import torch

import dispatch  # noqa: F401  (sets TRITON_INTERPRET before triton is imported, without a GPU)
import formats
import kernels_triton
from conftest import DEVICE, device_name, make_input
from dispatch import contract, registry
from dispatch.devices import current_device
from dispatch.vllm_plugin import ops, warmup
from kernels_triton import interpreting
from dispatch.devices import KNOWN_DEVICES
from kernels_triton import tuning
from kernels_triton._common import device_capability


def _served_by(impl: str) -> tuple[str, ...]:
    """The variants ``impl`` has a backend for in the registry (not a named gap: mxfp8_w8a16 on
    hopper)."""
    return tuple(v for v in contract.VARIANTS if not isinstance(registry.entries()[(impl, v)], registry.UnsupportedEntry))


VARIANTS = _served_by("triton")
HOPPER_VARIANTS = _served_by("hopper")
SHAPES = ((1024, 2048), (384, 1536))  # (N, K): K a multiple of 128 (block FP8)
MAX_TOKENS = 2048
# vLLM's own warmup counts: 1, the CUDA-graph capture sizes (its default list starts like this),
# max_num_batched_tokens.
VLLM_COUNTS = warmup.token_counts((1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 128, 256, 512), MAX_TOKENS)


def _what_m_decides(variant: str, m: int, n: int, k: int) -> tuple:
    """What a Triton call at M tokens compiles on this process's device, read off the kernel modules:
    the GEMM's tile (the lesson's route with kernels_triton.tuning's tiles, as the triton backend
    passes them), the activation quantizer's tile (tuning.quant_tile: the one the backend passes on
    a GPU, the lesson's own under the interpreter; none for W4A16), and Triton's integer specialization of M (== 1,
    divisible by 16: triton.runtime.jit)."""
    fmt, a16 = contract.variant(variant).fmt, contract.variant(variant).a16
    cap = device_capability(torch.device(DEVICE))
    tiles = tuning.tiles(fmt, m, n, k, capability=cap, a16=a16)
    tile = kernels_triton.module(fmt).route(m, n, k, capability=cap, a16=a16, tile=tiles.get("tile")).tile
    return tile, None if a16 else tuning.quant_tile(fmt, m, k), m == 1, m % 16 == 0  # W4A16: no quantizer


def _uncovered(variant, n, k, counts, max_tokens=MAX_TOKENS) -> list[int]:
    """The M in 1..max_tokens whose compiled kernels no count in ``counts`` compiles."""
    warm = {_what_m_decides(variant, m, n, k) for m in counts}
    return [m for m in range(1, max_tokens + 1) if _what_m_decides(variant, m, n, k) not in warm]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_buckets_cover_every_token_count(variant, n, k):
    """Warmup's buckets compile what every M in 1..max_tokens uses; vLLM's counts alone do not
    (so without the buckets a new prompt length would compile while serving)."""
    b = warmup.buckets("triton", variant, n, k, MAX_TOKENS)
    assert b[0] == 1 and all(1 <= m <= MAX_TOKENS for m in b) and list(b) == sorted(set(b))
    assert _uncovered(variant, n, k, b) == []
    # vLLM with enforce_eager (no CUDA graphs) warms 1 and max_num_batched_tokens only: a 3-token
    # prompt (M neither 1 nor a multiple of 16, so another Triton specialization) would compile.
    assert 3 in _uncovered(variant, n, k, warmup.token_counts((), MAX_TOKENS))


def test_cute_buckets_one_per_plan_capacity():
    """The cute path plans a b12x capacity cap_for(next_pow2(M), K) for an unprepared M: one
    bucket per capacity (powers of two up to max_tokens; mxfp4 at K >= 4096 raises small ones to
    129 rows)."""
    assert warmup.buckets("cute", "nvfp4", 1024, 2048, 1000) == (1, 2, 3, 5, 9, 17, 33, 65, 129, 257, 513)
    assert warmup.buckets("cute", "mxfp4", 1024, 4096, 1000) == (1, 129, 257, 513)
    assert warmup.buckets("reference", "nvfp4", 1024, 2048, 1000) == (1,)
    with pytest.raises(ValueError, match="impl must be one of reference, triton, hopper, cute, got 'gpu'"):
        warmup.route_key("gpu", "nvfp4", 1, 1024, 2048)


def test_hopper_variants_include_fp8_channel():
    """kernels_triton.hopper.fp8_channel serves fp8_channel on sm_90, so warmup covers its routes;
    mxfp8_w8a16 once its hopper path has run on a GPU (dispatch.backends.MXFP8_W8A16_GPU_RAN)."""
    from dispatch import backends

    gaps = set() if backends.MXFP8_W8A16_GPU_RAN else {"mxfp8_w8a16"}
    assert "fp8_channel" in HOPPER_VARIANTS and set(HOPPER_VARIANTS) == set(contract.VARIANTS) - gaps


@pytest.mark.parametrize("variant", HOPPER_VARIANTS)
def test_hopper_buckets_cover_every_token_count_on_a_described_h200(variant):
    """On an H200 (described) the hopper routes change with M (decode kernels up to 16 rows, split-K,
    the prefill tile): warmup's buckets hold every distinct route of M = 1..max_tokens, read off
    kernels_triton.hopper's own route() (the registry's route is not consulted here)."""
    import kernels_triton.hopper as hopper

    h200 = KNOWN_DEVICES["h200"]
    n, k, max_tokens = 1024, 2048, 1024
    a16 = contract.variant(variant).a16
    mod = hopper.module(contract.variant(variant).fmt)

    def key(m):
        kw = {"a16": True} if a16 else {}
        r = mod.route(m, n, k, capability=h200.capability, sm_count=h200.sm_count, **kw)
        return r.kernels, r.tile, r.split_k, m == 1, m % 16 == 0

    b = warmup.buckets("hopper", variant, n, k, max_tokens, device=h200)
    warm = {key(m) for m in b}
    assert [m for m in range(1, max_tokens + 1) if key(m) not in warm] == []
    assert any(len(key(m)[0]) != len(key(max_tokens)[0]) or key(m)[1] != key(max_tokens)[1] for m in b)


def test_layer_counts_add_buckets_only_where_kernels_compile():
    st = types.SimpleNamespace(backends={"triton:mxfp8": (registry.get("triton", "mxfp8"), None)}, variant="mxfp8",
                               n=1024, k=2048, device=current_device(), dtype=torch.bfloat16)
    counts = (1, 8, 512)
    on_gpu = warmup.layer_counts(st, counts, torch.device("cuda"))
    assert set(counts) <= set(on_gpu) and set(warmup.buckets("triton", "mxfp8", 1024, 2048, 512)) <= set(on_gpu)
    assert max(on_gpu) == 512
    assert warmup.layer_counts(st, counts, torch.device("cpu")) == counts


# ---------------------------------------------------------------------------------------------
# On a GPU: real compiles counted
# ---------------------------------------------------------------------------------------------
SERVED = (1, 2, 3, 7, 15, 16, 17, 31, 33, 48, 100, 127, 255, 257, 511, 1000, 1999, MAX_TOKENS)


class _Compiles:
    """Counts Triton JIT compiles (``triton.knobs.runtime.jit_post_compile_hook``: called after
    every compile of a new specialization in this process, disk-cache hit or not)."""

    def __init__(self):
        import triton

        self.knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
        if self.knobs is None or not hasattr(self.knobs, "jit_post_compile_hook"):
            pytest.skip(f"Triton {triton.__version__} has no triton.knobs.runtime.jit_post_compile_hook")
        self.seen: list[str] = []

    def __enter__(self):
        self.prev = self.knobs.jit_post_compile_hook
        self.knobs.jit_post_compile_hook = self._hook
        return self

    def _hook(self, *args, **kwargs):
        self.seen.append(str(kwargs.get("repr") or getattr(kwargs.get("fn"), "name", "?")))
        return False

    def __exit__(self, *exc):
        self.knobs.jit_post_compile_hook = self.prev


def _b12x_frozen():
    """b12x's kernel-resolution guard (any new b12x kernel resolution raises inside it), or a
    null context where b12x is absent."""
    import contextlib

    try:
        from b12x._lib.runtime_control import kernel_resolution_guard
    except ImportError:
        return contextlib.nullcontext()
    return kernel_resolution_guard("b12x-dual serving after warmup")


@pytest.mark.skipif(not torch.cuda.is_available() or interpreting(),
                    reason=f"needs a CUDA GPU with compiled Triton kernels; found {device_name()}")
@pytest.mark.parametrize("impl", ("triton", "hopper"))
@pytest.mark.parametrize("variant", VARIANTS)
def test_no_compile_while_serving_after_warmup(variant, impl):
    """A layer (N=1024, K=2048, with bias) on one implementation (B12X_IMPL forced: the readable
    Triton kernels, and on sm_90 the Hopper ones), prepared as the plugin does for every M bucket,
    warmed up with vLLM's counts, then served through the plugin's op at 18 token counts from 1 to
    max_tokens: Triton compiles nothing and b12x resolves nothing; every output has its shape and is
    finite."""
    from dispatch import policy

    n, k = 1024, 2048
    fmt = contract.variant(variant).fmt
    dev = current_device(torch.device("cuda"))
    ok, why = registry.verdict(registry.entries()[(impl, variant)], registry.Problem(variant, 1, n, k), dev)
    if not ok:
        pytest.skip(f"{impl} does not run {variant} on {device_name()}: {why}")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.05
    qw = formats.quantize(w, fmt, role="weight").to("cuda")
    with policy.use_impl(impl):
        st = ops.LayerState(qw, variant, name=f"test.{variant}", device=dev, dtype=torch.bfloat16)
        st.prepare_buckets()  # every M bucket, as the plugin's load does
        st.seal()
        assert set(st.backends) == {f"{impl}:{variant}"}
        _serve(st, n, k, g, variant)


def _serve(st, n, k, g, variant):
    """Warm one layer of state ``st`` up with vLLM's counts, then serve SERVED token counts through
    the plugin's op, counting compiles in both phases."""
    layer = torch.nn.Module()
    layer.b12x_dual_handle = ops.new_handle(st)
    layer.bias = torch.randn(n, generator=g).to("cuda", torch.bfloat16)
    assert st.device.kind == "cuda"
    with _Compiles() as during_warmup:
        warmup.warmup_model(layer, VLLM_COUNTS)
    assert during_warmup.seen, "warmup compiled nothing: the hook is not counting"
    with _Compiles() as serving, _b12x_frozen(), torch.inference_mode():
        for m in SERVED:
            x = make_input((m, k), torch.bfloat16, generator=torch.Generator().manual_seed(m), device="cuda")
            y = torch.ops.b12x_dual.linear(x, layer.bias, layer.b12x_dual_handle, n)
            assert y.shape == (m, n) and bool(torch.isfinite(y).all())
        torch.cuda.synchronize()
    assert serving.seen == [], f"{variant}: compiled while serving: {serving.seen}"
