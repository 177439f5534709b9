"""``hf:`` model specs: the allow-list, config.json paths, checked configuration overrides, the training call's
inputs, the requests they make, the hf zoo, and the CLI's one-line exit-2 errors. Models are tiny
configurations with random weights; nothing is downloaded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from remat.client.errors import ModelError, PlanError
from remat.client.hf_models import (
    DEFAULT_CPU_SEQ_LEN,
    DEFAULT_CUDA_SEQ_LEN,
    HF_ARCHITECTURES,
    TASKS,
    canonical_hf_name,
    check_override_values,
    check_service_spec,
    hf_architecture,
    hf_call_signature,
    hf_image_shape,
    hf_zoo,
    input_kind,
    is_token_model,
)
from remat.client.model_spec import canonical_spec, default_sample_shape, source_of
from remat.client.request import ModelRequest, default_request
from remat.client.zoo_batch import select_models, select_zoo_models, zoo_requests
from tests.utils.cli import run_cli

ROOT = Path(__file__).resolve().parents[2]

TINY: dict[str, dict[str, Any]] = {
    "gpt2": {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64, "vocab_size": 100, "bos_token_id": 0,
             "eos_token_id": 0},
    "llama": {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 100},
    "mistral": {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                "num_key_value_heads": 2, "vocab_size": 100},
    "qwen2": {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 100},
    "mixtral": {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                "num_key_value_heads": 2, "vocab_size": 100, "num_local_experts": 2, "num_experts_per_tok": 1},
    "bert": {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
             "vocab_size": 100, "max_position_embeddings": 64},
    "roberta": {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
                "vocab_size": 100, "max_position_embeddings": 66},
    "t5": {"num_layers": 1, "num_decoder_layers": 1, "d_model": 32, "d_ff": 64, "d_kv": 8, "num_heads": 4,
           "vocab_size": 100},
    "bart": {"encoder_layers": 1, "decoder_layers": 1, "d_model": 32, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
             "encoder_attention_heads": 2, "decoder_attention_heads": 2, "vocab_size": 100,
             "max_position_embeddings": 64},
    "vit": {"image_size": 32, "patch_size": 16, "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64,
            "num_attention_heads": 2, "num_labels": 5},
    "clip": {"projection_dim": 16,
             "text_config": {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                             "num_attention_heads": 2, "vocab_size": 100, "max_position_embeddings": 24},
             "vision_config": {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                               "num_attention_heads": 2, "image_size": 32, "patch_size": 16}},
}


@pytest.fixture(scope="module")
def transformers() -> Any:
    return pytest.importorskip("transformers")


# --- specs: torch-free ------------------------------------------------------------------------------------

def test_importing_the_spec_side_loads_neither_torch_nor_transformers() -> None:
    code = ("import sys, remat.client.hf_models, remat.client.request, remat.client.zoo_batch\n"
            "from remat.client.request import default_request\n"
            "default_request('hf:gpt2', batch_size=None, sample_shape=None, device='cpu', grads='none')\n"
            "default_request('hf:vit', batch_size=None, sample_shape=None, device='cpu', grads='none')\n"
            "default_request('hf:clip', batch_size=None, sample_shape=None, device='cpu', grads='none')\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_allow_list_covers_the_families_and_every_task_has_an_auto_class() -> None:
    assert {"gpt2", "llama", "bert", "t5", "vit", "mixtral"} <= set(HF_ARCHITECTURES)
    assert {arch.task for arch in HF_ARCHITECTURES.values()} <= set(TASKS)
    assert HF_ARCHITECTURES["t5"].task == "seq2seq-lm" and HF_ARCHITECTURES["bert"].task == "masked-lm"
    assert input_kind("hf:vit") == "image" and is_token_model("hf:mixtral") and not is_token_model("vit")
    assert input_kind("hf:clip") == "tokens+image" and is_token_model("hf:clip")  # --seq-len, images sized


@pytest.mark.parametrize(("spec", "canonical"), [
    ("hf:gpt2", "hf:gpt2"),
    ("hf:GPT2", "hf:gpt2"),
    (" hf:llama ", "hf:llama"),
])
def test_hf_names_have_one_spelling(spec: str, canonical: str) -> None:
    assert canonical_spec(spec) == canonical and source_of(spec) == "hf"


def test_a_config_path_is_canonical_as_its_absolute_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert canonical_spec("hf:cfg/config.json") == f"hf:{tmp_path / 'cfg' / 'config.json'}"
    assert canonical_spec("hf:config.json") == f"hf:{tmp_path / 'config.json'}"
    absolute = f"hf:{tmp_path / 'config.json'}"
    assert canonical_spec(absolute) == absolute and source_of(absolute) == "hf"
    with pytest.raises(ModelError, match="longer than 200 characters"):
        canonical_spec("hf:" + "d/" * 90 + "config.json")


@pytest.mark.parametrize(("spec", "message"), [
    ("hf:gtp2", "unknown hf: architecture 'gtp2'; did you mean gpt2? (known: gpt2, llama"),
    ("hf:lama", "did you mean llama?"),
    ("hf:resnet50", "unknown hf: architecture 'resnet50' (known: "),
])
def test_unknown_hf_names_give_close_matches(spec: str, message: str) -> None:
    with pytest.raises(ModelError) as info:
        canonical_spec(spec)
    assert str(info.value).startswith(message) or message in str(info.value)
    assert "\n" not in str(info.value)


def _write_config(path: Path, **fields: Any) -> Path:
    path.write_text(json.dumps(fields))
    return path


def test_a_config_json_names_its_architecture_and_its_image(tmp_path: Path) -> None:
    llama = _write_config(tmp_path / "llama.json", model_type="llama", **TINY["llama"])
    assert hf_architecture(f"hf:{llama}") == "llama" and is_token_model(f"hf:{llama}")
    vit = _write_config(tmp_path / "vit.json", model_type="vit", image_size=48, num_channels=1)
    assert hf_image_shape(f"hf:{vit}") == (1, 48, 48)
    assert hf_image_shape(f"hf:{vit}", {"image_size": 32}) == (1, 32, 32)
    assert default_sample_shape(f"hf:{vit}") == (1, 48, 48)
    assert default_sample_shape("hf:llama") is None
    with pytest.raises(ModelError, match="model_type 'gpt_neox' is not one remat builds"):
        hf_architecture(f"hf:{_write_config(tmp_path / 'neox.json', model_type='gpt_neox')}")
    with pytest.raises(ModelError, match="cannot be read"):
        hf_architecture(f"hf:{tmp_path / 'missing.json'}")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ModelError, match="not JSON"):
        hf_architecture(f"hf:{tmp_path / 'broken.json'}")


@pytest.mark.parametrize(("overrides", "message"), [
    ({"text_config": {"rope": {"theta": 1.0}}}, "model_kwargs: text_config.rope: must be a JSON scalar or a list"),
    ({"model_type": "bert"}, "model_kwargs: model_type cannot be set: the spec names the architecture"),
    ({"dtype": "bfloat16"}, "model_kwargs: dtype cannot be set: --dtype sets the precision"),
    ({"use_cache": True}, "model_kwargs: use_cache cannot be set"),
    ({"auto_map": "x"}, "model_kwargs: auto_map cannot be set: remat never runs a model's remote code"),
    ({"_attn_implementation": "eager"}, "model_kwargs: '_attn_implementation' is not a configuration field"),
    ({"rms_norm_eps": float("nan")}, "model_kwargs: rms_norm_eps: must be a finite number"),
])
def test_override_values_are_json_scalars_or_lists_of_fields_remat_does_not_set(overrides: dict,
                                                                                message: str) -> None:
    with pytest.raises(ModelError) as info:
        check_override_values(overrides)
    assert str(info.value).startswith(message)
    assert check_override_values({"n_layer": 2, "layer_types": ["a", "b"], "x": None}) == {
        "n_layer": 2, "layer_types": ["a", "b"], "x": None}


# --- requests ---------------------------------------------------------------------------------------------

def test_a_token_request_has_a_sequence_length_and_an_image_request_its_configured_size() -> None:
    gpt2 = default_request("hf:gpt2", batch_size=None, sample_shape=None, device="cpu", grads="none")
    assert gpt2.sample_shape == (DEFAULT_CPU_SEQ_LEN,) and gpt2.seq_len == DEFAULT_CPU_SEQ_LEN
    assert gpt2.input_shape == (4, DEFAULT_CPU_SEQ_LEN)
    cuda = ModelRequest.from_dict({**gpt2.to_dict(), "device": "cuda", "input_shape": [DEFAULT_CUDA_SEQ_LEN],
                                   "seq_len": DEFAULT_CUDA_SEQ_LEN})
    assert cuda.seq_len == DEFAULT_CUDA_SEQ_LEN
    short = default_request("hf:llama", batch_size=2, sample_shape=None, device="cpu", grads="none", seq_len=32)
    assert short.to_dict()["seq_len"] == 32 and short.to_dict()["input_shape"] == [32]
    assert ModelRequest.from_dict(short.to_dict()) == short
    assert short.fingerprint != gpt2.fingerprint
    vit = default_request("hf:vit", batch_size=None, sample_shape=None, device="cpu", grads="none")
    assert vit.sample_shape == (3, 224, 224) and vit.seq_len is None and "seq_len" not in vit.to_dict()


def test_requests_without_a_sequence_length_keep_their_fingerprint() -> None:
    resnet = ModelRequest(spec="resnet18", batch_size=2, sample_shape=(3, 32, 32))
    assert "seq_len" not in resnet.to_dict()
    assert resnet.fingerprint == ModelRequest.from_dict({**resnet.to_dict(), "seq_len": None}).fingerprint


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"spec": "hf:gpt2", "sample_shape": (3, 64), "seq_len": 64}, PlanError,
     "seq_len: 64 but input_shape is [3, 64]"),
    ({"spec": "resnet18", "sample_shape": (64,), "seq_len": 64}, ModelError,
     "seq_len: torchvision:resnet18 takes no token sequence"),
    ({"spec": "hf:gpt2", "sample_shape": (0,), "seq_len": 0}, PlanError, "input_shape: must be"),
    ({"spec": "hf:gpt2", "sample_shape": (64,), "seq_len": True}, PlanError, "seq_len: must be an integer"),
])
def test_a_request_refuses_a_sequence_length_that_does_not_fit(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error) as info:
        ModelRequest(batch_size=2, **kwargs)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(("spec", "options", "message"), [
    ("resnet18", {"seq_len": 64}, "--seq-len: torchvision:resnet18 takes images, not token sequences"),
    ("hf:vit", {"seq_len": 64}, "--seq-len: hf:vit takes images, not token sequences"),
    ("hf:gpt2", {"sample_shape": (3, 32, 32)}, "--input-shape: hf:gpt2 takes token ids"),
    ("hf:vit", {"sample_shape": (3, 32, 32)}, "--input-shape: hf:vit trains at its configuration's image size "
                                              "3,224,224"),
    ("pkg.nets:build", {"seq_len": 64, "sample_shape": (8,)}, "--seq-len: pkg.nets:build takes the input"),
])
def test_default_request_refuses_the_wrong_input_option(spec: str, options: dict, message: str) -> None:
    options = {"batch_size": None, "sample_shape": None, "device": "cpu", "grads": "none", **options}
    with pytest.raises(ModelError) as info:
        default_request(spec, **options)
    assert str(info.value).startswith(message)


def test_a_vision_request_takes_its_image_size_from_the_overrides(transformers: Any) -> None:
    vit = default_request("hf:vit", batch_size=2, sample_shape=None, device="cpu", grads="none",
                          model_kwargs={"image_size": 64})
    assert vit.sample_shape == (3, 64, 64) and vit.model_kwargs == {"image_size": 64}


# --- configuration overrides (transformers) ---------------------------------------------------------------

@pytest.mark.parametrize(("spec", "overrides", "message"), [
    ("hf:gpt2", {"n_layers": 2}, "model_kwargs: hf:gpt2's configuration has no field 'n_layers' (did you mean "
                                 "n_layer"),
    ("hf:llama", {"hidden_sise": 64, "foo": 1}, "model_kwargs: hf:llama's configuration has no field "
                                               "'hidden_sise' (did you mean hidden_size"),
    ("hf:vit", {"to_dict": 1}, "model_kwargs: hf:vit's configuration has no field 'to_dict'"),
])
def test_overrides_of_unknown_fields_are_named_with_close_matches(transformers: Any, spec: str, overrides: dict,
                                                                  message: str) -> None:
    with pytest.raises(ModelError) as info:
        default_request(spec, batch_size=2, sample_shape=None, device="cpu", grads="none", model_kwargs=overrides)
    assert str(info.value).startswith(message), info.value
    assert "'foo'" in str(info.value) or "foo" not in overrides


@pytest.mark.parametrize(("overrides", "message"), [
    ({"n_layer": -1}, "model_kwargs: n_layer must be a non-negative integer like its default (12), got -1"),
    ({"num_hidden_layers": "2"}, "model_kwargs: num_hidden_layers must be a non-negative integer like its default "
                                 "(12), got '2'"),
    ({"n_head": 2.0}, "model_kwargs: n_head must be a non-negative integer like its default (12), got 2.0"),
    ({"scale_attn_weights": 1}, "model_kwargs: scale_attn_weights must be true or false like its default (True)"),
    ({"layer_norm_epsilon": "small"}, "model_kwargs: layer_norm_epsilon must be a number like its default"),
    ({"activation_function": 3}, "model_kwargs: activation_function must be text like its default ('gelu_new')"),
    ({"vocab_size": -5}, "model_kwargs: vocab_size must be a non-negative integer like its default (50257), got -5"),
])
def test_override_values_of_another_kind_than_their_fields_default_are_refused(transformers: Any, overrides: dict,
                                                                                 message: str) -> None:
    from remat.client.hf_models import check_overrides

    with pytest.raises(ModelError) as info:
        check_overrides("hf:gpt2", overrides)
    assert str(info.value).startswith(message), info.value


def test_override_values_of_their_fields_kind_pass(transformers: Any) -> None:
    from remat.client.hf_models import check_overrides

    fine = {"n_layer": 0, "layer_norm_epsilon": 1e-3, "scale_attn_weights": False, "n_inner": 128,
            "activation_function": "relu", "resid_pdrop": 0}
    assert check_overrides("hf:gpt2", fine) == fine


def test_aliases_and_num_labels_are_fields(transformers: Any) -> None:
    from remat.client.hf_models import check_overrides

    assert check_overrides("hf:gpt2", {"num_hidden_layers": 2, "hidden_size": 64}) == {"num_hidden_layers": 2,
                                                                                      "hidden_size": 64}
    assert check_overrides("hf:vit", {"num_labels": 7}) == {"num_labels": 7}


def test_the_default_image_sizes_are_transformers_own(transformers: Any) -> None:
    config = transformers.AutoConfig.for_model("vit")
    assert hf_image_shape("hf:vit") == (config.num_channels, config.image_size, config.image_size)
    vision = transformers.AutoConfig.for_model("clip").vision_config
    assert hf_image_shape("hf:clip") == (vision.num_channels, vision.image_size, vision.image_size)
    text = transformers.AutoConfig.for_model("clip").text_config
    assert default_request("hf:clip", batch_size=None, sample_shape=None, device="cpu",
                           grads="none").seq_len == text.max_position_embeddings < DEFAULT_CPU_SEQ_LEN


# --- two towers: sub-configurations -------------------------------------------------------------------------

def test_a_two_tower_request_takes_its_tokens_length_and_its_images_from_the_vision_configuration(
        tmp_path: Path) -> None:
    small = {"vision_config": {"image_size": 48}, "text_config": {"max_position_embeddings": 40}}
    assert hf_image_shape("hf:clip", small) == (3, 48, 48)
    request = default_request("hf:clip", batch_size=2, sample_shape=None, device="cuda", grads="none",
                              model_kwargs=small)
    assert request.seq_len == 40 and request.sample_shape == (40,)  # the text tower's positions cap the default
    assert request.call_signature == ("input_ids: int64[2, 40]; pixel_values: float32[2, 3, 48, 48]; "
                                      "return_loss=True")
    at_32 = default_request("hf:clip", batch_size=2, sample_shape=None, seq_len=16, device="cpu", grads="none",
                            model_kwargs={"vision_config": {"image_size": 32}})
    assert at_32.call_signature != request.call_signature and at_32.fingerprint != request.fingerprint
    # A config.json's sub-configuration and the overrides merge field by field.
    clip = _write_config(tmp_path / "clip.json", model_type="clip",
                         vision_config={"image_size": 64, "num_channels": 1, "patch_size": 16})
    assert hf_image_shape(f"hf:{clip}") == (1, 64, 64)
    assert hf_image_shape(f"hf:{clip}", {"vision_config": {"image_size": 32}}) == (1, 32, 32)
    for overrides, message in (
            ({"vision_config": {"image_size": 0}}, "model_kwargs: vision_config.image_size must be a positive"),
            ({"vision_config": {"image_size": True}}, "model_kwargs: vision_config.image_size must be")):
        with pytest.raises(ModelError, match=message):
            hf_image_shape("hf:clip", overrides)
    with pytest.raises(ModelError, match=r"--input-shape: hf:clip takes token ids, not a sample shape; give "
                                         r"--seq-len N \(tokens per sample\) \(its images take vision_config"):
        default_request("hf:clip", batch_size=2, sample_shape=(3, 32, 32), device="cpu", grads="none")
    with pytest.raises(ModelError, match=r"--seq-len: hf:clip takes captions of at most 40 tokens \(its text "
                                         r"tower's position embeddings, text_config.max_position_embeddings\), "
                                         r"got 41"):
        default_request("hf:clip", batch_size=2, sample_shape=None, seq_len=41, device="cpu", grads="none",
                        model_kwargs=small)


def test_sub_configuration_fields_are_checked_like_the_top_levels(transformers: Any) -> None:
    from remat.client.hf_models import check_overrides

    fine = {"projection_dim": 16, "text_config": {"num_hidden_layers": 2, "hidden_act": "gelu"},
            "vision_config": {"image_size": 32, "patch_size": 16}}
    assert check_overrides("hf:clip", fine) == fine
    for overrides, message in (
            ({"text_config": {"num_layers": 2}}, "model_kwargs: hf:clip's text_config has no field 'num_layers' "
                                                 "(did you mean num_labels or num_hidden_layers?)"),
            ({"text_config": {"num_hidden_layers": -1}}, "model_kwargs: text_config.num_hidden_layers must be a "
                                                         "non-negative integer"),
            ({"text_config": {"model_type": "gpt2"}}, "model_kwargs: text_config.model_type cannot be set"),
            ({"text_config": {"_x": 1}}, "model_kwargs: 'text_config._x' is not a configuration field"),
            ({"text_config": {"num_hidden_layers": {"deeper": 1}}},
             "model_kwargs: text_config.num_hidden_layers: must be a JSON scalar or a list of them, got dict"),
            ({"projection_dim": {"x": 1}}, "model_kwargs: projection_dim: an object sets the fields of a "
                                           "sub-configuration, and projection_dim is not one of hf:clip's"),
            ({"vision_config": {"hidden_size": 30, "num_attention_heads": 4}},
             "model hf:clip: the configuration is refused: StrictDataclassClassValidationError")):
        with pytest.raises(ModelError) as info:
            check_overrides("hf:clip", overrides)
        assert str(info.value).startswith(message), info.value
    with pytest.raises(ModelError, match=r"model_kwargs: rope_parameters: an object sets the fields of a "
                                         r"sub-configuration, and rope_parameters is not one of hf:llama's \(set it "
                                         r"in a config.json"):
        check_overrides("hf:llama", {"rope_parameters": {"rope_theta": 1.0}})  # a dict field, not a configuration


def test_a_service_takes_allow_list_names_with_known_fields_only(transformers: Any, tmp_path: Path) -> None:
    check_service_spec("hf:gpt2", {"n_layer": 2})
    for spec, overrides, message in (
            ("hf:gtp2", None, "model: unknown hf: architecture 'gtp2'; did you mean gpt2?"),
            ("hf:cfg/config.json", None, "model: 'hf:cfg/config.json' names a file"),
            (f"hf:{tmp_path}/config.json", None, "model: "),
            ("hf:gpt2", {"n_layers": 2}, "model_kwargs: hf:gpt2's configuration has no field 'n_layers'"),
            ("hf:gpt2", {"n_layer": [[[1]]]}, "model_kwargs: n_layer: must be a JSON scalar"),
            ("hf:llama", {"hidden_size": 65, "num_attention_heads": 4}, "model_kwargs: model hf:llama: the "
                                                                       "configuration is refused")):
        with pytest.raises(ModelError) as info:
            check_service_spec(spec, overrides)
        assert str(info.value).startswith(message), info.value


# --- building and the training call -----------------------------------------------------------------------

@pytest.mark.parametrize("arch", sorted(TINY))
def test_every_architecture_builds_from_its_configuration_and_trains(transformers: Any, arch: str) -> None:
    import torch

    from remat.client.hf_models import hf_example_call
    from remat.client.model_spec import build_model

    model = build_model(f"hf:{arch}", TINY[arch])
    task = HF_ARCHITECTURES[arch].task
    auto_class = getattr(transformers, TASKS[task])
    assert model.training and type(model) is auto_class._model_mapping[type(model.config)]
    assert getattr(model.config, "use_cache", False) is False
    state = torch.random.get_rng_state()
    args, kwargs = hf_example_call(model, f"hf:{arch}", batch_size=2, seq_len=None if arch == "vit" else 16,
                                   device="cpu")
    assert torch.equal(state, torch.random.get_rng_state())  # a generator of its own
    again = hf_example_call(model, f"hf:{arch}", batch_size=2, seq_len=None if arch == "vit" else 16, device="cpu")
    assert all(torch.equal(v, again[1][k]) if isinstance(v, torch.Tensor) else v == again[1][k]
               for k, v in kwargs.items())  # seeded
    assert args == ()
    if arch == "vit":
        assert set(kwargs) == {"pixel_values", "labels"}
        assert kwargs["pixel_values"].shape == (2, 3, 32, 32) and kwargs["pixel_values"].dtype == torch.float32
        assert int(kwargs["labels"].max()) < 5
    elif arch == "clip":  # two towers: a caption and an image per sample, the contrastive loss asked for
        assert set(kwargs) == {"input_ids", "pixel_values", "return_loss"} and kwargs["return_loss"] is True
        assert kwargs["input_ids"].shape == (2, 16) and int(kwargs["input_ids"].max()) < 100
        assert kwargs["pixel_values"].shape == (2, 3, 32, 32)
    else:
        assert set(kwargs) == {"input_ids", "labels"}  # no padding, no mask (hf_example_call says why)
        ids, labels = kwargs["input_ids"], kwargs["labels"]
        assert ids.shape == labels.shape == (2, 16)
        assert ids.dtype == torch.int64 and int(ids.max()) < 100
        assert ids.untyped_storage().data_ptr() != labels.untyped_storage().data_ptr()
        if task == "causal-lm":
            assert torch.equal(ids, labels)
    loss = model(*args, **kwargs).loss
    loss.backward()
    assert torch.isfinite(loss)
    # What a lookup by name compares without building: the signature of the call made here.
    from remat.client.graph.model_call import ModelCall

    sample = (16,) if arch != "vit" else tuple(kwargs["pixel_values"].shape[1:])
    assert hf_call_signature(f"hf:{arch}", batch_size=2, sample_shape=sample, dtype="float32",
                             overrides=TINY[arch]) == ModelCall.bind(model, args, kwargs).signature


def test_t5_gets_a_decoder_start_token_and_a_config_json_never_sets_the_precision(transformers: Any,
                                                                               tmp_path: Path) -> None:
    import torch

    from remat.client.hf_models import build_hf_model

    t5 = build_hf_model("hf:t5", TINY["t5"])
    assert t5.config.decoder_start_token_id == 0 and t5.config.pad_token_id == 0
    path = _write_config(tmp_path / "config.json", model_type="llama", dtype="bfloat16", use_cache=True,
                         auto_map={"AutoModelForCausalLM": "modeling_evil.Evil"}, **TINY["llama"])
    model = build_hf_model(f"hf:{path}", {"num_hidden_layers": 1})
    assert type(model).__name__ == "LlamaForCausalLM" and len(model.model.layers) == 1
    assert next(model.parameters()).dtype == torch.float32 and model.config.use_cache is False
    assert not getattr(model.config, "auto_map", None)


def test_a_sequence_longer_than_the_positions_and_a_bad_configuration_are_one_line(transformers: Any) -> None:
    from remat.client.hf_models import build_hf_model, hf_example_call

    gpt2 = build_hf_model("hf:gpt2", TINY["gpt2"])
    with pytest.raises(ModelError, match="--seq-len: hf:gpt2 takes at most 64 tokens"):
        hf_example_call(gpt2, "hf:gpt2", batch_size=1, seq_len=65, device="cpu")
    assert hf_example_call(gpt2, "hf:gpt2", batch_size=1, seq_len=None, device="cpu")[1]["input_ids"].shape == (1, 64)
    vit = build_hf_model("hf:vit", TINY["vit"])
    with pytest.raises(ModelError, match="--seq-len: hf:vit takes images"):
        hf_example_call(vit, "hf:vit", batch_size=1, seq_len=8, device="cpu")
    with pytest.raises(ModelError) as info:
        build_hf_model("hf:llama", {**TINY["llama"], "hidden_size": 33})
    assert "hidden size (33) is not a multiple of the number of attention heads" in str(info.value)
    assert "\n" not in str(info.value)


# --- the hf zoo -------------------------------------------------------------------------------------------

def test_the_hf_zoo_selects_by_name_and_covers_the_families() -> None:
    assert select_models("hf") == ["hf:gpt2", "hf:llama", "hf:mixtral", "hf:bert", "hf:t5", "hf:vit", "hf:clip"]
    assert [m.spec for m in hf_zoo()] == select_models("hf")
    assert select_models("hf", "gpt2, l*") == ["hf:gpt2", "hf:llama"]
    chosen = select_zoo_models("hf", "mixtral")
    assert chosen[0].model_kwargs["num_local_experts"] == 4
    from remat.client.errors import UnknownModelError

    with pytest.raises(UnknownModelError, match="filter: 'gpt3' matches none of the 7 hf models"):
        select_models("hf", "gpt3")


def test_zoo_requests_give_the_sequence_length_to_token_models_only() -> None:
    models = select_zoo_models("hf", "gpt2,vit")
    gpt2, vit = zoo_requests(models, batch_size=2, sample_shape=None, seq_len=32, device="cpu", grads="none",
                             dtype="float32")
    assert gpt2.seq_len == 32 and gpt2.input_shape == (2, 32) and gpt2.model_kwargs["n_layer"] == 6
    assert vit.seq_len is None and vit.input_shape == (2, 3, 64, 64)
    gpt2, clip = zoo_requests(select_zoo_models("hf", "gpt2,clip"), batch_size=2, sample_shape=None, seq_len=256,
                              device="cpu", grads="none", dtype="float32")
    assert gpt2.seq_len == 256 and clip.seq_len == 77  # CLIP's captions stop at its text tower's positions
    with pytest.raises(ModelError, match="seq_len: none of the selected models takes token sequences"):
        zoo_requests(select_zoo_models("hf", "vit"), batch_size=2, sample_shape=None, seq_len=32, device="cpu",
                     grads="none", dtype="float32")
    with pytest.raises(ModelError, match="input_shape: every selected model takes token ids"):
        zoo_requests(select_zoo_models("hf", "gpt2"), batch_size=2, sample_shape=(3, 8, 8), seq_len=None,
                     device="cpu", grads="none", dtype="float32")


def test_every_hf_zoo_model_builds_and_trains_one_small_step(transformers: Any) -> None:
    import time

    from remat.client.hf_models import build_hf_model, hf_example_call

    for entry in hf_zoo():
        model = build_hf_model(entry.spec, entry.model_kwargs)
        args, kwargs = hf_example_call(model, entry.spec, batch_size=2, seq_len=None, device="cpu")
        start = time.perf_counter()
        model(*args, **kwargs).loss.backward()
        assert time.perf_counter() - start < 10, entry.spec


# --- the CLI ----------------------------------------------------------------------------------------------

def test_the_model_commands_take_seq_len(capsys) -> None:
    for command in ("plan", "trace", "measure", "submit", "show", "zoo"):
        code, out, _ = run_cli(capsys, command, "--help")
        assert code == 0 and "--seq-len N" in out, command
    code, out, _ = run_cli(capsys, "plan", "--help")
    assert "hf:gpt2" in out


@pytest.mark.parametrize(("args", "message"), [
    (["trace", "hf:gtp2"], "unknown hf: architecture 'gtp2'; did you mean gpt2?"),
    (["trace", "resnet18", "--seq-len", "64"], "--seq-len: torchvision:resnet18 takes images"),
    (["trace", "timm:resnet18", "--seq-len", "64"], "--seq-len: timm:resnet18 takes images"),
    (["trace", "hf:vit", "--seq-len", "64"], "--seq-len: hf:vit takes images"),
    (["plan", "hf:gpt2", "--input-shape", "3,32,32"], "--input-shape: hf:gpt2 takes token ids"),
    (["plan", "hf:clip", "--input-shape", "3,32,32"], "--input-shape: hf:clip takes token ids"),
    (["plan", "hf:clip", "--seq-len", "100"], "--seq-len: hf:clip takes captions of at most 77 tokens"),
    (["trace", "hf:clip", "--model-kwargs", '{"text_config": {"num_layers": 1}}'],
     "model_kwargs: hf:clip's text_config has no field 'num_layers'"),
    (["plan", "hf:gpt2", "--seq-len", "0"], "Invalid value for '--seq-len'"),
    (["measure", "hf:llama", "--model-kwargs", '{"rope_parameters": {"rope_theta": 1}}'],
     "model_kwargs: rope_parameters: an object sets the fields of a sub-configuration"),
    (["trace", "hf:gpt2", "--model-kwargs", '{"model_type": "bert"}'], "model_kwargs: model_type cannot be set"),
    (["show", "hf:missing/config.json"], "config.json: cannot be read"),
    (["zoo", "hf", "--filter", "nothing*"], "filter: 'nothing*' matches none of the 7 hf models"),
    (["zoo", "hf", "--filter", "vit", "--seq-len", "64"], "seq_len: none of the selected models takes token"),
    (["zoo", "torchvision", "--filter", "resnet18", "--seq-len", "64"], "seq_len: none of the selected models"),
    (["submit", "hf:cfg/config.json", "--server", "http://127.0.0.1:9"], "never read a file of yours"),
])
def test_bad_hf_input_is_one_line_and_exit_2(capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            args: list[str], message: str) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("REMAT_DATABASE_URL", f"sqlite:///{tmp_path / 'plans.sqlite'}")
    if args[1] == "hf:cfg/config.json":
        (tmp_path / "cfg").mkdir()
        _write_config(tmp_path / "cfg" / "config.json", model_type="gpt2")
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_an_unknown_configuration_field_is_one_line_and_exit_2(capsys, transformers: Any, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REMAT_DATABASE_URL", f"sqlite:///{tmp_path / 'plans.sqlite'}")
    code, _, err = run_cli(capsys, "plan", "hf:gpt2", "--model-kwargs", '{"n_layers": 6}')
    assert code == 2 and "hf:gpt2's configuration has no field 'n_layers' (did you mean n_layer" in err, err
    assert len(err.strip().splitlines()) == 1


def test_canonical_hf_name_is_the_part_after_the_prefix() -> None:
    assert canonical_hf_name("Mixtral") == "mixtral"
    with pytest.raises(ModelError, match="hf: needs an architecture"):
        canonical_hf_name(" ")
