"""Saving and loading a whole engine: the parameters and optimizer state through
torch.distributed.checkpoint (``save``, ``load``), and beside them the scheduler, loss scaler,
counters, dataloader position and random generators; a checkpoint loads into any world size
and ZeRO stage."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowtrain.checkpoint.atomic import TENSOR_DIR, load, resolve, save
from flowtrain.checkpoint.manifest import CheckpointError, raise_problems, verify_part
from flowtrain.engine.dataloader import rng_state, set_rng_state
from flowtrain.log import get_logger

if TYPE_CHECKING:
    from flowtrain.checkpoint.background import BackgroundWriter
    from flowtrain.checkpoint.protocol import CheckpointableEngine

log = get_logger("flowtrain.checkpoint")


def save_engine(engine: CheckpointableEngine, save_dir: str, tag: str | None = None,
                client_state: dict[str, Any] | None = None, save_latest: bool = True,
                exclude_frozen_parameters: bool = False,
                writer: BackgroundWriter | None = None) -> str:
    """Writes the parameters, optimizer, scheduler, loss scaler, counters, dataloader position
    and random generators; every rank must call it, and writes only what it holds. With a
    ``writer`` (checkpoint.async_save) it returns once the state is in host memory, after
    waiting for the previous save; the writer's thread writes and publishes it."""
    # torch.distributed.checkpoint is imported on the first save or load, not with the engine
    from flowtrain.checkpoint.save import FORMAT, snapshot, write

    tag = tag if tag is not None else f"global_step{engine.global_steps}"
    if writer is not None:
        writer.wait()
    tensors, description = snapshot(engine, exclude_frozen_parameters, writer)
    shared = None
    if engine.global_rank == 0:
        loader = engine.training_dataloader
        shared = {
            "format": FORMAT, "tensors": description,
            "zero_stage": engine.zero_stage, "world_size": engine.world_size,
            "precision": engine.precision,
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None
            else None,
            "loss_scaler": engine.loss_scaler.state_dict(),
            "loss_scaler_kind": type(engine.loss_scaler).__name__,
            "global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps, "micro_steps": engine.micro_steps,
            "gradient_accumulation_steps": engine.spec.gradient_accumulation_steps,
            # the resumed run reduces its gradients as this one did: the same sums
            "layout": engine.layout_state() if hasattr(engine, "layout_state") else None,
            # world size and batch size say how far into the epoch the ranks are together
            "dataloader": {**loader.state_dict(), "world_size": engine.world_size,
                           "batch_size": loader.batch_size} if loader is not None else None,
            "config": engine.config.to_dict(),
            "client_state": client_state or {},
        }
    per_rank = {"rng": rng_state(), "rank": engine.global_rank}
    if writer is None:
        path = save(save_dir, tag, rank=engine.global_rank, shared=shared, per_rank=per_rank,
                    barrier=engine.job_barrier, save_latest=save_latest,
                    write_tensors=lambda directory: write(tensors, directory))
        return str(path)
    staged = writer.stage(tensors)
    group = writer.process_group()
    path = save(save_dir, tag, rank=engine.global_rank, shared=shared, per_rank=per_rank,
                barrier=engine.job_barrier, save_latest=save_latest,
                write_tensors=lambda directory: write(staged, directory, group),
                run_later=lambda rest: writer.start(tag, rest))
    return str(path)


def auto_resume(engine: CheckpointableEngine) -> tuple[str | None, dict[str, Any] | None]:
    """``checkpoint.auto_resume``: loads the latest complete checkpoint of the config's
    ``checkpoint.save_dir``; (None, None), a fresh start, when it holds none yet. Every rank
    calls it, and every rank must see the same checkpoint (a shared file system)."""
    from flowtrain.checkpoint.dcp_io import all_gather_objects

    directory = engine.spec.checkpoint.save_dir
    if not engine.spec.checkpoint.auto_resume or directory is None:
        return None, None
    path = resolve(directory, None)
    seen = all_gather_objects(str(path) if path is not None else None)
    if len(set(seen)) > 1:
        found = ", ".join(f"rank {r}: {p or 'none'}" for r, p in enumerate(seen))
        raise CheckpointError(f"checkpoint.auto_resume: the ranks see different latest "
                              f"checkpoints in checkpoint.save_dir {directory!r} ({found}); "
                              f"save_dir must be on a file system every rank shares")
    if path is None:
        if engine.global_rank == 0:
            log.info("checkpoint.auto_resume: no checkpoint in checkpoint.save_dir yet; "
                     "starting fresh", save_dir=str(directory), console=True)
        return None, None
    loaded, client_state = load_engine(engine, directory)
    if engine.global_rank == 0:
        log.info(f"checkpoint.auto_resume: resumed from {loaded} at step "
                 f"{engine.global_steps}", console=True)
    return loaded, client_state


def load_engine(engine: CheckpointableEngine, load_dir: str, tag: str | None = None,
                load_module_strict: bool = True, load_optimizer_states: bool = True,
                load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                custom_load_fn: Any = None) -> tuple[str | None, dict[str, Any] | None]:
    """Loads a checkpoint saved by ``save_checkpoint`` on any number of ranks with any ZeRO
    stage; returns (path, client_state), or (None, None) when ``load_dir`` holds none, as
    DeepSpeed does. Every rank must call it."""
    from flowtrain.checkpoint.load import load as load_tensors
    from flowtrain.checkpoint.load import load_through

    path = resolve(load_dir, tag)
    if path is None:
        log.warning("no checkpoint to load: no 'latest' file", load_dir=str(load_dir))
        return None, None
    _verify(path)
    shared, per_rank = load(path, engine.global_rank)
    description = shared["tensors"]
    saved_layout = (shared["zero_stage"], shared["world_size"])
    if saved_layout != (engine.zero_stage, engine.world_size):
        log.info("resharding checkpoint", path=str(path), saved_zero_stage=saved_layout[0],
                 saved_world_size=saved_layout[1], zero_stage=engine.zero_stage,
                 world_size=engine.world_size)
    if shared.get("layout") is not None and hasattr(engine, "adopt_layout_state"):
        engine.adopt_layout_state(shared["layout"])  # before the tensors land in its buckets
    if custom_load_fn is not None:
        load_through(engine, custom_load_fn, path / TENSOR_DIR, description)
    load_tensors(engine, path / TENSOR_DIR, description, params=custom_load_fn is None,
                 module=custom_load_fn is None,
                 optimizer=load_optimizer_states and not load_module_only,
                 strict=load_module_strict)
    if not load_module_only:
        if load_optimizer_states:
            _load_loss_scaler(engine, shared)
        if load_lr_scheduler_states and engine.lr_scheduler is not None and \
                shared.get("lr_scheduler") is not None:
            engine.lr_scheduler.load_state_dict(shared["lr_scheduler"])
        engine.global_steps = shared["global_steps"]
        engine.global_samples = shared["global_samples"]
        engine.skipped_steps = shared["skipped_steps"]
        # With another accumulation count (the world size changed, the global batch did not)
        # the next micro-step starts a fresh window.
        gas = engine.spec.gradient_accumulation_steps
        engine.micro_steps = shared["micro_steps"] \
            if shared.get("gradient_accumulation_steps", gas) == gas \
            else engine.global_steps * gas
        loader = engine.training_dataloader
        if loader is not None and shared.get("dataloader") is not None:
            state, problem = map_loader_state(shared["dataloader"], engine.world_size,
                                              loader.batch_size)
            if problem is not None:
                log.warning(problem)
            loader.load_state_dict(state)
        if per_rank is not None:
            set_rng_state(per_rank["rng"])
        else:
            log.info("no saved random generator state for this rank (the checkpoint has "
                     f"{shared['world_size']} ranks); keeping its own", rank=engine.global_rank)
    if hasattr(engine, "peer_after_load"):
        engine.peer_after_load()
    engine.zero_grad()
    return str(path), shared.get("client_state", {})


def _verify(path: Path) -> None:
    """Every file of the checkpoint against its manifest, the work shared out among the ranks;
    every rank raises the same error when any rank finds damage."""
    from flowtrain.checkpoint.dcp_io import all_gather_objects, world_and_rank

    world, rank = world_and_rank()
    mine = verify_part(path, rank, world)
    if mine is None:
        if rank == 0:
            log.info("checkpoint has no manifest (written before checksums existed); loading "
                     "it unverified", path=str(path))
        return
    raise_problems(path, [p for problems in all_gather_objects(mine) for p in problems])


def _load_loss_scaler(engine: CheckpointableEngine, shared: dict[str, Any]) -> None:
    """The saved loss scale, when this engine scales the same way (an fp32 or bf16 checkpoint
    has nothing for fp16's dynamic scaler, and the other way round)."""
    kind = type(engine.loss_scaler).__name__
    saved_kind = shared.get("loss_scaler_kind", kind)
    if saved_kind != kind:
        log.info("the checkpoint's loss scaler does not apply to this engine; keeping its own",
                 saved=f"{saved_kind} ({shared.get('precision')})",
                 engine=f"{kind} ({engine.precision})")
        return
    engine.loss_scaler.load_state_dict(shared["loss_scaler"])


def map_loader_state(saved: dict[str, Any], world_size: int,
                     batch_size: int) -> tuple[dict[str, Any], str | None]:
    """The saved dataloader position for ``world_size`` ranks reading ``batch_size`` samples a
    batch: the same number of samples into the epoch, counted over all ranks (rank r reads the
    epoch's permutation at r, r + N, ..., so what N ranks took together is its first part,
    whatever N). Returns (state, None), or (state, why) when that count is not a whole number
    of batches here and the position was rounded down."""
    state: dict[str, Any] = {k: saved[k] for k in ("epoch", "batches_taken", "exhausted")
                             if k in saved}
    old_world = int(saved.get("world_size", world_size))
    old_batch = int(saved.get("batch_size", batch_size))
    if (old_world, old_batch) == (world_size, batch_size) or state.get("exhausted"):
        return state, None
    taken = int(saved["batches_taken"]) * old_batch * old_world
    per_batch = batch_size * world_size
    state["batches_taken"] = taken // per_batch
    if taken % per_batch == 0:
        return state, None
    kept = state["batches_taken"] * per_batch
    return state, (f"dataloader position: {taken} samples of epoch {state['epoch']} were read "
                   f"on {old_world} ranks x {old_batch}; that is not a whole number of "
                   f"{world_size} x {batch_size} batches, so this run restarts the epoch at "
                   f"sample {kept} and reads {taken - kept} samples again")
