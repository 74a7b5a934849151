"""Hostile inputs to the BAGEL engine: broken checkpoints, odd images, bad prompts and arguments.

Every bad input must give ONE clear error (``ValueError`` or :class:`CheckpointError`) that names the
value and says what to do; nothing falls back silently, and only safetensors/JSON are ever read.
"""

from __future__ import annotations

import json
import math
import pickle
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoint_edits import edit_json
from safetensors.torch import load_file, save_file

from unicache_core.bagel.checkpoint.loader import load_bagel
from unicache_core.bagel.config import load_bagel_config
from unicache_core.bagel.pipeline import BagelPipeline
from unicache_core.bagel.request import RunHooks
from unicache_core.bagel.settings import preset
from unicache_core.bagel.tokenizer import BagelTokenizer
from unicache_core.errors import CancelledError, CheckpointError
from unicache_core.kv.cache import CacheRequest, FullKVCache


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    return load_bagel(tiny_checkpoint, dtype="fp32")


@pytest.fixture(scope="module")
def pipe(loaded):
    return BagelPipeline(loaded)


#: A small, fast text-to-image request on the tiny checkpoint.
SMALL = preset("t2i", width=32, height=32, num_timesteps=2)


def _forbid_pickle(monkeypatch) -> None:
    def boom(*args, **kwargs):
        raise AssertionError("a pickle loader was called")

    monkeypatch.setattr(torch, "load", boom)
    monkeypatch.setattr(pickle, "load", boom)
    monkeypatch.setattr(pickle, "loads", boom)


# ------------------------------------------------------------------------------------ checkpoint folder


def test_checkpoint_path_is_a_file_or_empty_folder(tiny_checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        load_bagel(tiny_checkpoint / "vocab.json")
    with pytest.raises(CheckpointError, match="llm_config.json"):
        load_bagel(tmp_path)


@pytest.mark.parametrize(
    "text, match",
    [
        ("{ nope", "cannot parse"),
        ("[1, 2]", "JSON list, expected an object"),
        ("", "cannot parse"),
    ],
)
def test_llm_config_not_a_json_object(tiny_checkpoint_copy, text, match):
    (tiny_checkpoint_copy / "llm_config.json").write_text(text)
    with pytest.raises(CheckpointError, match=match):
        load_bagel(tiny_checkpoint_copy)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"hidden_size": "64"}, r"'hidden_size' = '64' must be of type int"),
        ({"hidden_size": True}, r"'hidden_size' = True must be of type int"),
        ({"num_attention_heads": 3}, "multiple of num_attention_heads 3"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads 3"),
        ({"rope_theta": -1.0}, "rope_theta"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
        ({"max_position_embeddings": 0}, "max_position_embeddings"),
        ({"vocab_size": -5}, "vocab_size"),
    ],
)
def test_llm_config_bad_values(tiny_checkpoint_copy, changes, match):
    edit_json(tiny_checkpoint_copy / "llm_config.json", **changes)
    with pytest.raises(CheckpointError, match=match):
        load_bagel_config(tiny_checkpoint_copy)


@pytest.mark.parametrize("literal", ["NaN", "Infinity"])
def test_llm_config_non_finite_float(tiny_checkpoint_copy, literal):
    path = tiny_checkpoint_copy / "llm_config.json"
    text = re.sub(r'"rope_theta": [0-9.e+]+', f'"rope_theta": {literal}', path.read_text())
    assert literal in text
    path.write_text(text)
    with pytest.raises(CheckpointError, match=f"'rope_theta' = {'nan' if literal == 'NaN' else 'inf'}.*finite"):
        load_bagel_config(tiny_checkpoint_copy)


def test_vit_config_non_finite_eps(tiny_checkpoint_copy):
    path = tiny_checkpoint_copy / "vit_config.json"
    path.write_text(path.read_text().rstrip().rstrip("}") + ', "layer_norm_eps": NaN}')
    with pytest.raises(CheckpointError, match="layer_norm_eps"):
        load_bagel_config(tiny_checkpoint_copy)


# ------------------------------------------------------------------------------------ safetensors files


def test_safetensors_header_length_huge_or_garbage(tiny_checkpoint_copy):
    path = tiny_checkpoint_copy / "ema.safetensors"
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 2**62) + data[8:])
    with pytest.raises(CheckpointError, match="ema.safetensors.*re-download"):
        load_bagel(tiny_checkpoint_copy)
    path.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="ema.safetensors.*re-download"):
        load_bagel(tiny_checkpoint_copy)


def test_integer_tensor_is_rejected(tiny_checkpoint_copy):
    path = tiny_checkpoint_copy / "ae.safetensors"
    tensors = load_file(str(path))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=re.escape(name) + ".*int32"):
        load_bagel(tiny_checkpoint_copy)


@pytest.mark.parametrize("pickle_name", ["ema.bin", "pytorch_model.bin", "ema.pt"])
def test_pickle_weights_are_never_read(tiny_checkpoint_copy, monkeypatch, pickle_name):
    (tiny_checkpoint_copy / "ema.safetensors").unlink()
    torch.save({"w": torch.zeros(2)}, tiny_checkpoint_copy / pickle_name)
    _forbid_pickle(monkeypatch)
    with pytest.raises(CheckpointError) as info:
        load_bagel(tiny_checkpoint_copy)
    message = str(info.value)
    assert "ema.safetensors" in message and pickle_name in message
    assert "pickle" in message and "safetensors" in message and "not read" in message


def test_pickle_file_named_safetensors(tiny_checkpoint_copy, monkeypatch):
    torch.save({"w": torch.zeros(2)}, tiny_checkpoint_copy / "ema.safetensors")
    _forbid_pickle(monkeypatch)
    with pytest.raises(CheckpointError, match="ema.safetensors.*pickle.*not read"):
        load_bagel(tiny_checkpoint_copy)


def test_out_of_memory_is_not_reported_as_corruption(tiny_checkpoint, monkeypatch):
    from unicache_core.bagel.checkpoint.tensor_file import TensorFile

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(TensorFile, "read", no_memory)  # the loader reads every tensor through it
    with pytest.raises(torch.OutOfMemoryError, match="out of memory"):
        load_bagel(tiny_checkpoint)


# ------------------------------------------------------------------------------------ tokenizer files


@pytest.mark.parametrize("name", ["vocab.json", "merges.txt", "tokenizer_config.json"])
def test_tokenizer_file_missing(tiny_checkpoint_copy, name):
    (tiny_checkpoint_copy / name).unlink()
    with pytest.raises(CheckpointError, match=f"missing tokenizer file .*{re.escape(name)}"):
        load_bagel(tiny_checkpoint_copy)


def _vocab_with(path: Path, **extra) -> None:
    data = json.loads(path.read_text())
    data.update(extra)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (lambda d: _vocab_with(d / "vocab.json", zzz=-5), r"vocab.json.*'zzz'.*-5"),
        (lambda d: _vocab_with(d / "vocab.json", zzz=3), r"vocab.json.*id 3"),
        (lambda d: (d / "vocab.json").write_text("[1]"), "vocab.json"),
        (lambda d: (d / "merges.txt").write_text("#version: 0.2\nqq zz\n"), r"merges.txt.*'qq'"),
        (lambda d: (d / "merges.txt").write_bytes(b"\xff\xfe\x00"), "merges.txt"),
        (
            lambda d: edit_json(d / "tokenizer_config.json", added_tokens_decoder={"5": {"content": 7}}),
            "tokenizer_config.json.*'5'",
        ),
        (
            lambda d: edit_json(d / "tokenizer_config.json", added_tokens_decoder={"-3": {"content": "<|x|>"}}),
            "tokenizer_config.json.*'-3'",
        ),
        (
            lambda d: edit_json(d / "tokenizer_config.json", added_tokens_decoder=[1]),
            "tokenizer_config.json.*added_tokens_decoder",
        ),
    ],
)
def test_tokenizer_files_malformed(tiny_checkpoint_copy, corrupt, match):
    corrupt(tiny_checkpoint_copy)
    with pytest.raises(CheckpointError, match=match):
        BagelTokenizer.from_dir(tiny_checkpoint_copy)


def test_vocab_smaller_than_special_ids(tiny_checkpoint_copy):
    tok = BagelTokenizer.from_dir(tiny_checkpoint_copy)
    edit_json(tiny_checkpoint_copy / "llm_config.json", vocab_size=tok.eos_token_id)
    with pytest.raises(CheckpointError, match=f"{tok.vocab_size} ids.*vocab_size={tok.eos_token_id}"):
        load_bagel(tiny_checkpoint_copy)


# ------------------------------------------------------------------------------------ dtype / device


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("fp16", torch.float16),
        ("FP32", torch.float32),
        ("float32", torch.float32),
        (torch.float16, torch.float16),
    ],
)
def test_dtype_aliases(tiny_checkpoint, spec, expected):
    loaded = load_bagel(tiny_checkpoint, dtype=spec)
    assert loaded.dtype == expected and loaded.model.dtype == expected
    assert loaded.vae.encoder.conv_in.weight.dtype == torch.float32


@pytest.mark.parametrize("spec", ["int8", "float64", torch.int8, None, 3])
def test_dtype_unknown(tiny_checkpoint, spec):
    with pytest.raises(ValueError, match=re.escape(f"`dtype` {spec!r} is not supported")):
        load_bagel(tiny_checkpoint, dtype=spec)


@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)])
def test_cuda_device_without_cuda(tiny_checkpoint, device, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"`device` .*cuda.* CUDA is not available.*'cpu'"):
        load_bagel(tiny_checkpoint, device=device)


@pytest.mark.parametrize("device, match", [("bogus", "not a torch device"), ("meta", "meta"), (3.5, "3.5")])
def test_unusable_device(tiny_checkpoint, device, match):
    with pytest.raises(ValueError, match=f"`device`.*{match}"):
        load_bagel(tiny_checkpoint, device=device)


def test_cpu_device_with_index(tiny_checkpoint):
    assert load_bagel(tiny_checkpoint, dtype="fp32", device="cpu:0").model.device.type == "cpu"


# ------------------------------------------------------------------------------------ accelerate offload


def _t2i(pipe_: BagelPipeline) -> np.ndarray:
    return np.asarray(pipe_.text_to_image("a red cube", SMALL.replace(num_timesteps=3), seed=7).image)


def test_offload_cpu_and_disk_gives_the_same_image(tiny_checkpoint, pipe, tmp_path):
    reference = _t2i(pipe)
    device_map = {
        "language_model.model.embed_tokens": "cpu",
        "language_model.model.layers.0": "cpu",
        "language_model.model.layers.1": "disk",
        "language_model.model.norm": "cpu",
        "language_model.model.norm_moe_gen": "cpu",
        "language_model.model.rotary_emb": "cpu",
        "language_model.lm_head": "disk",
        "vit_model": "cpu",
        "connector": "cpu",
        "vit_pos_embed": "cpu",
        "time_embedder": "cpu",
        "vae2llm": "cpu",
        "llm2vae": "disk",
        "latent_pos_embed": "cpu",
    }
    with pytest.raises(ValueError, match="`offload_folder`.*disk"):
        load_bagel(tiny_checkpoint, dtype="fp32", device_map=device_map)
    offloaded = load_bagel(tiny_checkpoint, dtype="fp32", device_map=device_map, offload_folder=tmp_path / "off")
    assert any((tmp_path / "off").iterdir())
    np.testing.assert_array_equal(_t2i(BagelPipeline(offloaded)), reference)
    head = offloaded.model.language_model.lm_head
    assert head.weight.device.type == "meta"  # really offloaded, materialised only during forwards


def test_offload_embeddings_on_disk(tiny_checkpoint, pipe, tmp_path):
    device_map = {
        "language_model.model.embed_tokens": "disk",
        "language_model.model.layers": "cpu",
        "language_model.model.norm": "cpu",
        "language_model.model.norm_moe_gen": "cpu",
        "language_model.model.rotary_emb": "cpu",
        "language_model.lm_head": "cpu",
        "vit_model": "cpu",
        "connector": "cpu",
        "vit_pos_embed": "cpu",
        "time_embedder": "cpu",
        "vae2llm": "cpu",
        "llm2vae": "cpu",
        "latent_pos_embed": "cpu",
    }
    offloaded = load_bagel(tiny_checkpoint, dtype="fp32", device_map=device_map, offload_folder=tmp_path / "off")
    np.testing.assert_array_equal(_t2i(BagelPipeline(offloaded)), _t2i(pipe))
    settings = preset("understanding", max_new_tokens=4)
    text = BagelPipeline(offloaded).understand("What is this?", None, settings).token_ids
    assert text == pipe.understand("What is this?", None, preset("understanding", max_new_tokens=4)).token_ids


def test_auto_device_map_with_small_max_memory(tiny_checkpoint, pipe, tmp_path):
    offloaded = load_bagel(
        tiny_checkpoint, dtype="fp32", device_map="auto", max_memory={"cpu": 1_500_000}, offload_folder=tmp_path / "off"
    )
    assert "disk" in set(offloaded.model.hf_device_map.values())
    np.testing.assert_array_equal(_t2i(BagelPipeline(offloaded)), _t2i(pipe))


def test_max_memory_needs_auto_map(tiny_checkpoint):
    with pytest.raises(ValueError, match="`max_memory`.*device_map='auto'"):
        load_bagel(tiny_checkpoint, max_memory={"cpu": 10**6})


def test_missing_accelerate_gives_install_hint(tiny_checkpoint, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "accelerate" or name.startswith("accelerate."):
            raise ImportError("No module named 'accelerate'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match="pip install accelerate"):
        load_bagel(tiny_checkpoint, device_map="auto")


# ------------------------------------------------------------------------------------ prompts


def test_empty_prompt_is_an_empty_text_block(pipe, loaded):
    """Official ``interleave_inference`` appends ``""`` as a text block: ``[im_start] [im_end]``."""
    ctx = pipe.build_understanding_context(None, "")
    assert ctx.num_tokens == 2 and ctx.rope == 2
    assert isinstance(pipe.understand("", None, preset("understanding", max_new_tokens=2)).text, str)


def test_special_token_text_is_plain_unless_asked(loaded):
    """By default ``<|im_end|>`` in a prompt is ordinary text; the official parsing (the slow tokenizer splits on
    added tokens, so it becomes the control id) only with ``special_tokens=True``."""
    tok = loaded.tokenizer
    plain = tok.encode("a<|im_end|>b")
    assert not set(plain) & set(tok.special_token_ids.values())
    assert tok.decode(plain) == "a<|im_end|>b"
    ids = tok.encode("a<|im_end|>b", special_tokens=True)
    assert ids == [*tok.encode("a"), tok.eos_token_id, *tok.encode("b")]


@pytest.mark.parametrize("prompt", [None, 5, b"bytes", ["a"]])
def test_non_str_prompt(pipe, prompt):
    with pytest.raises(ValueError, match="`prompt` must be a str"):
        pipe.understand(prompt, None, preset("understanding", max_new_tokens=1))
    with pytest.raises(ValueError, match="`prompt` must be a str"):
        pipe.text_to_image(prompt, SMALL)


@pytest.fixture(scope="module")
def short_context_pipe(tmp_path_factory, tiny_checkpoint):
    import shutil

    dst = tmp_path_factory.mktemp("short") / "ckpt"
    shutil.copytree(tiny_checkpoint, dst)
    edit_json(dst / "llm_config.json", max_position_embeddings=300)
    return BagelPipeline(load_bagel(dst, dtype="fp32"))


class _NoForward(FullKVCache):
    def begin_call(self, call):
        raise AssertionError("a forward ran before the length check")


def _no_forward_factory(request: CacheRequest):
    return _NoForward(request.num_layers, task=request.task, branch=request.branch)


def test_prompt_longer_than_max_positions_fails_before_running(short_context_pipe):
    pipe_ = BagelPipeline(short_context_pipe.loaded, cache_factory=_no_forward_factory)
    long_prompt = "the cat " * 200
    with pytest.raises(ValueError, match=r"`prompt`.*positions.*max_position_embeddings = 300"):
        pipe_.understand(long_prompt, None, preset("understanding", max_new_tokens=1))
    with pytest.raises(ValueError, match=r"`prompt`.*max_position_embeddings = 300"):
        pipe_.text_to_image(long_prompt, SMALL)
    with pytest.raises(ValueError, match=r"`max_new_tokens`.*max_position_embeddings = 300"):
        pipe_.understand("a cat", None, preset("understanding", max_new_tokens=299))
    with pytest.raises(ValueError, match=r"`think_max_new_tokens`.*max_position_embeddings = 300"):
        pipe_.text_to_image("a cat", SMALL.replace(think=True, think_max_new_tokens=1000))


def test_prompt_that_fits_runs(short_context_pipe):
    res = short_context_pipe.understand("a cat", None, preset("understanding", max_new_tokens=4))
    assert len(res.token_ids) <= 4


# ------------------------------------------------------------------------------------ generation arguments


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(cfg_text_scale=math.inf), "cfg_text_scale"),
        (dict(cfg_img_scale=math.inf), "cfg_img_scale"),
        (dict(cfg_text_scale=math.nan), "cfg_text_scale"),
        (dict(timestep_shift=math.inf), "timestep_shift"),
        (dict(num_timesteps=-3), "num_timesteps"),
        (dict(num_timesteps=5.0), "num_timesteps"),
        (dict(width=40), "width"),
        (dict(height=1040), "height"),
        (dict(seed=2**64), "seed"),
        (dict(seed=1.5), "seed"),
        (dict(cfg_interval=(1.0, 0.4)), "cfg_interval"),
        (dict(cfg_renorm_type="Global"), "cfg_renorm_type"),
        (dict(think="yes"), "think"),
        (dict(think=True, think_do_sample=1), "think_do_sample"),
        (dict(think=True, think_do_sample=True, think_temperature=math.inf), "think_temperature"),
    ],
)
def test_bad_generation_arguments(pipe, kwargs, name):
    kwargs = dict(kwargs)
    seed = kwargs.pop("seed", 0)
    with pytest.raises(ValueError, match=rf"`{re.escape(name)}`.*got"):
        pipe.text_to_image("x", SMALL.replace(**kwargs), seed=seed)


def test_largest_seed_is_accepted(pipe):
    assert pipe.text_to_image("x", SMALL, seed=2**64 - 1).seed == 2**64 - 1


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(do_sample=True, temperature=0.0), "temperature"),
        (dict(do_sample=True, temperature=math.inf), "temperature"),
        (dict(do_sample="no"), "do_sample"),
        (dict(think="no"), "think"),
        (dict(seed=2**64), "seed"),
        (dict(seed=-1), "seed"),
    ],
)
def test_bad_understanding_arguments(pipe, kwargs, name):
    kwargs = dict(kwargs)
    seed = kwargs.pop("seed", None)
    with pytest.raises(ValueError, match=rf"`{name}`.*got"):
        pipe.understand("x", None, preset("understanding", **kwargs), seed=seed)


def test_temperature_ignored_when_greedy(pipe):
    """Official: temperature only matters with do_sample; greedy decoding accepts any value."""
    a = pipe.understand("hello", None, preset("understanding", max_new_tokens=3, temperature=0.0)).token_ids
    assert a == pipe.understand("hello", None, preset("understanding", max_new_tokens=3)).token_ids


# ------------------------------------------------------------------------------------ interruption


def _cancel_after(n: int):
    calls = []

    def cancel() -> bool:
        calls.append(1)
        return len(calls) > n

    return cancel, calls


def test_cancel_during_think_mode(pipe):
    cancel, calls = _cancel_after(2)
    with pytest.raises(CancelledError, match="text decoding cancelled after 2"):
        pipe.text_to_image(
            "x", SMALL.replace(num_timesteps=3, think=True, think_max_new_tokens=50), hooks=RunHooks(cancel=cancel)
        )
    assert len(calls) == 3


def test_cancel_during_understanding_decode(pipe):
    cancel, calls = _cancel_after(1)
    with pytest.raises(CancelledError, match="after 1 of at most 50"):
        pipe.understand(
            "x", None, preset("understanding", max_new_tokens=50, think=True), hooks=RunHooks(cancel=cancel)
        )
    assert len(calls) == 2


def test_cancel_during_denoising(pipe):
    cancel, calls = _cancel_after(0)
    with pytest.raises(CancelledError, match="before step 1 of 9"):
        pipe.text_to_image("x", SMALL.replace(num_timesteps=10), hooks=RunHooks(cancel=cancel))
    assert len(calls) == 1
