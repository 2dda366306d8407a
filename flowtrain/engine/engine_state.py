"""Saving and loading a whole engine: what goes into a checkpoint (model, optimizer, master
weights, scheduler, loss scaler, counters, dataloader position, random generators) and back."""

from __future__ import annotations

from typing import Any

from flowtrain.engine.checkpoint import load, resolve, save
from flowtrain.engine.dataloader import rng_state, set_rng_state
from flowtrain.log import get_logger

log = get_logger("flowtrain.checkpoint")


def save_engine(engine: Any, save_dir: str, tag: str | None = None,
                client_state: dict[str, Any] | None = None, save_latest: bool = True,
                exclude_frozen_parameters: bool = False) -> str:
    """Writes the model, optimizer, scheduler, loss scaler, counters, dataloader position
    and random generators; every rank must call it."""
    tag = tag if tag is not None else f"global_step{engine.global_steps}"
    shared = None
    if engine.global_rank == 0:
        module_state = engine.module.state_dict()
        if exclude_frozen_parameters:
            frozen = {n for n, p in engine.module.named_parameters() if not p.requires_grad}
            module_state = {k: v for k, v in module_state.items() if k not in frozen}
        shared = {
            "module": module_state,
            # With ZeRO each rank's optimizer holds only its shard: it goes in the rank's file.
            "optimizer": engine.optimizer.state_dict() if engine.zero is None else None,
            "zero_stage": engine.zero_stage,
            "master_weights": engine.master.state_dict() if engine.master is not None else None,
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None
            else None,
            "loss_scaler": engine.loss_scaler.state_dict(),
            "global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps, "micro_steps": engine.micro_steps,
            "dataloader": engine.training_dataloader.state_dict()
            if engine.training_dataloader is not None else None,
            "world_size": engine.world_size,
            "config": engine.config.to_dict(),
            "client_state": client_state or {},
        }
    per_rank = {"rng": rng_state(), "rank": engine.global_rank}
    if engine.zero is not None:
        per_rank["zero"] = engine.zero.state_dict()
    path = save(save_dir, tag, rank=engine.global_rank, shared=shared, per_rank=per_rank,
                barrier=engine._barrier, save_latest=save_latest)
    return str(path)


def load_engine(engine: Any, load_dir: str, tag: str | None = None,
                load_module_strict: bool = True, load_optimizer_states: bool = True,
                load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                custom_load_fn: Any = None) -> tuple[str | None, dict[str, Any] | None]:
    """Loads a checkpoint saved by ``save_checkpoint``; returns (path, client_state), or
    (None, None) when ``load_dir`` holds none, as DeepSpeed does."""
    path = resolve(load_dir, tag)
    if path is None:
        log.warning("no checkpoint to load: no 'latest' file", load_dir=str(load_dir))
        return None, None
    shared, per_rank = load(path, engine.global_rank)
    if not load_module_only:
        _check_zero_layout(engine, path, shared, per_rank)
    if custom_load_fn is not None:
        custom_load_fn(src=shared["module"], dst=engine.module)
    else:
        engine.module.load_state_dict(shared["module"], strict=load_module_strict)
    if not load_module_only:
        if engine.zero is not None:
            engine.zero.load_state_dict(per_rank["zero"], load_optimizer=load_optimizer_states)
        if load_optimizer_states:
            if engine.zero is None:
                engine.optimizer.load_state_dict(shared["optimizer"])
            if engine.master is not None and shared.get("master_weights") is not None:
                engine.master.load_state_dict(shared["master_weights"])
            engine.loss_scaler.load_state_dict(shared["loss_scaler"])
        if load_lr_scheduler_states and engine.lr_scheduler is not None and \
                shared.get("lr_scheduler") is not None:
            engine.lr_scheduler.load_state_dict(shared["lr_scheduler"])
        engine.global_steps = shared["global_steps"]
        engine.global_samples = shared["global_samples"]
        engine.skipped_steps = shared["skipped_steps"]
        engine.micro_steps = shared["micro_steps"]
        if engine.training_dataloader is not None and shared.get("dataloader") is not None:
            engine.training_dataloader.load_state_dict(shared["dataloader"])
        if per_rank is not None:
            set_rng_state(per_rank["rng"])
    elif engine.master is not None:
        engine.master.load_state_dict([p.detach().float() for p in engine.trainable])
    if engine.zero is not None and (load_module_only or per_rank["zero"]["master"] is None):
        engine.zero.reload_from_model()
    engine._zero_grads()
    return str(path), shared.get("client_state", {})


def _check_zero_layout(engine: Any, path: Any, shared: dict[str, Any],
                       per_rank: dict[str, Any] | None) -> None:
    """ZeRO checkpoints load only into the same stage and data-parallel world size for now."""
    saved_stage = shared.get("zero_stage", 0)
    saved_world = shared.get("world_size", engine.world_size)
    if (saved_stage or engine.zero_stage) and \
            (saved_stage != engine.zero_stage or saved_world != engine.world_size or
             (engine.zero is not None and (per_rank is None or "zero" not in per_rank))):
        raise ValueError(
            f"checkpoint {path} was saved with ZeRO stage {saved_stage} on {saved_world} "
            f"data-parallel ranks; this engine runs ZeRO stage {engine.zero_stage} on "
            f"{engine.world_size}. Loading optimizer state into a different stage or world size "
            f"(resharding) is not supported yet; load with load_module_only=True to take just "
            f"the model weights")
