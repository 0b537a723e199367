"""checkfree.evalinputs: an evaluation after a rebuild that starts at the rebuilt stage from the inputs recorded
before it gives the whole route's loss, and evaluates the whole route (saying why) when the record does not fit."""

from __future__ import annotations

import json
import logging

import pytest
from checkfree.config import preset
from checkfree.evalinputs import StageInputs, route_loss
from checkfree.simulator import Simulator, evaluate


def _cfg(wire: str = "float32"):
    cfg = preset("tiny")
    cfg.num_stages = 4
    cfg.train.num_steps, cfg.train.eval_every, cfg.train.eval_batches = 4, 2, 3
    cfg.train.wire_dtype = wire
    cfg.failures.rate = 0.0
    return cfg


@pytest.mark.parametrize("wire", ["float32", "int8"])
@pytest.mark.parametrize("stage", [1, 2])
def test_an_evaluation_from_the_rebuilt_stage_equals_the_whole_routes(tmp_path, caplog, wire, stage):
    cfg = _cfg(wire)
    run = tmp_path / "run"
    Simulator(cfg, run, progress=False, save_steps=(2,), eval_inputs=StageInputs(tmp_path / "in", {2})).run()
    # evaluated after steps 1 and 3; the first (the state ready for step 2, the save's) recorded
    assert sorted(p.name for p in (tmp_path / "in" / "step-00000002").iterdir()) == [
        "meta.json", "stage-1.pt", "stage-2.pt", "stage-3.pt"]
    caplog.set_level(logging.WARNING, logger="checkfree.evalinputs")
    sim = Simulator(cfg, run, progress=False, resume=True, eval_inputs=StageInputs(tmp_path / "in"))
    val = sim.rebuild_and_evaluate({stage})  # CheckFree's average at `stage`, evaluated from it on
    assert "whole route" not in caplog.text
    assert val == pytest.approx(evaluate(sim.workers, sim.val), rel=0, abs=1e-6)
    recorded = json.loads((tmp_path / "in" / "step-00000002" / "meta.json").read_text())["val_loss"]
    assert abs(val - recorded) > 1e-3  # the rebuild changed the loss: the stages after it did run


def test_a_record_that_does_not_fit_falls_back_to_the_whole_route_and_says_why(tmp_path, caplog):
    cfg = _cfg()
    sim = Simulator(cfg, tmp_path / "run", progress=False, eval_inputs=StageInputs(tmp_path / "in", {2}))
    sim.run()
    rec = StageInputs(tmp_path / "in")
    workers = sim.workers  # trained two steps past the record: stage 0's weights are not the recorded ones
    full = route_loss(workers, sim.val)
    caplog.set_level(logging.WARNING, logger="checkfree.evalinputs")
    assert rec.evaluate_after(2, workers, sim.val, {2}) == full
    assert "stage(s) [0, 1] hold other weights" in caplog.text
    caplog.clear()
    assert rec.evaluate_after(4, workers, sim.val, {2}) == full
    assert "no stage inputs recorded for step 4" in caplog.text
    caplog.clear()
    assert rec.evaluate_after(2, workers, sim.val[:2], {2}) == route_loss(workers, sim.val[:2])
    assert "validation batches differ" in caplog.text
    with pytest.raises(ValueError, match="one recorded input per batch"):
        route_loss(workers, sim.val, first=2, inputs=[])
