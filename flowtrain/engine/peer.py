"""The engine under ``flowtrain launch --peer-recovery``: dropping a step when the group loses
a rank, re-forming the process group, and handing a replacement the training state (a mixin
of ``FlowtrainEngine``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from flowtrain.log import get_logger

log = get_logger("flowtrain.engine")


class PeerRecovery:
    # Set by FlowtrainEngine.__init__; declared for the checks of the methods below.
    peer: Any
    step_dropped: bool
    world_size: int
    global_rank: int
    dp_rank: int
    zero: Any
    zero_stage: int
    model_parallel: bool
    grid: Any
    config: Any
    module: torch.nn.Module
    optimizer: Any
    lr_scheduler: Any
    loss_scaler: Any
    global_steps: int
    global_samples: int
    micro_steps: int
    skipped_steps: int
    reducer: Any
    _parts: Any
    _losses: Any
    _order_settled: bool
    _runtime: Any
    health: Any
    # methods of the engine's other parts (annotations only: a stub here would shadow them)
    _spawn_reducer: Callable[[], None]
    _broadcast_model: Callable[[], None]
    _zero_grads: Callable[[], None]

    def _peer_group(self) -> Any:
        """The process's PeerGroup under ``launch --peer-recovery`` (data parallelism with
        ZeRO stage 0 only), else None."""
        from flowtrain import peer_recovery

        if not peer_recovery.enabled() or not dist.is_initialized():
            return None
        if self.zero_stage or self.model_parallel or self.grid is not None:
            raise ValueError(f"flowtrain launch --peer-recovery recovers data-parallel replicas "
                             f"with ZeRO stage 0; this engine has ZeRO stage {self.zero_stage}"
                             f"{' and model parallelism' if self.model_parallel else ''}: "
                             f"use --max-restarts (restart from a checkpoint) instead")
        return peer_recovery.group()

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
        self.micro_steps -= self.config.grad_accum
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
        if not joined:
            return
        try:
            self._broadcast_model()
            self._peer_sync_state(load=False)
        except RuntimeError as exc:  # GroupChanged too
            # a replacement died while it was being sent the state: the coordinator announces
            # the group without it (the weights here were not changed: the source's are the
            # same); a survivor whose broadcasts went through meets the others at its next
            # step, which the coordinator drops
            announced = self.peer.next_generation()
            log.warning("a replacement was lost while it joined; re-forming without it",
                        error=str(exc)[:300], members=announced.get("members"))
            self._peer_reform(int(announced["generation"]), list(announced["members"]),
                              joined=[], abandon=True)

    def _adopt_group(self) -> None:
        self.world_size = dist.get_world_size()
        self.global_rank = dist.get_rank()
        self.dp_rank = dist.get_rank()
        self._parts = dataclasses.replace(self._parts, world_size=self.world_size,
                                          dp_rank=self.dp_rank)
        self.health.parts = self._parts
        if self.world_size > 1:
            self._spawn_reducer()

    def peer_state(self) -> dict[str, Any]:
        """What a replacement rank takes from a healthy peer besides the weights."""
        scaler = self.loss_scaler
        return {
            "optimizer": self.optimizer.state_dict(),
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
        self.optimizer.load_state_dict(state["optimizer"])
        if state["lr_scheduler"] is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if state["loss_scaler"] is not None and hasattr(self.loss_scaler, "load_state_dict"):
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        for name, value in state["counters"].items():
            setattr(self, name, value)
        log.warning("took the model and training state from a peer",
                    global_steps=self.global_steps, generation=self.peer.generation
                    if self.peer is not None else None)

    def peer_join(self) -> None:
        """A replacement rank, once its engine and scheduler exist (``initialize``): takes
        the training state from the lowest member (the weights came in the constructor)."""
        from flowtrain import peer_recovery

        if self.peer is not None and peer_recovery.joining():
            self._peer_sync_state(load=True)
