"""ComfyUI stubbed in ``sys.modules`` for the node tests: ``folder_paths``, ``comfy.utils`` (a progress bar that
records its updates), ``comfy.model_management`` (records ``load_models_gpu`` calls, an interrupt flag),
``comfy.ops`` (``pick_operations`` for weights stored in the compute dtype only: the real host's fp8 operations
are tested in tests/host) and ``comfy.model_patcher``; the tiny checkpoint is linked into the stub's
``models/bagel`` as ``bagel-tiny``."""

from __future__ import annotations

import os
import sys
import types
from dataclasses import dataclass, field
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


#: The Image Edit node's widgets after its prompt, small for the tiny checkpoint (steps .. think).
EDIT_WIDGETS = (2, 0, 4.0, 2.0, 0.0, 1.0, 3.0, 0.0, "text_channel", False)


@pytest.fixture(scope="module")
def fresh_model_cache():
    """Import it as an autouse fixture of a module: the nodes' model cache is emptied before and after the module."""
    from nodes import model

    model.clear_cache()
    yield
    model.clear_cache()


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


# ------------------------------------------------------------------ a stand-in of ComfyUI's V3 API (comfy_api.latest)


class _classproperty:
    def __init__(self, get):
        self.get = get

    def __get__(self, obj, owner):
        return self.get(owner)


def _make_v3_io() -> types.ModuleType:
    """The part of ``comfy_api.latest.io`` (ComfyUI 0.3.75) the pack uses, with the same V1 view
    (``INPUT_TYPES``, ``RETURN_TYPES`` ...) as the real classes build (``Schema.get_v1_info``)."""
    io = types.ModuleType("comfy_api.latest._io")

    class Input:
        #: keyword -> the V1 option name it becomes (the real ``as_dict``)
        RENAMED = {"display_mode": "display", "force_input": "forceInput", "dynamic_prompts": "dynamicPrompts"}

        def __init__(self, id, display_name=None, optional=False, tooltip=None, lazy=None, **options):
            self.id, self.display_name, self.optional, self.tooltip, self.lazy = (
                id,
                display_name,
                optional,
                tooltip,
                lazy,
            )
            self.options = options

        def as_dict(self) -> dict:
            out = {"display_name": self.display_name, "tooltip": self.tooltip, "lazy": self.lazy}
            out.update({self.RENAMED.get(k, k): v for k, v in self.options.items()})
            return {k: v for k, v in out.items() if v is not None}

    class Output:
        def __init__(self, id=None, display_name=None, tooltip=None, is_output_list=False, **options):
            self.id, self.display_name, self.tooltip, self.is_output_list = id, display_name, tooltip, is_output_list

    def comfytype(io_type: str):
        def make(cls):
            cls.io_type = io_type
            cls.Input = type("Input", (Input,), {"io_type": io_type})
            cls.Output = type("Output", (Output,), {"io_type": io_type})
            return cls

        return make

    def Custom(io_type: str):  # noqa: N802  (ComfyUI's name)
        return comfytype(io_type)(type(f"Custom_{io_type}", (), {}))

    for name, io_type in {
        "Boolean": "BOOLEAN",
        "Int": "INT",
        "Float": "FLOAT",
        "String": "STRING",
        "Combo": "COMBO",
        "Image": "IMAGE",
        "Latent": "LATENT",
        "Vae": "VAE",
    }.items():
        setattr(io, name, comfytype(io_type)(type(name, (), {})))

    class Hidden:
        unique_id, prompt, extra_pnginfo = "UNIQUE_ID", "PROMPT", "EXTRA_PNGINFO"

    @dataclass
    class Schema:
        node_id: str
        display_name: str | None = None
        category: str = "sd"
        inputs: list = field(default_factory=list)
        outputs: list = field(default_factory=list)
        hidden: list = field(default_factory=list)
        description: str = ""
        is_output_node: bool = False
        not_idempotent: bool = False

    class NodeOutput:
        def __init__(self, *args, ui=None, expand=None, block_execution=None):
            self.args, self.ui = args, ui

        @property
        def result(self):
            return self.args if self.args else None

    class ComfyNode:
        @classmethod
        def define_schema(cls) -> Schema:
            raise NotImplementedError

        @classmethod
        def execute(cls, **kwargs):
            raise NotImplementedError

        @classmethod
        def INPUT_TYPES(cls, include_hidden=True, return_schema=False):  # noqa: N802  (ComfyUI's name)
            schema = cls.define_schema()
            spec: dict = {"required": {}}
            for i in schema.inputs:
                spec.setdefault("optional" if i.optional else "required", {})[i.id] = (i.io_type, i.as_dict())
            return (spec, schema) if return_schema else spec

        FUNCTION = "EXECUTE_NORMALIZED"
        RETURN_TYPES = _classproperty(lambda cls: [o.io_type for o in cls.define_schema().outputs])
        RETURN_NAMES = _classproperty(lambda cls: [o.display_name or o.io_type for o in cls.define_schema().outputs])
        OUTPUT_TOOLTIPS = _classproperty(lambda cls: [o.tooltip for o in cls.define_schema().outputs])
        DESCRIPTION = _classproperty(lambda cls: cls.define_schema().description)
        CATEGORY = _classproperty(lambda cls: cls.define_schema().category)
        OUTPUT_NODE = _classproperty(lambda cls: cls.define_schema().is_output_node)

        @classmethod
        def EXECUTE_NORMALIZED(cls, **kwargs):  # noqa: N802  (ComfyUI's name)
            out = cls.execute(**kwargs)
            return out if isinstance(out, NodeOutput) else NodeOutput(*out)

    io.Input, io.Output, io.Custom, io.Hidden, io.Schema = Input, Output, Custom, Hidden, Schema
    io.NodeOutput, io.ComfyNode = NodeOutput, ComfyNode
    return io


def install_v3_stub() -> None:
    """Put the stand-in ``comfy_api.latest`` into ``sys.modules`` unless a real ComfyUI is importable (the unit
    tests import the nodes, whose classes derive from ``io.ComfyNode``, before any fixture runs)."""
    import importlib.util

    if "comfy_api" in sys.modules or importlib.util.find_spec("comfy_api") is not None:
        return
    io = _make_v3_io()

    class ComfyExtension:
        async def on_load(self) -> None:
            return None

        async def get_node_list(self) -> list:
            raise NotImplementedError

    api = types.ModuleType("comfy_api")
    api.__path__ = []
    latest = types.ModuleType("comfy_api.latest")
    latest.io, latest.IO, latest.ComfyExtension = io, io, ComfyExtension
    api.latest = latest
    sys.modules.update({"comfy_api": api, "comfy_api.latest": latest, "comfy_api.latest._io": io})


class NodeCall:
    """A V3 node called as a test writes it: ``NodeCall(cls).anything(*positional, **named)`` runs ``cls.execute``
    with the positional values given to the schema's inputs in declaration order; returns the outputs' tuple, or for
    an output node ``{"ui": ..., "result": ...}``; the last call's UI data (warnings) stays in ``ui``."""

    def __init__(self, cls):
        self.cls, self.ui = cls, None

    def __call__(self, *args, **kwargs):
        names = [i.id for i in self.cls.define_schema().inputs]
        kwargs.update(zip(names, args))
        out = self.cls.execute(**kwargs)
        self.ui = out.ui
        return {"ui": out.ui, "result": out.args} if self.cls.OUTPUT_NODE else out.args

    def __getattr__(self, name):
        return self
