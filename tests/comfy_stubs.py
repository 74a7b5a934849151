"""ComfyUI stubbed in ``sys.modules`` for the node tests: ``folder_paths``, ``comfy.utils`` (a progress bar that
records its updates), ``comfy.model_management`` (records ``load_models_gpu`` calls, an interrupt flag),
``comfy.ops`` (``pick_operations`` for weights stored in the compute dtype only: the real host's fp8 operations
are tested in tests/host) and ``comfy.model_patcher``; the tiny checkpoint is linked into the stub's
``models/bagel`` as ``bagel-tiny``."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest
import torch

from unicache_core.bagel.modeling.operations import TorchOperations

TINY_NAME = "bagel-tiny"


class Interrupt(Exception):
    pass


def _make_stubs(base: Path) -> dict[str, types.ModuleType]:
    models = base / "models"
    fp = types.ModuleType("folder_paths")
    fp.models_dir = str(models)
    fp.folder_names_and_paths = {}

    def add_model_folder_path(name, path, is_default=False):
        paths, _ = fp.folder_names_and_paths.setdefault(name, ([], set()))
        if path not in paths:
            paths.insert(0, path) if is_default else paths.append(path)

    def get_filename_list(name):
        paths, exts = fp.folder_names_and_paths[name]
        out = []
        for p in paths:
            for dirpath, _, files in os.walk(p):
                for f in files:
                    if not exts or os.path.splitext(f)[1] in exts:
                        out.append(os.path.relpath(os.path.join(dirpath, f), p).replace(os.sep, "/"))
        return sorted(set(out))

    def get_full_path(name, filename):
        for p in fp.folder_names_and_paths[name][0]:
            full = os.path.join(p, filename)
            if os.path.isfile(full):
                return full
        return None

    fp.add_model_folder_path = add_model_folder_path
    fp.get_folder_paths = lambda name: list(fp.folder_names_and_paths[name][0])
    fp.get_filename_list = get_filename_list
    fp.get_full_path = get_full_path

    comfy = types.ModuleType("comfy")
    comfy.__path__ = []
    utils = types.ModuleType("comfy.utils")
    utils.__file__ = str(base / "comfy" / "utils.py")
    utils.progress = []

    class ProgressBar:
        def __init__(self, total, node_id=None):
            self.total = total

        def update_absolute(self, value, total=None, preview=None):
            utils.progress.append((value, total if total is not None else self.total))

    utils.ProgressBar = ProgressBar
    mm = types.ModuleType("comfy.model_management")
    mm.loads = []
    mm.interrupt = False
    mm.InterruptProcessingException = Interrupt
    mm.get_torch_device = lambda: torch.device("cpu")
    mm.unet_offload_device = lambda: torch.device("cpu")
    mm.should_use_bf16 = lambda device=None: False
    mm.load_models_gpu = lambda models, memory_required=0, force_full_load=False, **kw: mm.loads.append(
        (models, memory_required, force_full_load)
    )
    mm.processing_interrupted = lambda: mm.interrupt

    def throw():
        if mm.interrupt:
            mm.interrupt = False
            raise Interrupt()

    mm.throw_exception_if_processing_interrupted = throw
    patcher = types.ModuleType("comfy.model_patcher")

    class ModelPatcher:
        def __init__(self, model, load_device, offload_device, size=0, weight_inplace_update=False):
            self.model, self.load_device, self.offload_device, self.size = model, load_device, offload_device, size

    patcher.ModelPatcher = ModelPatcher
    ops = types.ModuleType("comfy.ops")

    def pick_operations(weight_dtype, compute_dtype, load_device=None, fp8_optimizations=False, **kwargs):
        if weight_dtype != compute_dtype:
            raise NotImplementedError(f"the stub host has no operations storing {weight_dtype} for {compute_dtype}")
        return TorchOperations

    ops.pick_operations = pick_operations
    comfy.utils, comfy.model_management, comfy.model_patcher, comfy.ops = utils, mm, patcher, ops
    return {
        "folder_paths": fp,
        "comfy": comfy,
        "comfy.utils": utils,
        "comfy.model_management": mm,
        "comfy.model_patcher": patcher,
        "comfy.ops": ops,
    }


@pytest.fixture
def host_stubs(tmp_path, monkeypatch, tiny_checkpoint):
    stubs = _make_stubs(tmp_path)
    for name, module in stubs.items():
        monkeypatch.setitem(sys.modules, name, module)
    bagel = tmp_path / "models" / "bagel"
    bagel.mkdir(parents=True)
    (bagel / TINY_NAME).symlink_to(tiny_checkpoint, target_is_directory=True)
    from nodes import host

    host._patcher_class.cache_clear()
    yield stubs  # the loaded tiny model stays cached across tests (the cache key is the resolved path)
    host._patcher_class.cache_clear()
