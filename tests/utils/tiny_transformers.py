"""Tiny Hugging Face models built from configurations (random weights, nothing downloaded), for tests of
calls with several inputs. Dropout stays at each architecture's default (GPT-2, BERT, T5: 0.1), and Llama's
attention dropout is turned on, so that every bit-equality test also tests RNG replay."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

VOCAB = 512
BATCH, SEQ = 2, 32


def _quiet() -> None:
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", module="transformers")


PAD = 0
"""The pad token of the classifiers (``…-classifier``): they pool each row's last token that is not PAD."""


def tiny(arch: str, *, layers: int = 2) -> nn.Module:
    """A two-block model of ``arch`` in train mode: gpt2, llama, bert (masked LM), t5, bart, clip (two towers of
    two blocks), mixtral, bloom, and gpt2-classifier, llama-classifier (sequence classification, 3 labels)."""
    _quiet()
    torch.manual_seed(0)
    auto = transformers.AutoModelForCausalLM
    if arch.endswith("-classifier"):
        cfg = tiny(arch.removesuffix("-classifier"), layers=layers).config
        cfg.pad_token_id, cfg.num_labels = PAD, 3
        torch.manual_seed(0)
        return transformers.AutoModelForSequenceClassification.from_config(cfg).train()
    if arch == "bloom":
        cfg = transformers.AutoConfig.for_model("bloom", n_layer=layers, hidden_size=64, n_head=4, vocab_size=VOCAB,
                                                use_cache=False)
    elif arch == "gpt2":
        cfg = transformers.AutoConfig.for_model("gpt2", n_layer=layers, n_embd=64, n_head=4, vocab_size=VOCAB,
                                                n_positions=128, use_cache=False)
    elif arch == "llama":
        cfg = transformers.AutoConfig.for_model("llama", num_hidden_layers=layers, hidden_size=64,
                                                intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                                vocab_size=VOCAB, attention_dropout=0.1, use_cache=False)
    elif arch == "bert":
        cfg = transformers.AutoConfig.for_model("bert", num_hidden_layers=layers, hidden_size=64,
                                                intermediate_size=128, num_attention_heads=4, vocab_size=VOCAB)
        auto = transformers.AutoModelForMaskedLM
    elif arch == "t5":
        cfg = transformers.AutoConfig.for_model("t5", num_layers=layers, num_decoder_layers=layers, d_model=64,
                                                d_ff=128, num_heads=4, d_kv=16, vocab_size=VOCAB,
                                                decoder_start_token_id=0, use_cache=False)
        auto = transformers.AutoModelForSeq2SeqLM
    elif arch == "bart":  # labels shifted into the decoder's ids before the encoder runs (NOTE [ parked values ])
        cfg = transformers.AutoConfig.for_model("bart", encoder_layers=layers, decoder_layers=layers, d_model=64,
                                                encoder_ffn_dim=128, decoder_ffn_dim=128, encoder_attention_heads=4,
                                                decoder_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=64,
                                                use_cache=False)
        auto = transformers.AutoModelForSeq2SeqLM
    elif arch == "clip":  # two towers side by side until the loss: call it with clip_batch()
        cfg = transformers.AutoConfig.for_model("clip", projection_dim=32)
        cfg.text_config.update({"num_hidden_layers": layers, "hidden_size": 64, "intermediate_size": 128,
                                "num_attention_heads": 4, "vocab_size": VOCAB, "max_position_embeddings": 64})
        cfg.vision_config.update({"num_hidden_layers": layers, "hidden_size": 64, "intermediate_size": 128,
                                  "num_attention_heads": 4, "image_size": 32, "patch_size": 8})
        return transformers.AutoModel.from_config(cfg).train()
    elif arch == "mixtral":
        cfg = transformers.AutoConfig.for_model("mixtral", num_hidden_layers=layers, hidden_size=64,
                                                intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                                vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2,
                                                use_cache=False)
    else:
        raise ValueError(arch)
    model = auto.from_config(cfg)
    model.train()
    return model


def classifier_batch(*, seed: int = 0, seq: int = SEQ, size: int = BATCH) -> dict[str, Any]:
    """A sequence classifier's call: every row but the first padded (PAD) after a different length, the mask
    that says so, one label per row."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(PAD + 1, VOCAB, (size, seq), generator=gen)
    for row in range(1, size):
        ids[row, seq - 2 * row:] = PAD
    return {"input_ids": ids, "attention_mask": (ids != PAD).long(),
            "labels": torch.randint(0, 3, (size,), generator=gen)}


def batch(*, seed: int = 0, seq: int = SEQ, mask: bool = True, size: int = BATCH) -> dict[str, Any]:
    """One training call's keyword inputs: token ids, an attention mask (one padded position), labels."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (size, seq), generator=gen)
    out: dict[str, Any] = {"input_ids": ids, "labels": ids.clone()}
    if mask:
        attention = torch.ones_like(ids)
        attention[0, -1] = 0
        out["attention_mask"] = attention
    return out


def clip_batch(*, seed: int = 0, seq: int = 16, size: int = 4) -> dict[str, Any]:
    """A CLIP training call: token ids, 32² images, and the contrastive loss asked for."""
    gen = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(3, VOCAB, (size, seq), generator=gen),
            "pixel_values": torch.randn(size, 3, 32, 32, generator=gen), "return_loss": True}


Step = tuple[torch.Tensor, list[torch.Tensor | None]]


def step(model: nn.Module, kwargs: dict[str, Any], *, seed: int = 3) -> Step:
    """One training step from a fixed RNG state: the loss and every parameter gradient."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    loss = model(**kwargs).loss
    loss.backward()
    return loss.detach(), [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def chain_step(model: nn.Module, chain: Any, call: Any, checkpoints: tuple[int, ...], *, seed: int = 3) -> Step:
    """``step`` run through a stage chain (``chain.run_call``) with ``checkpoints`` kept."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    loss = chain.run_call(call, checkpoints).loss
    loss.backward()
    return loss.detach(), [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def same_step(a: Step, b: Step) -> bool:
    """Loss and every gradient ``torch.equal``."""
    if not torch.equal(a[0], b[0]) or len(a[1]) != len(b[1]):
        return False
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a[1], b[1], strict=True))
