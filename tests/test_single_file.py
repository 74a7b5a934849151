"""Single-file checkpoints (ComfyUI-BAGEL's converted .safetensors), external VAEs and LATENT hooks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from training.tiny import (
    TINY_SINGLE_FILE,
    build_tiny_models,
    write_tiny_checkpoint,
    write_tiny_single_file,
)
from training.tiny import (
    main as tiny_main,
)
from unicache_core.bagel import contexts as C
from unicache_core.bagel.checkpoint.loader import load_bagel
from unicache_core.bagel.checkpoint.model_id import BAGEL_7B_MOT, model_id_from_variant, model_id_of
from unicache_core.bagel.checkpoint.single_file import (
    BAGEL_SPECIAL_TOKEN_IDS,
    METADATA_KEY,
    NATIVE_VARIANT,
    TINY_VARIANT,
    convert_folder,
    inspect_single_file,
    official_layout,
    sidecar_path,
)
from unicache_core.bagel.latents import (
    FLUX_SCALE_FACTOR,
    FLUX_SHIFT_FACTOR,
    VAEAdapter,
    from_comfy_latent,
    latent_factors,
    to_comfy_latent,
)
from unicache_core.bagel.pipeline import BagelPipeline
from unicache_core.bagel.request import GivenLatents
from unicache_core.bagel.seeding import seeded_generator
from unicache_core.bagel.settings import preset
from unicache_core.bagel.transforms import ImageTransforms
from unicache_core.errors import CheckpointError

FAST = preset("t2i", width=64, height=64, num_timesteps=3)  # run with seed=7
COMFY_TOKENIZER = Path(__file__).resolve().parents[1] / ".comfyhost/ComfyUI/comfy/text_encoders/qwen25_tokenizer"


def _pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image, dtype=np.uint8)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    """The tiny checkpoint (seed 0, the same weights as the shared folder fixture) in the single-file form."""
    return write_tiny_single_file(tmp_path_factory.mktemp("tiny_single"), seed=0)


@pytest.fixture(scope="module")
def folder_loaded(tiny_checkpoint):
    return load_bagel(tiny_checkpoint, dtype="fp32")


@pytest.fixture(scope="module")
def single_loaded(single):
    return load_bagel(
        single, dtype="fp32", tokenizer_dir=single.parent / "tokenizer", vae=single.parent / "ae.safetensors"
    )


@pytest.fixture(scope="module")
def no_vae_loaded(single):
    return load_bagel(single, dtype="fp32", tokenizer_dir=single.parent / "tokenizer")


@pytest.fixture(scope="module")
def source_image():
    rng = np.random.default_rng(3)
    return Image.fromarray(rng.integers(0, 256, size=(64, 64, 3), dtype=np.uint8))


def _rewrite(src: Path, dst: Path, meta: dict | None, tensors=None) -> Path:
    """``src``'s tensors saved to ``dst`` with ``meta`` as the comfyui_bagel metadata (None: no metadata)."""
    tensors = load_file(str(src)) if tensors is None else tensors
    header = {"format": "pt"} if meta is None else {"format": "pt", METADATA_KEY: json.dumps(meta)}
    save_file(tensors, str(dst), metadata=header)
    return dst


# ------------------------------------------------------------------------------------------ loading


def test_folder_and_single_file_give_the_same_image(folder_loaded, single_loaded, single, tiny_checkpoint, tmp_path):
    a = BagelPipeline(folder_loaded).text_to_image("a red cube on a table", FAST, seed=7)
    b = BagelPipeline(single_loaded).text_to_image("a red cube on a table", FAST, seed=7)
    assert np.array_equal(_pixels(a.image), _pixels(b.image))
    # the same weights, loaded from two files: fp32 kernels may take other vector paths for other memory
    # alignments (an AMD EPYC machine gave a 2e-6 difference), so the latents agree to rounding, not bit for bit
    assert a.latents.shape == (1, 16, 8, 8)
    torch.testing.assert_close(a.latents, b.latents, rtol=0, atol=2e-5)
    # the converter of a folder writes the same tensors as the tiny single-file writer
    converted = convert_folder(tiny_checkpoint, tmp_path / "c.safetensors", variant=TINY_VARIANT)
    left, right = load_file(str(converted)), load_file(str(single))
    assert left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)
    assert single_loaded.form == "single_file" and folder_loaded.form == "folder"
    assert single_loaded.variant == TINY_VARIANT and single_loaded.model_id == "unicache-tiny-random"
    assert single_loaded.metadata["format_version"] == 1
    assert BagelPipeline(single_loaded).model_id == "unicache-tiny-random"


def test_full_vocab_single_file_matches_its_folder(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "f", seed=1, full_vocab=True)
    single = write_tiny_single_file(tmp_path / "s", seed=1, full_vocab=True, sidecar=True)
    a = load_bagel(folder, dtype="fp32")
    b = load_bagel(
        single, dtype="fp32", tokenizer_dir=single.parent / "tokenizer", vae=single.parent / "ae.safetensors"
    )
    assert a.config.llm.vocab_size == b.config.llm.vocab_size == 152064
    for tok in (a.tokenizer, b.tokenizer):
        assert {n: tok.token_to_id(n) for n in BAGEL_SPECIAL_TOKEN_IDS} == BAGEL_SPECIAL_TOKEN_IDS
    ra = BagelPipeline(a).text_to_image("a blue car", FAST, seed=7)
    rb = BagelPipeline(b).text_to_image("a blue car", FAST, seed=7)
    assert np.array_equal(_pixels(ra.image), _pixels(rb.image))
    assert inspect_single_file(single).source == "sidecar"
    if COMFY_TOKENIZER.is_dir():  # ComfyUI's Qwen2.5 tokenizer fits a full-vocabulary model
        c = load_bagel(single, dtype="fp32", tokenizer_dir=COMFY_TOKENIZER, vae=single.parent / "ae.safetensors")
        assert c.tokenizer.bos_token_id == 151644
        # a folder carrying that tokenizer (--tokenizer-dir) gives the single file's image with it
        d = load_bagel(
            write_tiny_checkpoint(tmp_path / "g", seed=1, full_vocab=True, tokenizer_dir=COMFY_TOKENIZER), dtype="fp32"
        )
        assert (tmp_path / "g" / "vocab.json").read_bytes() == (COMFY_TOKENIZER / "vocab.json").read_bytes()
        rc = BagelPipeline(c).text_to_image("a blue car", FAST, seed=7)
        rd = BagelPipeline(d).text_to_image("a blue car", FAST, seed=7)
        assert np.array_equal(_pixels(rc.image), _pixels(rd.image))


def test_full_width_vae_is_flux_sized_and_finite():
    _, vae, cfg = build_tiny_models(100, seed=0, full_vae=True)
    assert (cfg.ae.ch, cfg.ae.ch_mult, cfg.ae.num_res_blocks) == (128, (1, 2, 4, 4), 2)
    assert vae.decoder.conv_in.weight.shape == (512, 16, 3, 3)
    with torch.no_grad():
        z = vae.encode(torch.rand(1, 3, 32, 32) * 2 - 1, sample=False)
        assert z.shape == (1, 16, 4, 4) and torch.isfinite(z).all()
        assert torch.isfinite(vae.decode(z)).all()
    model_small, _, _ = build_tiny_models(100, seed=0)
    model_full, _, _ = build_tiny_models(100, seed=0, full_vae=True)
    a, b = model_small.state_dict(), model_full.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # the VAE option leaves the BAGEL weights alone


def test_tiny_cli_single_file(tmp_path, capsys):
    assert tiny_main([str(tmp_path / "o"), "--single-file", "--dtype", "bf16"]) == 0
    info = inspect_single_file(tmp_path / "o" / TINY_SINGLE_FILE)
    assert info.dtype == "bf16" and info.source == "metadata"
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["ae.safetensors", TINY_SINGLE_FILE, "tokenizer"]
    assert tiny_main([str(tmp_path / "p"), "--sidecar"]) == 2  # --sidecar needs --single-file
    assert "--single-file" in capsys.readouterr().err


def test_metadata_and_sidecar(single, tmp_path):
    info = inspect_single_file(single)
    assert info.source == "metadata" and info.variant == TINY_VARIANT and info.dtype == "fp32"
    assert model_id_of(single) == info.model_id == model_id_from_variant(TINY_VARIANT)
    meta = dict(info.metadata)
    # the same metadata in a sidecar
    plain = _rewrite(single, tmp_path / "plain.safetensors", None)
    side = sidecar_path(plain)
    side.write_text(
        json.dumps(
            {"format": "comfyui_bagel_sidecar", "checkpoint_size": plain.stat().st_size, "metadata": json.dumps(meta)}
        )
    )
    assert inspect_single_file(plain).source == "sidecar"
    assert model_id_of(plain) == "unicache-tiny-random"
    # a sidecar written for another file size is refused
    side.write_text(
        json.dumps({"format": "comfyui_bagel_sidecar", "checkpoint_size": plain.stat().st_size + 1, "metadata": meta})
    )
    with pytest.raises(CheckpointError, match="sidecar .* bytes, but plain.safetensors has"):
        inspect_single_file(plain)
    side.write_text(json.dumps({"format": "something_else", "checkpoint_size": plain.stat().st_size}))
    with pytest.raises(CheckpointError, match="comfyui_bagel_sidecar"):
        inspect_single_file(plain)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"variant": "Zebra-CoT"}, "variant 'Zebra-CoT'.*no support"),
        ({"format_version": 2}, "format_version 2"),
        ({"format": "other"}, "format 'other'"),
        ({"quantization": "nf4"}, "quantization 'nf4'"),
        ({"latent_format": "sd3"}, "latent_format 'sd3'"),
        ({"dtype": "bf16"}, "dtype 'bf16' .* stored as \\['F32'\\]"),
        ({"model_options": {"x": 1}}, "model_options"),
        ({"model_configs": None}, "model_configs"),
    ],
)
def test_refused_metadata(single, tmp_path, change, match):
    meta = {**inspect_single_file(single).metadata, **change}
    bad = _rewrite(single, tmp_path / "bad.safetensors", meta)
    with pytest.raises(CheckpointError, match=match):
        inspect_single_file(bad)


def test_metadata_configs_are_checked_against_the_header(single, tmp_path):
    meta = inspect_single_file(single).metadata
    configs = dict(meta["model_configs"])
    configs["llm_config.json"] = {**configs["llm_config.json"], "num_hidden_layers": 3}
    bad = _rewrite(single, tmp_path / "bad.safetensors", {**meta, "model_configs": configs})
    with pytest.raises(CheckpointError, match=r"bad.safetensors\[metadata\]:llm_config.json does not match.*3 layers"):
        load_bagel(bad, tokenizer_dir=single.parent / "tokenizer")
    configs = dict(meta["model_configs"])
    configs["ae_config.json"] = {**configs["ae_config.json"], "ch": 64}
    bad = _rewrite(single, tmp_path / "bad2.safetensors", {**meta, "model_configs": configs})
    with pytest.raises(CheckpointError, match="ae_config.json does not match.*ae.safetensors"):
        load_bagel(bad, tokenizer_dir=single.parent / "tokenizer", vae=single.parent / "ae.safetensors")


def test_no_metadata_and_not_the_official_layout_is_one_clear_error(single, tmp_path):
    plain = _rewrite(single, tmp_path / "plain.safetensors", None)
    with pytest.raises(CheckpointError) as err:
        load_bagel(plain, tokenizer_dir=single.parent / "tokenizer")
    text = str(err.value)
    assert "no 'comfyui_bagel' safetensors metadata and no sidecar plain.safetensors.comfyui-bagel.json" in text
    assert "BAGEL-7B-MoT" in text and "do not match that layout" in text and "with other shapes" in text
    assert "\n" not in text


def _sparse_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], dtype: str = "BF16") -> Path:
    """A valid safetensors file of ``shapes`` whose data is a hole (no disk used): for header-only tests."""
    header, offset = {}, 0
    for name in sorted(shapes):
        size = 2 * int(np.prod(shapes[name]))
        header[name] = {"dtype": dtype, "shape": list(shapes[name]), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as fh:
        fh.write(len(blob).to_bytes(8, "little"))
        fh.write(blob)
        fh.truncate(8 + len(blob) + offset)
    return path


def test_no_metadata_with_the_official_layout_is_bagel_7b_mot(tmp_path):
    layout = official_layout()
    assert len(layout) == 1223
    real = _sparse_safetensors(tmp_path / "bagel-7b-mot.safetensors", layout)
    info = inspect_single_file(real)  # header only: the 29 GB of (absent) data are never read
    assert (info.source, info.variant, info.model_id, info.dtype) == ("layout", NATIVE_VARIANT, BAGEL_7B_MOT, "bf16")
    assert info.config.llm.num_hidden_layers == 28 and info.special_token_ids == BAGEL_SPECIAL_TOKEN_IDS
    assert model_id_of(real) == BAGEL_7B_MOT
    if COMFY_TOKENIZER.is_dir():
        from unicache_core.bagel.checkpoint.single_file import check_tokenizer
        from unicache_core.bagel.tokenizer import BagelTokenizer

        check_tokenizer(BagelTokenizer.from_dir(COMFY_TOKENIZER), info, COMFY_TOKENIZER)
    # one tensor off: refused
    shapes = dict(layout)
    shapes["llm2vae.weight"] = (32, 3584)
    with pytest.raises(
        CheckpointError, match=r"1 with other shapes \(llm2vae.weight \(32, 3584\) instead of \(64, 3584\)"
    ):
        inspect_single_file(_sparse_safetensors(tmp_path / "off.safetensors", shapes))


def test_vae_tensors_inside_the_file_are_refused(single, tmp_path):
    tensors = {**load_file(str(single)), "encoder.conv_in.weight": torch.zeros(32, 3, 3, 3)}
    bad = _rewrite(single, tmp_path / "bad.safetensors", inspect_single_file(single).metadata, tensors)
    with pytest.raises(CheckpointError, match="outside BAGEL's module roots.*encoder.conv_in.weight"):
        inspect_single_file(bad)


def test_argument_rules(single, tiny_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="`tokenizer_dir` is required"):
        load_bagel(single)
    with pytest.raises(ValueError, match="only for a single-file checkpoint"):
        load_bagel(tiny_checkpoint, tokenizer_dir=single.parent / "tokenizer")
    with pytest.raises(CheckpointError, match="not a .safetensors file"):
        load_bagel(tiny_checkpoint / "vocab.json", tokenizer_dir=single.parent / "tokenizer")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_bagel(tmp_path / "nothing.safetensors")


# ------------------------------------------------------------------------------------------ tokenizer


def test_special_token_ids_are_checked(single, tmp_path):
    tok = tmp_path / "tok"
    shutil.copytree(single.parent / "tokenizer", tok)
    config = json.loads((tok / "tokenizer_config.json").read_text())
    decoder = config["added_tokens_decoder"]
    vision_start = next(k for k, v in decoder.items() if v["content"] == "<|vision_start|>")
    del decoder[vision_start]  # BAGEL's code would add it at a fresh, untrained id
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError, match=r"does not belong to bagel-tiny.safetensors: <\|vision_start\|> is missing"
    ):
        load_bagel(single, tokenizer_dir=tok)
    if COMFY_TOKENIZER.is_dir():  # the real Qwen2.5 ids do not fit the small tiny vocabulary
        with pytest.raises(CheckpointError, match=r"<\|im_start\|> has id 151644, the checkpoint expects"):
            load_bagel(single, tokenizer_dir=COMFY_TOKENIZER)
    # metadata of BAGEL-7B-MoT disagreeing with its real ids is refused up front
    meta = {**inspect_single_file(single).metadata, "variant": NATIVE_VARIANT, "special_token_ids": {"<|im_start|>": 5}}
    bad = _rewrite(single, tmp_path / "bad.safetensors", meta)
    with pytest.raises(CheckpointError, match="disagree with BAGEL-7B-MoT"):
        inspect_single_file(bad)


# ------------------------------------------------------------------------------------------ VAE hooks


class CountingVAE:
    """An external VAE adapter over an AutoEncoder: posterior-mean encode, counts its calls."""

    def __init__(self, ae):
        self.ae, self.calls = ae, []

    def encode(self, image):
        self.calls.append(("encode", tuple(image.shape)))
        return self.ae.encode(image, sample=False)

    def decode(self, z):
        self.calls.append(("decode", tuple(z.shape)))
        return self.ae.decode(z)


def test_missing_vae_is_a_clear_error(no_vae_loaded, single_loaded, source_image):
    assert no_vae_loaded.vae is None
    pipe = BagelPipeline(no_vae_loaded)
    with pytest.raises(ValueError, match="no VAE to decode the latents.*vae=.*decode=False"):
        pipe.text_to_image("a red cube", FAST, seed=7)
    with pytest.raises(ValueError, match="no VAE to encode the source image"):
        pipe.edit("make it blue", source_image, preset("edit", num_timesteps=3), seed=1)
    # latents only: no VAE needed, same latents as with the VAE
    lat = pipe.text_to_image("a red cube", FAST, seed=7, decode=False)
    ref = BagelPipeline(single_loaded).text_to_image("a red cube", FAST, seed=7)
    assert lat.image is None and lat.info["vae"] is None and torch.equal(lat.latents, ref.latents)


def test_external_vae_adapter_is_used(no_vae_loaded, single_loaded, source_image):
    adapter = CountingVAE(single_loaded.vae)
    assert isinstance(adapter, VAEAdapter)
    ref = BagelPipeline(single_loaded).text_to_image("a red cube", FAST, seed=7)
    ext = BagelPipeline(no_vae_loaded, vae=adapter).text_to_image("a red cube", FAST, seed=7)
    assert adapter.calls == [("decode", (1, 16, 8, 8))] and ext.info["vae"] == "external"
    assert np.array_equal(_pixels(ext.image), _pixels(ref.image))
    # per call, overriding the pipeline's (here the checkpoint's) VAE
    adapter.calls.clear()
    pipe = BagelPipeline(single_loaded)
    out = pipe.edit("make it blue", source_image, preset("edit", num_timesteps=3), seed=1, vae=adapter)
    assert [c[0] for c in adapter.calls] == ["encode", "decode"] and adapter.calls[0][1] == (1, 3, 64, 64)
    assert out.info["source_latent"] == "external_vae" and out.latents.shape == (1, 16, 8, 8)
    own = pipe.edit("make it blue", source_image, preset("edit", num_timesteps=3), seed=1)
    assert own.info["source_latent"] == "checkpoint_vae"
    with pytest.raises(ValueError, match="`vae` must be an object with encode"):
        BagelPipeline(single_loaded, vae=object())
    with pytest.raises(ValueError, match="`vae_noise` is the sampling noise of the built-in VAE"):
        pipe.edit(
            "x",
            source_image,
            preset("edit", num_timesteps=3),
            seed=1,
            vae=adapter,
            given=GivenLatents(vae_noise=torch.zeros(1, 16, 8, 8)),
        )

    class Broken(CountingVAE):
        def decode(self, z):
            return torch.zeros(1, 3, 8, 8)

    with pytest.raises(ValueError, match=r"decode must return a float tensor of shape \(1, 3, 64, 64\)"):
        BagelPipeline(single_loaded, vae=Broken(single_loaded.vae)).text_to_image("x", FAST, seed=7)


def test_edit_with_a_given_latent_skips_the_encode(single_loaded, source_image, monkeypatch):
    pipe = BagelPipeline(single_loaded)
    seed = 5
    ref = pipe.edit("make it blue", source_image, preset("edit", num_timesteps=3), seed=seed)
    # the latent the built-in encode makes: the first draw of the seeded generator is its noise
    transforms = ImageTransforms.from_config(single_loaded.config)
    vae_input = transforms.vae(transforms.prepare(source_image, "image"))
    noise = torch.randn((1, 16, 8, 8), generator=seeded_generator(seed), dtype=torch.float32)
    with torch.no_grad():
        z = single_loaded.vae.encode(vae_input.unsqueeze(0).float(), noise=noise)

    def boom(*args, **kwargs):
        raise AssertionError("the VAE encoder ran although a source latent was given")

    monkeypatch.setattr(single_loaded.vae, "encode", boom)
    monkeypatch.setattr(C, "encode_vae_latent", boom)
    given = pipe.edit(
        "make it blue", source_image, preset("edit", num_timesteps=3), seed=seed, given=GivenLatents(source_latent=z)
    )
    assert given.info["source_latent"] == "given"
    assert torch.equal(given.latents, ref.latents)  # same seed → same later noise, same result
    assert np.array_equal(_pixels(given.image), _pixels(ref.image))
    # a latent of another size sets the output size; one off BAGEL's 2x2-cell grid is refused
    with pytest.raises(ValueError, match=r"`source_latent` is 5x4 latent cells .* crop it to 4x4"):
        pipe.edit(
            "x",
            source_image,
            preset("edit", num_timesteps=3),
            seed=seed,
            given=GivenLatents(source_latent=torch.zeros(1, 16, 5, 4)),
        )
    with pytest.raises(ValueError, match="text-to-image takes none"):
        pipe.text_to_image("x", FAST, seed=1, given=GivenLatents(source_latent=z))
    from unicache_core.errors import NumericalError

    with pytest.raises(NumericalError, match="source latent"):
        pipe.edit(
            "x",
            source_image,
            preset("edit", num_timesteps=3),
            seed=seed,
            given=GivenLatents(source_latent=torch.full((1, 16, 8, 8), float("nan"))),
        )


def test_latent_helpers_round_trip(single_loaded):
    z = torch.randn(1, 16, 8, 8)
    comfy = to_comfy_latent(z)
    assert torch.allclose(comfy, z / 0.3611 + 0.1159)
    assert torch.allclose(from_comfy_latent(comfy), z, atol=1e-6)
    assert latent_factors() == (FLUX_SCALE_FACTOR, FLUX_SHIFT_FACTOR) == (0.3611, 0.1159)
    assert latent_factors(single_loaded) == latent_factors(single_loaded.config) == latent_factors(single_loaded.vae)
    from unicache_core.bagel.config import AEConfig

    other = AEConfig(scale_factor=1.5, shift_factor=-0.25)
    assert torch.allclose(to_comfy_latent(z, other), z / 1.5 - 0.25)
    assert torch.allclose(from_comfy_latent(to_comfy_latent(z, other), other), z, atol=1e-6)
    with pytest.raises(ValueError, match="scale_factor"):
        latent_factors(object())
    # the checkpoint VAE's decode of a BAGEL latent equals the raw FLUX decode of its ComfyUI form
    with torch.no_grad():
        raw = single_loaded.vae.decoder(to_comfy_latent(z, single_loaded))
        assert torch.allclose(single_loaded.vae.decode(z), raw, atol=1e-5)


def test_truncated_or_garbled_single_file(single, tmp_path):
    data = single.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match="describes .* bytes but the file has .*truncated"):
        load_bagel(cut, tokenizer_dir=single.parent / "tokenizer")
    garbled = tmp_path / "garbled.safetensors"
    garbled.write_bytes(data[:8] + b"x" + data[9:])
    with pytest.raises(CheckpointError, match="header is not JSON"):
        inspect_single_file(garbled)
    tiny = tmp_path / "tiny.safetensors"
    tiny.write_bytes(b"\x01")
    with pytest.raises(CheckpointError, match="only 1 bytes"):
        inspect_single_file(tiny)
