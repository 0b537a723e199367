"""The simulator's executor of plans: it carries a strategy's `RecoveryPlan`s and protection (checkfree.plans)
out on the in-process stage workers, keeps the copies that protection took, and prices both with the cost
model (the swarm's coordinator carries the same plans out on peers: coordinator/recovery_driver.py).

The copies live here, one per stage (which stages' peers hold it is the `Copies` ledger's business): a snapshot
or backup's full state, reft's serialized snapshot and parity block, the replica of redundant computation, the
checkpoint files in storage (the swarm's layout, checkfree.strategies.storage), and snap's compressed copies
(checkfree.snapcodec: the holder's copy, which is also its owner's mirror, and the update in flight).
"""

from __future__ import annotations

import dataclasses
import time

from checkfree.baselines import Raim5Block, raim5_encode, raim5_recover
from checkfree.plans import (BackupSeal, BackupStart, Checkpoint, Copies, CopyPart, Failure, Holder, Init, Own, Parity,
                             ParitySnapshot, Protect, RecoveryPlan, RefreshReplicas, Replica, Snapshot, Storage,
                             StreamSent, StreamStep, TakeReplicas, abort_if_unrecoverable, plan_events)
from checkfree.recovery import rebuild_stage, recovered_optimizer_state
from checkfree.serialize import state_from_bytes, state_to_bytes
from checkfree.snapcodec import HeldCopy, apply_update, encode_update, restore_state, tree_nbytes
from checkfree.strategies import storage
from checkfree.strategies.base import FailureOutcome, Figures, Strategy, StrategyContext
from checkfree.strategies.state import StageState, state_nbytes, unit_nbytes, with_components

__all__ = ["SimExecutor", "part_nbytes"]


class SimExecutor:
    """Plans and protection carried out on the simulator's stage workers (`ctx`)."""

    def __init__(self, ctx: StrategyContext, strategy: Strategy) -> None:
        self.ctx, self.strategy, self.cost = ctx, strategy, ctx.cost
        self.copies = Copies()
        self.states: dict[int, StageState] = {}  # each stage's in-memory copy (a snapshot, a complete backup)
        self.blobs: dict[int, bytearray] = {}  # reft: each stage's serialized snapshot
        self.blocks: dict[int, Raim5Block] = {}  # reft: the parity block each stage's peer holds
        self.inflight: dict[int, StageState] = {}  # baft: the backup being sent
        self.replicas: dict[int, StageState] = {}  # redundant: each stage's replica, at its predecessor
        # recovery.optimizer own: each stage's own Adam state of its blocks, by parameter name, where a copy of it is
        # at hand when the stage is rebuilt (a study puts the lost stage's saved moments here; a snapshot could)
        self.own_optimizer: dict[int, dict[str, dict]] = {}
        self.held: dict[int, HeldCopy] = {}  # snap: each stage's compressed copy at its holder (and its mirror)
        self.updates: dict[int, tuple[tuple, dict]] = {}  # snap: each stage's update in flight (its key, the update)

    # ---- protection --------------------------------------------------------------------
    def start(self, step: int) -> None:
        """Before the first step: the protection every run starts with (redundant: the replicas), not priced."""
        for item in self.strategy.protection_at_start():
            self.protect(item, step)

    def prime(self, states: dict[int, StageState], step: int) -> None:
        """snap (experiments): every stage's copy complete at its holder, a full update of `states[stage]` (its
        state as of `step`), as if it had been streamed before."""
        strategy, fmt = self.strategy, self.strategy.copy_format
        assert fmt is not None, f"{strategy.name} streams no copies"
        for s, state in states.items():
            self.held[s] = apply_update(None, encode_update(state, step, fmt, None))
            strategy.copy_assumed(s, step)
            self.copies.sealed(s, step, (strategy.holder(s),))

    def before_step(self, step: int) -> None:
        """Before training `step`: the protection that travels inside it (snap: an update whose first part the step
        carries is encoded now, from the stage's state as it enters the step)."""
        item, fmt = self.strategy.in_step(step), self.strategy.copy_format
        if not isinstance(item, StreamStep):
            return
        assert fmt is not None, f"{self.strategy.name} streams parts of copies in no format"
        for s, part in item.parts.items():
            key = (part.step, part.kind, part.base)
            if part.part == 0 and self.updates.get(s, ((),))[0] != key:
                base = self.held.get(s) if part.kind == "delta" else None
                if part.kind == "delta" and (base is None or base.step != part.base):
                    raise AssertionError(f"stage {s}: a delta on the copy of step {part.base}, but the mirror is "
                                         f"{'none' if base is None else base.step}")
                self.updates[s] = (key, encode_update(self.ctx.capture(s, step), step, fmt, base))

    def after_step(self, step: int) -> Figures:
        """After committing `step`: what the step itself cost the strategy, then the protection due now."""
        figs = self.strategy.step_figures(self.ctx, step)
        for item in self.strategy.protection_due(step):
            figs = figs + self.protect(item, step + 1)
        return figs

    def protect(self, item: Protect, step: int) -> Figures:
        """Carry `item` out (`step`: the step every stage is ready to run) and price it."""
        ctx, cost, n = self.ctx, self.cost, self.ctx.num_stages
        if isinstance(item, Checkpoint):
            sizes = [storage.write_stage(ctx.storage_dir, item.step, s, state_to_bytes(ctx.capture(s, item.step)))
                     for s in range(n)]
            storage.seal(ctx.storage_dir, item.step, n)
            self.copies.checkpointed(item.step)
            return Figures(stall_s=max(cost.storage_s(b) for b in sizes), bytes_moved=sum(sizes))
        if isinstance(item, Snapshot):
            self.states = {s: ctx.capture(s, item.step) for s in range(n)}
            self.copies.taken(item.step, item.holders)
            return self._price_copies({s: state_nbytes(st) for s, st in self.states.items()}, item.holders)
        if isinstance(item, ParitySnapshot):
            return self._parity_snapshot(item)
        if isinstance(item, BackupStart):
            self.inflight = {s: ctx.capture(s, item.step) for s in range(n)}
            self.strategy.backup_taken({s: list(unit_nbytes(st).values()) for s, st in self.inflight.items()})
            return Figures(extra_memory_bytes=self.strategy.backup_memory({s: state_nbytes(st)
                                                                           for s, st in self.inflight.items()}))
        if isinstance(item, BackupSeal):
            self.states, self.inflight = self.inflight, {}
            self.copies.taken(item.step, item.holders)
            return Figures(extra_memory_bytes=self.strategy.backup_memory({s: state_nbytes(st)
                                                                           for s, st in self.states.items()}))
        if isinstance(item, StreamSent):
            return self._streamed(item)
        if isinstance(item, (RefreshReplicas, TakeReplicas)):
            stages = range(n) if isinstance(item, RefreshReplicas) else [(s + 1) % n for s in item.stages]
            self.replicas.update({s: ctx.capture(s, step) for s in stages})
            return Figures(extra_memory_bytes=max(state_nbytes(r) for r in self.replicas.values()))
        raise AssertionError(f"unknown protection {item!r}")

    def _streamed(self, item: StreamSent) -> Figures:
        """snap: every part the step carried arrived; an update whose last part it was is applied to its holder's
        copy (the owner's mirror), which is then complete. Priced as the parts' transfers in the step's idle link
        time (what does not fit stalls), and the holders' memory."""
        moved, slowest = 0, 0.0
        for s, part in item.parts.items():
            key, update = self.updates[s]
            n = part_nbytes(tree_nbytes(update), part)
            moved, slowest = moved + n, max(slowest, self.cost.transfer_s(n, s, part.holder))
            if self.strategy.copy_part_done(part):
                self.held[s] = apply_update(self.held.get(s) if part.kind == "delta" else None, update)
                del self.updates[s]
                self.copies.sealed(s, part.step, (part.holder,))
        memory = max(self.strategy.held_bytes(h) for h in range(self.ctx.num_stages))
        return Figures(stall_s=self.cost.background_stall_s(slowest, 1), bytes_moved=moved,
                       extra_memory_bytes=memory)

    def _price_copies(self, size: dict[int, int], holders: dict[int, tuple[int, ...]]) -> Figures:
        """Every stage sends its copy to its other holders in the links' idle time: what does not fit stalls."""
        stages = range(len(size))
        held = [sum(size[i] for i in stages if p in holders[i]) for p in stages]
        sends = {i: [(size[i], h) for h in holders[i] if h != i] for i in stages}
        slowest = max(sum(self.cost.transfer_s(b, i, h) for b, h in v) for i, v in sends.items())
        return Figures(stall_s=self.cost.background_stall_s(slowest, self.strategy.every),
                       bytes_moved=sum(b for v in sends.values() for b, _ in v), extra_memory_bytes=max(held))

    def _parity_snapshot(self, item: ParitySnapshot) -> Figures:
        """reft: every stage's serialized state, and the parity blocks of every group."""
        self.blobs = {s: state_to_bytes(self.ctx.capture(s, item.step)) for s in range(self.ctx.num_stages)}
        moved, slowest = 0, 0.0
        for g in item.parity_groups:
            for block in raim5_encode([self.blobs[s] for s in g]):
                self.blocks[g[block.holder]] = block
            for s in g:  # s sends one chunk of ~L/(n-1) to each other member
                chunk = -(-len(self.blobs[s]) // (len(g) - 1))
                moved += chunk * (len(g) - 1)
                slowest = max(slowest, sum(self.cost.transfer_s(chunk, s, p) for p in g if p != s))
        self.copies.taken(item.step, {s: (s,) for s in self.blobs})
        memory = max(len(self.blobs[s]) + len(self.blocks[s].parity) for s in self.blobs)
        return Figures(stall_s=self.cost.background_stall_s(slowest, self.strategy.every), bytes_moved=moved,
                       extra_memory_bytes=memory)

    # ---- recovery -----------------------------------------------------------------------
    def recover(self, step: int, failed: set[int]) -> FailureOutcome:
        """The strategy's plan for the failure of `failed` at the start of `step`, carried out: copies loaded, then
        stages rebuilt, events written, the protection due after it taken."""
        strategy, ctx = self.strategy, self.ctx
        strategy.interrupted()
        self.copies.lose(failed)
        if strategy.copy_format is not None:  # snap: the copies the lost peers held, and updates from or to them
            self.held = {s: c for s, c in self.held.items() if strategy.holder(s) not in failed}
            self.updates = {s: u for s, u in self.updates.items()
                            if s not in failed and strategy.holder(s) not in failed}
        plan = strategy.recovery_plan(Failure(step, frozenset(failed), dataclasses.replace(self.copies)))
        abort_if_unrecoverable(plan, strategy.name, ctx.event)
        loaded = self._load(plan) if plan.copied else None
        rebuilt, coeffs, took = self._rebuild(plan) if plan.rebuilt else (None, {}, {})
        for name, fields in plan_events(plan, strategy.name, ctx.cfg.recovery.omega_scope, coeffs):
            timing = {"recovery_time_s": took[fields["stage"]]} if name == "recovery" and fields["stage"] in took \
                else {}
            ctx.event(name, **fields, **timing)
        self.copies.recovered(plan)
        for item in plan.then:
            self.protect(item, plan.rollback_to if plan.rollback_to is not None else step)
        figs = _combine(loaded, rebuilt, strategy.restores_in_parallel)
        if plan.then:
            figs.bytes_moved += strategy.refill_bytes(plan, self._sizes(plan.then[0]))
        fb = plan.fallback
        return FailureOutcome(figs, plan.rollback_to, success=fb is None, fallback=None if fb is None else fb.name,
                              method=_method(plan))

    def _sizes(self, item: Protect) -> dict[int, int]:
        """Each stage's copy, in bytes, as the protection `item` keeps it."""
        if isinstance(item, ParitySnapshot):
            return {s: len(b) for s, b in self.blobs.items()}
        store = self.replicas if isinstance(item, TakeReplicas) else self.states
        return {s: state_nbytes(st) for s, st in store.items()}

    def _load(self, plan: RecoveryPlan) -> Figures:
        """Every stage of the plan that loads a copy (or its initial state) does; priced by its transfers."""
        ctx, cost = self.ctx, self.cost
        moved, slowest = 0, 0.0
        for s, src in plan.copied.items():
            if isinstance(src, Init):
                ctx.reset(s)
                continue
            if isinstance(src, Own):
                ctx.restore(s, self._own(s), replace=False)
                continue
            if isinstance(src, Parity):
                b, t = self._decode(s, src)
                moved, slowest = moved + b, max(slowest, t)
                continue
            if isinstance(src, Storage):
                blob = storage.read_stage(ctx.storage_dir, src.step, s)
                ctx.restore(s, state_from_bytes(blob), replace=s in plan.failed)
                moved, slowest = moved + len(blob), max(slowest, cost.storage_s(len(blob)))
                continue
            if isinstance(src, Holder) and src.form:  # snap: the compressed copy travels, the replacement decodes it
                ctx.restore(s, restore_state(self.held[s]), replace=True)
                b = self.held[s].nbytes()
                moved, slowest = moved + b, max(slowest, cost.transfer_s(b, src.holder, s))
                continue
            assert isinstance(src, (Holder, Replica)), src  # (a rebuild is not a copy)
            state, holder = (self.replicas[s], src.holder) if isinstance(src, Replica) else (self.states[s], src.holder)
            if isinstance(src, Holder) and src.edges:  # its components from the live co-holders
                state = with_components(state, {c: _parts(ctx.capture(h, state["step"])) for c, h in src.edges.items()})
            ctx.restore(s, state, replace=True)
            b = state_nbytes(state)
            moved, slowest = moved + b, max(slowest, cost.transfer_s(b, holder, s))
        lost = 0 if plan.rollback_to is None else plan.step - plan.rollback_to
        return Figures(bytes_moved=moved, lost_steps=lost, recovery_s=cost.recovery_s(slowest))

    def _own(self, stage: int) -> StageState:
        return state_from_bytes(self.blobs[stage]) if stage in self.blobs else self.states[stage]

    def _decode(self, stage: int, src: Parity) -> tuple[int, float]:
        """reft: the lost member's snapshot decoded from the group's survivors; (bytes, seconds) of the decode:
        each other member decodes one chunk from one chunk of every other survivor and sends it to the
        replacement, which then rebuilds its own parity block from one chunk of each other member."""
        g, cost = src.group, self.cost
        idx = {p: i for i, p in enumerate(g)}
        survivors = {idx[p]: self.blobs[p] for p in g if p != stage}
        blocks = {idx[p]: self.blocks[p] for p in g if p != stage}
        self.ctx.restore(stage, state_from_bytes(raim5_recover(idx[stage], survivors, blocks)), replace=True)
        chunk = -(-len(self.blobs[stage]) // (len(g) - 1))
        slowest = 0.0
        for p in (p for p in g if p != stage):
            gather = max((cost.transfer_s(chunk, q, p) for q in g if q not in (p, stage)), default=0.0)
            slowest = max(slowest, gather + cost.transfer_s(chunk, p, stage))
        return chunk * (len(g) - 1) * (len(g) - 1) + chunk * (len(g) - 1), slowest

    def _rebuild(self, plan: RecoveryPlan) -> tuple[Figures, dict[int, dict[int, float]], dict[int, float]]:
        """Rebuild every planned stage on a new peer from live stages' weights (and a replicated component's Adam
        state, copied with it); sources send in parallel. (figures, coefficients and seconds by stage)."""
        ctx, rc = self.ctx, self.ctx.cfg.recovery
        moved, slowest, coefficients, took = 0, 0.0, {}, {}
        for s, p in plan.rebuilt.items():
            t0 = time.perf_counter()
            blocks = {h: {k: v for k, v in ctx.weights(h).items() if k.startswith("blocks.")} for h in p.sources}
            edges = {c: {k: v for k, v in ctx.weights(h).items() if k.startswith(c + ".")}
                     for c, h in p.edge_sources.items()}
            edge_optim = {c: ctx.optimizer_state(h, c) for c, h in p.edge_sources.items()}
            state, coefficients[s] = rebuild_stage(p, ctx.template(s), blocks, {h: ctx.norm(h) for h in p.sources},
                                                   edges, eps=rc.eps, seed=ctx.cfg.train.seed + plan.step,
                                                   std=ctx.cfg.model.init_std)
            own = self.own_optimizer.get(s) if rc.optimizer == "own" else None
            if rc.optimizer == "own" and own is None:
                ctx.event("warning", step=plan.step, stage=s,
                          message="recovery.optimizer own: no copy of the lost stage's Adam state; it starts fresh")
            ctx.load_recovered(s, state, rc.lr_scale, recovered_optimizer_state(p, edge_optim, own))
            sends = [(h, _nbytes(sd)) for h, sd in blocks.items()] + [
                (p.edge_sources[c], _nbytes(sd) + state_nbytes(edge_optim[c])) for c, sd in edges.items()]
            moved += sum(b for _, b in sends)
            slowest = max([slowest] + [self.cost.transfer_s(b, h, s) for h, b in sends])
            took[s] = round(time.perf_counter() - t0, 6)
        return Figures(bytes_moved=moved, recovery_s=self.cost.recovery_s(slowest)), coefficients, took


def part_nbytes(total: int, part: CopyPart) -> int:
    """The bytes of a streamed update of `total` bytes that `part` carries: [p/parts, (p+1)/parts) of them."""
    return total * (part.part + 1) // part.parts - total * part.part // part.parts


def _nbytes(sd: dict) -> int:
    return sum(v.numel() * v.element_size() for v in sd.values())


def _parts(state: StageState) -> tuple[dict, dict]:
    """A captured state's weights and Adam state, by name (a donor of replicated components)."""
    return state["model"], state["optim"]["state"]


def _combine(loaded: Figures | None, rebuilt: Figures | None, parallel: bool) -> Figures:
    """The copies, then the rebuilds: one after the other, or (`parallel`) at the same time (the slower one)."""
    if loaded is None or rebuilt is None:
        return loaded or rebuilt or Figures()
    both = loaded + rebuilt
    if parallel:
        both.recovery_s = max(loaded.recovery_s, rebuilt.recovery_s)
    return both


def _method(plan: RecoveryPlan) -> str:
    """How a failure was handled, in a word or two (the simulator's failure_outcome event)."""
    parts = []
    copied = set(map(type, plan.copied.values()))
    if plan.rollback_to is not None:
        parts.append("rollback-storage" if Storage in copied else "rollback-memory")
    elif Replica in copied:
        parts.append("promote-replica")
    elif Holder in copied:
        parts.append("snapshot")
    rebuilt = list(plan.rebuilt.values())
    fb = plan.fallback
    if rebuilt and (fb is None or len(fb.reasons) < len(rebuilt)):
        parts.append(rebuilt[0].method)
    if rebuilt and fb is not None and fb.name not in ("checkpoint", "abort"):
        parts.append(f"fallback-{fb.name}")
    return "+".join(parts)

