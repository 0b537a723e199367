"""Simulated wall clock: seconds per step and per transfer from FLOPs and bytes.

Every strategy is charged in the same currency, so one failure trace replayed through all
of them gives comparable figures. Nothing here measures time: a run's simulated clock is a
pure function of its config, its trace and the bytes its strategy moves.

Model
-----
* Stage i runs in region ``i mod R`` of the profile; each stage is ``peers_per_stage``
  data-parallel peers and each pair of peers has its own link, so a stage-to-stage
  transfer of B bytes takes ``latency + B / (peers_per_stage * bandwidth)``.
* Per microbatch, stage i needs ``F_i / flops_per_s`` for its forward and twice that for its
  backward (FLOPs: ``2 * params`` per token for the matmuls plus ``4 T d`` per token per
  block for attention; the head counts, the embedding lookup does not), plus
  ``hop_overhead_s`` per visit, plus sending its activations (``microbatch_size * context
  * d_model * wire_bytes``) to the next stage.
* ``pipelined`` profiles run the swarm's schedule across peers, played out event by event
  (`CostModel.pipeline_s`): each stage one compute server (backward before forward), each link a
  sender serializing at its bandwidth with the latency added after the last byte, GPipe starting all
  M microbatches at once (1F1B: S, then one per finished microbatch). Latency is paid once per hop
  of each microbatch and overlaps the other microbatches' compute; the closed form this replaced,
  ``(M + S - 1) (t_f + t_b)`` with the latency inside every slot, charged it M + S - 1 times and
  predicted 3.8x the step time measured on the emulated WAN (`python -m benchmarks.wan`).
  A non-pipelined profile (one process running every stage in turn, as the simulator
  does) sums the stages instead.
* Redundant computation (Bamboo): every stage also runs its ring successor's forward for
  each microbatch (times ``redundant_slowdown``), and the successor ships its fp32 gradient
  after the backward so the replica's Adam step is bit-identical to the original's.
* A checkpoint write or read takes ``bytes / storage_Bps`` per peer (peers in parallel);
  a recovery takes ``detection_s`` plus the slowest transfer of the state it needs.
* Background copies (Gemini, REFT, snapshots) use the links while they carry no
  activations; only what does not fit in that idle time stalls the step.

Calibration of ``paper-geo`` (the paper's five-region setting: 4-130 ms, 0.01-0.25 GiB/s)
------------------------------------------------------------------------------------------
The latency / bandwidth table is illustrative, in the paper's ranges (the paper does not
publish its table). Two constants are fitted to the paper's ``paper-500m`` numbers
(d 1024, 24 layers, 6 stages, context 1024, 4 microbatches of 64 sequences, 4 peers per
stage, bf16 activations on the wire), with ``python -m benchmarks.calibrate --calibrate``:

* ``flops_per_s = 3.756e12`` (effective, per stage group) gives 91.30 s per iteration
  (paper 91.3 s). The last stage (4 blocks + the 32k-vocabulary head) is the bottleneck: 3.79 s
  forward and 8.47 s backward per microbatch with its sends, computing for half of the step; the
  rest is the pipeline's fill and drain through the five other stages.
* The mechanistic part of redundant computation (the successor's forward per microbatch
  on each stage, plus the gradient shipment) gives 118.6 s per iteration;
  the paper measured 151.04 s, with a baseline that halves the microbatch size and doubles
  their count. That inefficiency is not derivable here, so ``redundant_slowdown = 2.31``
  multiplies the redundant forward's time: 151.17 s (x1.656; paper x1.654).
* Not fitted: ``storage_Bps`` = 0.1 GiB/s per peer (remote storage), ``detection_s`` = 10 s
  (a heartbeat timeout; the paper reports ~30 s per recovery in its setup).

Calibration of ``local`` (this machine, one process, 2 shared cores)
--------------------------------------------------------------------
Measured with ``python -m benchmarks.calibrate --measure``: the fastest step of a 20-step
simulator run at one intra-op thread on the tiny and small presets, torch.save and memcpy
throughput. ``flops_per_s`` (~4.3e10) and ``hop_overhead_s`` (~4.2 ms per stage visit)
solve the two step times exactly (`solve_local`); latency 0, detection 0. The machine was
shared with other jobs (load 4-6 on 2 cores) while measuring: repeated runs gave tiny
0.11-0.18 s and small 0.34-0.41 s per step, so the local figures are good to ~30 %.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace

from checkfree.baselines import gpipe_idle_windows
from checkfree.config import RunConfig, preset
from checkfree.model import plan_stages

__all__ = ["GIB", "Profile", "PROFILES", "NETWORKS", "get_profile", "swarm_profile", "CostModel", "stage_params",
           "stage_forward_flops"]

GIB = float(2**30)
_MS = 1e-3

_GEO_REGIONS = ("us-east", "us-west", "eu-west", "eu-central", "asia-east")
# Symmetric tables; the diagonal is intra-region (1 ms, 10 Gbit/s).
_GEO_LATENCY_MS = (
    (1, 62, 75, 88, 130),
    (62, 1, 128, 120, 105),
    (75, 128, 1, 4, 125),
    (88, 120, 4, 1, 115),
    (130, 105, 125, 115, 1),
)
_GEO_BANDWIDTH_GIB = (
    (1.25, 0.15, 0.12, 0.10, 0.04),
    (0.15, 1.25, 0.05, 0.04, 0.08),
    (0.12, 0.05, 1.25, 0.25, 0.01),
    (0.10, 0.04, 0.25, 1.25, 0.03),
    (0.04, 0.08, 0.01, 0.03, 1.25),
)

# `python -m benchmarks.calibrate --measure` on this machine (2 shared cores, torch 2.13 CPU,
# load average 4-6 from other jobs), median of three runs of each figure; the step times are
# the fastest step of a 20-step simulator run at one intra-op thread.
LOCAL_MEASUREMENT = {
    "tiny_step_s": 0.158,
    "small_step_s": 0.345,
    "storage_GiB_s": 0.58,  # torch.save of 256 MiB to a temporary directory
    "memcpy_GiB_s": 0.72,  # clone of 256 MiB
}


@dataclass(frozen=True)
class Profile:
    """Hardware and network of a cost profile (times in s, bandwidths in bytes/s)."""

    name: str
    regions: tuple[str, ...]
    latency_s: tuple[tuple[float, ...], ...]  # region x region, symmetric
    bandwidth_Bps: tuple[tuple[float, ...], ...]  # per peer-to-peer link
    flops_per_s: float  # effective training throughput of one stage (all its peers)
    hop_overhead_s: float  # fixed cost of one stage visit by one microbatch
    peers_per_stage: int  # data-parallel peers of a stage, each with its own links
    wire_bytes: int  # bytes per activation value sent between stages
    storage_Bps: float  # per-peer checkpoint write / read bandwidth
    detection_s: float  # from a failure to the start of its recovery
    redundant_slowdown: float  # multiplier of the redundant forward's compute time
    pipelined: bool  # GPipe across peers (True) or all stages in one process in turn


def _geo() -> Profile:
    return Profile(
        name="paper-geo", regions=_GEO_REGIONS,
        latency_s=tuple(tuple(x * _MS for x in row) for row in _GEO_LATENCY_MS),
        bandwidth_Bps=tuple(tuple(x * GIB for x in row) for row in _GEO_BANDWIDTH_GIB),
        flops_per_s=3.756e12, hop_overhead_s=0.0, peers_per_stage=4, wire_bytes=2,
        storage_Bps=0.1 * GIB, detection_s=10.0, redundant_slowdown=2.31, pipelined=True)


def _local() -> Profile:
    flops_per_s, hop_s = solve_local(LOCAL_MEASUREMENT["tiny_step_s"], LOCAL_MEASUREMENT["small_step_s"])
    mem = LOCAL_MEASUREMENT["memcpy_GiB_s"] * GIB
    return Profile(
        name="local", regions=("local",), latency_s=((0.0,),), bandwidth_Bps=((mem,),),
        flops_per_s=flops_per_s, hop_overhead_s=hop_s, peers_per_stage=1, wire_bytes=4,
        storage_Bps=LOCAL_MEASUREMENT["storage_GiB_s"] * GIB, detection_s=0.0, redundant_slowdown=1.0,
        pipelined=False)


def solve_local(tiny_step_s: float, small_step_s: float) -> tuple[float, float]:
    """flops_per_s and hop_overhead_s such that step = M * sum_i (3 F_i / R + 2 h) gives both
    measured step times (the simulator runs the stages in turn)."""
    rows = []
    for name, t in (("tiny", tiny_step_s), ("small", small_step_s)):
        cfg = preset(name)
        rows.append((cfg.train.num_microbatches * sum(3 * f for f in stage_forward_flops(cfg)),
                     2 * cfg.train.num_microbatches * cfg.num_stages, t))
    (a1, h1, t1), (a2, h2, t2) = rows
    det = a1 * h2 - a2 * h1
    inv_r, hop = (t1 * h2 - t2 * h1) / det, (a1 * t2 - a2 * t1) / det
    if inv_r <= 0 or hop < 0:
        raise ValueError(f"step times tiny={tiny_step_s} s, small={small_step_s} s do not fit the local model")
    return 1.0 / inv_r, hop


PROFILES = {"paper-geo": _geo, "local": _local}
NETWORKS = ("paper-geo",)  # profiles with a network worth emulating (`checkfree local --wan`)


def get_profile(name: str) -> Profile:
    if name not in PROFILES:
        raise ValueError(f"unknown cost profile {name!r}; choose one of {sorted(PROFILES)}")
    return PROFILES[name]()


def swarm_profile(network: str, compute: str = "local", wire_bytes: int = 4) -> Profile:
    """The links of `network` (one peer per stage, each pair of peers its own link) with the hardware of
    `compute`, run as a pipeline across processes: what a swarm on `checkfree local --wan NETWORK` runs on,
    and the profile `python -m benchmarks.wan` predicts its step time with."""
    if network not in NETWORKS:
        raise ValueError(f"unknown network {network!r}; choose one of {list(NETWORKS)}")
    net, hw = get_profile(network), get_profile(compute)
    return replace(net, name=f"{network}+{compute}", flops_per_s=hw.flops_per_s, hop_overhead_s=hw.hop_overhead_s,
                   peers_per_stage=1, wire_bytes=wire_bytes, storage_Bps=hw.storage_Bps,
                   redundant_slowdown=hw.redundant_slowdown, pipelined=True)


def _block_params(cfg: RunConfig) -> int:
    m = cfg.model
    d, h, kv = m.d_model, m.mlp_width, m.kv_heads * m.head_dim
    return 2 * d * d + 2 * d * kv + 3 * d * h + 2 * d  # attention (q, o; k, v), SwiGLU, two RMSNorms


def stage_params(cfg: RunConfig) -> list[int]:
    """Parameters of each stage of the plain pipeline (embedding on 0, norm + head on S-1)."""
    d, v = cfg.model.d_model, cfg.model.vocab_size
    out = []
    for spec in plan_stages(cfg.model.num_layers, cfg.num_stages):
        n = spec.num_blocks * _block_params(cfg)
        n += v * d if spec.is_first else 0
        n += d + d * v if spec.is_last else 0
        out.append(n)
    return out


def stage_forward_flops(cfg: RunConfig) -> list[float]:
    """Forward FLOPs of one microbatch through each stage of the plain pipeline."""
    m = cfg.model
    tokens = cfg.train.microbatch_size * cfg.seq_len
    per_block = 2 * (_block_params(cfg) - 2 * m.d_model) + 4 * cfg.seq_len * m.d_model
    out = []
    for spec in plan_stages(m.num_layers, cfg.num_stages):
        f = spec.num_blocks * per_block + (2 * m.d_model * m.vocab_size if spec.is_last else 0)
        out.append(float(tokens * f))
    return out


class CostModel:
    """Seconds for the steps, transfers and recoveries of one run under one profile."""

    def __init__(self, cfg: RunConfig, profile: str | Profile | None = None) -> None:
        prof = profile if isinstance(profile, Profile) else get_profile(profile or cfg.strategy.cost_profile)
        if cfg.strategy.detection_s is not None:
            prof = replace(prof, detection_s=cfg.strategy.detection_s)
        self.cfg, self.profile = cfg, prof
        self.S, self.M = cfg.num_stages, cfg.train.num_microbatches
        self.flops = stage_forward_flops(cfg)
        m = cfg.model
        self.activation_bytes = cfg.train.microbatch_size * cfg.seq_len * m.d_model * prof.wire_bytes

    # --- links -------------------------------------------------------------------------
    def region(self, stage: int) -> int:
        return stage % len(self.profile.regions)

    def latency_s(self, src: int, dst: int) -> float:
        return self.profile.latency_s[self.region(src)][self.region(dst)]

    def bandwidth_Bps(self, src: int, dst: int) -> float:
        """Bytes per second from stage `src` to stage `dst` (all their peer pairs together)."""
        return self.profile.bandwidth_Bps[self.region(src)][self.region(dst)] * self.profile.peers_per_stage

    def transfer_s(self, nbytes: float, src: int, dst: int) -> float:
        """Seconds to move `nbytes` from stage `src` to stage `dst` (a replacement peer sits in
        the region of the stage it replaces); 0 for nothing or for a stage to itself."""
        if nbytes <= 0 or src == dst:
            return 0.0
        return self.latency_s(src, dst) + nbytes / self.bandwidth_Bps(src, dst)

    def storage_s(self, nbytes: float) -> float:
        """Seconds for one peer to write or read `nbytes` of checkpoint."""
        return nbytes / self.profile.storage_Bps

    def recovery_s(self, transfer_s: float) -> float:
        """Detection delay plus the (slowest) transfer a recovery waits for."""
        return self.profile.detection_s + transfer_s

    # --- steps -------------------------------------------------------------------------
    def compute_s(self, stage: int, passes: float) -> float:
        """Seconds of `passes` forward-equivalents of one microbatch on `stage` (a backward is 2), its hop included."""
        return passes * self.flops[stage] / self.profile.flops_per_s + self.profile.hop_overhead_s

    def _send_s(self, stage: int, to: int) -> float:
        return self.transfer_s(self.activation_bytes, stage, to) if 0 <= to < self.S else 0.0

    def t_f(self, redundant: bool = False) -> float:
        """Forward time per microbatch of the slowest stage, its send included."""
        extra = self.profile.redundant_slowdown if redundant else 0.0
        return max(self.compute_s(i, 1.0) + extra * self.flops[(i + 1) % self.S] / self.profile.flops_per_s
                   + self._send_s(i, i + 1) for i in range(self.S))

    def t_b(self) -> float:
        """Backward time per microbatch of the slowest stage, its send back included."""
        return max(self.compute_s(i, 2.0) + self._send_s(i, i - 1) for i in range(self.S))

    def step_s(self) -> float:
        """Seconds of one training step with no fault-tolerance work."""
        if not self.profile.pipelined:
            return self.M * sum(self.compute_s(i, 1.0) + self.compute_s(i, 2.0) for i in range(self.S))
        return self.pipeline_s()

    def pipeline_s(self, extra_forward: list[float] | None = None, schedule: str | None = None) -> float:
        """One step of the swarm's pipeline schedule, played out event by event: every stage one compute
        server (a backward before a waiting forward, else first come first served), every directed link a
        sender that serializes its messages at the link's bandwidth, each arriving one latency after its
        last byte left. GPipe starts all M microbatches at the first stage at once; 1F1B admits S and then
        one more per finished microbatch (peers.passes). `extra_forward[i]`: seconds added to each forward
        of stage i (redundant computation)."""
        S, M = self.S, self.M
        fwd = [self.compute_s(i, 1.0) + (extra_forward[i] if extra_forward else 0.0) for i in range(S)]
        bwd = [self.compute_s(i, 2.0) for i in range(S)]
        window = S if (schedule or self.cfg.train.schedule) == "1f1b" else M
        events: list[tuple[float, int, str, int, int]] = []  # (time, seq, what, stage, microbatch)
        seq = 0

        def push(t: float, what: str, stage: int, mb: int) -> None:
            nonlocal seq
            heapq.heappush(events, (t, seq, what, stage, mb))
            seq += 1

        ready: list[list[tuple[int, int, str, int]]] = [[] for _ in range(S)]  # (backward first, seq, kind, mb)
        busy = [False] * S
        link_free: dict[tuple[int, int], float] = {}
        admitted = min(window, M)
        for mb in range(admitted):
            push(0.0, "forward", 0, mb)
        finished, now = 0, 0.0

        def send(t: float, src: int, dst: int, kind: str, mb: int) -> None:
            lat, bw = self.latency_s(src, dst), self.bandwidth_Bps(src, dst)
            start = max(t, link_free.get((src, dst), 0.0))
            link_free[(src, dst)] = start + self.activation_bytes / bw
            push(link_free[(src, dst)] + lat, kind, dst, mb)

        while events:
            now, _, what, i, mb = heapq.heappop(events)
            if what == "done-forward":
                busy[i] = False
                if i + 1 < S:
                    send(now, i, i + 1, "forward", mb)
                else:  # the head: its backward goes first in line
                    heapq.heappush(ready[i], (0, seq, "backward", mb))
                    seq += 1
            elif what == "done-backward":
                busy[i] = False
                if i > 0:
                    send(now, i, i - 1, "backward", mb)
                else:
                    finished += 1
                    if admitted < M:
                        push(now, "forward", 0, admitted)
                        admitted += 1
            else:  # a forward or backward arrived at stage i
                heapq.heappush(ready[i], (0 if what == "backward" else 1, seq, what, mb))
                seq += 1
            if not busy[i] and ready[i]:
                _, _, kind, m = heapq.heappop(ready[i])
                busy[i] = True
                push(now + (fwd[i] if kind == "forward" else bwd[i]), f"done-{kind}", i, m)
        if finished != M:
            raise RuntimeError(f"pipeline model finished {finished} of {M} microbatches")
        return now

    def redundant_extra_s(self, grad_bytes: list[float] | None = None) -> float:
        """Extra seconds per step of redundant computation: the successor's forward per
        microbatch, then the successor's gradient shipped to its replica holder.
        `grad_bytes[j]`: stage j's fp32 gradient bytes (default: from the parameter count)."""
        grads = grad_bytes or [4.0 * p for p in stage_params(self.cfg)]
        ship = max(self.transfer_s(grads[(i + 1) % self.S], (i + 1) % self.S, i) for i in range(self.S))
        if not self.profile.pipelined:
            extra = self.M * sum(self.flops[(i + 1) % self.S] for i in range(self.S)) / self.profile.flops_per_s
            return self.profile.redundant_slowdown * extra + self.S * ship
        per_stage = [self.profile.redundant_slowdown * self.flops[(i + 1) % self.S] / self.profile.flops_per_s
                     for i in range(self.S)]
        return self.pipeline_s(extra_forward=per_stage) - self.pipeline_s() + ship

    def comm_busy_s(self) -> float:
        """Seconds per step the busiest link carries activations (both directions)."""
        worst = max([self._send_s(i, i + 1) for i in range(self.S)] + [self._send_s(i, i - 1) for i in range(self.S)])
        return 2 * self.M * worst

    def network_idle_s(self) -> float:
        """Seconds per step a link is free for background copies."""
        return max(0.0, self.step_s() - self.comm_busy_s())

    def background_stall_s(self, seconds: float, steps: int) -> float:
        """Stall of a background copy of `seconds` given `steps` steps of idle link time."""
        return max(0.0, seconds - steps * self.network_idle_s())

    def idle_windows(self) -> list[list[tuple[float, float]]]:
        """Per-stage GPipe idle windows of one step (BAFT schedules backups into them)."""
        return gpipe_idle_windows(self.S, self.M, self.t_f(), self.t_b())

    def hours(self, seconds: float) -> float:
        return seconds / 3600.0


def calibration(profile: str = "paper-geo") -> dict[str, float]:
    """paper-500m under `profile`: iteration time and redundant-computation iteration time."""
    cm = CostModel(preset("paper-500m"), profile)
    base = cm.step_s()
    plain = CostModel(cm.cfg, replace(cm.profile, redundant_slowdown=1.0))
    return {"step_s": base, "redundant_step_s": base + cm.redundant_extra_s(),
            "redundant_mechanistic_step_s": base + plain.redundant_extra_s(), "t_f": cm.t_f(), "t_b": cm.t_b(),
            "bottleneck_compute_share": cm.M * 3 * max(cm.flops) / cm.profile.flops_per_s / base}
