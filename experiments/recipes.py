"""The paper's experiments at the paper's scale, as Settings (`checkfree experiment ... --recipe NAME`).

One step is one of the paper's iterations (`rate_scale` 1), so the per-iteration failure
probabilities and the checkpoint interval are the authors' own for the model (experiments.spec.PAPER_MODELS,
from gensyn-ai/CheckFree `simulate_training/<model>_config.json` and the paper). Evaluation follows
the authors' code: every 500 iterations, 50 validation batches. Flags given beside `--recipe` override
its values.

The 500M recipes rebuild at LR scale 1.2, the authors' 500M config (the paper writes 1.1; `--lr-scale` overrides).

* `paper-500m-table2`  Table 2: every strategy x 5 / 10 / 16 % on the 500M model (`paper-500m`, OpenWebText),
  p 0.0009 / 0.002 / 0.004, checkpoint every 100 iterations. The paper's failure-free run needs 10,000
  iterations to its target and its slowest cell 22,000, so the runs are 25,000 steps and the target is
  the failure-free validation loss at iteration 10,000 (target fraction 0.4).
* `paper-500m-fig2`    Fig. 2: the recovery initialisations at 16 % on the 500M model, 10,000 iterations
  (the paper's perplexities are after 10,000).
* `paper-124m`         the 124M model (`paper-124m`, TinyStories) at the rates its config gives: 10 % and
  16 % (p 0.0006 and 0.001; the config has no 5 % figure), checkpoint every 50 iterations. The authors'
  config gives no run length (its max_iterations, 100001, is the training loop's cap), so `--steps` is
  required.
"""

from __future__ import annotations

from typing import Any, Callable

from experiments.spec import Settings

__all__ = ["RECIPES", "recipe"]

_AUTHORS_EVAL = {"eval_every": 500, "eval_batches": 50}  # convergence_training.py: itr % 500, validation 50


def _paper_500m_table2(**overrides: Any) -> Settings:
    base = dict(preset="paper-500m", data="hf:Skylion007/openwebtext", paper_model="500m", rate_scale=1.0, lr_scale=1.2,
                steps=25_000, target_fraction=0.4, rates=[5.0, 10.0, 16.0], seeds=[0, 1, 2], jobs=1,
                out="experiments/results/paper-500m", **_AUTHORS_EVAL)
    return Settings(**(base | overrides))


def _paper_500m_fig2(**overrides: Any) -> Settings:
    return _paper_500m_table2(**({"steps": 10_000, "target_fraction": 0.5, "init_rate": 16.0,
                                  "out": "experiments/results/paper-500m-fig2"} | overrides))


def _paper_124m(**overrides: Any) -> Settings:
    if "steps" not in overrides:
        raise ValueError("--recipe paper-124m needs --steps: the authors' 124M config gives no run length "
                         "(its max_iterations, 100001, is the training loop's cap)")
    base = dict(preset="paper-124m", data="hf:roneneldan/TinyStories", paper_model="124m", rate_scale=1.0,
                rates=[10.0, 16.0], init_rate=16.0, ckpt_rate=10.0, plus_rates=[0.0, 10.0, 16.0], seeds=[0, 1, 2],
                jobs=1, out="experiments/results/paper-124m", **_AUTHORS_EVAL)
    return Settings(**(base | overrides))


RECIPES: dict[str, Callable[..., Settings]] = {
    "paper-500m-table2": _paper_500m_table2,
    "paper-500m-fig2": _paper_500m_fig2,
    "paper-124m": _paper_124m,
}


def recipe(name: str, **overrides: Any) -> Settings:
    """The Settings of recipe `name`, with `overrides` (the flags given beside it)."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {sorted(RECIPES)}")
    return RECIPES[name](**overrides)
