"""Record reference tensors of the official BAGEL code on the tiny checkpoint: tests/goldens/official/.

The official implementation (github ByteDance-Seed/Bagel at :data:`OFFICIAL_COMMIT`) runs on CPU in fp32 on the
tiny random checkpoint of ``python -m training.tiny``; what it computes is written as small fixtures that
``tests/test_official_goldens.py`` compares our engine against without the official code (docs/equivalence.md).
Nothing of the official code is in this repository: this script imports it from ``--official DIR`` and patches it
at run time, in memory, without editing a file (the patches are in :func:`patch_official`):

* every ``torch.bfloat16`` that ``modeling/bagel/qwen2_navit.py`` and ``modeling/bagel/siglip_navit.py`` cast
  to (q/k/v before attention, the gen-mode layer input and MLP inputs) becomes ``torch.float32``: those two
  modules see a stand-in for their module global ``torch`` whose ``bfloat16`` is ``float32``;
* ``flash_attn.flash_attn_varlen_func`` (a CUDA-only package) is a float64 exact attention with the same
  semantics (varlen segments, GQA, default scale, bottom-right causal alignment), put into ``sys.modules``;
* the model is built and loaded as ``app.py`` does (config overrides, ViT patch conv to Linear), in fp32 on the
  CPU with a strict load instead of accelerate's bf16 dispatch; the VAE has the tiny checkpoint's
  ``ae_config.json`` geometry, since the official ``load_ae`` hard-codes BAGEL-7B's. The image transforms are
  ``app.py``'s (VAE 1024/512/16, ViT 980/224/14): the official code never reads ``transform_config.json``.

Every run checks that the folder holds the pinned official files (git blob ids of each imported file) and that
the patches took effect (the KV caches hold fp32, the stand-in attention ran).

Setup and run (from the repository root; ``.refcheck/`` is ignored by git)::

    tools/install_refcheck.sh                       # .refcheck/venv: transformers 4.49.0 etc., pinned; torch
                                                    # is the project venv's, reused through a .pth file
    git clone https://github.com/ByteDance-Seed/Bagel .refcheck/Bagel
    git -C .refcheck/Bagel checkout 056b5fd51a88c1eb4547318609e25d40080fcf87
    .venv/bin/python -m training.tiny .refcheck/bagel-tiny
    .refcheck/venv/bin/python tools/official_reference.py --official .refcheck/Bagel \\
        --checkpoint .refcheck/bagel-tiny [--out tests/goldens/official]

It writes ``official_reference.safetensors`` (the tensors) and ``official_reference.json`` (the cases: prompts,
seeds, sizes, settings; the tokenizer ids; the official commit; the checkpoint's file hashes; library versions).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import importlib.metadata
import json
import os
import platform
import random
import sys
import types
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

OFFICIAL_REPO = "ByteDance-Seed/Bagel"
OFFICIAL_COMMIT = "056b5fd51a88c1eb4547318609e25d40080fcf87"
#: Git blob ids at :data:`OFFICIAL_COMMIT` of every official file this script imports (``git ls-tree -r``).
OFFICIAL_BLOBS = {
    "inferencer.py": "faebe2887b1c339f72fb4d6282f2679eaafcd62c",
    "data/__init__.py": "943b7d3a7a676d9a500bf048d4307f4f803221f5",
    "data/data_utils.py": "bab578bd69eaa1095ecdfd7d300e10f3c550e59c",
    "data/transforms.py": "1b0d415a019ac027a5deeeddf8647439c9a6830f",
    "modeling/__init__.py": "9e4cde9b202f3093a49c2c9759642b0690315c39",
    "modeling/autoencoder.py": "ae5fca58f2b986421f16e6e3bf38aaca58821127",
    "modeling/bagel/__init__.py": "b631a97538ed5c2216d135717e90f663d74c8c9e",
    "modeling/bagel/bagel.py": "dd14009ef016b32ba9746f0a6990618d043460bd",
    "modeling/bagel/modeling_utils.py": "b2b3c4176b84bae8339644e7a03ad2a50bba0849",
    "modeling/bagel/qwen2_navit.py": "cdbc7570981b777613e4f8568a6b24dbd727a3ae",
    "modeling/bagel/siglip_navit.py": "26efea339b0251f7d064ee7fe7c53bd698ec5645",
    "modeling/cache_utils/taylorseer.py": "4547c86d06948d47aa9caf22f72529f795f76812",
    "modeling/qwen2/__init__.py": "00933a1c2a7af0f3d78769363157555737a0ee99",
    "modeling/qwen2/configuration_qwen2.py": "0175985df488eae6b8a6ef1c44cf62b397889e8c",
    "modeling/qwen2/modeling_qwen2.py": "f8f7abe87d52ef8f5c16aeb78019ef7b6cc5d63e",
    "modeling/qwen2/tokenization_qwen2.py": "eb005c5396dc63bc710075f16cbf0b24a4c63cb4",
    "modeling/qwen2/tokenization_qwen2_fast.py": "b76f0d508f858430783a941f3d8146c01b4126ea",
    "modeling/siglip/__init__.py": "9f365cee8a2d5a0b8b0c26d150b53bc08b77bba8",
    "modeling/siglip/configuration_siglip.py": "5573f13b933a46f63e2d5b19c903af06051e07f3",
    "modeling/siglip/modeling_siglip.py": "e38236aa50c132b1e3a8ad746962cf6e9a7024f5",
}
#: Packages of tools/requirements-refcheck.txt (the rest comes from the project venv).
REFCHECK_PACKAGES = ("transformers", "tokenizers", "huggingface_hub", "regex", "einops", "opencv-python-headless")
#: Versions checked before a run (torch is the project venv's, reused).
PINNED = {"transformers": "4.49.0", "tokenizers": "0.21.0", "torch": "2.14.1"}

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "tests" / "goldens" / "official"
FIXTURE = "official_reference"
#: The official ``app.py`` image transforms ``(max, min, stride)``.
VAE_TRANSFORM, VIT_TRANSFORM = (1024, 512, 16), (980, 224, 14)
#: Checkpoint files the official code (or this script, for the tiny VAE geometry) reads.
READ_FILES = (
    "llm_config.json",
    "vit_config.json",
    "ae_config.json",
    "ema.safetensors",
    "ae.safetensors",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
)

_T2I = dict(cfg_text_scale=4.0, cfg_img_scale=1.5, cfg_interval=[0.4, 1.0], cfg_renorm_type="global")
_EDIT = dict(cfg_text_scale=4.0, cfg_img_scale=2.0, cfg_interval=[0.0, 1.0], cfg_renorm_type="text_channel")
_SHIFT = dict(timestep_shift=3.0, cfg_renorm_min=0.0)
_THINK = dict(think=True, max_think_token_n=6, do_sample=True, text_temperature=0.7)


def _case(name: str, task: str, prompt: str, seed: int, settings: dict, **extra) -> dict:
    return dict(name=name, task=task, prompt=prompt, seed=seed, settings=settings, **extra)


#: The recorded requests. ``settings`` are the official ``interleave_inference`` keywords (app.py's defaults with
#: few steps); ``max_think_token_n`` counts the official loop's forwards (our ``max_new_tokens`` + 1). The 160x96
#: request's last step (t = 0.33) is outside the guidance interval; the think plan is sampled, so its draws come
#: before the latent noise from the same seeded stream.
# fmt: off
CASES = [
    _case("t2i_64x64", "t2i", "a red circle above a blue square", 7, dict(_T2I, **_SHIFT, num_timesteps=6),
          width=64, height=64),
    _case("t2i_160x96", "t2i", "two green triangles on a white background", 11, dict(_T2I, **_SHIFT, num_timesteps=8),
          width=160, height=96),
    _case("edit_60x45", "edit", "make the circle yellow", 5, dict(_EDIT, **_SHIFT, num_timesteps=4)),
    _case("t2i_think_sampled", "t2i", "a small blue star", 3, dict(_T2I, **_SHIFT, **_THINK, num_timesteps=3),
          width=64, height=64),
    _case("und_image_greedy", "understanding", "What shapes are in the image?", 1,
          dict(max_think_token_n=8, do_sample=False, text_temperature=0.3), image=True),
    _case("und_text_sampled", "understanding", "Describe a blue square.", 9,
          dict(max_think_token_n=8, do_sample=True, text_temperature=0.7), image=False),
]
# fmt: on
#: Tokenizer probes: the official ``tokenizer.encode`` parses control tokens typed in a prompt (our
#: ``special_tokens=True``).
TOKENIZER_PROMPTS = [
    "a red circle above a blue square",
    "  Two   spaces, digits 12345 and punctuation!?",
    "Ünïcödé text: 日本語 and emoji 🙂",
    "line one\nline two\ttab",
    "typed control <|im_end|> and <|vision_start|> tokens",
]


def source_image() -> np.ndarray:
    """The edit's and understanding's 60x45 source: ``[45, 60, 3]`` uint8 noise of a fixed seed (stored too)."""
    return np.random.default_rng(0).integers(0, 256, size=(45, 60, 3), dtype=np.uint8)


# ----------------------------------------------------------------------------------- the official code


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def check_official_tree(root: Path) -> None:
    """Exit with one line unless ``root`` holds :data:`OFFICIAL_BLOBS` exactly (a checkout or archive of the pin)."""
    for rel, blob in OFFICIAL_BLOBS.items():
        path = root / rel
        if not path.is_file():
            sys.exit(f"--official {root}: {rel} is missing; give a checkout of {OFFICIAL_REPO} at {OFFICIAL_COMMIT}")
        if git_blob_id(path.read_bytes()) != blob:
            sys.exit(
                f"--official {root}: {rel} differs from {OFFICIAL_REPO}@{OFFICIAL_COMMIT[:7]}; "
                f"check out commit {OFFICIAL_COMMIT}"
            )


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, causal=False, softmax_scale=None, **_
):
    """Stand-in for flash-attn's varlen attention, exact in float64: ``q [Tq, nh, d]``, ``k, v [Tk, nkv, d]``.

    Segment ``i`` of the queries attends to segment ``i`` of the keys; query head ``h`` reads KV head
    ``h // (nh / nkv)``; ``causal`` aligns the mask bottom-right (query ``j`` of ``Lq`` sees keys ``<= j + Lk - Lq``).
    Returns ``[Tq, nh, d]`` in ``q``'s dtype.
    """
    if q.dtype != torch.float32:
        raise RuntimeError(f"the fp32 patch did not take: attention got {q.dtype} queries")
    STANDIN_CALLS[0] += 1
    groups = q.shape[1] // k.shape[1]
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    for i in range(len(cu_seqlens_q) - 1):
        q0, q1, k0, k1 = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        qs = q[q0:q1].double().transpose(0, 1)
        ks = k[k0:k1].double().repeat_interleave(groups, dim=1).transpose(0, 1)
        vs = v[k0:k1].double().repeat_interleave(groups, dim=1).transpose(0, 1)
        scores = (qs @ ks.transpose(1, 2)) * scale
        if causal:
            lq, lk = q1 - q0, k1 - k0
            hidden = torch.arange(lk)[None, :] > torch.arange(lq)[:, None] + (lk - lq)
            scores = scores.masked_fill(hidden, float("-inf"))
        out[q0:q1] = (torch.softmax(scores, dim=-1) @ vs).transpose(0, 1).to(q.dtype)
    return out


STANDIN_CALLS = [0]


class _TorchWithFp32ForBf16(types.ModuleType):
    """What the patched modules see as ``torch``: torch itself, except that ``bfloat16`` is ``float32``."""

    bfloat16 = torch.float32

    def __getattr__(self, name):
        return getattr(torch, name)


def patch_official(root: Path) -> dict:
    """Import the official modules from ``root`` with the stand-ins of the module docstring; returns them by name."""
    stub = types.ModuleType("flash_attn")
    stub.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)  # transformers probes it with find_spec
    stub.flash_attn_varlen_func = flash_attn_varlen_func
    sys.modules["flash_attn"] = stub
    sys.path.insert(0, str(root))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import data.data_utils as data_utils
    import data.transforms as transforms
    import inferencer
    import modeling.autoencoder as autoencoder
    import modeling.bagel as bagel
    import modeling.bagel.qwen2_navit as qwen2_navit
    import modeling.bagel.siglip_navit as siglip_navit
    from modeling.qwen2 import Qwen2Tokenizer

    fp32_torch = _TorchWithFp32ForBf16("torch")
    for module in (qwen2_navit, siglip_navit):
        module.torch = fp32_torch
    return dict(
        data_utils=data_utils,
        transforms=transforms,
        inferencer=inferencer,
        autoencoder=autoencoder,
        bagel=bagel,
        Qwen2Tokenizer=Qwen2Tokenizer,
    )


def load_official(mods: dict, ckpt: Path):
    """The official model, VAE and tokenizer as ``app.py`` builds them, in fp32 on the CPU (strict load)."""
    bagel, ae = mods["bagel"], mods["autoencoder"]
    llm_config = bagel.Qwen2Config.from_json_file(str(ckpt / "llm_config.json"))
    llm_config.qk_norm = True
    llm_config.tie_word_embeddings = False
    llm_config.layer_module = "Qwen2MoTDecoderLayer"
    vit_config = bagel.SiglipVisionConfig.from_json_file(str(ckpt / "vit_config.json"))
    vit_config.rope = False
    vit_config.num_hidden_layers -= 1
    vae_params = ae.AutoEncoderParams(**json.loads((ckpt / "ae_config.json").read_text()))
    vae = ae.AutoEncoder(vae_params)
    _load_strict(vae, ckpt / "ae.safetensors")
    config = bagel.BagelConfig(
        visual_gen=True,
        visual_und=True,
        llm_config=llm_config,
        vit_config=vit_config,
        vae_config=vae_params,
        vit_max_num_patch_per_side=70,
        connector_act="gelu_pytorch_tanh",
        latent_patch_size=2,
        max_latent_size=64,
    )
    model = bagel.Bagel(bagel.Qwen2ForCausalLM(llm_config), bagel.SiglipVisionModel(vit_config), config)
    model.vit_model.vision_model.embeddings.convert_conv2d_to_linear(vit_config)
    _load_strict(model, ckpt / "ema.safetensors")
    tokenizer, new_token_ids, added = mods["data_utils"].add_special_tokens(
        mods["Qwen2Tokenizer"].from_pretrained(ckpt)
    )
    if added:
        sys.exit(f"--checkpoint {ckpt}: the tokenizer lacks BAGEL's control tokens ({added} were added)")
    image_transform = mods["transforms"].ImageTransform
    runner = mods["inferencer"].InterleaveInferencer(
        model.float().eval(),
        vae.float().eval(),
        tokenizer,
        image_transform(*VAE_TRANSFORM),
        image_transform(*VIT_TRANSFORM),
        new_token_ids,
    )
    return runner, tokenizer, new_token_ids


def _load_strict(module: torch.nn.Module, path: Path) -> None:
    missing, unexpected = module.load_state_dict(load_file(str(path)), strict=False)
    if missing or unexpected:
        sys.exit(f"{path}: missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]} ({module.__class__})")


# ----------------------------------------------------------------------------------- recording


@contextmanager
def recording(runner):
    """Record the denoising forwards (branch and guided velocities), lm_head logits, decoded ids and the decoded
    latent of one request while the official code runs."""
    model, rec = runner.model, {"steps": [], "logits": [], "texts": [], "latent": None}
    flow, generate_text, decode = model._forward_flow, model.generate_text, runner.vae_model.decode

    def flow_recorded(**kw):
        outputs = []
        hook = model.llm2vae.register_forward_hook(lambda _m, _i, out: outputs.append(out.detach().clone()))
        try:
            guided = flow(**kw)
        finally:
            hook.remove()
        cache = kw["past_key_values"].key_cache[0]
        if cache is not None and cache.dtype != torch.float32:
            raise RuntimeError(f"the fp32 patch did not take: the KV cache holds {cache.dtype}")
        idx = kw["packed_vae_token_indexes"]
        rec["steps"].append(([o[idx] for o in outputs], guided.detach().clone()))
        return guided

    def generate_text_recorded(**kw):
        ids = generate_text(**kw)
        rec["texts"].append(ids[:, 0].tolist())
        return ids

    def decode_recorded(z):
        rec["latent"] = z.detach().clone()
        return decode(z)

    hook = model.language_model.lm_head.register_forward_hook(
        lambda _m, _i, out: rec["logits"].append(out.detach()[0].clone())
    )
    model._forward_flow, model.generate_text, runner.vae_model.decode = (
        flow_recorded,
        generate_text_recorded,
        decode_recorded,
    )
    try:
        yield rec
    finally:
        hook.remove()
        del model._forward_flow, model.generate_text, runner.vae_model.decode


def seed_all(seed: int) -> None:
    """``app.py``'s ``set_seed`` (which seeds only when ``seed > 0``: every case has one)."""
    if seed <= 0:
        raise ValueError(f"a case's seed must be > 0 (app.py leaves the RNG unseeded otherwise), got {seed}")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_case(runner, case: dict, image: Image.Image, tensors: dict) -> dict:
    """Run one request of :data:`CASES` through ``InterleaveInferencer``; tensors into ``tensors``; returns its JSON."""
    name, task, s = case["name"], case["task"], dict(case["settings"])
    entry = {k: v for k, v in case.items() if k != "name"}
    seed_all(case["seed"])
    if task == "understanding":
        with recording(runner) as rec:
            out = runner(image=image if case["image"] else None, text=case["prompt"], understanding_output=True, **s)
        (ids,) = rec["texts"]
        answer = ids[1:]  # after the <|im_start|> query
        logits = torch.stack(rec["logits"])
        # the loop stops at <|im_end|> (not kept) or after max_think_token_n forwards, the last prediction dropped
        entry.update(answer_text=out["text"], answer_ids=answer, stopped_at_eos=len(ids) < s["max_think_token_n"])
        tensors[f"{name}.logits"] = logits
        return entry
    if task == "t2i":
        s["image_shapes"] = (case["height"], case["width"])
    with recording(runner) as rec:
        out = runner(image=image if task == "edit" else None, text=case["prompt"], **s)
    if s.get("think"):
        (plan_ids,) = rec["texts"]
        entry.update(plan_text=out["text"], plan_ids=plan_ids[1:])
        tensors[f"{name}.plan_logits"] = torch.stack(rec["logits"])
    branches, guided = rec["steps"][0]
    names = ("gen", "cfg_text", "cfg_img")[: len(branches)]
    for branch, velocity in zip(names, branches):
        tensors[f"{name}.step0.{branch}"] = velocity
    tensors[f"{name}.step0.guided"] = guided
    tensors[f"{name}.final_latent"] = rec["latent"]
    picture = np.asarray(out["image"], dtype=np.uint8)
    tensors[f"{name}.image"] = torch.from_numpy(picture.copy())
    entry.update(
        steps=len(rec["steps"]),
        step0_branches=list(names),
        output_size=[picture.shape[1], picture.shape[0]],
        forwards_per_step=[len(b) for b, _ in rec["steps"]],
    )
    return entry


# ----------------------------------------------------------------------------------- main


def versions() -> dict:
    """Installed versions of the libraries the official run uses (``None``: not installed)."""
    found: dict[str, str | None] = {}
    for name in (*REFCHECK_PACKAGES, "torch", "torchvision", "numpy", "pillow", "safetensors"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    found["python"] = platform.python_version()
    return found


def check_versions(found: dict) -> None:
    """Exit with one line unless the pinned versions are installed (the refcheck venv)."""
    for name, want in PINNED.items():
        have = found[name]
        if have is None or have.split("+")[0] != want:
            sys.exit(
                f"{name} {have or 'is not installed'}: the official code runs with {name}=={want}: run "
                "tools/install_refcheck.sh, then this script with .refcheck/venv/bin/python"
            )


def write_atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    tmp.chmod(0o644)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--official", type=Path, required=True, help=f"checkout of {OFFICIAL_REPO} at {OFFICIAL_COMMIT}"
    )
    parser.add_argument("--checkpoint", type=Path, default=REPO / "models" / "bagel" / "bagel-tiny")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    root, ckpt = args.official.resolve(), args.checkpoint.resolve()
    check_official_tree(root)
    missing = [f for f in READ_FILES if not (ckpt / f).is_file()]
    if missing:
        sys.exit(f"--checkpoint {ckpt} lacks {missing}: write it with `python -m training.tiny DIR`")
    found = versions()
    check_versions(found)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    runner, tokenizer, special = load_official(patch_official(root), ckpt)

    pixels = source_image()
    tensors: dict[str, torch.Tensor] = {"source_image": torch.from_numpy(pixels)}
    cases = {}
    for case in CASES:
        print(f"official_reference: {case['name']}", flush=True)
        cases[case["name"]] = run_case(runner, case, Image.fromarray(pixels), tensors)
    if not STANDIN_CALLS[0]:
        raise RuntimeError("the flash-attn stand-in never ran")
    record = {
        "official": {"repo": OFFICIAL_REPO, "commit": OFFICIAL_COMMIT, "files_checked": sorted(OFFICIAL_BLOBS)},
        "run": {
            "device": "cpu",
            "dtype": "float32",
            "attention": "float64 flash_attn_varlen_func stand-in",
            "patches": "torch.bfloat16 -> torch.float32 in modeling/bagel/qwen2_navit.py and siglip_navit.py "
            "(module global swapped at run time; no file edited)",
            "transforms": {"vae": list(VAE_TRANSFORM), "vit": list(VIT_TRANSFORM)},
            "versions": found,
        },
        "checkpoint": {
            "written_by": "python -m training.tiny DIR (seed 0)",
            "sha256": {f: hashlib.sha256((ckpt / f).read_bytes()).hexdigest() for f in READ_FILES},
            "not_read": "transform_config.json (the official code takes app.py's transform sizes)",
        },
        "source_image": {"tensor": "source_image", "size": [pixels.shape[1], pixels.shape[0]]},
        "tokenizer": {
            "special_ids": special,
            "encoded": [{"text": t, "ids": tokenizer.encode(t)} for t in TOKENIZER_PROMPTS],
        },
        "cases": cases,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stored = {k: v.contiguous() for k, v in sorted(tensors.items())}
    write_atomic(args.out / f"{FIXTURE}.safetensors", lambda p: save_file(stored, str(p)))
    text = json.dumps(record, indent=1, ensure_ascii=False, allow_nan=False) + "\n"
    write_atomic(args.out / f"{FIXTURE}.json", lambda p: p.write_text(text, encoding="utf-8"))
    size = sum(v.numel() * v.element_size() for v in stored.values())
    print(f"official_reference: {len(stored)} tensors ({size / 2**20:.2f} MiB) in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
