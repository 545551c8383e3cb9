"""What ``b12x-dual diff`` reads: a model's quantized linears as (name, weight, bias, options), and
their inputs.

MODEL is one of:

* a checkpoint folder (config.json with a ``quantization_config`` + ``*.safetensors``):
  compressed-tensors (NVFP4, NVFP4A16, FP8 per tensor, FP8_DYNAMIC, FP8_BLOCK, MXFP8, MXFP8A16, MXFP4), ModelOpt (NVFP4,
  MXFP8) or DeepSeek-style ``Fp8Config`` block FP8. Each module's tensors are recognised by name and
  dtype and converted by the vLLM plugin's converters (dispatch.vllm_plugin.convert, which check
  them), after renaming them the way vLLM leaves them on a layer:

      CT nvfp4      weight_packed -> weight; weight_global_scale g_w -> 1/g_w; input_global_scale g_x
      ModelOpt nvfp4  weight_scale_2 (= 1/g_w) as is; input_scale (= 1/g_x) -> g_x
      mxfp4         weight_packed -> weight; W4A16 when the config quantizes no input activations
      fp8 block     weight_scale or weight_scale_inv [ceil(N/128), K/128] (fp32 or E8M0)
      fp8 tensor    weight_scale with one element; input_scale when static
      fp8 channel   weight_scale [N, 1] or [N] (one per output channel); input_scale when static
      mxfp8         weight e4m3, weight_scale E8M0 bytes; W8A16 when the config quantizes no input activations

  Modules with a plain float weight (ignored layers) are not quantized linears and are left out.
* this project's safetensors file (``save_quantized``; dispatch.quant_linear.read_quantized);
* a folder whose config.json builds a transformers model (no quantization_config): the model is
  loaded with transformers and every nn.Linear quantized to ``--format`` (quantize_model).

MoE layers (dispatch.moe_check.MoELayer) are read beside the linears, in the same forward order:

* a transformers folder whose MoE blocks hold their experts as 3-D parameters (Qwen3-MoE:
  ``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) and a top-k router
  (``mlp.gate``: weight [E, H], ``top_k``, ``norm_topk_prob``): each expert's W13 and W2
  quantized to ``--format`` with the oracle (one global scale per expert's W13 for nvfp4);
* a checkpoint whose experts are modules ``<layer>.experts.<e>.{gate_proj, up_proj, down_proj}``
  (``w1``, ``w3``, ``w2`` too; compressed-tensors / llm-compressor's MoE layout, as vLLM loads
  it): each converted as a linear, gate and up stacked into W13 [2I, H] (they must share an NVFP4
  global scale and static input scales, as vLLM's MoE method requires; FP8 per-tensor weight
  scales are merged to the larger, vLLM's requantize_with_max_scale); the router is
  ``<layer>.gate.weight`` (float), top_k ``num_experts_per_tok`` and renormalize
  ``norm_topk_prob`` (default true) of config.json, activation ``hidden_act`` (silu).

An MoE layer is named after the module that holds the experts and the router (``model.layers.0.mlp``);
``--layers`` matches that name or ``<name>.experts``.

Inputs: seeded random activations (dispatch.apps._harness.make_input); the model's own forward on
``--text`` (hooks on each nn.Linear capture its input; the checkpoint families through
transformers' compressed-tensors support where it can build the model); or ``--inputs FILE``, a
safetensors file {layer name: activations [..., K]} (``--save-inputs`` writes one).
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from dispatch.moe_check import MoELayer
from formats import QuantizedTensor
from formats.validate import scan_raw


@dataclass
class Layer:
    """One quantized linear: name, variant, weight [N, K], bias [N] or None, activation options."""

    name: str
    variant: str
    qweight: QuantizedTensor
    bias: Optional[torch.Tensor] = None
    act_opts: dict = field(default_factory=dict)


@dataclass
class Model:
    """The layers of a MODEL (quantized linears, :class:`Layer`, and MoE layers, MoELayer), in forward
    order, and what it is (``kind``); ``float_model`` is the
    transformers model for --text (None when there is none); ``refused``: {module: findings} of
    checkpoint modules whose values the converters refuse (formats.validate.scan_raw on the stored
    tensors), which no implementation can run; ``order``: how the forward order was found; ``notes``:
    how MoE routers were read, and expert modules read as dense linears (one line each)."""

    path: str
    kind: str
    layers: list  # Layer and MoELayer, in forward order
    skipped: dict = field(default_factory=dict)
    float_model: object = None
    refused: dict = field(default_factory=dict)
    order: str = ""
    notes: list = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Forward order and the two spellings of a layer name
# ---------------------------------------------------------------------------------------------
ROLE_ORDER = (
    "embed_tokens", "embeddings", "self_attn", "attention", "attn", "self_attention", "self",
    "q_proj", "query", "k_proj", "key", "v_proj", "value", "qkv_proj", "query_key_value", "Wqkv",
    "o_proj", "out_proj", "dense", "mlp", "feed_forward", "ffn", "block_sparse_moe", "experts",
    "intermediate", "gate_proj", "w1", "up_proj", "w3", "gate_up_proj", "fc1", "down_proj", "w2", "fc2",
    "output", "norm", "lm_head",
)
"""The order modules run in within a layer, by the names common architectures give them (Llama,
Mistral, Qwen, BERT, GPT-NeoX, Mixtral): the fallback when transformers cannot build the model."""


def canonical(name: str) -> str:
    """A layer name without the causal-LM wrapper's ``model.`` prefix: a transformers folder
    (``AutoModel``) names a layer ``layers.0.mlp.up_proj``, its checkpoint ``model.layers.0.mlp.up_proj``."""
    return name[len("model."):] if name.startswith("model.") else name


def spellings(name: str) -> tuple[str, ...]:
    """The names a --layers pattern may use for a layer: as the model names it, without the
    ``model.`` prefix, and with it."""
    c = canonical(name)
    return (name, c, "model." + c)


def _role_key(name: str) -> tuple:
    """Numeric components as numbers (layers.2 before layers.10), names by :data:`ROLE_ORDER`."""
    key = []
    for part in canonical(name).split("."):
        if part.isdigit():
            key.append((0, int(part), ""))
        else:
            key.append((1, ROLE_ORDER.index(part) if part in ROLE_ORDER else len(ROLE_ORDER), part))
    return tuple(key)


def meta_model(folder: Path):
    """The model ``folder``'s config.json describes (transformers' ``AutoModel``), built on the meta
    device (no weights, no quantizer), or None where transformers is missing or cannot build it."""
    try:
        import transformers
        from transformers import AutoConfig, AutoModel
    except ImportError:
        return None
    transformers.logging.set_verbosity_error()
    try:
        cfg = AutoConfig.from_pretrained(str(folder))
        with torch.device("meta"):
            return AutoModel.from_config(cfg)
    except Exception:  # noqa: BLE001  (any failure: the callers fall back)
        return None


def module_order(folder: Path, net=None) -> Optional[dict[str, int]]:
    """{canonical module name: its index in the model's own module order} for the model that
    ``folder``'s config.json describes (``net``: :func:`meta_model`'s, built here when None), or None
    where transformers is missing or cannot build it."""
    net = meta_model(folder) if net is None else net
    if net is None:
        return None
    return {canonical(n): i for i, (n, _m) in enumerate(net.named_modules())}


def checkpoint_renamer(model_type: str):
    """A function: a checkpoint's module name -> the name transformers' model gives that module, by the
    renamings transformers applies when it loads a checkpoint of ``model_type``
    (transformers.conversion_mapping: Mixtral's ``block_sparse_moe`` is its model's ``mlp``); the
    identity where transformers has none (or is missing)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        renamings = [t for t in (get_checkpoint_conversion_mapping(model_type) or [])
                     if isinstance(t, WeightRenaming)]
    except Exception:  # noqa: BLE001  (no mapping: names as stored)
        renamings = []

    def rename(name: str) -> str:
        key = name + ".weight"  # the renamings match tensor keys
        for t in renamings:
            key, _ = t.rename_source_key(key)
        return key[:-len(".weight")]

    return rename


def forward_order(layers: list, order: Optional[dict[str, int]],
                  source: str = "transformers, built on the meta device", rename=None) -> tuple[list[Layer], str]:
    """``layers`` sorted in the model's forward order, and how it was found: the model's module order
    (``order``, from :func:`module_order`) where it names the layer (``rename``: a checkpoint name ->
    the model's, :func:`checkpoint_renamer`), else the numeric layer index (layers.2 before
    layers.10) then the usual order of module roles within a layer (attention before MLP; q, k, v,
    o; gate, up, down: :data:`ROLE_ORDER`)."""
    rename = rename or (lambda n: n)
    known = order if order and any(rename(canonical(lay.name)) in order for lay in layers) else {}
    how = (f"the model's module order ({source})" if known
           else "layer index, then module role (no model definition here)")

    def key(lay: Layer) -> tuple:
        c = rename(canonical(lay.name))
        return (0, known[c], ()) if c in known else (1, 0, _role_key(lay.name))

    return sorted(layers, key=key), how


E4M3 = torch.float8_e4m3fn
E8M0 = (torch.uint8,) + ((torch.float8_e8m0fnu,) if hasattr(torch, "float8_e8m0fnu") else ())


def _read_folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"MODEL {str(folder)!r}: config.json has a quantization_config but the folder has no "
                         "*.safetensors files")
    out = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def _has_input_activations(qcfg: dict) -> bool:
    """Whether a quantization_config quantizes activations (CT config_groups' input_activations)."""
    groups = qcfg.get("config_groups") or {}
    if groups:
        return any((g or {}).get("input_activations") for g in groups.values())
    algo = str(qcfg.get("quant_algo", "")).upper()
    return "W4A16" not in algo


def _recip(t: torch.Tensor) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32) / t.float().reshape(())


class _Params:
    """The tensors of one module, named as vLLM leaves them on a layer (for convert.py)."""

    def __init__(self, prefix: str, **tensors):
        self.prefix = prefix
        for k, v in tensors.items():
            setattr(self, k, v)


def convert_module(prefix: str, t: dict[str, torch.Tensor], qcfg: dict) -> tuple[Optional[Layer], Optional[str]]:
    """One checkpoint module's tensors (leaf name -> tensor) -> (Layer, None), or (None, why it is
    not a quantized linear). Raises dispatch.vllm_plugin.convert.CheckpointError (a ValueError)
    naming the module and tensor for a malformed quantized module."""
    from dispatch.vllm_plugin import convert

    bias = t.get("bias")
    packed = t.get("weight_packed", t.get("weight"))
    scale = t.get("weight_scale", t.get("weight_scale_inv"))
    if packed is None:
        return None, "no weight"
    if scale is None:
        return None, f"weight is {str(packed.dtype).replace('torch.', '')} with no scale (not quantized)"
    if packed.dtype == torch.uint8:  # e2m1 codes, two per byte
        if scale.dtype == E4M3:
            a16 = "input_global_scale" not in t and "input_scale" not in t
            if "weight_scale_2" in t:  # ModelOpt: the dequantization multiplier 1/g_w, input 1/g_x
                wgs, igs = t["weight_scale_2"], (None if a16 else _recip(t["input_scale"]))
            else:  # compressed-tensors: the divisors g_w, g_x
                wgs, igs = _recip(t["weight_global_scale"]), t.get("input_global_scale")
            p = _Params(prefix, weight=packed, weight_scale=scale, weight_global_scale=wgs,
                        input_global_scale_inv=igs)
            qw, opts = convert.nvfp4(p, a16=a16)
            variant = "nvfp4_w4a16" if a16 else "nvfp4"
        else:
            qw, opts = convert.mxfp4(_Params(prefix, weight=packed, weight_scale=scale))
            variant = "mxfp4" if _has_input_activations(qcfg) else "mxfp4_w4a16"
    elif packed.dtype == E4M3:
        n, k = packed.shape
        if scale.dtype in E8M0 and tuple(scale.shape) == (n, k // 32):
            qw, opts = convert.mxfp8(_Params(prefix, weight=packed, weight_scale=scale), n, k)
            variant = "mxfp8" if _has_input_activations(qcfg) else "mxfp8_w8a16"
        elif scale.numel() == 1:
            p = _Params(prefix, weight=packed, weight_scale=scale, input_scale=t.get("input_scale"))
            qw, opts = convert.fp8_tensor(p, n, k, static_input="input_scale" in t)
            opts = {k2: v for k2, v in opts.items() if v is not None}
            variant = "fp8_tensor"
        elif tuple(scale.shape) in ((n, 1), (n,)):
            p = _Params(prefix, weight=packed, weight_scale=scale, input_scale=t.get("input_scale"))
            qw, opts = convert.fp8_channel(p, n, k, static_input="input_scale" in t)
            opts = {k2: v for k2, v in opts.items() if v is not None}
            variant = "fp8_channel"
        elif scale.dim() == 2 and tuple(scale.shape) == (-(-n // 128), k // 128):
            name = "weight_scale_inv" if "weight_scale_inv" in t else "weight_scale"
            qw, opts = convert.fp8_block(_Params(prefix, weight=packed, **{name: scale}), n, k)
            variant = "fp8_block"
        else:
            return None, (f"e4m3 weight {tuple(packed.shape)} with scale {tuple(scale.shape)} "
                          f"{str(scale.dtype).replace('torch.', '')}: not a scheme b12x-dual serves "
                          "(per-tensor, per-channel, 128x128 blocks or MX 1x32)")
    else:
        return None, f"weight is {str(packed.dtype).replace('torch.', '')} (not quantized)"
    return Layer(prefix, variant, qw, None if bias is None else bias.to(torch.bfloat16), opts), None


EXPERT_MODULE = re.compile(r"^(?P<layer>.+)\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)$")
"""An expert's module in a checkpoint: ``<layer>.experts.<e>.<proj>`` (gate_proj/w1, up_proj/w3, down_proj/w2)."""
DENSE_EXPERTS = re.compile(r"^(?P<layer>.+\.experts)\.")
"""A module under an ``experts`` container: read as a dense linear unless EXPERT_MODULE matches it."""
_PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def fuse_w13(gate: QuantizedTensor, up: QuantizedTensor, what: str) -> QuantizedTensor:
    """One expert's gate [I, H] and up [I, H] weights stacked into W13 [2I, H] (gate rows first, as
    formats.reference_moe's silu reads them). NVFP4: the two must share one global scale; FP8 per
    tensor: the one with the smaller scale is re-encoded under the larger (vLLM's
    requantize_with_max_scale); fp8_block: I must hold whole 128-row blocks. ValueError naming
    ``what`` otherwise."""
    from dispatch.check import linear_scales

    if (gate.fmt, gate.shape) != (up.fmt, up.shape):
        raise ValueError(f"{what}: gate and up differ ({gate.fmt} {gate.shape} vs {up.fmt} {up.shape})")
    if gate.global_scale is not None and not torch.equal(gate.global_scale.float().reshape(()),
                                                         up.global_scale.float().reshape(())):
        raise ValueError(f"{what}: gate and up have different NVFP4 weight global scales "
                         f"({float(gate.global_scale):g} and {float(up.global_scale):g}); an expert's W13 has one "
                         "(compressed-tensors shares it over gate and up, and vLLM's MoE method requires it)")
    n, k = gate.shape
    if gate.block_shape is None:  # fp8_tensor: one scale per tensor
        from dispatch.vllm_plugin.moe import _requantize_to_max

        scales = torch.stack([gate.scale.float().reshape(()), up.scale.float().reshape(())]).reshape(1, 2)
        data = torch.cat([gate.data, up.data]).unsqueeze(0)
        codes = _requantize_to_max(data, scales)[0]
        return QuantizedTensor(gate.fmt, "weight", codes, scales.amax().reshape(()), None, None, (2 * n, k))
    br = gate.block_shape[0]
    if n % br:
        raise ValueError(f"{what}: {gate.fmt} weight blocks are {br} rows; the expert's I={n} must hold whole "
                         "blocks to stack gate and up into W13")
    scale = torch.cat([linear_scales(gate), linear_scales(up)])
    return QuantizedTensor(gate.fmt, "weight", torch.cat([gate.data, up.data]).contiguous(), scale.contiguous(),
                           gate.global_scale, gate.block_shape, (2 * n, k))


def _stack_opts(opts: list[dict], what: str) -> dict:
    """Per-expert activation options -> one dict (a tensor option: [E] values, one per expert)."""
    keys = set().union(*[o.keys() for o in opts]) if opts else set()
    out = {}
    for key in keys:
        vals = [o.get(key) for o in opts]
        if any(v is None for v in vals):
            raise ValueError(f"{what}: activation option {key!r} is given for some experts only")
        if isinstance(vals[0], torch.Tensor):
            out[key] = torch.stack([v.float().reshape(()) for v in vals])
        elif len(set(vals)) == 1:
            out[key] = vals[0]
        else:
            raise ValueError(f"{what}: activation option {key!r} differs between experts ({vals[:4]})")
    return out


PROBE_ROWS = 32
"""Rows of the seeded random input a router is probed on (:func:`router_renormalizes`)."""


def router_renormalizes(name: str, router, top_k: int) -> bool:
    """Whether a transformers top-k router module (``router.weight`` [E, H]) renormalizes the top-k
    softmax weights it returns, read from its own output.

    The router runs on PROBE_ROWS seeded random rows x [32, H] (float32, unit normal). It must return
    (logits, scores [32, top_k], indices [32, top_k]) as transformers 5's top-k routers do
    (Qwen3MoeTopKRouter, MixtralTopKRouter), select the experts dispatch.moe_check.route_tokens
    selects (softmax of x . W^T in float32, top_k) in the same order, and return as scores either
    their softmax weights (False: Qwen3 with ``norm_topk_prob`` off) or those divided by their sum
    (True: Mixtral always; Qwen3 with ``norm_topk_prob``), within 2^-20 relative (float32 sums in
    another order). Raises ValueError naming the layer and the router's class for a router diff
    would read wrongly (a bias, a sigmoid, grouped top-k, a scaling factor, another output), or
    whose probe rows cannot tell the two apart (every row's top-k mass within 2^-20 of 1)."""
    from dispatch.moe_check import route_tokens

    what = f"MoE layer {name}: router {type(router).__name__}"
    weight = getattr(router, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{what} has no weight [E, H]; diff reads softmax top-k routers (x . W^T)")
    x = torch.randn(PROBE_ROWS, weight.shape[1], generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            out = router(x.to(weight.device, weight.dtype))
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"{what} cannot be run on [{PROBE_ROWS}, H] rows here ({type(e).__name__}: {e})") from None
    if not (isinstance(out, tuple) and len(out) == 3 and all(isinstance(t, torch.Tensor) for t in out)):
        raise ValueError(f"{what} does not return (logits, top-k weights, top-k indices); diff cannot read its "
                         "routing")
    _, scores, idx = out
    ids, w = route_tokens(x, weight.float(), top_k)
    ids, w = ids.to(idx.device), w.to(idx.device)
    if tuple(idx.shape) != tuple(ids.shape) or not torch.equal(idx.to(torch.int32), ids):
        raise ValueError(f"{what} selects other experts than the softmax top-{top_k} of x . W^T (a bias, a "
                         "sigmoid or grouped routing); diff's routing would not be the model's")
    plain, renormed = w, w / w.sum(dim=-1, keepdim=True)
    if torch.allclose(plain, renormed, rtol=2.0 ** -20, atol=0.0):
        raise ValueError(f"{what}: its top-{top_k} softmax weights sum to 1 on every probe row, so whether it "
                         "renormalizes cannot be read from its output; diff's routing would be a guess")
    for renorm, want in ((False, plain), (True, renormed)):
        if torch.allclose(scores.float(), want, rtol=2.0 ** -20, atol=0.0):
            return renorm
    raise ValueError(f"{what} weights the top-{top_k} experts neither by their softmax probabilities nor by those "
                     "renormalized to sum 1 (a scaling factor?); diff's routing would not be the model's")


def _checkpoint_router(net, rename, name: str, tensors: dict):
    """The router module of checkpoint MoE layer ``name`` as transformers builds it (``net``: the
    meta-device model, :func:`meta_model`) holding the checkpoint's tensors ``tensors`` (leaf ->
    tensor), or None where there is no such module or its tensors are not all in the checkpoint."""
    import copy

    if net is None:
        return None
    try:
        meta = net.get_submodule(rename(canonical(name)) + ".gate")
    except AttributeError:
        return None
    keys = set(meta.state_dict())
    if not keys or not keys <= set(tensors):
        return None
    router = copy.deepcopy(meta).to_empty(device="cpu")
    try:
        router.load_state_dict({k: tensors[k] for k in keys}, strict=True)
    except (RuntimeError, ValueError):  # a shape or dtype transformers' module does not take
        return None
    return router.float().eval()


def _renormalize_of(name: str, router, top_k: int, config: dict) -> tuple[bool, str]:
    """(renormalize, how it was read): the router module's own output (:func:`router_renormalizes`)
    where there is one, else config.json's ``norm_topk_prob``. ValueError naming the layer when
    neither says."""
    if router is not None:
        r = router_renormalizes(name, router, top_k)
        return r, (f"{type(router).__name__}: softmax top-{top_k}, "
                   f"{'renormalized to sum 1' if r else 'not renormalized'} (read from its own output)")
    if "norm_topk_prob" in config:
        r = bool(config["norm_topk_prob"])
        return r, f"softmax top-{top_k}, {'renormalized' if r else 'not renormalized'} (config.json norm_topk_prob)"
    raise ValueError(f"MoE layer {name}: cannot tell whether its router renormalizes the top-{top_k} weights: "
                     f"config.json has no norm_topk_prob, and no router module transformers builds here for model_type "
                     f"{config.get('model_type')!r} takes the checkpoint's '{name}.gate' tensors")


def _moe_from_modules(name: str, experts: dict, modules: dict, qcfg: dict, config: dict, net=None,
                      rename=None, notes: Optional[list] = None) -> MoELayer:
    """One MoE layer of a checkpoint from its experts' modules {e: {"gate"|"up"|"down": (prefix, tensors)}}.
    ``net`` / ``rename``: the meta-device model and the checkpoint's renamings (:func:`meta_model`,
    :func:`checkpoint_renamer`), whose router module says whether the top-k weights are
    renormalized (else config.json's norm_topk_prob); ``notes`` receives how. Raises CheckpointError
    from the converters (with the module's prefix) and ValueError for a layer that is not one
    (missing projections, no router, another activation, a router diff cannot read)."""
    E = max(experts) + 1
    missing = [f"expert {e} {p}" for e in range(E) for p in ("gate", "up", "down") if p not in experts.get(e, {})]
    if missing:
        raise ValueError(f"MoE layer {name}: checkpoint module(s) missing: {', '.join(missing[:6])}")
    router = modules.get(f"{name}.gate", {}).get("weight")
    if router is None or not router.is_floating_point() or router.dim() != 2 or router.shape[0] != E:
        raise ValueError(f"MoE layer {name}: no float router weight '{name}.gate.weight' [E={E}, H] in the checkpoint")
    act = str(config.get("hidden_act", "silu"))
    if act != "silu":
        raise ValueError(f"MoE layer {name}: activation {act!r}; diff reads checkpoint MoE layers with 'silu' "
                         "(Qwen3-MoE, Mixtral)")
    w13, w2, o13, o2 = [], [], [], []
    variant = None
    for e in range(E):
        got = {}
        for proj in ("gate", "up", "down"):
            prefix, t = experts[e][proj]
            lay, why = convert_module(prefix, t, qcfg)
            if lay is None:
                raise ValueError(f"MoE layer {name}: expert {e} {proj} ({prefix}) is not quantized ({why})")
            got[proj] = lay
        variant = got["gate"].variant
        if got["gate"].act_opts.keys() != got["up"].act_opts.keys() or any(
                not torch.equal(torch.as_tensor(got["gate"].act_opts[k]), torch.as_tensor(got["up"].act_opts[k]))
                for k in got["gate"].act_opts):
            raise ValueError(f"MoE layer {name}: expert {e}: gate and up have different static input scales; an "
                             "expert's W13 has one (vLLM's MoE method requires it)")
        w13.append(fuse_w13(got["gate"].qweight, got["up"].qweight, f"MoE layer {name}: expert {e}"))
        w2.append(got["down"].qweight)
        o13.append(got["gate"].act_opts)
        o2.append(got["down"].act_opts)
    top_k = int(config.get("num_experts_per_tok", config.get("num_experts_per_token", 2)))
    module = _checkpoint_router(net, rename or (lambda n: n), name, modules.get(f"{name}.gate", {}))
    renorm, how = _renormalize_of(name, module, top_k, config)
    if notes is not None and f"routers: {how}" not in notes:
        notes.append(f"routers: {how}")
    return MoELayer(name, variant, w13, w2, router.float(), top_k, renorm, act,
                    _stack_opts(o13, f"MoE layer {name} W13"), _stack_opts(o2, f"MoE layer {name} W2"))


def load_checkpoint(folder: Path, config: dict) -> Model:
    """A compressed-tensors / ModelOpt / Fp8Config checkpoint folder -> its quantized linears and MoE layers."""
    qcfg = config.get("quantization_config") or {}
    tensors = _read_folder_tensors(folder)
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        prefix, _, leaf = key.rpartition(".")
        modules.setdefault(prefix, {})[leaf] = t
    from dispatch.vllm_plugin.convert import CheckpointError

    layers, skipped, refused = [], {}, {}
    moe: dict[str, dict[int, dict]] = {}
    for prefix, t in modules.items():
        m = EXPERT_MODULE.match(prefix)
        if m and ("weight" in t or "weight_packed" in t):
            moe.setdefault(m["layer"], {}).setdefault(int(m["e"]), {})[_PROJ[m["proj"]]] = (prefix, t)
    routers = {f"{name}.gate" for name in moe}
    for prefix, t in modules.items():
        if "weight" not in t and "weight_packed" not in t:
            continue
        if EXPERT_MODULE.match(prefix) or prefix in routers:
            continue
        try:
            layer, why = convert_module(prefix, t, qcfg)
        except CheckpointError:
            # a value the converters refuse (a NaN or zero scale): a checkpoint finding, located in
            # the stored tensors; any other refusal (a dtype, a shape) is a bad MODEL
            findings = [f for leaf, v in sorted(t.items()) for f in scan_raw(v, f"{prefix}.{leaf}")]
            if not findings:
                raise
            refused[prefix] = findings
            continue
        if layer is None:
            skipped[prefix] = why
        else:
            layers.append(layer)
    net = meta_model(folder)
    rename = checkpoint_renamer(str(config.get("model_type", "")))
    notes: list[str] = []
    for name, experts in moe.items():
        try:
            layers.append(_moe_from_modules(name, experts, modules, qcfg, config, net, rename, notes))
        except CheckpointError:
            findings = [dict(f, expert=e) for e, projs in sorted(experts.items())
                        for _p, (prefix, t) in sorted(projs.items())
                        for leaf, v in sorted(t.items()) for f in scan_raw(v, f"{prefix}.{leaf}")]
            if not findings:
                raise
            refused[name] = findings
    kind = str(qcfg.get("quant_method", "?"))
    layers, how = forward_order(layers, module_order(folder, net) if net is not None else None, rename=rename)
    dense = sorted({m["layer"] for p in (lay.name for lay in layers if isinstance(lay, Layer))
                    if (m := DENSE_EXPERTS.match(p))})
    notes += [f"{d}: expert modules not named <layer>.experts.<e>.<proj> (gate_proj/w1, up_proj/w3, down_proj/w2): "
              "diff reads their linears as dense linears (no routing)" for d in dense]
    return Model(str(folder), f"checkpoint ({kind})", layers, skipped, refused=refused, order=how, notes=notes)


def load_own(path: Path) -> Model:
    """This project's safetensors file (save_quantized) -> its layers."""
    from dispatch.quant_linear import read_quantized

    layers = [Layer(name, m["variant"], q, None if b is None else b.to(torch.bfloat16))
              for name, (q, b, m) in read_quantized(path).items()]
    layers, how = forward_order(layers, None)
    return Model(str(path), "b12x-dual safetensors", layers, order=how)


def _transformers(what: str):
    try:
        import transformers
    except ImportError as e:
        raise ValueError(f"{what} needs transformers, which is not importable ({e}); install it with: "
                         "pip install 'b12x-dual[demo]'") from None
    return transformers


def load_transformers(folder: Path, fmt: str, patterns: Optional[list[str]] = None) -> Model:
    """A folder whose config.json builds a transformers model: every nn.Linear the format allows (of
    those ``patterns`` select, see :func:`select`) quantized with the oracle (dispatch.quantize_model)."""
    import copy

    transformers = _transformers(f"MODEL {str(folder)!r} (a transformers model folder)")
    from transformers import AutoModel

    from dispatch.quant_linear import QuantLinear, quantize_model

    transformers.logging.set_verbosity_error()
    try:
        model = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"MODEL {str(folder)!r}: transformers cannot build the model from its config.json "
                         f"({type(e).__name__}: {e})") from None
    names = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    blocks = {n: m for n, m in model.named_modules() if _moe_block(m)}
    everything = [Layer(n, fmt, None) for n in names] + [_stub(n) for n in blocks]
    chosen = {lay.name for lay in select(everything, patterns)}
    wanted = chosen - set(blocks)
    qmodel = quantize_model(copy.deepcopy(model), fmt, skip=lambda name, _m: name not in wanted)
    layers = [Layer(name, m.variant, m.qweight, None if m.bias is None else m.bias.detach().to(torch.bfloat16),
                    dict(m.act_opts))
              for name, m in qmodel.named_modules() if isinstance(m, QuantLinear)]
    notes: list[str] = []
    layers += [moe_from_block(n, m, fmt, notes) for n, m in blocks.items() if n in chosen]
    layers, how = forward_order(layers, {canonical(n): i for i, (n, _m) in enumerate(model.named_modules())},
                                "the transformers model built here")
    notes += dense_expert_notes(model, blocks)
    return Model(str(folder), f"transformers model quantized to {fmt}", layers,
                 {k: v for k, v in getattr(qmodel, "b12x_skipped", {}).items() if k in wanted}, float_model=model,
                 order=how, notes=notes)


def dense_expert_notes(model, blocks: dict) -> list[str]:
    """One line per expert container of a transformers model that is not read as an MoE layer (not
    inside a block :func:`_moe_block` recognises). transformers 5.20 keeps SwitchTransformers' and
    NLLB-MoE's experts as an nn.ModuleDict of per-expert MLPs (top-1 routers with their own capacity
    rules), ViTPose's as an nn.ModuleList of linears indexed by dataset: their nn.Linear layers are
    diffed as dense linears, without routing. Other containers hold 3-D expert parameters in a block
    diff does not read (a router not named ``gate`` or without ``top_k``, as Llama 4's sigmoid
    ``router``; another layout, as Llama 4's gate_up_proj [E, H, 2I]): they are not diffed at all."""
    out = []
    for n, m in model.named_modules():
        if any(n == b or n.startswith(b + ".") for b in blocks):
            continue
        if not (n.rsplit(".", 1)[-1] == "experts" or type(m).__name__.endswith(("Experts", "NaiveMoe"))):
            continue
        if isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            out.append(f"{n} ({type(m).__name__}, an nn.{type(m).__bases__[0].__name__} of per-expert modules): "
                       "diff reads its experts' linears as dense linears (no routing)")
        elif any(p.dim() == 3 for p in m.parameters(recurse=False)):
            out.append(f"{n} ({type(m).__name__}): 3-D expert parameters in a block diff does not read as an MoE "
                       "layer (it reads experts.gate_up_proj [E, 2I, H], down_proj [E, H, I] with a top-k router "
                       "'gate'); not diffed")
    return out


def _moe_block(m) -> bool:
    """A transformers MoE block with 3-D expert parameters in Qwen3-MoE's / Mixtral's layout
    (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) and a top-k router ``gate``."""
    ex, gate = getattr(m, "experts", None), getattr(m, "gate", None)
    gu, dn = getattr(ex, "gate_up_proj", None), getattr(ex, "down_proj", None)
    return (isinstance(gu, torch.Tensor) and gu.dim() == 3 and isinstance(dn, torch.Tensor) and dn.dim() == 3
            and gu.shape[0] == dn.shape[0] and gu.shape[2] == dn.shape[1] and gu.shape[1] == 2 * dn.shape[2]
            and isinstance(getattr(gate, "weight", None), torch.Tensor) and hasattr(gate, "top_k"))


def _stub(name: str) -> MoELayer:
    return MoELayer(name, "", [], [])


def moe_from_block(name: str, block, fmt: str, notes: Optional[list] = None) -> MoELayer:
    """A transformers MoE block (Qwen3-MoE, Mixtral: experts.gate_up_proj [E, 2I, H] gate rows first,
    experts.down_proj [E, H, I], gate.weight [E, H], gate.top_k, the experts' act_fn) -> MoELayer,
    each expert's W13 and W2 quantized to ``fmt`` (a registry variant) with the oracle
    (formats.quantize); whether the top-k weights are renormalized is read from the router's own
    output (:func:`router_renormalizes`: Qwen3's ``norm_topk_prob``, Mixtral's always), and how is
    appended to ``notes``. ValueError for an activation other than silu or a router diff cannot read."""
    from dispatch import registry
    from formats import quantize

    act = type(getattr(block.experts, "act_fn", None)).__name__.lower()
    if "silu" not in act and "swish" not in act:
        raise ValueError(f"MoE layer {name}: activation {act!r}; diff reads transformers MoE blocks with silu")
    v = registry.variant(fmt)
    gu, dn = block.experts.gate_up_proj.detach().float(), block.experts.down_proj.detach().float()
    w13 = [quantize(gu[e], v.fmt) for e in range(gu.shape[0])]
    w2 = [quantize(dn[e], v.fmt) for e in range(dn.shape[0])]
    top_k = int(block.gate.top_k)
    renorm, how = _renormalize_of(name, block.gate, top_k, {})
    if notes is not None and f"routers: {how}" not in notes:
        notes.append(f"routers: {how}")
    return MoELayer(name, v.name, w13, w2, block.gate.weight.detach().float(), top_k, renorm, "silu")


def load_model(path: str, fmt: str = "nvfp4", patterns: Optional[list[str]] = None) -> Model:
    """MODEL -> Model. ``patterns``: the --layers selection (a transformers model quantizes only
    those; the other kinds are selected from afterwards, by :func:`select`). Raises ValueError naming
    MODEL: no such file or folder, a folder without config.json, a file that is not a b12x-dual
    safetensors file, a model with no quantized linears; or a pattern that matches no layer."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"MODEL {path!r}: no such file or folder")
    if p.is_file():
        m = load_own(p)
    else:
        cfg_path = p / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"MODEL {path!r}: the folder has no config.json (expected a checkpoint folder, a "
                             "transformers model folder or a b12x-dual .safetensors file)")
        config = json.loads(cfg_path.read_text())
        m = load_checkpoint(p, config) if config.get("quantization_config") else load_transformers(p, fmt, patterns)
    if not m.layers and not m.refused:
        raise ValueError(f"MODEL {path!r}: no quantized linear layers found ({m.kind})")
    return m


def matches(name: str, pattern: str) -> bool:
    """Whether a --layers pattern (a name or an fnmatch glob) matches a layer, in either spelling
    (:func:`spellings`: ``layers.0.mlp.up_proj`` and ``model.layers.0.mlp.up_proj`` are one layer)."""
    return any(fnmatch.fnmatchcase(n, pattern) for n in spellings(name))


def select(layers: list[Layer], patterns: Optional[list[str]], also: tuple[str, ...] = ()) -> list[Layer]:
    """The layers whose name matches any pattern (:func:`matches`), in their order; all when
    ``patterns`` is None. ``also``: further names a pattern may match (modules the checkpoint
    stage refused). ValueError naming each pattern that matches nothing, with a few names that exist."""
    if not patterns:
        return layers
    names = [n for lay in layers for n in _names(lay)] + list(also)
    dead = [pat for pat in patterns if not any(matches(n, pat) for n in names)]
    if dead:
        raise ValueError(f"--layers {','.join(dead)!r} matches no quantized layer; layers are e.g. "
                         f"{names[:4]} ({len(names)} in all)")
    return [lay for lay in layers if any(matches(n, pat) for pat in patterns for n in _names(lay))]


def _names(lay) -> tuple[str, ...]:
    """The names a pattern may match: a linear's; an MoE layer's and ``<name>.experts``."""
    return (lay.name, lay.name + ".experts") if isinstance(lay, MoELayer) else (lay.name,)


def capture_text(model: Model, text: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Run the model's own forward on ``text`` and capture each linear's (and MoE block's) input
    [tokens, K] in ``dtype``.

    The transformers model of a transformers folder is used as is; for a checkpoint folder,
    transformers builds it (its compressed-tensors support decompresses the weights). Raises
    ValueError naming MODEL when transformers cannot build it here, or for a b12x-dual file (no
    model to run)."""
    if model.kind == "b12x-dual safetensors":
        raise ValueError(f"--text needs a model to run; MODEL {model.path!r} is a b12x-dual safetensors file "
                         "(weights only): pass --inputs FILE, or the model's folder")
    _transformers("--text")
    from transformers import AutoModel, AutoTokenizer

    net = model.float_model
    if net is None:
        try:
            # transformers' compressed-tensors support decompresses the quantized linears to bf16;
            # the whole forward then runs in bf16
            net = AutoModel.from_pretrained(model.path, dtype=torch.bfloat16).eval()
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"--text: transformers cannot build MODEL {model.path!r} here "
                             f"({type(e).__name__}: {e}); pass --inputs FILE instead") from None
    try:
        tok = AutoTokenizer.from_pretrained(model.path)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"--text: MODEL {model.path!r} has no tokenizer transformers can load "
                         f"({type(e).__name__}: {e}); pass --inputs FILE instead") from None
    wanted = {canonical(lay.name): lay.name for lay in model.layers}  # the checkpoint's spelling may differ
    moe = {canonical(lay.name) for lay in model.layers if isinstance(lay, MoELayer)}  # an MoE block's input
    got: dict[str, torch.Tensor] = {}
    hooks = []
    for name, mod in net.named_modules():
        if canonical(name) in wanted and (isinstance(mod, torch.nn.Linear) or canonical(name) in moe):
            def hook(m, args, name=wanted[canonical(name)]):
                got[name] = args[0].detach().reshape(-1, args[0].shape[-1]).to(dtype)
            hooks.append(mod.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            net(**tok(text, return_tensors="pt"))
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"--text: the forward of MODEL {model.path!r} failed here ({type(e).__name__}: {e}); "
                         "pass --inputs FILE instead") from None
    finally:
        for h in hooks:
            h.remove()
    return got


def read_inputs(path: str) -> dict[str, torch.Tensor]:
    """--inputs FILE: a safetensors file {layer name: activations [..., K]}. ValueError naming the
    file when it cannot be read."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"--inputs {path!r}: cannot read it as a safetensors file ({type(e).__name__}: {e})") from None
