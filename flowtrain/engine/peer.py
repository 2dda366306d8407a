"""The engine under ``flowtrain launch --peer-recovery``: dropping a step when the group loses
a rank, re-forming the process group, and handing a replacement the training state (a mixin
of ``FlowtrainEngine``: a re-formed group rebuilds most of the engine's parts, so these methods
work on the engine itself)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from flowtrain.engine.strategy import strategy_for
from flowtrain.log import get_logger

if TYPE_CHECKING:
    from flowtrain.engine.buckets import GradBuckets
    from flowtrain.engine.parts import EngineParts
    from flowtrain.engine.strategy import Strategy
    from flowtrain.engine.surface import LRScheduler
    from flowtrain.parallel.grid import ProcessGrid
    from flowtrain.plan.spec import TrainingSpec
    from flowtrain.plan.step_plan import StepPlan
    from flowtrain.precision.loss_scaler import LossScaler
    from flowtrain.zero.sharded import ZeroOptimizer

log = get_logger("flowtrain.engine")


class PeerRecovery:
    # Set by FlowtrainEngine.__init__; declared for the checks of the methods below.
    peer: Any
    step_dropped: bool
    world_size: int
    global_rank: int
    dp_rank: int
    zero: ZeroOptimizer | None
    zero_stage: int
    _layout: list[int]
    _mirrored: bool
    _groups: Any
    trainable: list[torch.nn.Parameter]
    buckets: GradBuckets
    plan: StepPlan
    model_parallel: bool
    grid: ProcessGrid | None
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: LRScheduler | None
    loss_scaler: LossScaler
    global_steps: int
    global_samples: int
    micro_steps: int
    skipped_steps: int
    reducer: Any
    _parts: EngineParts
    spec: TrainingSpec
    strategy: Strategy
    _losses: Any
    _runtime: Any
    health: Any
    # methods of the engine's other parts (annotations only: a stub here would shadow them)
    _spawn_reducer: Callable[[], None]
    _broadcast_model: Callable[[], None]
    _zero_grads: Callable[[], None]
    _make_plan: Callable[..., Any]
    _make_buckets: Callable[[Any], Any]

    def _peer_group(self) -> Any:
        """The process's PeerGroup under ``launch --peer-recovery`` (data parallelism with
        ZeRO stages 0-2, no offload), else None."""
        from flowtrain import peer_recovery

        if not peer_recovery.enabled() or not dist.is_initialized():
            return None
        offload = self.spec.offload_optimizer != "none" or self.spec.offload_params != "none"
        if not self.strategy.peer_recoverable or self.model_parallel or self.grid is not None:
            what = f"ZeRO stage {self.zero_stage}" + (" with offload" if offload else "") + \
                (" and model parallelism" if self.model_parallel else "")
            raise ValueError(f"flowtrain launch --peer-recovery recovers data-parallel replicas "
                             f"with ZeRO stages 0-2 without offload; this engine has {what}: "
                             f"use --max-restarts (restart from a checkpoint) instead")
        group = peer_recovery.group()
        # the launch ranks ZeRO's shards are cut for, in group order
        self._layout = list(group.members)
        return group

    def _peer_vote(self, reduced: bool, error: str | None) -> dict[str, Any] | None:
        """Under --peer-recovery, the commit vote on this step once its gradients are reduced
        (a lone member votes too: a replacement enters the group after a committed step);
        a dropped step is dropped here. The verdict, or None without a vote."""
        if self.peer is None or not (reduced or self.world_size == 1):
            return None
        verdict: dict[str, Any] = self.peer.should_commit(self.global_steps, error is None)
        if not verdict.get("commit"):
            self._peer_drop(verdict, error)
        return verdict

    def _peer_drop(self, verdict: dict[str, Any], error: str | None) -> None:
        """The coordinator dropped this step (a rank was lost while it ran): nothing of it is
        kept; the survivors re-form the group and the script redoes the step."""
        assert self.peer is not None
        self.step_dropped = True
        self.peer.dropped_steps += 1
        self._losses.clear()
        self._zero_grads()
        self.micro_steps -= self.spec.gradient_accumulation_steps
        log.warning("step dropped: the group lost a rank; re-forming it",
                    step=self.global_steps + 1, reduce_error=error, members=verdict.get("members"),
                    generation=verdict.get("generation"))
        self._peer_reform(int(verdict["generation"]), list(verdict["members"]), joined=[])

    def _peer_reform(self, generation: int, members: list[int], *, joined: list[int],
                     abandon: bool = False) -> None:
        """Moves the engine onto the generation's process group; when replacement ranks
        joined, the lowest member sends them the model and the training state."""
        assert self.peer is not None
        if self.reducer is not None:
            self._runtime.stop_actor(self.reducer.name)
            self.reducer = None
        joined = self.peer.reform(generation, members, joined, abandon)
        self._adopt_group()
        if not joined and self.zero is None:
            return
        try:
            if joined:
                self._broadcast_model()
                self._peer_sync_state(load=False)
            if self.zero is not None:
                self._zero_regroup(self._layout)
        except RuntimeError as exc:  # GroupChanged too
            # a replacement (or, exchanging ZeRO's shards, another member) died while the state
            # moved: the coordinator announces the group without it (the weights here were not
            # changed: the source's are the same, and ZeRO's layout changes only once every
            # shard arrived); a survivor whose broadcasts went through meets the others at its
            # next step, which the coordinator drops
            announced = self.peer.next_generation()
            log.warning("a replacement was lost while it joined; re-forming without it"
                        if joined else "a member was lost while ZeRO's shards moved; "
                        "re-forming without it",
                        error=str(exc)[:300], members=announced.get("members"))
            self._peer_reform(int(announced["generation"]), list(announced["members"]),
                              joined=[], abandon=True)

    def _adopt_group(self) -> None:
        self.world_size = dist.get_world_size()
        self.global_rank = dist.get_rank()
        self.dp_rank = dist.get_rank()
        # the same decisions over the group's new size (the mirror, decided at the start, stays)
        self.spec = self.spec.replace(dp=self.world_size)
        self.strategy = strategy_for(self.spec)
        self._parts = dataclasses.replace(self._parts, spec=self.spec,
                                          world_size=self.world_size, dp_rank=self.dp_rank)
        self.health.parts = self._parts
        if self.world_size > 1 and self.zero is None:  # ZeRO's after its shards are re-cut
            self._spawn_reducer()

    def _zero_regroup(self, layout: list[int], described: list[dict[str, Any]] | None = None,
                      *, force: bool = False) -> None:
        """ZeRO-1/2 on the generation's group: the whole optimizer state, cut for the launch
        ranks ``layout``, rebuilt from its holders (each shard's owner, or the predecessor
        that mirrors it), then this rank's new shard and mirror taken from it. A replacement
        passes the layout and the state's ``described`` form it was sent; ``force`` re-cuts
        an unchanged group (the mirrors after a checkpoint load)."""
        from flowtrain.zero import mirror as zm

        assert self.peer is not None
        members = list(self.peer.members)
        if self.reducer is not None:
            self._runtime.stop_actor(self.reducer.name)
            self.reducer = None
        if layout != members or force:
            zero = self.zero
            assert zero is not None and zero.optimizer is not None  # ZeRO-1/2 regroups
            optimizer = zero.optimizer
            holding = zm.holders(layout, members)
            me = members.index(self.peer.rank.env.rank)
            mine_at = layout.index(members[me]) if members[me] in layout else None

            def mine(k: int, mirrored: bool) -> list[dict[str, Any]]:
                if mirrored:
                    assert zero.mirror is not None and mine_at is not None and \
                        (mine_at + 1) % len(layout) == k
                    return zm.shard_state(zero.mirror.master, zero.mirror.optimizer)
                assert mine_at == k
                return zm.shard_state(zero.master, optimizer)

            if described is None:
                described = zm.describe(zm.shard_state(zero.master, optimizer))
            whole = zm.assemble([b.numel for b in zero.plan], described, len(layout), holding,
                                me, mine, self.peer.broadcast, zero.device)
            self._zero_rebuild(whole)
            log.warning("ZeRO shards re-cut for the group", layout=layout, members=members,
                        from_mirrors=[k for k, (_, m) in enumerate(holding) if m])
        self._layout = members
        if self.world_size > 1:
            self._spawn_reducer()

    def peer_after_load(self) -> None:
        """After a checkpoint load under --peer-recovery with ZeRO-1/2: each rank's mirror
        takes what its neighbour just loaded (a mirror is in no checkpoint)."""
        if self.peer is not None and self.zero is not None and self.zero.mirror is not None:
            self._zero_regroup(self._layout, force=True)

    def _zero_rebuild(self, whole: list[dict[str, Any]]) -> None:
        """New buckets and ZeroOptimizer for this group's size and rank, loaded from the
        buckets' ``whole`` state (``flowtrain.zero.mirror.assemble``)."""
        from flowtrain.zero import mirror as zm
        optimizer = self.optimizer
        self.buckets.remove_hooks()
        # the user's optimizer back on the model's parameters and without state, as it was
        # handed to build_zero at the start
        optimizer.state.clear()
        for g, group in enumerate(optimizer.param_groups):
            group["params"] = [p for p, gi in zip(self.trainable, self._groups) if gi == g]
        self.plan = self._make_plan(order=None)
        self.buckets = self._make_buckets(self.plan)
        self.zero, _ = self.strategy.build(self._parts, self.buckets, optimizer)
        zero = self.zero
        assert zero is not None, "a ZeRO-1/2 rebuild makes a ZeroOptimizer"
        numels = [b.numel for b in zero.plan]
        zm.load_state(zero.master, optimizer,
                      [zm.take(w, s, n) for w, s, n in zip(whole, zero.shards, numels)],
                      copy_masters=not zero.aliased)
        if zero.mirror is not None:
            zm.load_state(zero.mirror.master, zero.mirror.optimizer,
                          [zm.take(w, s, n) for w, s, n in zip(whole, zero.mirror.shards, numels)],
                          copy_masters=True)
        self.health.zero = zero

    def peer_state(self) -> dict[str, Any]:
        """What a replacement rank takes from a healthy peer besides the weights."""
        scaler = self.loss_scaler
        zero = None
        if self.zero is not None:  # the replacement takes its shard in _zero_regroup
            from flowtrain.zero import mirror as zm

            zero = {"layout": self._layout, "described": zm.describe(
                zm.shard_state(self.zero.master, self.optimizer))}
        return {
            "optimizer": self.optimizer.state_dict() if self.zero is None else None,
            "zero": zero,
            "lr_scheduler": self.lr_scheduler.state_dict()
            if self.lr_scheduler is not None and hasattr(self.lr_scheduler, "state_dict")
            else None,
            "loss_scaler": scaler.state_dict() if hasattr(scaler, "state_dict") else None,
            "counters": {"global_steps": self.global_steps,
                         "global_samples": self.global_samples,
                         "skipped_steps": self.skipped_steps, "micro_steps": self.micro_steps},
        }

    def _peer_sync_state(self, load: bool) -> None:
        """The state source (the lowest member that is no replacement) broadcasts
        ``peer_state()``; a replacement (``load``) takes it, the other survivors hold the same
        values already."""
        import io

        peer = self.peer
        assert peer is not None
        source = peer.source
        size = torch.zeros(1, dtype=torch.int64)
        data = torch.empty(0, dtype=torch.uint8)
        if self.dp_rank == source:
            buffer = io.BytesIO()
            torch.save(self.peer_state(), buffer)
            data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
            size[0] = data.numel()
        peer.broadcast(size, source, "the training state's size")
        if self.dp_rank != source:
            data = torch.empty(int(size[0]), dtype=torch.uint8)
        peer.broadcast(data, source, "the training state")
        if self.dp_rank == source or not load:
            return
        state = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
        if state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if state["lr_scheduler"] is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if state["loss_scaler"] is not None and hasattr(self.loss_scaler, "load_state_dict"):
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        for name, value in state["counters"].items():
            setattr(self, name, value)
        if state.get("zero") is not None:
            self._zero_regroup(list(state["zero"]["layout"]), state["zero"]["described"])
        log.warning("took the model and training state from a peer",
                    global_steps=self.global_steps, generation=self.peer.generation
                    if self.peer is not None else None)

    def peer_join(self) -> None:
        """A replacement rank, once its engine and scheduler exist (``initialize``): takes
        the training state from the lowest member (the weights came in the constructor)."""
        from flowtrain import peer_recovery

        if self.peer is not None and peer_recovery.joining():
            self._peer_sync_state(load=True)
