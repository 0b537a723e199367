"""The runtime on an accelerator: one prepared script that proves the GPU path, measures it, and runs the
studies that need it (issue 41). `python -m benchmarks.accelerator --help`; benchmarks/README.md has the
commands of the day (pack here, then one device command per call).

Phases, each in a process of its own under its own time cap (a phase past its cap is stopped, and what it had
finished is kept and reported as such):

* **env**: versions, the device, the bf16 (and fp32) matmul peak measured with torch.matmul, and which swarm
  transport can start (hivemind's p2pd; `tcp` still needs the DHT's p2pd).
* **correctness**: the swarm (real processes) against the simulator on the device through a CheckFree
  recovery and CheckFree+ edge recoveries, in float32 (losses to 1e-5, same coefficients) and in bf16
  autocast (`BF16_TOL`, with the measured nondeterminism floor and the bf16-vs-float32 gap beside it); an HF
  model out (`checkfree export --format hf`, loaded by transformers on the device) and in (`--init-from`).
* **speed**: the swarm against torch.distributed.pipelining on the same GPU, same stages, microbatches,
  schedules (GPipe, 1F1B) and optimizer; tokens/s and the model FLOPs utilisation against the measured bf16
  peak; the simulator (every stage in one process, no wire) beside them; the recovery of a 100M-parameter stage.
* **science**: the SmolLM2 immediate damage of every init at stages 1-4, the `paper-124m` Fig. 2 comparison, a
  Table 2 point at 500M, then the SmolLM2 recovery curves (stages 1-4, 512 tokens a step) for as many steps as the
  time left allows, each item sized to its share (benchmarks.accelerator.science).

Call 1 runs env, correctness and speed; call 2 runs env and science: the most valuable results come back
first. Call `hf` is the focused one (about 120 s): a light env (no peak, no transport probe) and only the HF part of
the correctness phase, from a short run of its own (`--call hf`, carried with `.accel-pack/hf`).

Results: `callN.json` (everything, rendered by `benchmarks.accelerator.report`), `callN.md` (a summary),
`callN.log`, and `call2-science.tar.gz` (the studies' result files), at most 8 files in the output folder.
"""

from __future__ import annotations

__all__ = ["SCIENCE_ITEMS", "PHASES", "CALLS", "ONLY", "call_key", "CAPS_S", "DRY_CAPS_S", "BF16_TOL", "FP32_TOL",
           "DEFAULT_INITS"]

PHASES = ("env", "correctness", "speed", "science")
SCIENCE_ITEMS = ("smollm2-damage", "fig2-124m", "table2-500m", "smollm2-curves")  # the science phase's, in order
CALLS: dict[int | str, tuple[str, ...]] = {1: ("env", "correctness", "speed"), 2: ("env", "science"),
                                           "hf": ("env", "correctness")}
# a call that runs only a part of a phase: call hf runs the correctness phase's HF in/out check alone
ONLY = {"hf": {"correctness": "hf"}}
# seconds each phase may run on the H200: call 1 = 285 s, call 2 = 195 s (8 min in all, starts not counted), sized
# from the first run's timings (benchmarks/README.md, "On a GPU", the basis of each); call hf: 120 s, from its two
# tries at 1543f55 (callhf.json, callhf-1.json)
CAPS_S = {1: {"env": 15, "correctness": 105, "speed": 165}, 2: {"env": 10, "science": 185},
          "hf": {"env": 20, "correctness": 100}}
DRY_CAPS_S = {1: {"env": 120, "correctness": 300, "speed": 300}, 2: {"env": 120, "science": 300},
              "hf": {"env": 60, "correctness": 240}}
FP32_TOL = 1e-5  # the swarm and the simulator compute the same float32 numbers (tests/test_swarm.py's tolerance)
# bf16 keeps 8 significant bits: one rounding is off by up to 2^-9 relative. The swarm and the simulator run the
# same kernels on the same inputs, so they can differ only where a nondeterministic reduction (atomics in
# attention's backward on CUDA) lands an intermediate on the other side of a bf16 rounding; over a dozen steps
# such flips stay below one bf16 ulp (2^-8) of the loss and of the coefficients. A difference above that is a
# disagreement, not rounding. The run also measures the floor (the simulator against itself) and the scale (bf16
# against float32) and reports both beside it.
BF16_TOL = 2.0 ** -8
# The recovery initialisations the SmolLM2 study compares (experiments.pretrained.ALL_INITS labels); add one here
# (or with --inits) when another lands: an unknown label is refused at once, before anything runs. Issue 42's snap
# copy as the default snap keeps it (int8, a delta sent every step: one step old at the failure).
DEFAULT_INITS = ("checkfree post/stage", "uniform", "copy", "random", "identity", "snap int8 age 1")


def call_key(text: str | int) -> int | str:
    """A call's key in CALLS from the command line: 1, 2 or "hf"."""
    key: int | str = int(text) if str(text).isdigit() else str(text)
    if key not in CALLS:
        raise ValueError(f"no call {text!r}: one of {', '.join(map(str, CALLS))}")
    return key
