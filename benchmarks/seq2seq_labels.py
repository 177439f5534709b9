"""Encoder–decoders trained with ``labels=``: their chain, and `none` and `linear` predicted beside measured.

Given labels, BART, T5 and their kin shift them right into the decoder's input ids before the encoder runs
(NOTE [ parked values ] in remat.client.graph.boundaries). Each model is built from its configuration (random
weights, nothing downloaded) at a moderate size, profiled on one call (batch × tokens, labels as long as the
input), planned with `none` and `linear`, and each plan measured in a real training step (the worker's
measured step: CPU live-storage meter). That they train bit-equal is benchmarks/hf_breadth.py's question.

    uv run python benchmarks/seq2seq_labels.py                      # bart, t5, marian
    uv run python benchmarks/seq2seq_labels.py --models bart --layers 6 --batch 8 --tokens 128
"""

from __future__ import annotations

import argparse
import warnings

import torch

_BART_LIKE = {"encoder_layers": "L", "decoder_layers": "L", "d_model": 128, "encoder_attention_heads": 4,
              "decoder_attention_heads": 4, "encoder_ffn_dim": 512, "decoder_ffn_dim": 512,
              "max_position_embeddings": 512}
SIZES = {"bart": _BART_LIKE, "marian": {**_BART_LIKE, "decoder_start_token_id": 1},
         "t5": {"num_layers": "L", "num_decoder_layers": "L", "d_model": 128, "d_ff": 512, "d_kv": 32, "num_heads": 4,
                "decoder_start_token_id": 0}}
"""Configuration fields per model; "L" is ``--layers``."""
VOCAB = 1000


def build(name: str, layers: int) -> torch.nn.Module:
    import transformers

    fields = {k: layers if v == "L" else v for k, v in SIZES[name].items()}
    config = transformers.AutoConfig.for_model(name, vocab_size=VOCAB, pad_token_id=0, use_cache=False, **fields)
    torch.manual_seed(0)
    return transformers.AutoModelForSeq2SeqLM.from_config(config).train()


def main() -> None:
    from remat.client.graph.model_call import ModelCall
    from remat.client.graph.stage_graph import build_stage_chain
    from remat.client.planning.plans import make_plan
    from remat.worker.measure import measure_step
    from remat.worker.profilers import profile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bart,t5,marian")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print("| model | stages (in the encoder) | plan | checkpoints | predicted | measured | error |")
    print("|---|---|---|---:|---:|---:|---:|")
    for name in args.models.split(","):
        model = build(name, args.layers)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(3, VOCAB, (args.batch, args.tokens), generator=gen)
        call = ModelCall.bind(model, (), {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                          "labels": torch.randint(3, VOCAB, (args.batch, args.tokens), generator=gen)})
        chain = build_stage_chain(model, call)
        in_encoder = sum(1 for stage in chain.names if stage.split("..")[-1].startswith(("model.encoder", "encoder")))
        trace = profile(model, call, chain=chain, grads="kept", timing_repeats=0)
        for algorithm in ("none", "linear"):
            plan = make_plan(trace, algorithm, cost_model="pytorch")
            m = measure_step(model, call, plan.checkpoints, grads="kept", chain=chain, trace=trace, baseline=False)
            error = (m.predicted_peak_bytes - m.measured_peak_bytes) / m.measured_peak_bytes
            print(f"| {name} | {chain.num_stages} ({in_encoder}) | `{algorithm}` | {len(plan.checkpoints)} | "
                  f"{m.predicted_peak_bytes / 2**20:.1f} MiB | {m.measured_peak_bytes / 2**20:.1f} MiB | "
                  f"{100 * error:+.2f}% |", flush=True)


if __name__ == "__main__":
    main()
