"""The parts of the engine's DeepSpeed surface that only read its state or hand it to other
modules: accessors, checkpoints, memory figures and whole-model views under ZeRO stage 3."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from flowtrain.checkpoint.checkpointer import load_engine, save_engine
from flowtrain.checkpoint.protocol import Stateful

if TYPE_CHECKING:
    from flowtrain.checkpoint.background import BackgroundWriter
    from flowtrain.config.model import FlowtrainConfig
    from flowtrain.engine.bucket_order import BucketOrder
    from flowtrain.engine.buckets import GradBuckets
    from flowtrain.engine.dataloader import DistributedLoader
    from flowtrain.engine.embedding_rows import EmbeddingRows
    from flowtrain.engine.mixed import MasterWeights
    from flowtrain.parallel.grid import ProcessGrid
    from flowtrain.plan.spec import TrainingSpec
    from flowtrain.plan.step_plan import StepPlan
    from flowtrain.precision.loss_scaler import LossScaler
    from flowtrain.zero.sharded import ZeroOptimizer
    from flowtrain.zero.stage3 import Stage3Params


class LRScheduler(Stateful, Protocol):
    """What the engine asks of an lr scheduler: a step after each optimizer step that is not
    skipped, and the state a checkpoint keeps."""

    def step(self) -> None: ...


def job_world_size() -> int:
    """How many ranks the whole job has (every data, pipeline and tensor-parallel rank)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class EngineSurface:
    """Mixed into FlowtrainEngine (which provides the attributes used here)."""

    # Set by FlowtrainEngine.__init__; declared here (annotations only, no class attributes)
    # so that the methods below are checked against them, and so that the mixin is the
    # CheckpointableEngine that save_checkpoint and load_checkpoint hand on.
    module: torch.nn.Module
    config: FlowtrainConfig  # recorded beside checkpoints, never read for a decision
    spec: TrainingSpec
    optimizer: torch.optim.Optimizer
    trainable: list[torch.nn.Parameter]
    buckets: GradBuckets
    master: MasterWeights | None
    zero: ZeroOptimizer | None
    stage3: Stage3Params | None
    transient: bool
    global_rank: int
    loss_scaler: LossScaler
    _global_grad_norm: float | None
    _names: list[str]
    zero_stage: int
    precision: str
    lr_scheduler: LRScheduler | None
    training_dataloader: DistributedLoader | None
    world_size: int
    dp_rank: int
    model_parallel: bool
    grid: ProcessGrid | None
    global_steps: int
    global_samples: int
    skipped_steps: int
    micro_steps: int
    plan: StepPlan
    _order: BucketOrder
    _rows: EmbeddingRows | None

    if TYPE_CHECKING:
        # FlowtrainEngine's own; for the type checker only, since a method defined here would
        # come before torch.nn.Module's in the engine's method order.
        def zero_grad(self, set_to_none: bool = False) -> None: ...

        def _use_bucket_order(self, order: list[int]) -> bool: ...

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds, by kind: parameters, gradients (stage 2: the rank's
        gradient shard and the bucket buffers backward accumulates into), optimizer state,
        fp32 master weights and their gradients; and the process's resident set size."""
        from flowtrain.zero.sharded import optimizer_state_bytes, process_rss

        if self.zero is not None:
            out = self.zero.memory_breakdown()
        else:
            def nbytes(ts: Any) -> int:
                return sum(t.numel() * t.element_size() for t in ts)

            out = {"parameters": nbytes(self.trainable),
                   "gradient_buckets": nbytes(self.buckets.flat), "gradient_shards": 0,
                   "master_weights": nbytes(self.master.master) if self.master else 0,
                   "master_gradients": nbytes(self.master.flat) if self.master else 0}
        trainable = {id(p) for p in self.trainable}
        out["parameters"] += sum(p.numel() * p.element_size() for p in self.module.parameters()
                                 if id(p) not in trainable)
        out["gradients"] = out["gradient_buckets"] + out["gradient_shards"]
        # transient buckets (stages 2-3) are communication buffers, not model states
        grads = out["gradient_shards"] if self.transient else out["gradients"]
        out["optimizer_state"] = optimizer_state_bytes(self.optimizer)
        out["total"] = out["parameters"] + out["gradients"] + out["optimizer_state"] + \
            out["master_weights"] + out["master_gradients"]
        out["model_states"] = out["parameters"] + grads + out["optimizer_state"] + \
            out["master_weights"] + out["master_gradients"]
        out["process_rss"] = process_rss()
        return out

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[None]:
        """Under ZeRO stage 3, every parameter whole inside the block (like DeepSpeed's
        GatheredParameters over the whole model); every rank must enter it. Changes made
        inside are not written back to the shards."""
        if self.stage3 is None:
            yield
            return
        self.stage3.gather_all()
        try:
            yield
        finally:
            self.stage3.release_all()

    def module_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's whole state_dict on every rank, also under ZeRO stage 3 (collective)."""
        with self.gathered_parameters():
            return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Rank 0 writes the model's whole state_dict in its training dtype (DeepSpeed's
        name; under stage 3 this gathers, as stage3_gather_16bit_weights_on_model_save does).
        Every rank must call it; returns True where the file was written."""
        from flowtrain.checkpoint.atomic import save_file

        state = self.module_state_dict()
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        if self.global_rank != 0:
            return False
        os.makedirs(save_dir, exist_ok=True)
        path = os.path.join(save_dir, save_filename)
        tmp = f"{path}.tmp{os.getpid()}"
        save_file(state, Path(tmp))
        os.replace(tmp, path)
        return True

    # -- accessors DeepSpeed scripts use ---------------------------------------------------------

    def train(self, mode: bool = True) -> Any:
        self.module.train(mode)
        self.training = mode
        return self

    def eval(self) -> Any:
        return self.train(False)

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return self._global_grad_norm

    def train_batch_size(self) -> int:
        return self.spec.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.spec.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.spec.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether this micro-batch ends the step: every gradient_accumulation_steps-th one,
        unless ``set_gradient_accumulation_boundary`` said otherwise."""
        told = getattr(self, "_boundary_told", None)
        if told is not None:
            return bool(told)
        return (self.micro_steps + 1) % self.spec.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's manual override (what accelerate calls): the next backward and step
        treat this micro-batch as ending the step exactly when ``is_boundary`` is true. Set it
        before each micro-batch's forward."""
        self._boundary_told = bool(is_boundary)

    def zero_optimization_stage(self) -> int:
        return self.zero_stage

    def fp16_enabled(self) -> bool:
        return self.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.precision == "bf16"

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """The config's stage3_gather_16bit_weights_on_model_save (what HF's Trainer asks
        before saving a ZeRO-3 model as one file)."""
        return self.spec.checkpoint.gather_16bit_on_save

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False,
                                             ) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict in its training dtype on rank 0, None on the others,
        as DeepSpeed's; every rank must call it (it gathers under stage 3)."""
        state = self.module_state_dict()
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return state if self.global_rank == 0 else None

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    @property
    def param_names(self) -> list[str]:
        """The name of each trainable parameter (``trainable``'s order), as the module names it."""
        return self._names

    # -- checkpoints -------------------------------------------------------------------------------

    # Set by flowtrain.initialize when checkpoint.auto_resume loaded a checkpoint: its path and
    # the client_state saved with it (what load_checkpoint would have returned); else None.
    resumed_checkpoint: str | None = None
    resumed_client_state: dict[str, Any] | None = None
    # checkpoint.async_save's writer, made at the first save
    checkpoint_writer: BackgroundWriter | None = None

    def bucket_layout(self) -> list[int]:
        """The index (in ``trainable``) of each parameter, in the order the buckets hold them."""
        return [slot.index for bucket in self.plan.buckets for slot in bucket.slots]

    def layout_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of how this engine reduces its gradients: the settled bucket
        order (``BucketOrder.saved``) and whether the tied embedding's split is on (None
        without one)."""
        return {"bucket_order": self._order.saved(self.bucket_layout()),
                "tied_rows_split": self._rows.enabled if self._rows is not None else None}

    def adopt_layout_state(self, state: dict[str, Any]) -> None:
        """A checkpoint's ``layout_state`` (every rank loads the same one). A split the saved
        run had switched off stays off from the first step here, which then reduces the tied
        gradient densely as that run did; a settled order the buckets are rebuilt in, and not
        observed again."""
        if state.get("tied_rows_split") is False and self._rows is not None:
            self._rows.enabled = False
        order = state.get("bucket_order")
        if order is not None and self._order.adopt(order, len(self.trainable)):
            self._use_bucket_order(order)
            self.buckets.observed_order.clear()

    def save_checkpoint(self, save_dir: str | None = None, tag: str | None = None,
                        client_state: dict[str, Any] | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> str:
        """Writes the model, optimizer, scheduler, loss scaler, counters, dataloader position
        and random generators atomically (into the config's checkpoint.save_dir when
        ``save_dir`` is not given); every rank must call it."""
        directory = save_dir if save_dir is not None else self.spec.checkpoint.save_dir
        if directory is None:
            raise ValueError("save_checkpoint needs a directory: pass save_dir, or set "
                             "checkpoint.save_dir in the config")
        if self.spec.checkpoint.async_save and self.checkpoint_writer is None:
            from flowtrain.checkpoint.background import BackgroundWriter

            self.checkpoint_writer = BackgroundWriter()
        return save_engine(self, directory, tag, client_state, save_latest,
                           exclude_frozen_parameters, writer=self.checkpoint_writer)

    def wait_for_checkpoint(self) -> None:
        """Returns once the checkpoint being written in the background (checkpoint.async_save)
        is published; raises its error if that save failed. At once without one."""
        if self.checkpoint_writer is not None:
            self.checkpoint_writer.wait()

    def load_checkpoint(self, load_dir: str, tag: str | None = None,
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn: Any = None) -> tuple[str | None, dict[str, Any] | None]:
        """Loads a checkpoint saved by ``save_checkpoint``; returns (path, client_state), or
        (None, None) when ``load_dir`` holds none, as DeepSpeed does."""
        self.wait_for_checkpoint()  # it may be the checkpoint being written
        return load_engine(self, load_dir, tag, load_module_strict, load_optimizer_states,
                           load_lr_scheduler_states, load_module_only, custom_load_fn)

    def job_barrier(self, name: str) -> None:
        """Waits for every rank of the job, not only this rank's data-parallel group: with
        pipeline or tensor parallelism ``world_size`` is the group's size (1 when there is no
        data parallelism) while every stage still writes into the same checkpoint."""
        if job_world_size() > 1:
            from flowtrain.runtime.rank import current_rank

            current_rank().barrier(name)
