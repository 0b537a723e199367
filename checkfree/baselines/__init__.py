"""Network-free cores of the alternative fault-tolerance systems (Gemini, REFT, BAFT).

Re-exports the public names of :mod:`.placement` (Gemini placement and checkpoint timing),
:mod:`.parity` (REFT RAIM5 XOR parity, survival, state bytes) and :mod:`.bubbles`
(BAFT bubble scheduling and ring survival).
"""

from __future__ import annotations

from .bubbles import (
    BackupPlan,
    LayerSlot,
    Window,
    common_windows,
    gpipe_bubble_fraction,
    gpipe_idle_windows,
    gpipe_iteration_time,
    plan_backup,
    ring_survival,
    ring_survival_bruteforce,
)
from .parity import (
    ParityBlock,
    Raim5Block,
    decode_missing,
    encode_parity,
    raim5_block,
    raim5_chunk,
    raim5_encode,
    raim5_recover,
    reft_survival_eq2,
    reft_survival_eq2_bruteforce,
    reft_survival_groups,
    reft_survival_groups_bruteforce,
    state_from_bytes,
    state_to_bytes,
    xor_bytes,
)
from .gemini_placement import (
    gemini_wasted_time,
    group_placement,
    mixed_placement,
    recovery_probability_bruteforce,
    recovery_probability_group,
    recovery_probability_lower_bound,
    young_interval,
)

__all__ = [
    # placement (Gemini)
    "group_placement",
    "mixed_placement",
    "recovery_probability_group",
    "recovery_probability_lower_bound",
    "recovery_probability_bruteforce",
    "gemini_wasted_time",
    "young_interval",
    # parity (REFT)
    "ParityBlock",
    "Raim5Block",
    "xor_bytes",
    "encode_parity",
    "decode_missing",
    "raim5_encode",
    "raim5_chunk",
    "raim5_block",
    "raim5_recover",
    "reft_survival_groups",
    "reft_survival_groups_bruteforce",
    "reft_survival_eq2",
    "reft_survival_eq2_bruteforce",
    "state_to_bytes",
    "state_from_bytes",
    # bubbles (BAFT)
    "Window",
    "LayerSlot",
    "BackupPlan",
    "gpipe_iteration_time",
    "gpipe_bubble_fraction",
    "gpipe_idle_windows",
    "common_windows",
    "plan_backup",
    "ring_survival",
    "ring_survival_bruteforce",
]
