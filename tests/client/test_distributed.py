"""Plans under data parallelism (NOTE [ plans under data parallelism ] in remat.client.model_wrappers): two ranks
on CPU (gloo over loopback) train ResNet-18, and a two-block GPT-2 under DDP, with and without a plan, under
DistributedDataParallel and FSDP (tests/client/distributed_ranks.py). The oracle is the unmodified model under
the same wrapper, same seed, same batches: gradients ``torch.equal`` after the wrapper's reduction, on both
ranks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

RANKS = Path(__file__).with_name("distributed_ranks.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What both ranks recorded (one run of the two processes for every test here)."""
    out = tmp_path_factory.mktemp("ranks")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "GLOO_SOCKET_IFNAME": "lo",
           "REMAT_DATABASE_URL": f"sqlite:///{out / 'local.sqlite'}", "REMAT_PLAN_CACHE_DIR": str(out / "plans"),
           "OMP_NUM_THREADS": "1"}
    for name in ("REMAT_SERVER", "REMAT_API_TOKEN"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, str(RANKS), str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"rank{k}.json").read_text()) for k in range(2)]


@pytest.mark.parametrize("wrapper", ["ddp", "ddp_gpt2", "ddp_wrapped_first", "fully_shard_one_unit", "fsdp1_one_unit"])
def test_a_plan_trains_bit_equal_under_ddp_and_fsdp_of_the_whole_model(ranks: list[dict[str, Any]],
                                                                        wrapper: str) -> None:
    for rank in ranks:
        run = rank[wrapper]
        assert run["equal"], run
        # The plan ran: the forward saved a handful of tensors outside its checkpoints, not every activation.
        assert run["saved_applied"] < run["saved_unmodified"] / 4, run


@pytest.mark.parametrize(("case", "names"), [
    ("fully_shard_blocks", ["layer1.0 was sharded with fully_shard", "as one unit", "DistributedDataParallel"]),
    ("fsdp1_blocks", ["layer1.0 was sharded with FullyShardedDataParallel", "as one unit"]),
    ("dtensor_parameter_after_the_plan", ["parameter fc.weight is a DTensor in training"]),
])
def test_fsdp_units_inside_an_applied_model_are_refused_at_its_first_training_call(ranks: list[dict[str, Any]],
                                                                                   case: str, names: list[str]) -> None:
    _refused_in_one_line(ranks, case, "remat: ", names)


def _refused_in_one_line(ranks: list[dict[str, Any]], case: str, prefix: str, names: list[str]) -> None:
    """Both ranks got remat's ModelError for ``case``: one line, starting with ``prefix``, naming ``names``."""
    for rank in ranks:
        assert rank[case] is not None and rank[case]["type"] == "ModelError", rank[case]
        message = rank[case]["message"]
        assert message.startswith(prefix) and "\n" not in message, message
        for name in names:
            assert name in message, message


def test_apply_and_fetch_refuse_data_parallel_before_tracing_or_asking_a_service() -> None:
    """No process group needed: the wrapper is refused before the model is traced or a server is reached
    (port 9 on loopback: nothing is asked)."""
    from torch import nn

    import remat.client
    from remat.client.errors import ModelError
    from remat.client.plan import Plan

    model = nn.DataParallel(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    plan = Plan(algorithm="linear", cost_model="pytorch", checkpoints=(), predicted_peak_bytes=1,
                baseline_peak_bytes=1, num_stages=2)
    with pytest.raises(ModelError, match=r"^apply: the model is wrapped in torch\.nn\.DataParallel"):
        remat.client.apply(model, plan)
    for call in (remat.client.fetch_plan, remat.client.fetch_and_apply):
        with pytest.raises(ModelError, match=rf"^{call.__name__}: the model is wrapped in torch\.nn\.DataParallel"):
            call(model, (2, 4), server="http://127.0.0.1:9")
    assert "forward" not in model.module.__dict__  # nothing was applied


@pytest.mark.parametrize(("case", "names"), [
    ("sharded_first", ["the model is already sharded with fully_shard", "call checkpoint first"]),
    ("data_parallel", ["torch.nn.DataParallel", "DistributedDataParallel"]),
    ("dtensor_parameter", ["parameter fc.weight is a DTensor"]),
])
def test_a_model_sharded_or_replicated_before_checkpoint_is_refused_in_one_line(ranks: list[dict[str, Any]],
                                                                                case: str, names: list[str]) -> None:
    _refused_in_one_line(ranks, case, "checkpoint: ", names)
