"""The synthetic "shapes" world: scenes of coloured shapes, their captions, edits and questions.

Everything here is exact and deterministic: a :class:`Scene` renders to one image, its caption names
every object, an :class:`Edit` maps a scene to its exact target scene, and a :class:`Question` has one
right answer. Samples come from ``random.Random(seed)``, so a seed names a sample for good; training
and evaluation use disjoint seed ranges (:data:`TRAIN_SEEDS`, :data:`EVAL_SEEDS`).

Geometry: a ``CANVAS`` x ``CANVAS`` image (128 px) split into a 3x3 grid of cells; each object sits
centred in its own cell (so objects never overlap and "position" is one of nine words). Objects are
drawn at 4x and box-filtered down, so edges are anti-aliased but identical on every machine.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import numpy as np
from PIL import Image, ImageDraw

from ..validation import check_int

CANVAS = 128
GRID = 3
SUPERSAMPLE = 4

#: Object colours (RGB); names are single words of the captions.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 205, 40),
    "purple": (140, 60, 180),
    "orange": (245, 135, 30),
}
#: Background colours (RGB), disjoint from the object colours.
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (240, 240, 240),
    "black": (25, 25, 25),
    "gray": (128, 128, 128),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
#: Object size name → side of its bounding box in pixels.
SIZES: dict[str, int] = {"small": 22, "large": 36}
#: Cell index (row * 3 + col) → position phrase.
POSITIONS: tuple[str, ...] = (
    "top left",
    "top",
    "top right",
    "left",
    "center",
    "right",
    "bottom left",
    "bottom",
    "bottom right",
)
COUNT_WORDS: tuple[str, ...] = ("zero", "one", "two", "three")
MAX_OBJECTS = 3

#: Seeds of training samples (anything below 2**40) and of held-out evaluation samples (at or above).
TRAIN_SEEDS = range(0, 1 << 40)
EVAL_SEEDS = range(1 << 40, 1 << 41)

EDIT_KINDS: tuple[str, ...] = ("recolor", "move", "add", "remove", "background")
QUESTION_KINDS: tuple[str, ...] = ("color", "shape", "count", "position", "exists", "background")


@dataclass(frozen=True)
class Shape:
    """One object: ``shape`` in :data:`SHAPES`, ``color`` in :data:`COLORS`, ``size`` in :data:`SIZES`,
    ``cell`` in ``0..8`` (row-major 3x3 grid)."""

    shape: str
    color: str
    size: str
    cell: int

    @property
    def position(self) -> str:
        return POSITIONS[self.cell]

    @property
    def name(self) -> str:
        """``"red circle"``: unique within a scene (scenes never hold two objects of one colour and shape)."""
        return f"{self.color} {self.shape}"

    def phrase(self) -> str:
        return f"a {self.size} {self.color} {self.shape} at the {self.position}"


@dataclass(frozen=True)
class Scene:
    """A background and up to :data:`MAX_OBJECTS` objects in distinct cells, sorted by cell."""

    background: str
    objects: tuple[Shape, ...] = field(default_factory=tuple)

    def __post_init__(self):
        if self.background not in BACKGROUNDS:
            raise ValueError(f"unknown background {self.background!r}; one of {list(BACKGROUNDS)}")
        cells = [o.cell for o in self.objects]
        if len(set(cells)) != len(cells):
            raise ValueError(f"two objects share a cell in {self.objects}")
        names = [o.name for o in self.objects]
        if len(set(names)) != len(names):
            raise ValueError(f"two objects share colour and shape in {self.objects}")
        for o in self.objects:
            if o.shape not in SHAPES or o.color not in COLORS or o.size not in SIZES or not 0 <= o.cell < 9:
                raise ValueError(f"invalid object {o}")
        object.__setattr__(self, "objects", tuple(sorted(self.objects, key=lambda o: o.cell)))

    def caption(self) -> str:
        """``"a large red circle at the top left and a small blue square at the center on a gray background"``."""
        if not self.objects:
            return f"an empty {self.background} background"
        return " and ".join(o.phrase() for o in self.objects) + f" on a {self.background} background"

    def find(self, name: str) -> Shape | None:
        return next((o for o in self.objects if o.name == name), None)

    def free_cells(self) -> list[int]:
        used = {o.cell for o in self.objects}
        return [c for c in range(GRID * GRID) if c not in used]

    def render(self) -> Image.Image:
        """The scene as a ``CANVAS`` x ``CANVAS`` RGB image."""
        big = CANVAS * SUPERSAMPLE
        image = Image.new("RGB", (big, big), BACKGROUNDS[self.background])
        draw = ImageDraw.Draw(image)
        for o in self.objects:
            draw_shape(draw, o, SUPERSAMPLE)
        return image.resize((CANVAS, CANVAS), Image.Resampling.BOX)


def cell_center(cell: int, scale: int = 1) -> tuple[float, float]:
    """``(x, y)`` centre of a grid cell in pixels (times ``scale``)."""
    row, col = divmod(cell, GRID)
    step = CANVAS * scale / GRID
    return (col + 0.5) * step, (row + 0.5) * step


def draw_shape(draw: ImageDraw.ImageDraw, obj: Shape, scale: int) -> None:
    cx, cy = cell_center(obj.cell, scale)
    half = SIZES[obj.size] * scale / 2
    fill = COLORS[obj.color]
    box = (cx - half, cy - half, cx + half - 1, cy + half - 1)
    if obj.shape == "circle":
        draw.ellipse(box, fill=fill)
    elif obj.shape == "square":
        draw.rectangle(box, fill=fill)
    else:  # isosceles triangle, apex up, base at the bottom of the box
        draw.polygon([(cx, cy - half), (cx + half - 1, cy + half - 1), (cx - half, cy + half - 1)], fill=fill)


# ------------------------------------------------------------------------------------------ edits


@dataclass(frozen=True)
class Edit:
    """An instruction and the exact scene it produces."""

    kind: str
    instruction: str
    source: Scene
    target: Scene


def apply_edit(scene: Scene, kind: str, rng: random.Random) -> Edit | None:
    """A random edit of ``kind`` on ``scene`` (``None`` when the scene does not allow it)."""
    objs = list(scene.objects)
    if kind == "background":
        bg = rng.choice([b for b in BACKGROUNDS if b != scene.background])
        return Edit(kind, f"change the background to {bg}", scene, replace(scene, background=bg))
    if kind == "add":
        if len(objs) >= MAX_OBJECTS:
            return None
        new = _random_object(scene, rng)
        if new is None:
            return None
        return Edit(kind, f"add {new.phrase()}", scene, Scene(scene.background, tuple(objs + [new])))
    if not objs:
        return None
    obj = rng.choice(objs)
    rest = [o for o in objs if o is not obj]
    if kind == "remove":
        return Edit(kind, f"remove the {obj.name}", scene, Scene(scene.background, tuple(rest)))
    if kind == "recolor":
        taken = {o.name for o in rest}
        colors = [c for c in COLORS if c != obj.color and f"{c} {obj.shape}" not in taken]
        color = rng.choice(colors)
        return Edit(
            kind,
            f"make the {obj.name} {color}",
            scene,
            Scene(scene.background, tuple(rest + [replace(obj, color=color)])),
        )
    if kind == "move":
        cell = rng.choice(scene.free_cells())
        return Edit(
            kind,
            f"move the {obj.name} to the {POSITIONS[cell]}",
            scene,
            Scene(scene.background, tuple(rest + [replace(obj, cell=cell)])),
        )
    raise ValueError(f"unknown edit kind {kind!r}; one of {EDIT_KINDS}")


# -------------------------------------------------------------------------------------- questions


@dataclass(frozen=True)
class Question:
    kind: str
    question: str
    answer: str


def ask(scene: Scene, kind: str, rng: random.Random) -> Question | None:
    """A random question of ``kind`` about ``scene`` with its one right answer (``None`` if not askable)."""
    objs = scene.objects
    if kind == "background":
        return Question(kind, "what color is the background?", scene.background)
    if kind == "count":
        return Question(kind, "how many shapes are there?", COUNT_WORDS[len(objs)])
    if kind == "exists":
        if objs and rng.random() < 0.5:
            o = rng.choice(objs)
            return Question(kind, f"is there a {o.name}?", "yes")
        names = {o.name for o in objs}
        absent = [f"{c} {s}" for c in COLORS for s in SHAPES if f"{c} {s}" not in names]
        return Question(kind, f"is there a {rng.choice(absent)}?", "no")
    if not objs:
        return None
    o = rng.choice(objs)
    if kind == "position":
        return Question(kind, f"where is the {o.name}?", o.position)
    if kind == "color":
        if sum(x.shape == o.shape for x in objs) != 1:
            return None
        return Question(kind, f"what color is the {o.shape}?", o.color)
    if kind == "shape":
        if sum(x.color == o.color for x in objs) != 1:
            return None
        return Question(kind, f"what shape is the {o.color} object?", o.shape)
    raise ValueError(f"unknown question kind {kind!r}; one of {QUESTION_KINDS}")


# --------------------------------------------------------------------------------------- sampling


def _random_object(scene: Scene, rng: random.Random) -> Shape | None:
    free = scene.free_cells()
    taken = {o.name for o in scene.objects}
    kinds = [(s, c) for s in SHAPES for c in COLORS if f"{c} {s}" not in taken]
    if not free or not kinds:
        return None
    shape, color = rng.choice(kinds)
    return Shape(shape, color, rng.choice(list(SIZES)), rng.choice(free))


def random_scene(rng: random.Random, *, min_objects: int = 1, max_objects: int = MAX_OBJECTS) -> Scene:
    """A uniform background and ``min_objects..max_objects`` random objects in random free cells."""
    scene = Scene(rng.choice(list(BACKGROUNDS)))
    for _ in range(rng.randint(min_objects, max_objects)):
        obj = _random_object(scene, rng)
        if obj is None:
            raise ValueError(
                f"`max_objects` = {max_objects} is more than a scene holds ({GRID * GRID} cells, one object of "
                f"each colour and shape); pass at most {MAX_OBJECTS}"
            )
        scene = Scene(scene.background, scene.objects + (obj,))
    return scene


def _check_seed(seed: int) -> int:
    return check_int("seed", seed, 0)


def t2i_sample(seed: int, *, max_objects: int = 2) -> Scene:
    """The text-to-image sample of ``seed``: a scene with 1..``max_objects`` objects (prompt = its caption)."""
    return random_scene(random.Random(_check_seed(seed) * 4 + 1), max_objects=max_objects)


def edit_sample(seed: int, kind: str | None = None) -> Edit:
    """The edit sample of ``seed`` (``kind`` chosen by the seed unless given)."""
    rng = random.Random(_check_seed(seed) * 4 + 2)
    while True:
        chosen = kind or rng.choice(EDIT_KINDS)
        lo = 2 if chosen == "remove" else 1
        hi = MAX_OBJECTS - 1 if chosen == "add" else MAX_OBJECTS
        edit = apply_edit(random_scene(rng, min_objects=lo, max_objects=hi), chosen, rng)
        if edit is not None:
            return edit


def understanding_sample(
    seed: int, kind: str | None = None, *, max_objects: int = MAX_OBJECTS
) -> tuple[Scene, Question]:
    """The question sample of ``seed``: a scene with 1..``max_objects`` objects and one question about it."""
    rng = random.Random(_check_seed(seed) * 4 + 3)
    while True:
        scene = random_scene(rng, max_objects=max_objects)
        q = ask(scene, kind or rng.choice(QUESTION_KINDS), rng)
        if q is not None:
            return scene, q


def eval_seeds(count: int, offset: int = 0) -> Iterator[int]:
    """``count`` held-out seeds (disjoint from every training seed)."""
    start = EVAL_SEEDS.start + offset
    return iter(range(start, start + count))


def vocabulary_text() -> list[str]:
    """Lines covering every word the world uses (a tokenizer trained on them encodes each word whole)."""
    rng = random.Random(0)
    lines = []
    for _ in range(3000):
        scene = random_scene(rng, min_objects=0)
        lines.append(scene.caption())
        for kind in EDIT_KINDS:
            e = apply_edit(scene, kind, rng)
            if e is not None:
                lines.append(e.instruction)
        for kind in QUESTION_KINDS:
            q = ask(scene, kind, rng)
            if q is not None:
                lines += [q.question, q.answer]
    return lines


def image_array(image: Image.Image) -> np.ndarray:
    """``[H, W, 3]`` uint8 array of an RGB image."""
    return np.asarray(image.convert("RGB"), dtype=np.uint8)


__all__ = [
    "BACKGROUNDS",
    "CANVAS",
    "COLORS",
    "COUNT_WORDS",
    "EDIT_KINDS",
    "EVAL_SEEDS",
    "Edit",
    "GRID",
    "MAX_OBJECTS",
    "POSITIONS",
    "QUESTION_KINDS",
    "Question",
    "SHAPES",
    "SIZES",
    "Scene",
    "Shape",
    "TRAIN_SEEDS",
    "apply_edit",
    "ask",
    "cell_center",
    "edit_sample",
    "eval_seeds",
    "image_array",
    "random_scene",
    "t2i_sample",
    "understanding_sample",
    "vocabulary_text",
]
