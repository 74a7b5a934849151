"""The loader node's ``weight_dtype`` input without a host (ComfyUI stubbed): core UNETLoader's choices, optional
(so older workflows run as ``default``), and part of IS_CHANGED and of the model cache key. The real host's fp8
operations, ``model_size()`` and partial loading: tests/host/test_weight_dtype.py."""

from __future__ import annotations

import pytest
from comfy_stubs import TINY_NAME, NodeCall, host_stubs  # noqa: F401  (host_stubs: a fixture)


def test_weight_dtype_is_an_optional_input_with_unet_loaders_choices():
    from nodes.loader_node import UniCacheBagelLoader

    spec = UniCacheBagelLoader.INPUT_TYPES()
    assert "weight_dtype" not in spec["required"]
    kind, options = spec["optional"]["weight_dtype"]
    choices = options["options"]
    assert (
        kind == "COMBO"
        and choices == ["default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"]
        and options["default"] == "default"
    )


def test_is_changed_and_the_cache_key_include_weight_dtype(host_stubs):
    from nodes import host
    from nodes.loader_node import UniCacheBagelLoader

    changed = {w: UniCacheBagelLoader.fingerprint_inputs(TINY_NAME, "fp32", "auto", w) for w in host.WEIGHT_DTYPES}
    assert len(set(changed.values())) == len(changed)
    assert (
        UniCacheBagelLoader.fingerprint_inputs(TINY_NAME, "fp32", "auto") == changed["default"]
    )  # a workflow without it
    (model,) = NodeCall(UniCacheBagelLoader)(TINY_NAME, "fp32", "auto")
    (same,) = NodeCall(UniCacheBagelLoader)(TINY_NAME, "fp32", "auto", weight_dtype="default")
    assert same is model and model.weight_dtype == "default"
    # another weight dtype is another model: the (stub) host is asked for fp8 operations, not the cached one
    with pytest.raises(NotImplementedError, match="float8_e4m3fn"):
        NodeCall(UniCacheBagelLoader)(TINY_NAME, "fp32", "auto", weight_dtype="fp8_e4m3fn")


def test_unknown_weight_dtype_is_one_line(host_stubs):
    from nodes import host

    with pytest.raises(
        ValueError,
        match=r"^`weight_dtype` must be one of default, fp8_e4m3fn, fp8_e4m3fn_fast, "
        r"fp8_e5m2, got 'int4'$",
    ):
        host.host_operations("int4", "fp32", None)
