"""The command line's ``--items FILE.json``: a request's texts and images in order (docs/bagel.md "Item lists").

The file is UTF-8 JSON: an object whose ``items`` is a list (a bare list is accepted too), each element one of::

    {"text": "put the red circle of the first image into the second"}
    {"image": "shapes/a.png"}          (a path relative to the JSON file's folder, or absolute)
    {"generate": true}                  (t2i/edit: generate an image here and go on with it: iterative editing)

For example ``{"items": [{"image": "a.png"}, {"image": "b.png"}, {"text": "..."}]}``. :func:`read_items_file`
checks it before anything loads and names the first mistake on one line (``--items FILE: items[2] ...``); the
images are decoded as ``--image`` files are (:func:`~.checks.open_image`).
"""

from __future__ import annotations

import json
from pathlib import Path

from unicache_commands.flags import printable
from unicache_commands.input_files import parse_json

from ..items import GENERATE, Item, TextItem

#: Largest accepted ``--items`` file (its images are separate files; the texts are bounded by the positions).
MAX_ITEMS_FILE_BYTES = 4 << 20
#: The keys an element may have (exactly one of them).
ITEM_KEYS = ("text", "image", "generate")
_SHAPE = '{"text": "..."}, {"image": "PATH"} or {"generate": true}'


def _fail(path: Path, message: str) -> ValueError:
    return ValueError(f"--items {printable(path)}: {message}")


def _load(path: Path) -> object:
    from .checks import not_found

    if path.is_dir():
        raise ValueError(f"--items: {path} is a directory; pass a JSON file of the request's items")
    if not path.exists():
        raise not_found("--items", path, "file")
    if not path.is_file():
        raise ValueError(f"--items: {path} is not a regular file; pass a JSON file of the request's items")
    size = path.stat().st_size
    if size > MAX_ITEMS_FILE_BYTES:
        raise _fail(path, f"{size} bytes; an items file may hold at most {MAX_ITEMS_FILE_BYTES} bytes")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        message = f"not valid UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start}); save it as UTF-8"
        raise _fail(path, message) from None
    return parse_json(text, label=f"--items {printable(path)}")  # no key twice, no nesting too deep: one line


def read_items_file(path: Path, *, generation: bool) -> tuple[list[object], list[Path]]:
    """The request's items of ``path`` (texts as :class:`~.items.TextItem`, ``generate`` as
    :data:`~.items.GENERATE`, images as the resolved :class:`~pathlib.Path` to open) and the image paths in order.

    ``generation``: ``generate`` elements are allowed (t2i, edit). Every mistake is a one-line ValueError naming the
    file and the element.
    """
    document = _load(path)
    if isinstance(document, dict):
        unknown = sorted(set(document) - {"items"})
        if unknown or "items" not in document:
            what = f"unknown key {unknown[0]!r}" if unknown else "no 'items' key"
            raise _fail(path, f'{what} at the top level; write {{"items": [{_SHAPE}, ...]}}')
        document = document["items"]
    if not isinstance(document, list):
        raise _fail(path, f"the items must be a JSON list of {_SHAPE}, got {type(document).__name__}")
    if not document:
        raise _fail(path, "the list of items is empty; give at least one text (the prompt)")
    items: list[object] = []
    images: list[Path] = []
    for index, element in enumerate(document):
        where = f"items[{index}]"
        if not isinstance(element, dict) or len(element) != 1 or next(iter(element)) not in ITEM_KEYS:
            shown = json.dumps(element, ensure_ascii=False)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise _fail(path, f"{where} must be one of {_SHAPE}, got {shown}")
        key, value = next(iter(element.items()))
        if key == "text":
            if not isinstance(value, str):
                raise _fail(path, f'{where}: "text" must be a string, got {type(value).__name__}')
            items.append(TextItem(value))
        elif key == "generate":
            if value is not True:
                raise _fail(path, f'{where}: "generate" must be true, got {json.dumps(value)}')
            if not generation:
                raise _fail(
                    path, f'{where}: "generate" belongs to t2i and edit; an understanding request answers at its end'
                )
            items.append(GENERATE)
        else:
            if not isinstance(value, str) or not value:
                raise _fail(path, f'{where}: "image" must be a non-empty path string, got {json.dumps(value)}')
            if "\0" in value:  # no file name holds one (the OS refuses it); shown escaped, never raw
                raise _fail(
                    path,
                    f'{where}: "image" {json.dumps(value)[:80]} holds a NUL byte (\\u0000), which no file path can '
                    "hold; write the image's real path",
                )
            image = Path(value) if Path(value).is_absolute() else path.parent / value
            items.append(image)
            images.append(image)
    if not any(isinstance(item, TextItem) for item in items):
        advice = 'add the instruction or question, e.g. {"text": "..."}'
        raise _fail(path, f"{len(items)} item(s) but no text: {advice}")
    return items, images


def open_items(path: Path, *, generation: bool) -> tuple[tuple[Item, ...], list[Path]]:
    """:func:`read_items_file` with every image decoded (:func:`~.checks.open_image`, errors naming the element);
    the items are then checked as the engine checks them (:func:`~.items.request_items`)."""
    from ..items import request_items
    from .checks import open_image

    raw, images = read_items_file(path, generation=generation)
    opened = []
    for index, item in enumerate(raw):
        opened.append(open_image(item, flag=f"--items {path}: items[{index}]") if isinstance(item, Path) else item)
    try:
        return request_items(opened, generation=generation), images
    except ValueError as exc:
        raise _fail(path, str(exc)) from None


__all__ = ["ITEM_KEYS", "MAX_ITEMS_FILE_BYTES", "open_items", "read_items_file"]
