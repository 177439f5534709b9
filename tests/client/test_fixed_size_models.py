"""Models built for one input size (vision transformers, MaxViT): remat profiles them at that size, takes it
from the argument that builds them for another, and refuses any other ``--input-shape`` in one line naming
that argument, before building anything. A timm model says it is one in its configuration
(``fixed_input_size``); before, CPU requests scaled its images to 128 px and every plan failed in its forward."""

from __future__ import annotations

import json

import pytest

from remat.client import model_spec
from remat.client.errors import ModelError
from remat.client.request import DEFAULT_CPU_RESOLUTION, check_fixed_size, default_request
from tests.utils.cli import run_cli


def _sample_shape(spec: str, model_kwargs: dict[str, object] | None = None, device: str = "cpu") -> tuple[int, ...]:
    return default_request(spec, batch_size=None, sample_shape=None, device=device, grads="none",
                           model_kwargs=model_kwargs).sample_shape


@pytest.mark.parametrize("spec, model_kwargs, shape", [
    ("vit_b_16", None, (3, 224, 224)),
    ("vit_b_16", {"image_size": 32}, (3, 32, 32)),
    ("vit_h_14", {"image_size": 28, "num_layers": 1}, (3, 28, 28)),
    ("maxvit_t", {"input_size": [112, 224]}, (3, 112, 224)),
    ("timm:vit_tiny_patch16_224", None, (3, 224, 224)),
    ("timm:vit_tiny_patch16_224", {"img_size": 32}, (3, 32, 32)),
    ("timm:vit_tiny_patch16_224", {"img_size": [32, 48], "in_chans": 1}, (1, 32, 48)),
    ("timm:swin_tiny_patch4_window7_224", None, (3, 224, 224)),
])
def test_a_fixed_size_model_is_profiled_at_the_size_it_is_built_for(
        spec: str, model_kwargs: dict[str, object] | None, shape: tuple[int, ...]) -> None:
    if spec.startswith("timm:"):
        pytest.importorskip("timm")
    assert _sample_shape(spec, model_kwargs) == shape


def test_models_of_any_size_are_still_scaled_down_on_the_cpu() -> None:
    pytest.importorskip("timm")
    for spec in ("resnet18", "timm:resnet18", "timm:convnext_tiny"):
        assert _sample_shape(spec) == (3, DEFAULT_CPU_RESOLUTION, DEFAULT_CPU_RESOLUTION), spec
        assert _sample_shape(spec, device="cuda") == (3, 224, 224), spec


@pytest.mark.parametrize("args, message", [
    (["vit_b_16", "--input-shape", "3,64,64"],
     "--input-shape 3,64,64: torchvision:vit_b_16 is built for 3,224,224 images only: use --input-shape "
     "3,224,224, or build it for 64x64 with --model-kwargs '{\"image_size\": 64}'"),
    (["vit_b_16", "--input-shape", "3,64,64", "--model-kwargs", '{"num_layers": 2, "image_size": 32}'],
     "torchvision:vit_b_16 is built for 3,32,32 images only: use --input-shape 3,32,32, or build it for 64x64 "
     "with --model-kwargs '{\"num_layers\": 2, \"image_size\": 64}'"),
    (["maxvit_t", "--input-shape", "3,112,224"],
     "or build it for 112x224 with --model-kwargs '{\"input_size\": [112, 224]}'"),
    (["vit_b_16", "--input-shape", "1,224,224"],
     "torchvision:vit_b_16 is built for 3,224,224 images only: use --input-shape 3,224,224"),
    (["timm:vit_tiny_patch16_224", "--input-shape", "3,32,32"],
     "timm:vit_tiny_patch16_224 is built for 3,224,224 images only: use --input-shape 3,224,224, or build it "
     "for 32x32 with --model-kwargs '{\"img_size\": 32}'"),
])
def test_another_input_shape_is_refused_before_the_model_is_built(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, cache_dir: object,
        args: list[str], message: str) -> None:
    if args[0].startswith("timm:"):
        pytest.importorskip("timm")

    def must_not_build(*_: object) -> None:
        raise AssertionError("the model was built before its input shape was checked")

    monkeypatch.setattr(model_spec, "build_model", must_not_build)
    code, out, err = run_cli(capsys, "plan", *args)
    assert code == 2 and message in err and err.count("\n") == 1 and out == "", err


@pytest.mark.parametrize("spec, given", [("vit_b_16", (3, 48, 48)), ("maxvit_t", (3, 112, 224)),
                                         ("timm:vit_tiny_patch16_224", (3, 32, 48))])
def test_the_arguments_the_refusal_names_build_the_model_for_the_shape_given(
        spec: str, given: tuple[int, ...]) -> None:
    """Its advice, followed, is taken: the size argument it names makes the shape it refused the model's."""
    if spec.startswith("timm:"):
        pytest.importorskip("timm")
    with pytest.raises(ModelError) as refused:
        check_fixed_size(spec, given, {"drop_rate": 0.0})
    advised = json.loads(str(refused.value).split("--model-kwargs '", 1)[1].rstrip("'"))
    assert advised.pop("drop_rate") == 0.0
    check_fixed_size(spec, given, {"drop_rate": 0.0, **advised})
    assert model_spec.fixed_sample_shape(spec, advised) == given


def test_a_size_argument_of_another_type_is_left_to_the_builder() -> None:
    assert model_spec.fixed_sample_shape("vit_b_16", {"image_size": "big"}) is None
    assert model_spec.fixed_sample_shape("resnet18", {"image_size": 32}) is None


def test_a_zoo_plans_its_fixed_size_models_at_their_own_size() -> None:
    """As CLIP's captions stop at its positions, a zoo's --input-shape goes to the models that can take it."""
    from remat.client.zoo_batch import select_zoo_models, zoo_requests

    def shapes(zoo: str, pattern: str) -> dict[str, tuple[int, ...]]:
        return {r.name: r.sample_shape for r in zoo_requests(
            select_zoo_models(zoo, pattern), batch_size=2, sample_shape=(3, 32, 32), seq_len=None, device="cpu",
            grads="none", dtype="float32")}

    assert shapes("torchvision", "vit_b_16,resnet18,maxvit_t") == {
        "torchvision:vit_b_16": (3, 224, 224), "torchvision:resnet18": (3, 32, 32),
        "torchvision:maxvit_t": (3, 224, 224)}
    for zoo, pattern, named in (("torchvision", "vit_b_*", "vit_b_16, vit_b_32"), ("hf", "vit,gpt2", "vit")):
        with pytest.raises(ModelError, match=f"input_shape: every selected model that takes images is built for one "
                                             f"size \\({named}\\)"):
            shapes(zoo, pattern)
