"""Edits of a copied checkpoint for tests: change config JSON values, rewrite safetensors tensors."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file


def edit_json(path: Path, **changes) -> None:
    """Set ``changes`` in the JSON object stored at ``path``."""
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def rewrite_tensors(path: Path, edit) -> None:
    """Load the safetensors file at ``path``, let ``edit(tensors)`` change the dict, save it back."""
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def set_value(name: str, value: float):
    """An ``edit`` for :func:`rewrite_tensors`: the first element of tensor ``name`` becomes ``value``."""

    def edit(tensors):
        tensors[name].view(-1)[0] = value

    return edit
