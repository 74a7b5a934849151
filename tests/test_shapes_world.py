"""The shapes world is exact and deterministic, and the analyser reads rendered scenes back exactly."""

import random

import numpy as np
import pytest

from unicache_core.shapes import analyse, edit_sample, judge_t2i, psnr, scenes_match, t2i_sample, unchanged_mask
from unicache_core.shapes.world import (
    BACKGROUNDS,
    EDIT_KINDS,
    EVAL_SEEDS,
    QUESTION_KINDS,
    TRAIN_SEEDS,
    Scene,
    Shape,
    apply_edit,
    ask,
    image_array,
    random_scene,
    understanding_sample,
)


def test_samples_are_deterministic_per_seed():
    assert t2i_sample(17) == t2i_sample(17)
    assert edit_sample(17) == edit_sample(17)
    assert understanding_sample(17) == understanding_sample(17)
    assert np.array_equal(image_array(t2i_sample(3).render()), image_array(t2i_sample(3).render()))
    assert len({t2i_sample(s).caption() for s in range(50)}) > 40


def test_train_and_eval_seeds_are_disjoint():
    assert TRAIN_SEEDS.stop <= EVAL_SEEDS.start


def test_analyser_reads_rendered_scenes_exactly():
    rng = random.Random(123)
    for _ in range(400):
        scene = random_scene(rng, min_objects=0)
        assert analyse(scene.render()) == scene


def test_analyser_reads_blurred_scenes_and_rounded_corners_as_a_person_does():
    """A VAE blurs edges and rounds corners; the analyser still reads the scene (a box-fill rule read small blurred
    triangles and rounded squares as circles)."""
    from PIL import ImageDraw, ImageFilter

    from unicache_core.shapes.world import BACKGROUNDS as BG
    from unicache_core.shapes.world import COLORS, cell_center

    rng = random.Random(321)
    for _ in range(300):
        scene = random_scene(rng, min_objects=1)
        for radius in (1.2, 2.0):
            assert scenes_match(analyse(scene.render().filter(ImageFilter.GaussianBlur(radius))), scene)
    for size, shape_px in (("small", 22), ("large", 36)):
        image = Scene("white").render()
        draw = ImageDraw.Draw(image)
        cx, cy = cell_center(4)
        half = shape_px / 2
        draw.rounded_rectangle(
            (cx - half, cy - half, cx + half - 1, cy + half - 1), radius=shape_px // 6, fill=COLORS["blue"]
        )
        assert analyse(image) == Scene("white", (Shape("square", "blue", size, 4),))
    assert BG["white"] != COLORS["blue"]


def test_edit_targets_are_exact_and_change_what_they_say():
    for kind in EDIT_KINDS:
        for seed in range(30):
            e = edit_sample(seed, kind)
            assert e.kind == kind and e.source != e.target
            src, tgt = e.source, e.target
            if kind == "background":
                assert tgt.objects == src.objects and tgt.background != src.background
            elif kind == "add":
                assert len(tgt.objects) == len(src.objects) + 1
            elif kind == "remove":
                assert len(tgt.objects) == len(src.objects) - 1
            elif kind == "recolor":
                assert sorted(o.cell for o in tgt.objects) == sorted(o.cell for o in src.objects)
                assert sum(a.color != b.color for a, b in zip(src.objects, tgt.objects)) == 1
            elif kind == "move":
                assert {o.name for o in tgt.objects} == {o.name for o in src.objects}
            # the exact target image is the target scene's render, and the analyser sees the target scene
            assert scenes_match(analyse(tgt.render()), tgt)


def test_unchanged_region_excludes_the_edited_object():
    e = edit_sample(5, "recolor")
    src, tgt = image_array(e.source.render()), image_array(e.target.render())
    mask = unchanged_mask(src, tgt)
    assert 0 < (~mask).sum() < mask.size / 4
    assert psnr(src, tgt, mask) == 100.0  # outside the edit, source == target
    assert psnr(src, tgt) < 40.0


def test_questions_have_their_exact_answer():
    scene = Scene("gray", (Shape("circle", "red", "large", 0), Shape("square", "blue", "small", 8)))
    rng = random.Random(0)
    assert ask(scene, "count", rng).answer == "two"
    assert ask(scene, "background", rng).answer == "gray"
    for _ in range(20):
        q = ask(scene, "position", rng)
        assert (
            q.answer
            == {"where is the red circle?": "top left", "where is the blue square?": "bottom right"}[q.question]
        )
        q = ask(scene, "exists", rng)
        assert q.answer == ("yes" if q.question in ("is there a red circle?", "is there a blue square?") else "no")
    for kind in QUESTION_KINDS:
        for seed in range(10):
            s, q = understanding_sample(seed, kind)
            assert q.kind == kind and q.answer


def test_judge_t2i_fails_a_wrong_image():
    scene = t2i_sample(2)
    assert judge_t2i(scene.render(), scene).correct
    other = next(t2i_sample(s) for s in range(3, 100) if not scenes_match(t2i_sample(s), scene))
    assert not judge_t2i(other.render(), scene).correct
    blank = Scene(scene.background).render()
    j = judge_t2i(blank, scene)
    assert not j.correct and j.position == 0.0


def test_invalid_scenes_are_refused():
    with pytest.raises(ValueError, match="share a cell"):
        Scene("white", (Shape("circle", "red", "large", 0), Shape("square", "blue", "large", 0)))
    with pytest.raises(ValueError, match="unknown background"):
        Scene("pink")
    with pytest.raises(ValueError, match="seed"):
        t2i_sample(-1)
    with pytest.raises(ValueError, match="128x128"):
        analyse(np.zeros((64, 64, 3), dtype=np.uint8))
    assert apply_edit(Scene("white"), "remove", random.Random(0)) is None
    assert set(BACKGROUNDS) == {"white", "black", "gray"}
