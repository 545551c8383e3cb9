"""Every checkpoint tensor vLLM loads into our layers is checked (dtype and shape before vLLM copies
it; presence when the weights are processed), on real vLLM layers with compressed-tensors
checkpoints tampered one tensor at a time, for every family the plugin serves
(dispatch/vllm_plugin/loading.py, patch ``load_checks``).
"""

from __future__ import annotations

import re

import pytest
import torch

from _vllm_env import ckpt, ckpt_root, dist, forward, impl, loaded  # noqa: F401
import checkpoints
import harness
from conftest import make_input

from dispatch.vllm_plugin import convert, loading

KINDS = checkpoints.KINDS
PREFIX = {name: f"{harness.PREFIX}.{mods[0]}" for name, mods in harness.LINEARS.items()}
PREFIX["qkv"] = f"{harness.PREFIX}.attention.self.qkv"


def _leaves(d, name: str) -> list[str]:
    return sorted(harness.expected_shards(d, name))


def _x(k, m=3, seed=0):
    return make_input((m, k), torch.bfloat16, generator=torch.Generator().manual_seed(seed), device="cpu")


def _tamper(leaf: str, fn, module: str | None = None):
    """A harness tamper hook that applies ``fn`` to one tensor (of one module, if given)."""

    def hook(mod, name, t):
        if name == leaf and (module is None or mod == module):
            return fn(t)
        return t

    return hook


def _wrong_dtype(t: torch.Tensor, spec: loading.Spec) -> torch.Tensor:
    """The same tensor in a dtype a real mistake would give, outside the spec's allowed set."""
    if t.dtype == torch.float8_e4m3fn:  # dequantized / unquantized values where codes belong
        out = t.to(torch.bfloat16)
    elif spec is loading._MX_SCALE:
        out = torch.exp2(t.float() - 127)  # E8M0 as its float32 values
    elif t.dtype == torch.uint8:  # packed codes written as int8
        out = t.view(torch.int8)
    else:  # a float scale or bias written as integers
        out = t.to(torch.int32)
    assert out.dtype not in spec.dtypes
    return out


def _spec(variant: str, leaf: str) -> loading.Spec:
    return loading.SPECS[variant].get(leaf) or loading._BIAS


@pytest.mark.parametrize("kind", KINDS)
def test_every_checkpoint_tensor_is_guarded(kind, dist, ckpt, impl):
    """Each tensor the checkpoint holds for a layer goes through a checked loader, and each arrival
    is recorded per fused shard (q, k, v)."""
    impl("reference")
    d = ckpt(kind)
    layers, _ = loaded(d, ("qkv", "o"), process=False)
    for name, layer in layers.items():
        rec = layer.b12x_dual_load_record
        assert sorted(rec.wrapped) == _leaves(d, name), name
        for leaf in rec.wrapped:
            assert callable(getattr(getattr(layer, leaf).weight_loader, "__b12x_dual_original__", None))
        want = {"q", "k", "v"} if name == "qkv" else {None}
        assert all(rec.arrived[leaf] == want for leaf in rec.wrapped), rec.arrived


@pytest.mark.parametrize("kind", KINDS)
def test_missing_tensor_named_at_processing(kind, dist, ckpt, impl):
    """A tensor left out of the file (one at a time; for q/k/v, only k's) fails when the weights
    are processed, naming the layer, the tensor (and shard) and "missing from the checkpoint",
    instead of serving the parameter's uninitialised memory."""
    impl("reference")
    d = ckpt(kind)
    for leaf in _leaves(d, "o"):
        with harness.vllm_context(d) as cfg:
            layers = harness.make_layers(harness.quant_config(cfg), ("o",))
            missing = rf"layer {PREFIX['o']}: checkpoint tensor\(s\) '{leaf}' missing from the checkpoint"
            with pytest.raises(convert.CheckpointError, match=missing):
                harness.load(layers, d, skip=(leaf,))
    k_module = harness.LINEARS["qkv"][1]
    for leaf in _leaves(d, "qkv"):
        with harness.vllm_context(d) as cfg:
            layers = harness.make_layers(harness.quant_config(cfg), ("qkv",))
            with pytest.raises(convert.CheckpointError,
                               match=rf"layer {PREFIX['qkv']}: checkpoint tensor\(s\) '{leaf}' \(shards 'k'\) missing"):
                harness.load(layers, d, tamper=_tamper(leaf, lambda t: None, k_module))


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_dtype_refused_before_the_copy(kind, dist, ckpt, impl):
    """Each tensor in a wrong dtype (codes as bf16 or int8, E8M0 as float32, scales as int32) is
    refused by the loader, naming layer, tensor, what arrived and what is allowed."""
    impl("reference")
    d = ckpt(kind)
    for leaf in _leaves(d, "o"):
        with harness.vllm_context(d) as cfg:
            layers = harness.make_layers(harness.quant_config(cfg), ("o",))
            spec = _spec(loading.our_kernel(layers["o"])._variant(), leaf)
            bad = {}

            def wrong(t):
                bad["t"] = _wrong_dtype(t, spec)
                return bad["t"]

            with pytest.raises(convert.CheckpointError) as e:
                harness.load(layers, d, process=False, tamper=_tamper(leaf, wrong))
        got = str(bad["t"].dtype).replace("torch.", "")
        msg = str(e.value)
        assert f"layer {PREFIX['o']}: checkpoint tensor '{leaf}' is {got} {tuple(bad['t'].shape)}" in msg, msg
        assert "must be one of " + loading._names(spec.dtypes) in msg, msg


def test_mxfp8_e8m0_scale_as_float32_refused(dist, ckpt, impl):
    """vLLM's loader would cast float32 powers of two into the uint8 parameter (0.125 -> byte 0,
    relative error 1.0); the checked loader refuses it and says how E8M0 is stored."""
    impl("reference")
    d = ckpt("ct_mxfp8")
    with harness.vllm_context(d) as cfg:
        layers = harness.make_layers(harness.quant_config(cfg), ("up",))
        as_float = _tamper("weight_scale", lambda t: torch.exp2(t.float() - 127))
        with pytest.raises(convert.CheckpointError,
                           match=r"intermediate\.dense: checkpoint tensor 'weight_scale' is float32 \(1536, 12\); "
                                 r"an E8M0 block scale \[N, K/32\] must be one of uint8, float8_e8m0fnu; E8M0 scales "
                                 r"must be stored as their bytes"):
            harness.load(layers, d, tamper=as_float)


def _cut_last(t: torch.Tensor) -> torch.Tensor:
    """The tensor with its last column (2-D) or one more element (scalar) changed: a wrong shape."""
    if t.dim() >= 2:
        return t[:, :-1].contiguous()
    if t.numel() == 1:
        return t.reshape(1).repeat(2)
    return t[:-1].contiguous()


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_shape_named_before_vllm_narrows(kind, dist, ckpt, impl):
    """Each tensor of each of q's, k's and v's shards with a wrong shape, one at a time, is refused
    with our error (layer, tensor, shard, arrived, expected), never vLLM's ``start (0) + length (3)
    exceeds dimension size (2)``."""
    impl("reference")
    d = ckpt(kind)
    for shard, module in zip(("q", "k", "v"), harness.LINEARS["qkv"]):
        for leaf in _leaves(d, "qkv"):
            with harness.vllm_context(d) as cfg:
                layers = harness.make_layers(harness.quant_config(cfg), ("qkv",))
                with pytest.raises(convert.CheckpointError) as e:
                    harness.load(layers, d, process=False, tamper=_tamper(leaf, _cut_last, module))
            msg = str(e.value)
            assert f"layer {PREFIX['qkv']}: checkpoint tensor '{leaf}' (shard '{shard}') is " in msg, msg
            assert "expected" in msg and "exceeds dimension size" not in msg, msg


def _merged_up(d, edit):
    """The checkpoint's up projection (intermediate.dense) as a gate/up-style merged column layer:
    its two halves along N are shards 0 and 1 (per-tensor scales go to both), each passed through
    ``edit(shard, leaf, tensor)`` before vLLM's loader (None: left out); processed. Returns the layer."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    prefix = f"{harness.PREFIX}.{harness.LINEARS['up'][0]}"
    tensors = harness.expected_shards(d, "up")
    half = harness.INTER // 2
    with harness.vllm_context(d) as cfg:
        layer = MergedColumnParallelLinear(harness.HIDDEN, [half, half], bias=True,
                                           quant_config=harness.quant_config(cfg), prefix=prefix)
        params = dict(layer.named_parameters())
        for leaf, (t,) in tensors.items():
            if leaf not in params:
                continue
            for shard in (0, 1):
                part = t if t.dim() == 0 or t.numel() == 1 else t[shard * (t.shape[0] // 2):(shard + 1) * (t.shape[0] // 2)]
                part = edit(shard, leaf, part)
                if part is not None:
                    params[leaf].weight_loader(params[leaf], part, shard)
        layer.quant_method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("kind", KINDS)
def test_every_merged_shard_wrong_shape_named(kind, dist, ckpt, impl):
    """Gate/up-style merged layers in every family: each tensor of shard 0 and of shard 1 with a
    wrong shape, one at a time, is our error naming layer, tensor and shard."""
    impl("reference")
    d = ckpt(kind)
    prefix = f"{harness.PREFIX}.{harness.LINEARS['up'][0]}"
    for shard in (0, 1):
        for leaf in _leaves(d, "up"):
            with pytest.raises(convert.CheckpointError) as e:
                _merged_up(d, lambda s, lf, t: _cut_last(t) if (s, lf) == (shard, leaf) else t)
            msg = str(e.value)
            assert f"layer {prefix}: checkpoint tensor '{leaf}' (shard {shard}) is " in msg, msg
            assert "expected" in msg and "exceeds dimension size" not in msg, msg


@pytest.mark.parametrize("kind,leaf", [("ct_fp8_block", "weight_scale"), ("deepseek_fp8_block", "weight_scale_inv"),
                                       ("ct_mxfp4", "weight_packed")])
def test_block_scale_and_packed_shape_issue_cases(kind, leaf, dist, ckpt, impl):
    """The two shapes the issue saw fail inside vLLM: a block-FP8 scale with one column too few
    (vLLM: narrow past the end) and an MXFP4 weight_packed of the wrong width."""
    impl("reference")
    d = ckpt(kind)
    with harness.vllm_context(d) as cfg:
        layers = harness.make_layers(harness.quant_config(cfg), ("o",))
        if leaf == "weight_packed":
            expected, got = "(384, 192)", "(384, 191)"
        else:
            expected, got = "(3, 3)", "(3, 2)"
        with pytest.raises(convert.CheckpointError) as e:
            harness.load(layers, d, tamper=_tamper(leaf, _cut_last))
    msg = str(e.value)
    assert re.search(rf"attention\.output\.dense: checkpoint tensor '{leaf}' is \w+ {re.escape(got)}; "
                     rf"expected .* of shape {re.escape(expected)} for N=384, K=384", msg), msg
    assert "exceeds dimension size" not in msg


def _output(d, which, tamper=None, x=None):
    layers, _ = loaded(d, (which,), tamper=tamper)
    layer = layers[which]
    return forward(layer, x if x is not None else _x(layer.input_size_per_partition))


@pytest.mark.parametrize("kind,leaf,dtype", [
    ("ct_fp8", "weight_scale", torch.bfloat16), ("ct_fp8", "weight_scale", torch.float16),
    ("ct_fp8", "input_scale", torch.bfloat16), ("ct_fp8", "input_scale", torch.float16),
    ("ct_fp8_dynamic", "weight_scale", torch.bfloat16),
    ("ct_nvfp4", "weight_global_scale", torch.bfloat16), ("ct_nvfp4", "input_global_scale", torch.float16),
    ("modelopt_nvfp4", "weight_scale_2", torch.bfloat16), ("modelopt_nvfp4", "input_scale", torch.float16),
    ("ct_fp8_block", "weight_scale", torch.float32), ("ct_fp8_block", "weight_scale", torch.float16),
    ("deepseek_fp8_block", "weight_scale_inv", torch.bfloat16),
    ("ct_mxfp8", "weight_scale", torch.float8_e8m0fnu), ("ct_mxfp4", "weight_scale", torch.float8_e8m0fnu),
    ("modelopt_mxfp8", "weight_scale", torch.float8_e8m0fnu),
])
def test_every_allowed_dtype_loads_to_the_same_output(kind, leaf, dtype, dist, ckpt, impl):
    """A scale stored in another allowed dtype serves the same output as the same values in the
    file's dtype: the checks refuse nothing a checkpoint may legitimately carry. The values are
    first made representable in ``dtype`` (rounded through it, kept in the file's dtype; the
    conversions between float32, bfloat16 and float16 of such values are exact), so the two loads
    must agree bit for bit. E8M0 bytes (uint8) and float8_e8m0fnu are the same bits."""
    impl("reference")
    d = ckpt(kind)
    for which in ("o", "qkv"):
        if dtype == torch.float8_e8m0fnu:
            base = _output(d, which)
            alt = _output(d, which, _tamper(leaf, lambda t: t.view(torch.float8_e8m0fnu)))
        else:
            base = _output(d, which, _tamper(leaf, lambda t: t.to(dtype).to(t.dtype)))
            alt = _output(d, which, _tamper(leaf, lambda t: t.to(dtype)))
        assert base.abs().max() > 0
        assert torch.equal(base, alt), f"{kind} {which} {leaf} as {dtype}"


def test_ue8m0_block_scales_load_like_their_float32_values(dist, ckpt, impl):
    """DeepSeek UE8M0 block scales (float8_e8m0fnu powers of two) serve the same output as the same
    powers of two stored as float32 (E8M0 -> float32 is exact)."""
    impl("reference")
    d = ckpt("deepseek_fp8_block")

    def pow2(t):  # round each block scale up to a power of two (what UE8M0 exporters do)
        return torch.exp2(torch.ceil(torch.log2(t.float())))

    as_f32 = _output(d, "qkv", _tamper("weight_scale_inv", pow2))
    as_e8m0 = _output(d, "qkv", _tamper("weight_scale_inv", lambda t: pow2(t).to(torch.float8_e8m0fnu)))
    assert as_f32.abs().max() > 0
    assert torch.equal(as_f32, as_e8m0)


def test_processing_twice_and_unguarded_layers(dist, ckpt, impl):
    """A second processing of the same load passes (nothing new arrived); a layer loaded from a
    checkpoint whose records are complete passes; a layer not ours carries no record."""
    impl("reference")
    d = ckpt("ct_mxfp8")
    with harness.vllm_context(d) as cfg:
        layers = harness.make_layers(harness.quant_config(cfg), ("o",))
        harness.load(layers, d)
        loading.check_complete(layers["o"])  # same load again: passes
        from vllm.model_executor.layers.linear import RowParallelLinear

        plain = RowParallelLinear(384, 384, bias=True, quant_config=None, prefix="plain")
    assert getattr(plain, "b12x_dual_load_record", None) is None
    assert not hasattr(plain.weight.weight_loader, "__b12x_dual_original__")


def test_merged_column_shards_checked_and_named(dist, ckpt, impl):
    """A gate/up-style merged column layer (integer shard ids) built from the MXFP8 up projection
    split in two halves along N: the halves load and serve the unsplit layer's output exactly; a
    half left out is named by its shard id, and a half of the wrong height by its shard and the
    expected (N/2, K/32)."""
    impl("reference")
    d = ckpt("ct_mxfp8")
    prefix = f"{harness.PREFIX}.{harness.LINEARS['up'][0]}"

    def build_and_load(edit=lambda shard, leaf, t: t):
        return _merged_up(d, edit)

    merged = build_and_load()
    assert loading.our_kernel(merged) is not None and merged.b12x_dual_load_record.shards == (0, 1)
    plain, _ = loaded(d, ("up",))
    x = _x(harness.HIDDEN)
    assert torch.equal(forward(merged, x), forward(plain["up"], x))
    with pytest.raises(convert.CheckpointError,
                       match=rf"layer {prefix}: checkpoint tensor\(s\) 'weight_scale' \(shards 1\) missing"):
        build_and_load(lambda shard, leaf, t: None if (shard, leaf) == (1, "weight_scale") else t)
    with pytest.raises(convert.CheckpointError,
                       match=rf"layer {prefix}: checkpoint tensor 'weight_scale' \(shard 0\) is uint8 \(767, 12\); "
                             rf"expected .* of shape \(768, 12\) for N=768, K=384"):
        build_and_load(lambda shard, leaf, t: t[:-1] if (shard, leaf) == (0, "weight_scale") else t)


def test_dummy_load_format_is_not_a_missing_checkpoint(dist, ckpt, impl):
    """vLLM's ``load_format="dummy"`` writes random values into the parameters without any
    weight_loader: the completeness check lets it through (there is no checkpoint to miss), and
    the same layer without that format is refused."""
    from vllm.config import LoadConfig, set_current_vllm_config

    impl("reference")
    d = ckpt("ct_mxfp8")
    with harness.vllm_context(d) as cfg:
        layers = harness.make_layers(harness.quant_config(cfg), ("o",))
        with pytest.raises(convert.CheckpointError, match="missing from the checkpoint"):
            loading.check_complete(layers["o"])
        cfg.load_config = LoadConfig(load_format="dummy")
        with set_current_vllm_config(cfg):
            loading.check_complete(layers["o"])


def test_ue8m0_block_scales_in_an_e8m0_parameter_are_decoded(dist, ckpt, impl):
    """When vLLM's Fp8 method creates its block-scale parameter as float8_e8m0fnu (its quant config's
    ``is_scale_e8m0``, read by vLLM's ``Fp8LinearMethod``), a DeepSeek-style checkpoint's UE8M0 scales
    (safetensors F8_E8M0) arrive as E8M0 bytes and the plugin decodes them: the output equals the same
    powers of two loaded into vLLM's default float32 parameter. The scales are far below 1 (asserted:
    at most 2^-2), so reading their bytes (>= 100) as integers instead of decoding them would scale
    the output by 2^9 or more: a conversion that does so fails here."""
    impl("reference")
    d = ckpt("deepseek_fp8_block")

    def pow2(t):  # each block scale rounded up to a power of two, as UE8M0 exporters do
        return torch.exp2(torch.ceil(torch.log2(t.float())))

    as_f32 = _output(d, "qkv", _tamper("weight_scale_inv", pow2))
    with harness.vllm_context(d) as cfg:
        qc = harness.quant_config(cfg)
        qc.is_scale_e8m0 = True  # what vLLM's Fp8LinearMethod reads to create an E8M0 parameter
        layers = harness.make_layers(qc, ("qkv",))
        assert layers["qkv"].weight_scale_inv.dtype == torch.float8_e8m0fnu
        scales = torch.cat(harness.expected_shards(d, "qkv")["weight_scale_inv"], 0)
        assert float(pow2(scales).max()) <= 0.25 and int(pow2(scales).to(torch.float8_e8m0fnu).view(torch.uint8).min()) >= 100
        harness.load(layers, d, tamper=_tamper("weight_scale_inv", lambda t: pow2(t).to(torch.float8_e8m0fnu)))
    x = _x(layers["qkv"].input_size)
    as_e8m0 = forward(layers["qkv"], x)
    assert as_f32.abs().max() > 0
    assert torch.equal(as_f32, as_e8m0)


def test_uint8_block_scales_are_refused_in_the_file(dist, ckpt, impl):
    """UE8M0 block scales written as uint8 bytes would be taken as integers by vLLM's float32
    parameter (byte 120 -> 120.0 instead of 2^-7): refused at load, naming the tensor and the fix."""
    impl("reference")
    d = ckpt("deepseek_fp8_block")

    def as_bytes(t):
        return (torch.ceil(torch.log2(t.float())) + 127).to(torch.uint8)

    with pytest.raises(convert.CheckpointError, match=r"weight_scale_inv.*uint8.*float8_e8m0fnu"):
        loaded(d, ("o",), tamper=_tamper("weight_scale_inv", as_bytes))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")], ids=["zero", "negative", "inf", "nan"])
@pytest.mark.parametrize("kind,leaf", [("ct_fp8_channel", "weight_scale"), ("ct_fp8_channel_static", "input_scale")])
def test_bad_per_channel_or_input_scale_value_named_as_it_arrives(kind, leaf, bad, dist, ckpt, impl):
    """One output channel's scale of v's shard (or v's static input scale) that is zero, negative,
    Inf or NaN is refused by the checked loader, naming the layer, the tensor, the shard, the value
    and the row: before vLLM's processing, whose max over the fused shards would hide a zero or a
    negative input scale behind q's and k's."""
    impl("reference")
    d = ckpt(kind)
    v_module = harness.LINEARS["qkv"][2]

    def one_bad(t):
        t = t.clone()
        t.view(-1)[5 if t.numel() > 5 else 0] = bad
        return t

    with harness.vllm_context(d) as cfg:
        layers = harness.make_layers(harness.quant_config(cfg), ("qkv",))
        with pytest.raises(convert.CheckpointError) as e:
            harness.load(layers, d, tamper=_tamper(leaf, one_bad, v_module))
    msg = str(e.value)
    assert f"layer {PREFIX['qkv']}: checkpoint tensor '{leaf}' (shard 'v') is float32" in msg, msg
    assert f"holding {bad!r}" in msg and "must be finite and > 0" in msg, msg
    if leaf == "weight_scale":
        assert "at row 5" in msg and "a per-channel scale [N, 1] (one per output channel)" in msg, msg


def test_per_channel_scale_of_the_wrong_length_named(dist, ckpt, impl):
    """A per-channel weight_scale with one row too few for k's shard is refused with the expected
    shape (one scale per output channel), never narrowed by vLLM past its end."""
    impl("reference")
    d = ckpt("ct_fp8_channel")
    with harness.vllm_context(d) as cfg:
        layers = harness.make_layers(harness.quant_config(cfg), ("qkv",))
        short = _tamper("weight_scale", lambda t: t[:-1].contiguous(), harness.LINEARS["qkv"][1])
        with pytest.raises(convert.CheckpointError,
                           match=rf"layer {re.escape(PREFIX['qkv'])}: checkpoint tensor 'weight_scale' \(shard 'k'\) is "
                                 r"float32 \(383, 1\); expected a per-channel scale \[N, 1\] \(one per output channel\) "
                                 r"of shape \(384, 1\) for N=384, K=384"):
            harness.load(layers, d, tamper=short)


def test_per_channel_conversion_names_a_bad_scale_that_reaches_it(dist, ckpt, impl):
    """convert.fp8_channel (also b12x-dual diff's reader, which has no loader) names the layer, the
    tensor, the output channel and the value of a bad scale, and a scale vector of the wrong length."""
    impl("reference")
    d = ckpt("ct_fp8_channel")
    layers, _ = loaded(d, ("o",), process=False)
    layer = layers["o"]
    n, k = 384, 384
    w = layer.weight_scale.data
    w[7] = -2.0
    with pytest.raises(convert.CheckpointError,
                       match=rf"layer {re.escape(PREFIX['o'])}: per-channel FP8 tensor 'weight_scale' holds -2.0 for "
                             r"output channel 7 \(of 384\); every per-channel scale must be finite and > 0"):
        convert.fp8_channel(layer, n, k, static_input=False)
    layer.weight_scale = torch.nn.Parameter(w[:-1].abs().clone(), requires_grad=False)
    with pytest.raises(convert.CheckpointError, match=r"'weight_scale' has shape \(383, 1\), expected \(384, 1\) or \(384,\)"):
        convert.fp8_channel(layer, n, k, static_input=False)

# ---------------------------------------------------------------------------------------------
# Values: the checkpoint checks of `b12x-dual diff`, at load (loading.check_values)
# ---------------------------------------------------------------------------------------------
def _set_byte(r: int, c: int, byte: int):
    def fn(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(torch.uint8)[r, c] = byte
        return t

    return fn


def _load_one(d, which, tamper):
    with harness.vllm_context(d) as cfg:
        layers = harness.make_layers(harness.quant_config(cfg), (which,))
        return harness.load(layers, d, tamper=tamper)[which]


NAN_IN_K = _tamper("weight", _set_byte(9, 300, 0xFF), "attention.self.key")  # k's row 9 = fused row 384 + 9


def test_nan_weight_code_is_refused_at_load_by_name(dist, ckpt, impl, monkeypatch):
    """An e4m3 weight code 0xFF (NaN) in the key projection of an MXFP8 checkpoint: the fused qkv layer
    is refused at load, naming the layer, the tensor, the position in the fused weight (row 393,
    column 300, K-block 9) and the variable that serves it anyway."""
    impl("reference")
    monkeypatch.delenv(loading.ENV_ALLOW_NAN_WEIGHTS, raising=False)
    with pytest.raises(convert.CheckpointError,
                       match=re.escape(f"layer {PREFIX['qkv']}: weight.data: 1 NaN weight code(s) (e4m3 0x7F/0xFF")
                       + r".* at row 393, column 300 \(K-block 9\)\. Refused: .*B12X_VLLM_ALLOW_NAN_WEIGHTS=1"):
        _load_one(ckpt("ct_mxfp8"), "qkv", NAN_IN_K)


def test_nan_weight_code_is_served_when_allowed(dist, ckpt, impl, monkeypatch, caplog):
    """B12X_VLLM_ALLOW_NAN_WEIGHTS=1: the layer loads with one WARNING naming it and the position, and
    answers NaN in output column 393 for every token, finite elsewhere (the oracle's answer)."""
    import logging

    impl("reference")
    monkeypatch.setenv(loading.ENV_ALLOW_NAN_WEIGHTS, "1")
    with caplog.at_level(logging.WARNING, "dispatch.vllm_plugin"):
        layer = _load_one(ckpt("ct_mxfp8"), "qkv", NAN_IN_K)
    msgs = [r.getMessage() for r in caplog.records if "NaN weight code" in r.getMessage()]
    assert len(msgs) == 1 and PREFIX["qkv"] in msgs[0] and "row 393, column 300" in msgs[0]
    assert "served anyway (B12X_VLLM_ALLOW_NAN_WEIGHTS=1)" in msgs[0]
    y = forward(layer, _x(384))
    assert torch.isnan(y[:, 393]).all() and torch.isfinite(torch.cat([y[:, :393], y[:, 394:]], 1)).all()


@pytest.mark.parametrize("value", ["maybe", "2", "allow"])
def test_an_unknown_allow_nan_weights_value_is_refused_by_name(dist, ckpt, impl, monkeypatch, value):
    impl("reference")
    monkeypatch.setenv(loading.ENV_ALLOW_NAN_WEIGHTS, value)
    with pytest.raises(ValueError, match=re.escape(f"B12X_VLLM_ALLOW_NAN_WEIGHTS={value!r} is not allowed; allowed: "
                                                   "1, true, on, yes (serve NaN weight codes) or 0, false, off, no")):
        _load_one(ckpt("ct_mxfp8"), "qkv", NAN_IN_K)


def test_e8m0_nan_scale_is_refused_even_with_nan_codes_allowed(dist, ckpt, impl, monkeypatch):
    """An E8M0 scale byte 0xFF (NaN) in an MXFP4 checkpoint: refused whatever the variable says,
    naming the layer and the block (row 7, K-block 3, columns 96-127)."""
    impl("reference")
    monkeypatch.setenv(loading.ENV_ALLOW_NAN_WEIGHTS, "1")
    with pytest.raises(convert.CheckpointError,
                       match=re.escape(f"layer {PREFIX['down']}: weight.scale: 1 E8M0 scale byte(s) 0xFF")
                       + r".* at row 7, K-block 3 \(columns 96-127\)"):
        _load_one(ckpt("ct_mxfp4"), "down", _tamper("weight_scale", _set_byte(7, 3, 0xFF)))


def test_zero_block_scale_over_nonzero_codes_is_served_with_a_warning(dist, ckpt, impl, caplog):
    """An NVFP4 block scale set to 0 where the block's codes are not zero: its weights read as 0. The
    layer is served (a quantizer writes 0 for an all-zero block, and one that underflows may leave
    codes), with one WARNING naming the layer and the block."""
    import logging

    impl("reference")
    with caplog.at_level(logging.WARNING, "dispatch.vllm_plugin"):
        layer = _load_one(ckpt("ct_nvfp4"), "o", _tamper("weight_scale", _set_byte(5, 2, 0x00)))
    msgs = [r.getMessage() for r in caplog.records if "zero block scale" in r.getMessage()]
    assert len(msgs) == 1 and PREFIX["o"] in msgs[0] and "row 5, K-block 2 (columns 32-47)" in msgs[0]
    assert torch.isfinite(forward(layer, _x(384))).all()
