"""``remat.client.checkpoint`` across Hugging Face architectures beyond the allow-list: planned or refused why.

The allow-list (``remat.client.hf_models``) bounds what a service's workers build; ``checkpoint()`` takes any
model a training script holds. This script builds tiny models of many transformers families from their
configurations (random weights, nothing downloaded: two blocks, width 64, vocabulary 1000, dropout at each
configuration's default), gives ``checkpoint()`` one training call, and then trains it beside an unmodified
copy, from the same RNG state, on three calls: the example's sizes, a shorter one and a larger batch at a
longer one (images: batch 2, 2, 3), the two last on the export for any sizes or a graph of their own.

Reported per model: ``bit-equal`` (loss and every gradient ``torch.equal`` at all three calls), the number of
stages and of checkpoints in the applied ``linear`` plan with its predicted peak against the no-checkpoint
peak, the seconds ``checkpoint()`` took (export, probe, profile, plan, two measured steps); or the one-line
refusal. Every run starts from an empty plan cache and plan store.

    uv run python benchmarks/hf_breadth.py                 # every model (about 3 minutes on 2 cores)
    uv run python benchmarks/hf_breadth.py --only gpt2-classifier,m2m_100
    uv run python benchmarks/hf_breadth.py --without-padding   # all-ones masks, then a padded call
    uv run python benchmarks/hf_breadth.py --as-written        # labels=input_ids itself, use_cache as configured
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

VOCAB = 1000
SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 128, "head_dim": 16,
         "embedding_size": 64, "use_cache": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
         "decoder_start_token_id": 1}
SEQ2SEQ = {"encoder_layers": 2, "decoder_layers": 2, "d_model": 64, "encoder_attention_heads": 4,
           "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128}
Batches = list[dict[str, Any]]


def _config(model_type: str, *, small: bool = True, **fields: Any) -> Any:
    """The architecture's default configuration shrunk: SMALL's fields where it has them and can set them
    (``small``), then ``fields``."""
    import transformers

    config = transformers.AutoConfig.for_model(model_type)
    for key, value in SMALL.items() if small else ():
        if AS_WRITTEN and key == "use_cache":
            continue
        if hasattr(config, key):
            with contextlib.suppress(AttributeError):  # a derived field (Falcon's head_dim)
                setattr(config, key, value)
    for key, value in fields.items():
        setattr(config, key, value)
    return config


AS_WRITTEN = False
"""``--as-written``: calls as Hugging Face's own examples write them: a causal LM's ``labels`` is the
``input_ids`` tensor itself (NOTE [ inputs that alias ]), and each configuration keeps its own ``use_cache``
(NOTE [ training without the cache ])."""
WITHOUT_PADDING = False
"""``--without-padding``: the example and the 2 × 24 call have no padding (an all-ones mask), the 3 × 40 one
has, so that both attention paths run (NOTE [ masks without padding ] in client/graph/mask_skips.py)."""


def _tokens(b: int, s: int, seed: int, labels: str) -> dict[str, Any]:
    """Token ids with the last row padded (pad 0) over its 3 last positions (``WITHOUT_PADDING``: not below 40
    tokens), its mask, and labels: ``lm`` (the ids), ``seq2seq`` (half as long), ``class`` (one of 3 per row),
    ``token`` (one of 3 per token)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (b, s), generator=gen)
    if not WITHOUT_PADDING or s >= 40:
        ids[-1, s - 3:] = 0
    out: dict[str, Any] = {"input_ids": ids, "attention_mask": (ids != 0).long()}
    out["labels"] = {"lm": lambda: ids if AS_WRITTEN else ids.clone(),
                     "seq2seq": lambda: torch.randint(3, VOCAB, (b, s // 2), generator=gen),
                     "class": lambda: torch.randint(0, 3, (b,), generator=gen),
                     "token": lambda: torch.randint(0, 3, (b, s), generator=gen)}[labels]()
    return out


def _token_batches(labels: str) -> Batches:
    return [_tokens(2, 32, 1, labels), _tokens(2, 24, 2, labels), _tokens(3, 40, 3, labels)]


def _images(size: int = 32, segmentation: bool = False) -> Batches:
    out = []
    for seed, b in enumerate((2, 2, 3)):
        gen = torch.Generator().manual_seed(seed)
        labels = torch.randint(0, 10, (b, size, size) if segmentation else (b,), generator=gen)
        out.append({"pixel_values": torch.randn(b, 3, size, size, generator=gen), "labels": labels})
    return out


def _auto(kind: str) -> Any:
    import transformers

    return getattr(transformers, {"lm": "AutoModelForCausalLM", "mlm": "AutoModelForMaskedLM",
                                  "seq2seq": "AutoModelForSeq2SeqLM", "class": "AutoModelForSequenceClassification",
                                  "image": "AutoModelForImageClassification"}[kind])


def _text(model_type: str, kind: str, **fields: Any) -> Callable[[], tuple[torch.nn.Module, Batches]]:
    labels = {"lm": "lm", "mlm": "lm", "seq2seq": "seq2seq", "class": "class"}[kind]
    extra = {"num_labels": 3} if kind == "class" else {}
    return lambda: (_auto(kind).from_config(_config(model_type, **extra, **fields)), _token_batches(labels))


def _image(model_type: str, *, small: bool = True, size: int = 32,
           **fields: Any) -> Callable[[], tuple[torch.nn.Module, Batches]]:
    shrink = {"image_size": size, "patch_size": 8, "num_labels": 10, **fields}
    return lambda: (_auto("image").from_config(_config(model_type, small=small, **shrink)), _images(size))


def _whisper() -> tuple[torch.nn.Module, Batches]:
    import transformers

    config = _config("whisper", **SEQ2SEQ, num_mel_bins=16, max_source_positions=32, max_target_positions=64)
    batches = []
    for seed, (b, t) in enumerate(((2, 10), (2, 7), (3, 12))):
        gen = torch.Generator().manual_seed(seed)
        batches.append({"input_features": torch.randn(b, 16, 64, generator=gen),
                        "labels": torch.randint(3, VOCAB, (b, t), generator=gen)})
    return transformers.AutoModelForSpeechSeq2Seq.from_config(config), batches


def _clip() -> tuple[torch.nn.Module, Batches]:
    import transformers

    config = transformers.AutoConfig.for_model("clip")
    config.text_config.update({"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                               "num_attention_heads": 4, "vocab_size": VOCAB, "max_position_embeddings": 64})
    config.vision_config.update({"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                                 "num_attention_heads": 4, "image_size": 32, "patch_size": 8})
    config.projection_dim = 32
    batches = []
    for seed, (b, s) in enumerate(((2, 16), (2, 12), (3, 20))):
        gen = torch.Generator().manual_seed(seed)
        batches.append({"input_ids": torch.randint(3, VOCAB, (b, s), generator=gen),
                        "pixel_values": torch.randn(b, 3, 32, 32, generator=gen), "return_loss": True})
    return transformers.AutoModel.from_config(config), batches


def _segformer() -> tuple[torch.nn.Module, Batches]:
    import transformers

    config = transformers.AutoConfig.for_model(
        "segformer", num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
        num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2], decoder_hidden_size=32,
        num_labels=10)
    return transformers.AutoModelForSemanticSegmentation.from_config(config), _images(64, segmentation=True)


def _lora() -> tuple[torch.nn.Module, Batches]:
    """Llama with LoRA adapters on its attention's query and value projections (peft, when installed: ``uv pip
    install peft``; ``uv sync`` removes it again): the base weights frozen, the adapters' dropout on."""
    from peft import LoraConfig, get_peft_model

    adapters = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
    return get_peft_model(_auto("lm").from_config(_config("llama")), adapters), _token_batches("lm")


MODELS: dict[str, Callable[[], tuple[torch.nn.Module, Batches]]] = {
    # decoders (causal LM)
    **{name: _text(name, "lm") for name in (
        "gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi", "phi3", "gpt_neox",
        "falcon", "gpt_bigcode", "olmo", "stablelm", "starcoder2", "granite", "cohere", "mamba", "bloom")},
    "opt": _text("opt", "lm", ffn_dim=128, word_embed_proj_dim=64),
    "gptj": _text("gptj", "lm", rotary_dim=8, n_positions=128),
    "mixtral": _text("mixtral", "lm", num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": _text("qwen2_moe", "lm", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                       shared_expert_intermediate_size=64),
    "llama + LoRA (peft)": _lora,
    # classifiers: a decoder pools each row's last token that is not padding
    **{f"{name}-classifier": _text(name, "class") for name in ("gpt2", "llama", "qwen2", "bert")},
    # encoders (masked LM)
    **{name: _text(name, "mlm") for name in (
        "bert", "roberta", "distilbert", "electra", "albert", "deberta-v2", "xlm-roberta", "mpnet", "modernbert")},
    # encoder-decoders
    "t5": _text("t5", "seq2seq", decoder_start_token_id=0, num_layers=2, num_decoder_layers=2, d_model=64, d_ff=128,
                d_kv=16, num_heads=4),
    **{name: _text(name, "seq2seq", **SEQ2SEQ) for name in ("bart", "mbart", "pegasus", "blenderbot")},
    "marian": _text("marian", "seq2seq", **SEQ2SEQ, decoder_vocab_size=VOCAB),
    "m2m_100": _text("m2m_100", "seq2seq", **SEQ2SEQ),
    "m2m_100 (layerdrop 0)": _text("m2m_100", "seq2seq", **SEQ2SEQ, encoder_layerdrop=0.0, decoder_layerdrop=0.0),
    "whisper": _whisper,
    # vision, vision-language
    **{name: _image(name) for name in ("vit", "beit", "dinov2")},
    "swin": _image("swin", small=False, depths=[1, 1], num_heads=[2, 4], embed_dim=32, window_size=2, patch_size=4),
    "convnext": _image("convnext", small=False, size=64, depths=[1, 1, 1, 1], hidden_sizes=[16, 32, 64, 128]),
    "resnet (HF)": _image("resnet", small=False, depths=[1, 1, 1, 1], hidden_sizes=[16, 32, 64, 128],
                          embedding_size=16),
    "segformer": _segformer,
    "clip": _clip,
}


def _step(model: torch.nn.Module, call: dict[str, Any], seed: int) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    loss = model(**call).loss
    loss.backward()
    return loss.detach(), [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _same(a: tuple[torch.Tensor, list[torch.Tensor | None]], b: tuple[torch.Tensor, list[torch.Tensor | None]]) -> bool:
    return torch.equal(a[0], b[0]) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a[1], b[1], strict=True))


def run_one(name: str) -> str:
    import remat.client
    from remat.client.apply_plan import applied_plan

    torch.manual_seed(0)
    try:
        reference, batches = MODELS[name]()
    except Exception as exc:  # noqa: BLE001 - a configuration this transformers version does not build
        return f"| {name} | not built here: {type(exc).__name__}: {str(exc).splitlines()[0][:120]} | | | |"
    reference.train()
    model = copy.deepcopy(reference)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        os.environ["REMAT_DATABASE_URL"] = f"sqlite:///{cache}/store.db"
        try:
            remat.client.checkpoint(model, cache_dir=cache, **batches[0])
        except Exception as exc:  # noqa: BLE001 - the refusal is the result
            return f"| {name} | refused: {str(exc).splitlines()[0]} | | | |"
        took = time.perf_counter() - started
        plan = applied_plan(model)
        for seed, call in enumerate(batches):
            try:
                same = _same(_step(reference, call, seed), _step(model, call, seed))
            except Exception as exc:  # noqa: BLE001 - a training call refused is the result
                return f"| {name} | **refused at** {_sizes(call)}: {str(exc).splitlines()[0][:200]} | | | {took:.1f} |"
            if not same:
                return f"| {name} | **differs** at {_sizes(call)} | | | {took:.1f} |"
    assert plan is not None
    stages = plan.num_stages
    saving = f"{plan.predicted_peak_bytes / 2**20:.2f} of {plan.baseline_peak_bytes / 2**20:.2f} MiB"
    return f"| {name} | bit-equal | {stages} / {len(plan.checkpoints)} | {saving} | {took:.1f} |"


def _sizes(call: dict[str, Any]) -> str:
    return ", ".join(f"{k} {list(v.shape)}" for k, v in call.items() if isinstance(v, torch.Tensor))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated names of MODELS")
    parser.add_argument("--without-padding", action="store_true",
                        help="token calls at 2 x 32 and 2 x 24 without padding (all-ones masks), 3 x 40 padded")
    parser.add_argument("--as-written", action="store_true",
                        help="labels=input_ids (one tensor) for causal LMs, and each configuration's own use_cache")
    args = parser.parse_args()
    global WITHOUT_PADDING, AS_WRITTEN
    WITHOUT_PADDING, AS_WRITTEN = args.without_padding, args.as_written
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    names = [n for n in args.only.split(",") if n] or list(MODELS)
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        parser.error(f"unknown models: {', '.join(unknown)} (known: {', '.join(MODELS)})")
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    print("| model | result (3 training calls against the unmodified model) | stages / checkpoints, `linear` "
          "| `linear` predicted peak | checkpoint() s |")
    print("|---|---|---|---|---:|")
    for name in names:
        print(run_one(name), flush=True)


if __name__ == "__main__":
    main()
