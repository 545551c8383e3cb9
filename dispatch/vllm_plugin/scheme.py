"""Which variant a layer serves, read from the checkpoint's own quantization scheme.

vLLM builds a layer's kernel from its scheme class, and some of its classes stand for more than
one checkpoint scheme: vLLM 0.32 and 0.33 map every compressed-tensors MXFP4-weight scheme to the
W4A4 class (``CompressedTensorsW4A4Mxfp4``, whose activation key defaults to dynamic MXFP4) and
every MXFP8-weight scheme to the W8A8 class, so a weight-only MXFP4A16 or MXFP8A16 checkpoint
would have its activations quantized although it keeps them in bf16 (they are served as
mxfp4_w4a16 and mxfp8_w8a16). The plugin therefore asks the
checkpoint, not vLLM's scheme object, what the layer's activations are:

    compressed-tensors   ``quant_config.get_scheme_dict(layer, prefix)``: the ``weights`` and
                         ``input_activations`` QuantizationArgs of the config group that targets
                         the layer (compressed-tensors' ``PRESET_SCHEMES`` write these)
    other families       (ModelOpt, DeepSeek's ``Fp8Config``) have one scheme per quant_algo,
                         which vLLM maps one to one: the kernel class's variant stands

:func:`variant_of` is the table, a pure function of the two QuantizationArgs; :func:`read` applies
it to a loaded vLLM layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class CheckpointScheme:
    """What a checkpoint says of one layer, and what b12x-dual serves for it.

    ``text`` describes the scheme in the checkpoint's own terms (for messages); ``variant`` is the
    registry variant that computes exactly that scheme, or None with ``why`` when b12x-dual has
    none (the layer is then refused at load, by name)."""

    family: str
    text: str
    variant: Optional[str]
    why: str = ""


def _get(args: Any, name: str, default=None):
    v = getattr(args, name, None) if not isinstance(args, dict) else args.get(name)
    v = default if v is None else v
    return getattr(v, "value", v)  # compressed-tensors enums (strategy, type) as their strings


def describe(args: Any) -> str:
    """One QuantizationArgs as text: ``float8 channel static``, ``float4 group 32 dynamic``."""
    if args is None:
        return "none (kept in the model's dtype)"
    kind = f"{_get(args, 'type', '?')}{_get(args, 'num_bits', '?')}"
    strategy = _get(args, "strategy", "?")
    group = _get(args, "group_size")
    block = _get(args, "block_structure")
    dyn = _get(args, "dynamic", False)
    parts = [kind, str(strategy)]
    if group:
        parts.append(str(group))
    if block:
        parts.append("x".join(str(b) for b in block))
    parts.append("dynamic" if dyn is True else ("dynamic local" if dyn == "local" else "static"))
    return " ".join(parts)


def _is_float(args, bits: int) -> bool:
    return args is not None and _get(args, "type") == "float" and _get(args, "num_bits") == bits


def variant_of(weights: Any, inputs: Any) -> tuple[Optional[str], str]:
    """The registry variant for a compressed-tensors (weights, input_activations) pair.

    Args:
        weights: the config group's ``weights`` QuantizationArgs (or a dict of its fields).
        inputs: its ``input_activations`` QuantizationArgs, or None for a weight-only scheme.

    Returns:
        (variant, why): the variant that computes the scheme as written, or (None, the reason)
        where b12x-dual has none. Pure: no vLLM or torch needed.
    """
    ws, wg = _get(weights, "strategy"), _get(weights, "group_size")
    istrat = _get(inputs, "strategy") if inputs is not None else None
    if _is_float(weights, 4) and ws == "tensor_group" and wg == 16:  # NVFP4
        if inputs is None:
            return "nvfp4_w4a16", ""
        if _is_float(inputs, 4) and istrat == "tensor_group" and _get(inputs, "group_size") == 16:
            return "nvfp4", ""
        return None, "NVFP4 weights take NVFP4 activations (W4A4) or none (W4A16)"
    if _is_float(weights, 4) and ws == "group" and wg == 32:  # MXFP4
        if inputs is None:
            return "mxfp4_w4a16", ""
        if _is_float(inputs, 4) and istrat == "group" and _get(inputs, "group_size") == 32 \
                and _get(inputs, "dynamic") is True:
            return "mxfp4", ""
        return None, "MXFP4 weights are served with dynamic MXFP4 activations (W4A4) or none (W4A16)"
    if _is_float(weights, 8) and ws == "group" and wg == 32:  # MXFP8
        if inputs is None:
            return "mxfp8_w8a16", ""
        if _is_float(inputs, 8) and istrat == "group" and _get(inputs, "group_size") == 32 \
                and _get(inputs, "dynamic") is True:
            return "mxfp8", ""
        return None, "MXFP8 weights are served with dynamic MXFP8 activations (W8A8) or none (W8A16)"
    if _is_float(weights, 8) and ws == "block":
        if list(_get(weights, "block_structure") or []) != [128, 128]:
            return None, "block FP8 takes 128x128 weight blocks"
        if _is_float(inputs, 8) and istrat == "group" and _get(inputs, "group_size") == 128 \
                and _get(inputs, "dynamic") is True:
            return "fp8_block", ""
        return None, "block FP8 weights are served with dynamic 1x128 FP8 activation groups"
    if _is_float(weights, 8) and ws == "tensor":
        if _is_float(inputs, 8) and (istrat == "tensor" or (istrat == "token" and _get(inputs, "dynamic") is True)):
            return "fp8_tensor", ""
        return None, "per-tensor FP8 weights are served with FP8 activations (static or dynamic)"
    if _is_float(weights, 8) and ws == "channel":  # FP8_DYNAMIC: one weight scale per output channel
        dyn = _get(inputs, "dynamic") if inputs is not None else None
        if _is_float(inputs, 8) and ((istrat == "token" and dyn is True) or (istrat == "tensor" and dyn is False)):
            return "fp8_channel", ""
        return None, ("per-channel FP8 weights are served with FP8 activations scaled dynamically per token "
                      "or statically per tensor (fp8_channel)")
    return None, ("outside b12x-dual's formats (fp8_tensor, fp8_channel, fp8_block, mxfp8, nvfp4, mxfp4 and the "
                  "weight-only nvfp4_w4a16, mxfp4_w4a16, mxfp8_w8a16)")


def read(layer) -> Optional[CheckpointScheme]:
    """The checkpoint's scheme for a loaded vLLM linear layer, or None where the family has one
    scheme per kernel class (ModelOpt, ``Fp8Config``, online quantization): the class decides.

    Reads ``layer.quant_method.quantization_config`` (compressed-tensors' config) and the layer's
    ``prefix``; raises nothing (a layer it cannot read gives None).
    """
    method = getattr(layer, "quant_method", None)
    qc = getattr(method, "quantization_config", None) or getattr(method, "quant_config", None)
    if qc is None or not hasattr(qc, "get_scheme_dict"):
        return None
    try:
        d = qc.get_scheme_dict(layer, getattr(layer, "prefix", None))
    except Exception:  # noqa: BLE001  (an unreadable config: the kernel class's variant stands)
        return None
    if not d or d.get("weights") is None:
        return None
    w, a = d.get("weights"), d.get("input_activations")
    variant, why = variant_of(w, a)
    text = f"compressed-tensors weights {describe(w)}, input activations {describe(a)}"
    return CheckpointScheme("compressed-tensors", text, variant, why)
