"""The warmup key, field by field (dispatch/vllm_plugin/warmup.py): no compile while serving.

``warmup.route_key`` is what one layer's call at M tokens compiles, as far as M decides it; warmup
runs one M per distinct key (``warmup.buckets``). A field the key dropped would let two M that
compile different kernels share one warmup run, and the second would compile while serving. For
every field of the key (warmup.RouteKey: the route's kernels, tile, split-K, options, the activation
quantizer's tile, M's Triton class) and every input it is built from (variant and a16, the x dtype,
the device), on described devices (an H200, sm_90, and a DGX Spark GB10, sm_121; DeviceInfo
values, no GPU needed), each test shows

    (a) the key differs where that field alone differs: two M (or two values of the input) whose
        launches, read off the kernel modules themselves (not through route_key), differ in that
        field only; and route_key's field equals the launch's value at every bucket M;
    (b) warmup's buckets up to 2^20 tokens hold an M for every distinct launch (all six fields
        together, so every value of the field under test) that some M in 1..2^20 makes.

Over M, the kernels, split-K and the quantizer tile never differ alone in today's routes (a hopper
route's kernels and split-K change with its tile, whose text names the split; the quantizer's tile
changes at the decode bound M = 16 with the GEMM tile), and neither does the tile on sm_90's hopper
routes: there (a) is the field-by-field equality, which fails the moment the key loses the field,
and for the kernels the x dtype, which changes them alone (test_dtype_changes_the_key).

Cost: (b) walks every M of 1..2^20 twice per configuration (the buckets, and the launches read
off the modules), six configurations, each once per session: the file took 432 s on a shared
2-core CPU machine (30-75 s per configuration; the field and input tests after the first of each
configuration reuse its walk).
"""

from __future__ import annotations

import functools
import inspect
import itertools

import dispatch  # noqa: F401,I001  (sets TRITON_INTERPRET before triton is imported, without a GPU)
import pytest
import torch
import triton
import kernels_triton
import kernels_triton.hopper as hopper
from dispatch import contract
from dispatch.devices import KNOWN_DEVICES
from dispatch.vllm_plugin import warmup
from kernels_triton import fp8_tensor, nvfp4, tuning

H200, GB10 = KNOWN_DEVICES["h200"], KNOWN_DEVICES["gb10"]
DEVICES = {"h200": H200, "gb10": GB10}
N, K = 1024, 2048  # a layer's GEMM shape (K a multiple of 128)
MAX_TOKENS = 2 ** 20
FIELDS = warmup.RouteKey._fields
# One xdist worker holds every walk (they are cached per process): `--dist loadgroup` (the GPU run's
# tools/h200_session.sh) sends the whole file there; without it each worker walks what its tests need.
pytestmark = pytest.mark.xdist_group("warmup_key_walks")


def test_the_described_devices():
    """The tests below describe the parts they name (capability, SMs) with DeviceInfo values."""
    assert (H200.capability, H200.sm_count, H200.is_sm90) == ((9, 0), 132, True)
    assert (GB10.capability, GB10.sm_count, GB10.is_sm12x) == ((12, 1), 48, True)


def _m_class(m: int) -> str:
    """Triton's specialization of an int argument (triton.runtime.jit: == 1, divisible by 16, other)."""
    return "1" if m == 1 else ("16" if m % 16 == 0 else "")


def _lesson_quantizer(fmt: str, m: int, quant: tuple[int, int]) -> tuple:
    """The launch values a kernels_triton.<fmt> quantizer derives from M on a GPU, read off the
    lesson: its tile, and for the dynamic-scale quantizers the amax partial count's class (and
    nvfp4's BLOCK_P, next_pow2 of the count, at least 16)."""
    if fmt == "nvfp4":
        n = nvfp4.amax_partials(m, quant[0], interpreted=False)
        return quant, _m_class(n), max(16, triton.next_power_of_2(n))
    if fmt == "fp8_tensor":
        pm, pk = fp8_tensor.amax_grid(m, K, *quant, interpreted=False)
        return quant, _m_class(pm * pk)
    return (quant,)


def launch(impl: str, variant: str, m: int, device: str, dtype: torch.dtype) -> tuple:
    """What a call at M tokens launches on the described ``device``, in RouteKey's field order, read
    off the kernel modules (kernels_triton.hopper.<fmt>.route with the device's capability and SMs;
    for the lessons kernels_triton.<fmt>.route with the tiles kernels_triton.tuning gives the
    triton backend on a GPU), not through warmup.route_key."""
    v, dev = contract.variant(variant), DEVICES[device]
    cap, sms = tuple(dev.capability), dev.sm_count
    if impl == "hopper":
        mod = hopper.module(v.fmt)
        kw = {"a16": True} if v.a16 else {}
        if "x_dtype" in inspect.signature(mod.route).parameters:
            kw["x_dtype"] = dtype
        r = mod.route(m, N, K, capability=cap, sm_count=sms, **kw)
        quant = None if v.a16 else tuning.quant_config(m, K, False, 32)
        options = tuple(r.options)
    else:
        t = tuning.tiles(v.fmt, m, N, K, capability=cap, a16=v.a16)
        r = kernels_triton.module(v.fmt).route(m, N, K, capability=cap, sm_count=sms, a16=v.a16, tile=t["tile"])
        quant = None if v.a16 else t["quant_tile"]
        options = () if v.a16 else _lesson_quantizer(v.fmt, m, quant)
    return tuple(r.kernels), r.tile, r.split_k, options, quant, _m_class(m)


@functools.lru_cache(maxsize=None)
def sweep(impl: str, variant: str, device: str, dtype: torch.dtype) -> dict[tuple, int]:
    """Every distinct launch over M in 1..MAX_TOKENS, with the first M that makes it."""
    first: dict[tuple, int] = {}
    for m in range(1, MAX_TOKENS + 1):
        first.setdefault(launch(impl, variant, m, device, dtype), m)
    return first


@functools.lru_cache(maxsize=None)
def buckets(impl: str, variant: str, device: str, dtype: torch.dtype) -> tuple[int, ...]:
    return warmup.buckets(impl, variant, N, K, MAX_TOKENS, device=DEVICES[device], dtype=dtype)


def key(impl, variant, m, device, dtype=torch.bfloat16):
    return warmup.route_key(impl, variant, m, N, K, DEVICES[device], dtype)


def assert_key_is_the_launch(cfg, ms):
    """route_key's every field equals the launch's (read off the modules) at each M of ``ms``."""
    impl, variant, device, dtype = cfg
    for m in ms:
        k, want = key(impl, variant, m, device, dtype), launch(impl, variant, m, device, dtype)
        for name, value in zip(FIELDS, want):
            assert getattr(k, name) == value, f"{cfg} M={m}: route_key's {name} {getattr(k, name)!r} != {value!r}"


def assert_buckets_cover(cfg, field=None):
    """(b): warmup's buckets make every distinct launch of M in 1..2^20 (so every value of ``field``)."""
    impl, variant, device, dtype = cfg
    b = buckets(*cfg)
    assert b[0] == 1 and max(b) <= MAX_TOKENS
    every = sweep(*cfg)
    warm = {launch(impl, variant, m, device, dtype) for m in b}
    missing = {lk: m for lk, m in every.items() if lk not in warm}
    assert not missing, f"{cfg}: launches no bucket makes (first M): {sorted(missing.values())[:8]}"
    if field is not None:
        i = FIELDS.index(field)
        assert {lk[i] for lk in every} == {lk[i] for lk in warm}
    return every


def alone_pair(every: dict[tuple, int], field: str):
    """Two M whose launches differ in ``field`` only (the smallest such pair), or None."""
    i = FIELDS.index(field)
    pairs = [(ma, mb) for (a, ma), (b, mb) in itertools.combinations(every.items(), 2)
             if [j for j in range(len(FIELDS)) if a[j] != b[j]] == [i]]
    return min((tuple(sorted(p)) for p in pairs), default=None)


TRITON_GB10 = ("triton", "nvfp4", "gb10", torch.bfloat16)  # the lesson on SM12x: native tiles, amax partials
TRITON_H200 = ("triton", "nvfp4", "h200", torch.bfloat16)  # the lesson on sm_90: portable tiles
HOPPER_H200 = ("hopper", "nvfp4", "h200", torch.bfloat16)  # decode / fused / pre-pass routes, split-K
HOPPER_A16_BF16 = ("hopper", "nvfp4_w4a16", "h200", torch.bfloat16)
HOPPER_A16_FP16 = ("hopper", "nvfp4_w4a16", "h200", torch.float16)
HOPPER_MXFP4 = ("hopper", "mxfp4", "h200", torch.bfloat16)

# (field, configuration, whether two M differ in that field alone there)
FIELD_CASES = [
    ("kernels", HOPPER_H200, False), ("tile", HOPPER_H200, False), ("tile", TRITON_GB10, True),
    ("split_k", HOPPER_H200, False), ("options", HOPPER_H200, True), ("options", TRITON_GB10, True),
    ("quant_tile", HOPPER_H200, False), ("quant_tile", TRITON_GB10, False),
    ("m_class", HOPPER_H200, True), ("m_class", TRITON_GB10, True),
]


@pytest.mark.parametrize("field,cfg,alone", FIELD_CASES, ids=[f"{f}-{c[0]}-{c[1]}-{c[2]}" for f, c, _ in FIELD_CASES])
def test_field_of_the_key(field, cfg, alone):
    """(a) and (b) for one RouteKey field over M on a described device."""
    impl, variant, device, dtype = cfg
    # (a), cheap part first: route_key carries the field, equal to the launch's at every bucket M.
    assert_key_is_the_launch(cfg, (1, 2, 16, 17, 33, 65, 129, 257, 513, 1025, 4097, 65536, MAX_TOKENS))
    every = assert_buckets_cover(cfg, field)
    values = {lk[FIELDS.index(field)] for lk in every}
    assert len(values) >= 2, f"{cfg}: {field} never changes with M: {values}"
    assert_key_is_the_launch(cfg, buckets(*cfg))
    pair = alone_pair(every, field)
    assert (pair is not None) == alone, f"{cfg}: a pair of M differing in {field} alone: {pair}"
    if pair:  # (a): dropping the field would make these two M share one warmup run
        ma, mb = pair
        assert key(impl, variant, ma, device, dtype) != key(impl, variant, mb, device, dtype)


def test_options_hold_the_quantizer_class_on_sm12x():
    """The H200 caught nvfp4's amax partial count compiling while serving; on a GB10 (described) the
    count's class changes at M = 481 (cdiv(481, 32) = 16) and BLOCK_P at M = 513, with the GEMM tile
    and quantizer tile unchanged: two warmup runs that only the options tell apart."""
    a, b, c = (key("triton", "nvfp4", m, "gb10") for m in (465, 481, 513))
    assert a._replace(options=None, m_class=None) == b._replace(options=None, m_class=None) == \
        c._replace(options=None, m_class=None)
    assert len({a.options, b.options, c.options}) == 3
    assert {481, 513} <= set(warmup.buckets("triton", "nvfp4", N, K, 1024, device=GB10))


def _cross(cfg_a, cfg_b, m):
    """(a) across an input: route_key differs at M where the two launches differ, and each
    configuration's buckets cover its own launches (b)."""
    la, lb = launch(cfg_a[0], cfg_a[1], m, cfg_a[2], cfg_a[3]), launch(cfg_b[0], cfg_b[1], m, cfg_b[2], cfg_b[3])
    assert la != lb
    ka, kb = key(cfg_a[0], cfg_a[1], m, cfg_a[2], cfg_a[3]), key(cfg_b[0], cfg_b[1], m, cfg_b[2], cfg_b[3])
    assert ka != kb and tuple(ka) == la and tuple(kb) == lb
    assert_buckets_cover(cfg_a)
    assert_buckets_cover(cfg_b)
    return la, lb


def test_dtype_changes_the_key():
    """x dtype: on an H200 the W4A16 decode route of fp16 x launches other kernels than bf16's, with
    the same tile and split-K (the kernels field alone): route_key must read the dtype it is given."""
    la, lb = _cross(HOPPER_A16_BF16, HOPPER_A16_FP16, 1)
    assert [FIELDS[j] for j in range(len(FIELDS)) if la[j] != lb[j]] == ["kernels"]


def test_a16_changes_the_key():
    """a16: nvfp4 (W4A4: a quantizer, its tile and amax options) vs nvfp4_w4a16 (none) on an H200."""
    la, lb = _cross(HOPPER_H200, HOPPER_A16_BF16, 17)
    assert la[FIELDS.index("quant_tile")] is not None and lb[FIELDS.index("quant_tile")] is None


def test_format_changes_the_key():
    """variant / format: nvfp4 vs mxfp4 on an H200 at M = 1 (nvfp4's dynamic global scale adds the
    amax kernel and its options)."""
    _cross(HOPPER_H200, HOPPER_MXFP4, 1)


def test_device_changes_the_key():
    """device: the nvfp4 lesson on a GB10 (sm_121: the native SM12x tiles) vs an H200 (sm_90: the
    portable ones) at M = 17: route_key is the described device's, not this process's."""
    path, why = kernels_triton._common.gemm_path("nvfp4", GB10.capability)
    if path != "native":  # the installed Triton decides whether sm_121 lowers dot_scaled natively
        pytest.skip(f"Triton {triton.__version__} serves the nvfp4 lesson on sm_121 with the portable GEMM too "
                    f"({why}): a GB10 and an H200 launch the same kernels here; Triton 3.9 (CI's) checks this")
    la, lb = _cross(TRITON_GB10, TRITON_H200, 17)
    assert la[FIELDS.index("tile")] != lb[FIELDS.index("tile")]


def test_buckets_make_every_launch_of_hopper_fp8_channel():
    """(b) for the sm_90 fp8_channel routes (decode, portable, TMA prefill) and their two-stage
    per-token quantizer, whose options name its tile, partials block and Pk class."""
    cfg = ("hopper", "fp8_channel", "h200", torch.bfloat16)
    every = assert_buckets_cover(cfg)
    assert len({lk[0] for lk in every}) >= 3, f"{cfg}: expected the decode, portable and prefill kernels: {every}"
    assert_key_is_the_launch(cfg, buckets(*cfg))
