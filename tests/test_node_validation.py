"""Node inputs ComfyUI's own validation lets through: ``nan``/``inf`` floats, sizes off the latent grid, values not
among a V3 combo's options (refused by the nodes' ``validate_inputs``, so ``/prompt`` answers HTTP 400), and source
latents of another model's format."""

from __future__ import annotations

import inspect
import math
import re

import pytest
import torch

from nodes.kv_nodes import UniCacheKVConfig
from nodes.task_nodes import UniCacheImageEdit, UniCacheTextToImage, UniCacheUnderstand
from nodes.validation import check_source_latent, check_widgets

T2I_OK = dict(
    width=64,
    height=48,
    cfg_text_scale=4.0,
    cfg_img_scale=1.5,
    cfg_interval_lo=0.4,
    cfg_interval_hi=1.0,
    timestep_shift=3.0,
    cfg_renorm_min=0.0,
)


def test_validate_inputs_takes_every_input_by_name():
    """One generic check per node (no widget listed a second time): it takes every input as a keyword, and a name
    the node does not declare is left alone."""
    for cls in (UniCacheTextToImage, UniCacheImageEdit, UniCacheUnderstand, UniCacheKVConfig):
        params = inspect.signature(cls.validate_inputs).parameters
        assert [p.kind for p in params.values()] == [inspect.Parameter.VAR_KEYWORD], cls.__name__
        assert cls.validate_inputs(not_an_input=math.nan) is True


def test_combo_values_are_checked():
    assert "cfg_renorm_type = 'sideways' is not a choice" in UniCacheImageEdit.validate_inputs(
        cfg_renorm_type="sideways"
    )
    assert "method = 'zip' is not a choice" in UniCacheKVConfig.validate_inputs(method="zip")
    assert UniCacheKVConfig.validate_inputs(method="snapkv") is True


def test_defaults_and_edges_pass():
    assert UniCacheTextToImage.validate_inputs(**T2I_OK) is True
    assert UniCacheTextToImage.validate_inputs(**{**T2I_OK, "width": 1024, "cfg_text_scale": 0.0}) is True
    assert UniCacheImageEdit.validate_inputs(**{k: v for k, v in T2I_OK.items() if "cfg" in k or "shift" in k}) is True
    assert UniCacheUnderstand.validate_inputs(temperature=0.3) is True
    assert UniCacheKVConfig.validate_inputs(kv_target=0.0, rho=0.0, rho_floor=-1.0) is True


@pytest.mark.parametrize(
    "change, message",
    [
        ({"width": 40}, "width = 40 is not a multiple of 16 (BAGEL's latent tokens are 16 px wide); use 32 or 48"),
        ({"height": 8}, "height = 8 is outside [16, 1024]"),
        ({"height": 1040}, "height = 1040 is outside [16, 1024]"),
        ({"cfg_text_scale": math.nan}, "cfg_text_scale = nan is not a finite number"),
        ({"cfg_img_scale": math.inf}, "cfg_img_scale = inf is not a finite number"),
        ({"timestep_shift": -math.inf}, "timestep_shift = -inf is not a finite number"),
        ({"cfg_renorm_min": 1.5}, "cfg_renorm_min = 1.5 is outside [0.0, 1.0]"),
    ],
)
def test_t2i_refuses_at_validation(change, message):
    assert message in UniCacheTextToImage.validate_inputs(**{**T2I_OK, **change})


def test_linked_widgets_are_left_to_run_time():
    assert check_widgets(UniCacheTextToImage, width=None, cfg_text_scale=None) is True


@pytest.mark.parametrize(
    "values, message",
    [
        ({"kv_target": math.nan, "rho": 0.0, "rho_floor": -1.0}, "kv_target = nan is not a finite number"),
        ({"kv_target": 0.0, "rho": math.nan, "rho_floor": -1.0}, "rho = nan"),
        ({"kv_target": 0.0, "rho": 0.0, "rho_floor": math.nan}, "rho_floor = nan"),
    ],
)
def test_kv_config_nan_is_refused_not_read_as_unset(values, message):
    assert message in UniCacheKVConfig.validate_inputs(**values)
    with pytest.raises(ValueError, match=f"UniCache KV config: {message}"):
        UniCacheKVConfig.execute("unicache", policy="default", **values)
    assert "temperature = nan" in UniCacheUnderstand.validate_inputs(temperature=math.nan)


def _latent(*shape, fill=None):
    samples = torch.randn(*shape) if fill is None else torch.full(shape, fill)
    return {"samples": samples}


@pytest.mark.parametrize(
    "latent, message",
    [
        (_latent(1, 16, 8, 8, fill=0.0), r"holds only the value 0: an empty latent \(e.g. EmptySD3LatentImage\)"),
        (_latent(1, 4, 8, 8), r"has shape \(1, 4, 8, 8\), not a LATENT \[batch, 16, H/8, W/8\] of BAGEL's FLUX VAE"),
        (_latent(1, 16, 1, 8, 8), r"has shape \(1, 16, 1, 8, 8\)"),
        (_latent(1, 128, 4, 4), r"has shape \(1, 128, 4, 4\)"),
        (_latent(1, 16, 0, 8), r"is empty"),
        ({"samples": torch.tensor([[[[math.nan, 1.0]]]]).expand(1, 16, 1, 2)}, r"holds 16 NaN or infinite values"),
        ({"noise": torch.zeros(1)}, r"must be a LATENT .* got dict"),
        (torch.zeros(1, 16, 8, 8), r"must be a LATENT .* got Tensor"),
    ],
)
def test_source_latent_of_another_format_is_refused(latent, message):
    with pytest.raises(ValueError, match=message):
        check_source_latent(latent, 16)


def test_encoded_latent_of_any_size_passes():
    for shape in ((1, 16, 8, 8), (2, 16, 5, 13)):
        latent = _latent(*shape)
        assert check_source_latent(latent, 16) is latent["samples"]


def test_image_with_nan_is_refused():
    from nodes.convert import image_to_pils

    image = torch.rand(1, 8, 8, 3)
    image[0, 1, 2, 0] = math.nan
    with pytest.raises(ValueError, match=r"`image` holds 1 NaN or infinite values"):
        image_to_pils(image)


KV_UNSET = dict(kv_target=0.0, rho=0.0, rho_floor=-1.0, policy="default")


@pytest.mark.parametrize(
    "method, change, message",
    [
        ("h2o", {"rho": 0.5}, "rho = 0.5 applies to the unicache method only, not to 'h2o'; set rho to 0 (unset)"),
        ("h2o", {"rho_floor": 0.1}, "rho_floor = 0.1 applies to the unicache method only, not to 'h2o'; set rho_floor"),
        ("snapkv", {"policy": "bagel-7b-mot.json"}, "policy = 'bagel-7b-mot.json' applies to the unicache method only"),
        ("full", {"kv_target": 0.3}, "kv_target = 0.3 applies to the compressing methods (full keeps every row)"),
        ("unicache", {"kv_target": 0.3, "rho": 0.5}, "`rho` (0.5) and `kv_target` (0.3) both set UniCache's retention"),
        ("unicache", {"kv_target": 0.3, "rho_floor": 0.0}, "`rho_floor` (0.0) and `kv_target` (0.3) both set"),
        ("kivi", {"objective": "memory"}, "objective = 'memory' applies to the unicache method only, not to 'kivi'"),
    ],
)
def test_kv_config_refuses_a_setting_the_method_would_not_use(method, change, message):
    """The command line refuses `h2o --rho`, `full --kv-target` and `--rho` beside `--kv-target`; the node ran them
    as plain H2O, as full KV, or with rho winning over the target, without a word. It refuses them the same way, at
    /prompt (validate_inputs) and when run."""
    values = {**KV_UNSET, **change}
    assert message in UniCacheKVConfig.validate_inputs(method=method, **values)
    with pytest.raises(ValueError, match=re.escape(f"UniCache KV config: {message}")):
        UniCacheKVConfig.execute(method, **values)
    assert UniCacheKVConfig.validate_inputs(method=method, **KV_UNSET) is True
    # a linked widget is not known at /prompt: the pair is left to the run
    assert UniCacheKVConfig.validate_inputs(method=method, **{**values, "kv_target": None}) is True


def test_kv_config_refuses_an_objective_that_is_not_a_choice():
    message = "objective = 'fastest' is not a choice of this input (speed, memory)"
    values = {**KV_UNSET, "objective": "fastest"}
    assert message in UniCacheKVConfig.validate_inputs(method="unicache", **values)
    with pytest.raises(ValueError, match=re.escape(f"UniCache KV config: {message}")):
        UniCacheKVConfig.execute("unicache", **values)


def _comfy_400(class_type: str, inputs: list[str], message: str) -> dict:
    """A /prompt HTTP 400 body as ComfyUI 0.3.75 builds it for a node whose validate_inputs returned ``message``
    (execution.py: one error per input of the node, each tagged with it), beside another node's own error."""
    errors = [
        {
            "type": "custom_validation_failed",
            "message": "Custom validation failed for node",
            "details": f"{name} - {message}",
            "extra_info": {"input_name": name},
        }
        for name in inputs
    ]
    other = {"type": "value_not_in_list", "message": "Value not in list", "details": "x: 'a' not in []",
             "extra_info": {"input_name": "x"}}  # fmt: skip
    lines = [f"{e['message']}: {e['details']}" for e in errors]
    return {
        "error": {"type": "prompt_outputs_failed_validation", "details": "\n".join([*lines, "Value not in list: x"])},
        "node_errors": {
            "3": {"errors": errors, "dependent_outputs": ["3"], "class_type": class_type},
            "9": {"errors": [other, dict(other)], "dependent_outputs": ["9"], "class_type": "CoreNode"},
        },
    }


@pytest.mark.parametrize(
    "inputs, message, kept",
    [
        (["model", "prompt", "steps", "width", "height"], "width = 40 is not a multiple of 16; use 32 or 48", "width"),
        (
            ["method", "rho", "rho_floor", "kv_target"],
            "rho_floor = 0.1 applies to the unicache method only",
            "rho_floor",
        ),
        (["method", "rho", "kv_target"], "`rho` (0.5) and `kv_target` (0.3) both set UniCache's retention", "rho"),
        (["model", "steps"], "a message about no input", "model"),
    ],
)
def test_a_refusal_is_kept_once_on_the_input_it_names(inputs, message, kept):
    from nodes.validation import one_error_per_input

    body = one_error_per_input(_comfy_400("UniCacheTextToImage", inputs, message), {"UniCacheTextToImage"})
    errors = body["node_errors"]["3"]["errors"]
    assert [e["extra_info"]["input_name"] for e in errors] == [kept]
    assert errors[0]["details"] == f"{kept} - {message}"
    assert body["error"]["details"].splitlines() == [f"Custom validation failed for node: {kept} - {message}",
                                                       "Value not in list: x"]  # fmt: skip
    assert len(body["node_errors"]["9"]["errors"]) == 2  # another pack's node is left as ComfyUI wrote it
