"""An applied transformer in an accelerate loop (transformers' ``no_trainer`` examples), against the same model
trained without remat.

Needs ``accelerate``, which remat does not depend on: ``uv run --with accelerate python
benchmarks/hf_accelerate.py --mixed-precision bf16``. A tiny GPT-2 (4 blocks, dropout on) is planned with
``remat.client.checkpoint`` (under ``accelerator.autocast()``, so that the plan is made for the precision the
loop trains in), prepared with its optimizer, and trained ``--steps`` AdamW steps the way those examples write
the loop (``outputs = model(**batch); loss = outputs.loss; accelerator.backward(loss)``). Prints whether every
loss and final parameter is ``torch.equal`` to the unmodified model's, and remat's warnings (the loop holds
``outputs`` through backward: docs/apply.md, Limits). One precision per process: accelerate's state is global.

    uv run --with accelerate python benchmarks/hf_accelerate.py --mixed-precision no
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _train(planned: bool, precision: str, steps: int, cache: str) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                                                        list[str]]:
    from accelerate import Accelerator

    import remat.client
    from tests.utils.tiny_transformers import batch, tiny

    accelerator = Accelerator(cpu=True, mixed_precision=precision)
    model = tiny("gpt2", layers=4)
    if planned:
        with accelerator.autocast():
            remat.client.checkpoint(model, cache_dir=cache, **batch(seed=1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = []
    torch.manual_seed(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            outputs = model(**batch(seed=10 + step))
            loss = outputs.loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
    told = [str(w.message) for w in caught if str(w.message).startswith("remat")]
    return losses, [p.detach().clone() for p in model.parameters()], told


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mixed-precision", choices=["no", "bf16"], default="no")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        plain = _train(False, args.mixed_precision, args.steps, cache)
        planned = _train(True, args.mixed_precision, args.steps, cache)
    same_losses = all(torch.equal(a, b) for a, b in zip(plain[0], planned[0], strict=True))
    same_params = all(torch.equal(a, b) for a, b in zip(plain[1], planned[1], strict=True))
    print(f"mixed precision {args.mixed_precision}: every loss equal: {'yes' if same_losses else 'NO'}; "
          f"every final parameter equal: {'yes' if same_params else 'NO'}")
    for message in planned[2]:
        print(f"  warned: {message}")


if __name__ == "__main__":
    main()
