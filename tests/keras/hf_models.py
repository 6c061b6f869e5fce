"""Tiny Hugging Face models built from configs (no download), their data, and plain PyTorch's training.

Shared by tests/keras/test_hf_models.py and the workers of hf_mw_script.py (which import it as
``hf_models``). Everything is dropout-free and float64 by default, so that sg.Model's training can be
compared with a plain loop to rounding.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

VOCAB, LENGTH, ROWS, CLASSES = 40, 8, 23, 3
BATCH, EPOCHS = 8, 2   # 23 = 8 + 8 + 7: no replica of 4 gets an empty slice


def seeded(build: Callable[[], torch.nn.Module], dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """``build()`` seeded, its parameters created in ``dtype`` (not converted after: a module made
    in a strategy's scope is placed as it is created)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(0)
        return build()
    finally:
        torch.set_default_dtype(previous)


def bert(dtype: torch.dtype = torch.float64) -> BertForSequenceClassification:
    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, num_labels=CLASSES,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return seeded(lambda: BertForSequenceClassification(config), dtype)


def gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return seeded(lambda: GPT2LMHeadModel(config))


def bert_data() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``x`` as BERT's tokenizer gives it (ids, a padding mask), and the labels."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (ROWS, LENGTH), generator=generator)
    lengths = torch.randint(3, LENGTH + 1, (ROWS,), generator=generator)
    mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask}, torch.randint(0, CLASSES, (ROWS,), generator=generator)


def token_data() -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, LENGTH), generator=torch.Generator().manual_seed(2))


def next_token_loss(y: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-example loss of a causal language model: each position predicts the next token."""
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), y[:, 1:], reduction="none").mean(dim=1)


def plain_training(module: torch.nn.Module, x: Any, y: torch.Tensor, loss: Callable) -> torch.nn.Module:
    """Adam (lr 1e-3, Keras's "adam") over the batches fit(shuffle=False) reads: plain PyTorch."""
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    for _ in range(EPOCHS):
        for start in range(0, ROWS, BATCH):
            rows = slice(start, start + BATCH)
            outputs = module(**{k: v[rows] for k, v in x.items()}) if isinstance(x, dict) else module(x[rows])
            optimizer.zero_grad()
            loss(y[rows], outputs.logits).mean().backward()
            optimizer.step()
    return module


def sparse_cross_entropy(y: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, y, reduction="none")
