"""Architecture hash and plan key: stable where plans transfer, different where they do not."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torchvision
from torch import nn

from remat.client.errors import PlanError
from remat.client.graph.built_model import key_for_model
from remat.client.graph.hashing import architecture_hash
from remat.client.graph.stage_graph import trace_model
from remat.client.plan_key import KEY_FIELDS, PlanKey, current_torch_version


def _mlp(width: int = 16, blocks: int = 2) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(8, width)]
    for _ in range(blocks):
        layers += [nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, width)]
    return nn.Sequential(*layers, nn.Linear(width, 2))


def _resnet18_hash(seed: int) -> str:
    torch.manual_seed(seed)
    return architecture_hash(torchvision.models.resnet18(num_classes=10))


def test_same_architecture_other_weights_same_hash_in_another_process() -> None:
    here = _resnet18_hash(0)
    assert len(here) == 64 and int(here, 16) >= 0
    assert _resnet18_hash(1) == here
    code = textwrap.dedent(
        """
        import torch, torchvision
        from remat.client.graph.hashing import architecture_hash
        torch.manual_seed(7)
        model = torchvision.models.resnet18(num_classes=10)
        model.to(torch.float32).eval()  # mode and a no-op move: neither is part of the architecture
        print(architecture_hash(model))
        """
    )
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "99"},
    )
    assert other.stdout.strip() == here


def test_graph_argument_gives_the_same_hash() -> None:
    model = _mlp()
    assert architecture_hash(model, graph=trace_model(model)) == architecture_hash(model)
    assert architecture_hash(model, graph=trace_model(model).graph) == architecture_hash(model)
    assert architecture_hash(model, graph=trace_model(model, train=False)) == architecture_hash(model)


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(lambda: _mlp(width=17), id="layer width"),
        pytest.param(lambda: _mlp(blocks=3), id="one extra block"),
        pytest.param(lambda: _mlp().double(), id="dtype"),
        pytest.param(lambda: _mlp().requires_grad_(False), id="frozen"),
    ],
)
def test_architecture_changes_change_the_hash(other: object) -> None:
    assert architecture_hash(other()) != architecture_hash(_mlp())  # type: ignore[operator]


def test_hyper_parameters_without_shapes_change_the_hash() -> None:
    a, b = _mlp(), _mlp()
    b[1].eps = 1e-3  # BatchNorm eps: same shapes, other computation
    assert architecture_hash(a) != architecture_hash(b)


def test_resnet_width_and_depth_change_the_hash() -> None:
    base = _resnet18_hash(0)
    assert architecture_hash(torchvision.models.resnet18(num_classes=11)) != base
    assert architecture_hash(torchvision.models.resnet34(num_classes=10)) != base


def test_plan_keys_differ_by_input_shape_and_name_the_difference() -> None:
    model = _mlp()
    a = key_for_model(model, (4, 8))
    b = key_for_model(model, (8, 8))
    assert a != b
    assert a.describe_mismatch(b) == "input_shape: [4, 8] vs [8, 8]"
    assert a.describe_mismatch(key_for_model(model, (4, 8))) is None
    c = key_for_model(_mlp(width=17), (4, 8), grads="kept")
    message = a.describe_mismatch(c)
    assert message is not None and message.startswith("model_hash: ") and "grads: none vs kept" in message


def test_plan_key_round_trip_and_normalisation() -> None:
    key = PlanKey(
        model_hash="ab" * 32,
        input_shape=[2, 3, 64, 64],  # type: ignore[arg-type]
        dtype="torch.bfloat16",
        device="cuda:1",
        torch_version="2.15.0+cu132",
        grads="kept",
    )
    assert key.input_shape == (2, 3, 64, 64)
    assert (key.dtype, key.device, key.torch_version, key.mode) == ("bfloat16", "cuda", "2.15", "train")
    assert tuple(key.to_dict()) == KEY_FIELDS
    assert PlanKey.from_dict(key.to_dict()) == key
    # A trace's metadata carries the same names plus others, which are ignored.
    metadata = {**key.to_dict(), "model": "resnet18", "device_name": "H100", "batch_size": 2}
    assert PlanKey.from_dict(metadata) == key
    assert PlanKey(model_hash="x", input_shape=(1,)).torch_version == current_torch_version()


@pytest.mark.parametrize(
    ("change", "field"),
    [({"mode": "training"}, "mode"), ({"grads": "zero"}, "grads"), ({"input_shape": [2, 0]}, "input_shape"),
     ({"model_hash": ""}, "model_hash"), ({"torch_version": "latest"}, "torch_version")],
)
def test_plan_key_rejects_bad_fields(change: dict, field: str) -> None:
    with pytest.raises(PlanError, match=field):
        PlanKey.from_dict({"model_hash": "ab", "input_shape": [2, 3], **change})
    with pytest.raises(PlanError, match="input_shape"):
        PlanKey.from_dict({"model_hash": "ab"})


class _Heads(nn.Module):
    """Two inputs and a reshape whose shape names the batch, as attention does: export writes the batch
    size into the graph."""

    def __init__(self, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        y = self.proj(x).reshape(b, t, self.heads, c // self.heads).transpose(1, 2)
        return (y.softmax(-1) * mask[:, None, :, None]).sum()


def _call_hash(model: nn.Module, batch: int, seq: int = 5, cache_dir: object = None) -> str:
    from remat.client.graph.model_call import ModelCall

    gen = torch.Generator().manual_seed(batch)
    call = ModelCall.bind(model, (), {"x": torch.randn(batch, seq, 8, generator=gen), "mask": torch.ones(batch, seq)})
    return architecture_hash(model, graph=trace_model(model, train=True, call=call, cache_dir=cache_dir))


def test_an_exported_model_has_one_hash_at_every_batch_size_from_two(tmp_path) -> None:
    """Profiles of one architecture at batch 2 and 4 must find each other (derived traces), though export
    writes the batch into every reshape; a batch of 1 keeps its own graph, and other architectures, other
    sequence lengths and other head counts keep other hashes."""
    model = _Heads()
    at_two = _call_hash(model, 2, cache_dir=tmp_path)
    assert _call_hash(model, 3, cache_dir=tmp_path) == at_two
    assert _call_hash(model, 7, cache_dir=tmp_path) == at_two
    assert _call_hash(model, 7) == at_two  # no disk cache: the same description, exported afresh
    assert _call_hash(model, 1, cache_dir=tmp_path) != at_two
    assert _call_hash(model, 4, seq=6, cache_dir=tmp_path) != at_two
    assert _call_hash(_Heads(heads=4), 4, cache_dir=tmp_path) != at_two
    # what is hashed at batch 7 is the graph at batch 2, not the one at hand
    from remat.client.graph.model_call import ModelCall

    call = ModelCall.bind(model, (), {"x": torch.randn(7, 5, 8), "mask": torch.ones(7, 5)})
    gm = trace_model(model, train=True, call=call, cache_dir=tmp_path)
    assert "7" in str([n.args for n in gm.graph.nodes])
    assert architecture_hash(model, graph=gm) == at_two


def test_the_hash_at_another_batch_is_kept_in_the_graph_cache_and_a_bad_file_is_ignored(tmp_path) -> None:
    """A start at batch 7 stores its hash beside the exported graphs, so the next start need not rebuild the
    graph at batch 2; a file of another format or a malformed one is recomputed and rewritten."""
    import json

    model = _Heads()
    at_two = _call_hash(model, 2)
    assert _call_hash(model, 7, cache_dir=tmp_path) == at_two
    (stored,) = (tmp_path / "graphs").glob("*.hash.json")
    assert json.loads(stored.read_text())["architecture_hash"] == at_two
    for bad in ("{", json.dumps({"format": "other"}), json.dumps({**json.loads(stored.read_text()),
                                                                  "architecture_hash": "not hex"})):
        stored.write_text(bad)
        assert _call_hash(model, 7, cache_dir=tmp_path) == at_two
    assert json.loads(stored.read_text())["architecture_hash"] == at_two
