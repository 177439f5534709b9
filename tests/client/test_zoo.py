"""Zoo names resolve to randomly initialised torchvision models, never downloading weights."""

from __future__ import annotations

import pytest
import torchvision

from remat.client.errors import UnknownModelError
from remat.client.zoo import canonical_name, default_input_shape, resolve_model


def test_plain_and_prefixed_names_resolve() -> None:
    assert isinstance(resolve_model("resnet18"), torchvision.models.ResNet)
    model = resolve_model("torchvision:resnet18", num_classes=10)
    assert model.fc.out_features == 10
    assert canonical_name("resnet18") == "torchvision:resnet18"


def test_unknown_names_list_close_matches_in_one_line() -> None:
    with pytest.raises(UnknownModelError) as info:
        resolve_model("resnet15")
    message = str(info.value)
    assert isinstance(info.value, ValueError) and "\n" not in message
    assert "unknown model 'resnet15'" in message and "resnet152" in message
    with pytest.raises(UnknownModelError, match="unknown model source 'timm'"):
        resolve_model("timm:resnet18")


def test_weights_are_never_requested(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_download(*args: object, **kwargs: object) -> None:
        raise AssertionError("tried to download weights")

    monkeypatch.setattr(torchvision.models.WeightsEnum, "get_state_dict", no_download)
    resolve_model("fasterrcnn_mobilenet_v3_large_320_fpn")  # would fetch an ImageNet backbone by default
    with pytest.raises(UnknownModelError, match="without pretrained weights"):
        resolve_model("resnet18", weights="DEFAULT")


def test_default_input_shapes() -> None:
    assert default_input_shape("inception_v3") == (3, 299, 299)
    assert default_input_shape("torchvision:resnet152") == (3, 224, 224)
    assert default_input_shape("r3d_18") == (3, 16, 112, 112)
