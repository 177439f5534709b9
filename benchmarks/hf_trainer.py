"""An applied transformer under transformers' ``Trainer``, against the same model trained without remat.

Needs ``accelerate`` and ``datasets``, which remat does not depend on: ``uv pip install accelerate datasets``
into the environment first (``uv sync`` removes them again). A tiny GPT-2 (2 blocks, dropout on) is trained
``--steps`` AdamW steps on token rows of random lengths, collated by padding each batch to its longest row
(labels -100 on padding), once as it is and once after
``remat.client.checkpoint(model, **batch, num_items_in_batch=torch.tensor(1.0))`` on the first batch
(docs/apply.md, "With transformers' Trainer"). Prints the logged losses of both and whether every final
parameter is ``torch.equal``.

    uv run --no-sync python benchmarks/hf_trainer.py --steps 6
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    longest = max(len(row["input_ids"]) for row in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        ids[i, :n] = torch.tensor(row["input_ids"])
        mask[i, :n] = 1
        labels[i, :n] = ids[i, :n]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    import datasets
    import transformers

    import remat.client
    from tests.utils.tiny_transformers import tiny

    transformers.logging.set_verbosity_error()
    rng = random.Random(0)
    rows = [{"input_ids": [rng.randrange(512) for _ in range(rng.randint(12, 32))]}
            for _ in range(args.steps * args.batch)]
    dataset = datasets.Dataset.from_list(rows)
    base = tiny("gpt2")
    results = {}
    for name in ("unmodified", "remat"):
        model = copy.deepcopy(base)
        with tempfile.TemporaryDirectory() as tmp:
            if name == "remat":
                example = _collate(rows[: args.batch])
                remat.client.checkpoint(model, cache_dir=Path(tmp) / "plans", **example,
                                        num_items_in_batch=torch.tensor(1.0))
            training = transformers.TrainingArguments(
                output_dir=tmp, per_device_train_batch_size=args.batch, max_steps=args.steps, logging_steps=1,
                report_to=[], use_cpu=True, seed=0, save_strategy="no", disable_tqdm=True)
            trainer = transformers.Trainer(model=model, args=training, train_dataset=dataset, data_collator=_collate)
            trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        results[name] = (losses, [p.detach().clone() for p in model.parameters()])
        print(f"{name}: logged losses {losses}", flush=True)
    equal = all(torch.equal(a, b) for a, b in zip(results["unmodified"][1], results["remat"][1], strict=True))
    print(f"every final parameter equal: {'yes' if equal else 'NO'}")


if __name__ == "__main__":
    main()
