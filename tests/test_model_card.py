"""The model card is written from the run's record: the training facts and notes it states come from there."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _card_module():
    spec = importlib.util.spec_from_file_location("model_card", ROOT / "tools" / "model_card.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_card_states_the_records_init_questions_and_notes():
    card = _card_module().card
    record = json.loads((ROOT / "models" / "bagel" / "unicache-shapes" / "training.json").read_text())
    cfg = dict(
        record["config"],
        unit_input_init="und",
        und_questions=4,
        und_late_kinds=["background", "exists"],
        und_late_from=800,
        steps=2500,
        stop_at=0,
    )
    text = card(dict(record, config=cfg), None, ["A note about this run."])
    assert "- The ViT and the connector started at unit gain, N(0, 1/fan_in)" in text
    assert "up to 4 questions of different kinds" in text and "join at step 800" in text
    assert "- A note about this run." in text
    assert "stops at step" not in text  # the schedule ran to its end
    assert "## Scores" not in text  # no quality report given
    every = card(dict(record, config=dict(cfg, unit_input_init=True)), None)
    assert "The image input path (ViT, connector, timestep embedder, `vae2llm`) started" in every
    assert "started at N(0, 1/fan_in)" not in card(dict(record, config=dict(cfg, unit_input_init=False)), None)
    fast = card(dict(record, config=dict(cfg, precision="bf16", compile=True, ema_decay=0.998)), None)
    assert "bfloat16 autocast" in fast and "`torch.compile`" in fast and "decay 0.998" in fast
    plain = card(dict(record, config=dict(cfg, precision="fp32", compile=False, ema_decay=0.0, gen_lr_scale=1.0)), None)
    assert "All in fp32." in plain and "the learning rate." not in plain
    assert "at 2x the learning rate." in card(dict(record, config=dict(cfg, gen_lr_scale=2.0)), None)
