"""Two-tower models (CLIP): the chain through both towers, and plans predicted beside measured.

CLIP runs its image tower, then its text tower, then a contrastive loss that reads both. The image embedding
waits through the text tower (NOTE [ parked values ] in remat.client.graph.boundaries), and the stage that makes
it also starts the text tower, so that stage's backward is reached by the embedding's gradient alone; the
profiler seeds it (NOTE [ seeding a stage's exports ] in remat.worker.profilers.export_seeds). The model is built
from its configuration (random weights, nothing downloaded), profiled on one call (gradients kept), and
`none`, `linear`, `chen-sqrt` and ``--random`` random plans are each measured in the worker's measured step
(the CPU live-storage meter). That it trains bit-equal is benchmarks/hf_breadth.py's question.

    uv run python benchmarks/two_towers.py
    uv run python benchmarks/two_towers.py --layers 2 --width 64 --batch 4 --random 4
"""

from __future__ import annotations

import argparse
import random
import warnings

import torch

VOCAB = 1000


def build(layers: int, width: int, image: int) -> torch.nn.Module:
    import transformers

    config = transformers.AutoConfig.for_model("clip", projection_dim=width // 2)
    tower = {"num_hidden_layers": layers, "hidden_size": width, "intermediate_size": 4 * width,
             "num_attention_heads": max(1, width // 32)}
    config.text_config.update({**tower, "vocab_size": VOCAB, "max_position_embeddings": 128})
    config.vision_config.update({**tower, "image_size": image, "patch_size": 8})
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(config).train()


def main() -> None:
    from remat.client.graph.model_call import ModelCall
    from remat.client.graph.stage_graph import build_stage_chain
    from remat.client.planning.plans import make_plan
    from remat.worker.measure import measure_step
    from remat.worker.profilers import profile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="blocks per tower")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--image", type=int, default=64, help="image side in pixels (patches of 8)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--random", type=int, default=10, help="random plans besides the planners'")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    model = build(args.layers, args.width, args.image)
    gen = torch.Generator().manual_seed(1)
    call = ModelCall.bind(model, (), {"input_ids": torch.randint(3, VOCAB, (args.batch, args.tokens), generator=gen),
                                      "pixel_values": torch.randn(args.batch, 3, args.image, args.image, generator=gen),
                                      "return_loss": True})
    chain = build_stage_chain(model, call)
    towers = {tower: sum(1 for name in chain.names if name.startswith(f"{tower}_model"))
              for tower in ("vision", "text")}
    print(f"{chain.num_stages} stages: {towers['vision']} in the image tower, {towers['text']} in the text tower")
    trace = profile(model, call, chain=chain, grads="kept", timing_repeats=0)
    n = trace.num_stages
    plans = {algorithm: make_plan(trace, algorithm, cost_model="pytorch").checkpoints
             for algorithm in ("none", "linear", "chen-sqrt")}
    rng = random.Random(0)
    for k in range(args.random):
        plans[f"random {k + 1}"] = tuple(sorted(rng.sample(range(1, n), rng.randint(1, max(1, (n - 1) // 2)))))
    print("| plan | checkpoints | predicted | measured | error (bytes) |")
    print("|---|---:|---:|---:|---:|")
    for name, checkpoints in plans.items():
        m = measure_step(model, call, checkpoints, grads="kept", chain=chain, trace=trace, baseline=False)
        error = m.predicted_peak_bytes - m.measured_peak_bytes
        print(f"| `{name}` | {len(checkpoints)} | {m.predicted_peak_bytes / 2**20:.2f} MiB | "
              f"{m.measured_peak_bytes / 2**20:.2f} MiB | {100 * error / m.measured_peak_bytes:+.2f}% ({error:+d}) |",
              flush=True)


if __name__ == "__main__":
    main()
