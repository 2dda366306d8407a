"""``flowtrain.initialize``: DeepSpeed's entry point with the same arguments and return value,
plus ``add_config_arguments`` and ``init_distributed`` for scripts written for DeepSpeed."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from flowtrain import comm
from flowtrain.plan.zero_stage import partitions_parameters
from flowtrain.zero import construct

if TYPE_CHECKING:
    from flowtrain.config import ConfigSource, FlowtrainConfig
    from flowtrain.engine.dataloader import DistributedLoader
    from flowtrain.engine.engine import FlowtrainEngine
    from flowtrain.engine.surface import LRScheduler
    from flowtrain.parallel.grid import ProcessGrid
    from flowtrain.pipe.module import PipelineModule


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int | None = None, verbose: bool = True,
                     timeout: Any = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: object = None,
                     rank: int = -1, world_size: int = -1) -> None:
    """Initialises torch.distributed (and this rank's runtime) like
    ``deepspeed.init_distributed``."""
    if distributed_port is not None and "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(distributed_port)
    if rank >= 0:
        os.environ.setdefault("RANK", str(rank))
    if world_size > 0:
        os.environ.setdefault("WORLD_SIZE", str(world_size))
    seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else comm.DEFAULT_TIMEOUT
    comm.init_distributed(dist_backend, timeout=seconds, init_method=init_method or "env://")
    from flowtrain.runtime.rank import current_rank

    current_rank()


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds DeepSpeed's command-line arguments (``--deepspeed``, ``--deepspeed_config``) and a
    ``--local_rank`` that defaults to the LOCAL_RANK the launcher set."""
    group = parser.add_argument_group("flowtrain", "flowtrain/DeepSpeed configuration")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable the engine (accepted for DeepSpeed scripts)")
    group.add_argument("--deepspeed_config", "--flowtrain_config", default=None, type=str,
                       help="path to a DeepSpeed JSON config")
    existing = {a for action in parser._actions for a in action.option_strings}
    if "--local_rank" not in existing and "--local-rank" not in existing:
        group.add_argument("--local_rank", "--local-rank", type=int,
                           default=int(os.environ.get("LOCAL_RANK", 0)),
                           help="this process's rank on its node (set by the launcher)")
    return parser


def initialize(args: Any = None, model: torch.nn.Module | None = None,
               optimizer: torch.optim.Optimizer | Callable[..., Any] | None = None,
               model_parameters: Iterable[Any] | None = None, training_data: Any = None,
               lr_scheduler: LRScheduler | Callable[[torch.optim.Optimizer],
                                                        LRScheduler] | None = None,
               distributed_port: int | None = None, mpu: Any = None,
               dist_init_required: bool | None = None, collate_fn: Any = None,
               config: ConfigSource | None = None, mesh_param: Any = None,
               config_params: ConfigSource | None = None,
               auto_values: Any = None
               ) -> tuple[FlowtrainEngine, torch.optim.Optimizer, DistributedLoader | None,
                          LRScheduler | None]:
    """Builds the training engine; returns ``(engine, optimizer, training_dataloader,
    lr_scheduler)`` as ``deepspeed.initialize`` does.

    A config's "auto" values are filled as Hugging Face's Trainer fills them: from
    ``auto_values`` (a dict of dotted keys such as ``{"optimizer.params.lr": 3e-4}``, or a
    TrainingArguments-like object), the model (``config.hidden_size``, its dtype), a
    ``training_data`` DataLoader's batch_size, the optimizer/scheduler passed in, the world
    size, and otherwise TrainingArguments' defaults; a scheduler's total_num_steps from a
    ``training_data`` Dataset's length and ``auto_values``' num_train_epochs. What each became
    is logged once and written to the run directory's ``auto_values.json``."""
    from flowtrain.checkpoint.checkpointer import auto_resume
    from flowtrain.config import load_config
    from flowtrain.config.hf import auto_values_of
    from flowtrain.engine.engine import FlowtrainEngine
    from flowtrain.optimizers import build_optimizer
    from flowtrain.profiling import engine_hook
    from flowtrain.schedulers import build_scheduler

    if model is None:
        raise ValueError("initialize needs model=, the torch.nn.Module to train")
    if mpu is not None or mesh_param is not None:
        raise ValueError("mpu= and mesh_param= (model parallelism) are not supported yet")
    if config is None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "flowtrain_config", None)
    if config is None:
        raise ValueError("initialize needs a config: config='ds_config.json' (or a dict), "
                         "config_params=, or args.deepspeed_config")

    init_distributed(distributed_port=distributed_port)
    world_size = dist.get_world_size()
    pipe_module = _pipeline_module(model)
    if pipe_module is not None or _raw_tp_size(config) > 1:
        # stages and tensor-parallel splits cut whole weights: zero.Init's partitions go
        construct.restore(model.parameters())
    names_before = {id(p): n for n, p in model.named_parameters()}
    grid = pipe_module.grid if pipe_module is not None else _tensor_parallel_grid(config, model)
    if grid is not None:  # the batch rule counts data-parallel ranks only
        world_size = grid.shape.dp
    micro_batch = getattr(training_data, "batch_size", None) if training_data is not None else None
    if not isinstance(micro_batch, int) or isinstance(micro_batch, bool):
        micro_batch = None  # a Dataset, or a DataLoader batched by its own batch_sampler
    cfg = load_config(config, world_size=world_size, model=model,
                      optimizer_given=optimizer is not None,
                      scheduler_given=lr_scheduler is not None,
                      micro_batch_size=micro_batch, auto_values=auto_values_of(auto_values),
                      dataset_length=dataset_length(training_data),
                      epochs=epochs_of(auto_values))
    _report_auto(cfg.auto_resolved)
    if not (partitions_parameters(cfg.zero_optimization.stage) and world_size > 1 and
            grid is None):
        # only ZeRO-3 over several data-parallel ranks takes zero.Init's partitions as they are
        construct.restore(model.parameters())

    if pipe_module is not None:
        # before the optimizer takes the parameters: interleaving re-cuts the module's layers
        _check_pipeline_config(cfg, pipe_module)
    else:
        check_plain_module_config(cfg)
    params = list(model_parameters) if model_parameters is not None else \
        [p for p in model.parameters() if p.requires_grad]
    if grid is not None and grid.shape.tp > 1 and pipe_module is None:
        # the split replaced the layers: the parameters given before it are gone
        params = [p for p in model.parameters() if p.requires_grad]
    optim: torch.optim.Optimizer
    if optimizer is None:
        if cfg.optimizer is None:
            raise ValueError("no optimizer: pass optimizer= or give the config an "
                             "'optimizer' section")
        optim = build_optimizer(cfg.optimizer.type, params, dict(cfg.optimizer.params))
    elif isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
        optim = optimizer
        if grid is not None and grid.shape.tp > 1 and pipe_module is None:
            _follow_the_split(optim, model, names_before)
    else:
        optim = optimizer(params)

    from flowtrain import activation_checkpointing

    activation_checkpointing.configure(deepspeed_config=cfg)
    _warm_up_kernels(optim)
    if cfg.flowtrain.keep_freed_host_memory and \
            all(p.device.type == "cpu" for p in model.parameters()):
        from flowtrain import host_memory

        host_memory.keep_freed_memory()
    engine: FlowtrainEngine
    if pipe_module is not None:
        from flowtrain.pipe.engine import PipelineEngine

        engine = PipelineEngine(pipe_module, optim, cfg, training_data=training_data,
                                collate_fn=collate_fn)
    else:
        engine = FlowtrainEngine(model, optim, cfg, training_data=training_data,
                                 collate_fn=collate_fn, grid=grid)
    # The scheduler is built on the optimizer as the engine left it (master weights in place).
    scheduler: LRScheduler | None
    if lr_scheduler is None:
        scheduler = build_scheduler(cfg.scheduler.type, engine.optimizer,
                                    dict(cfg.scheduler.params)) \
            if cfg.scheduler is not None else None
    elif hasattr(lr_scheduler, "step"):
        scheduler = cast("LRScheduler", lr_scheduler)
    elif callable(lr_scheduler):  # a callable taking the optimizer, as DeepSpeed accepts
        scheduler = lr_scheduler(engine.optimizer)
    else:
        raise TypeError(f"lr_scheduler must be a scheduler (an object with step()) or a "
                        f"callable that builds one from the optimizer, got "
                        f"{type(lr_scheduler).__name__}")
    engine.lr_scheduler = scheduler
    from flowtrain import peer_recovery

    if peer_recovery.joining():
        # a replacement rank (launch --peer-recovery): the state comes from a healthy peer,
        # not from a checkpoint
        engine.peer_join()
        engine.resumed_checkpoint, engine.resumed_client_state = None, None
    else:
        # after the scheduler exists: a resumed checkpoint restores its state too
        engine.resumed_checkpoint, engine.resumed_client_state = auto_resume(engine)
    from flowtrain import telemetry

    telemetry.attach(engine)  # a no-op unless `flowtrain launch` hosts the job
    engine.flops_profiler = engine_hook(engine, cfg.flops_profiler)  # rank 0's, or None
    return engine, engine.optimizer, engine.training_dataloader, scheduler


AUTO_VALUES_FILE = "auto_values.json"


def dataset_length(training_data: Any) -> int | None:
    """How many samples ``training_data`` (a Dataset, or a DataLoader's Dataset) holds, when
    it says (an IterableDataset need not)."""
    if training_data is None:
        return None
    data: Any = training_data.dataset \
        if isinstance(training_data, torch.utils.data.DataLoader) else training_data
    try:
        length = len(data)
    except TypeError:
        return None
    return length if isinstance(length, int) else None


def epochs_of(auto_values: Any) -> float | None:
    """The epochs ``auto_values`` asks for: a TrainingArguments-like object's
    num_train_epochs, or the dict key "num_train_epochs"."""
    from collections.abc import Mapping

    given = auto_values.get("num_train_epochs") if isinstance(auto_values, Mapping) else \
        getattr(auto_values, "num_train_epochs", None)
    if isinstance(given, (int, float)) and not isinstance(given, bool) and given > 0:
        return float(given)
    return None


def _report_auto(resolved: dict[str, tuple[Any, str]]) -> None:
    """Rank 0 logs what each "auto" became and writes it to the run directory (when the job
    has one), so a run's hyper-parameters are on record even where the config says "auto"."""
    if not resolved or dist.get_rank() != 0:
        return
    import json

    from flowtrain.env import RUN_DIR
    from flowtrain.log import get_logger

    text = "; ".join(f"{k} = {v!r} ({source})" for k, (v, source) in resolved.items())
    get_logger("flowtrain.config").info(f"config 'auto' values resolved: {text}", console=True)
    run_dir = os.environ.get(RUN_DIR)
    if not run_dir:
        return
    record = {k: {"value": v, "from": source} for k, (v, source) in resolved.items()}
    path = os.path.join(run_dir, AUTO_VALUES_FILE)
    try:
        with open(f"{path}.tmp", "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1, default=str)
        os.replace(f"{path}.tmp", path)
    except OSError as exc:
        get_logger("flowtrain.config").warning("cannot write the run's auto_values.json",
                                               error=str(exc))


def _tensor_parallel_grid(config: ConfigSource, model: torch.nn.Module) -> ProcessGrid | None:
    """With tensor_parallel.tp_size > 1: the grid, and the model split across its
    tensor-parallel group (every rank first takes rank 0's whole weights)."""
    tp = _raw_tp_size(config)
    if tp == 1:
        return None
    from flowtrain.parallel import build_grid
    from flowtrain.tp import parallelize

    grid = build_grid(pp=1, tp=tp)
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(tensor.data, src=0)
    parallelize(model, grid.tp_group)
    return grid


def _follow_the_split(optim: torch.optim.Optimizer, model: torch.nn.Module,
                      names_before: dict[int, str]) -> None:
    """A client optimizer built before ``initialize`` split the model holds the whole
    parameters the split replaced: point each of its groups at the split ones, by name (its
    hyper-parameters stay as the client set them). An optimizer that has already stepped
    holds state for the whole tensors, which no split parameter can take."""
    if any(optim.state.values()):
        raise ValueError("the optimizer passed to initialize has state already (it has "
                         "stepped), but tensor_parallel.tp_size splits the model's parameters: "
                         "build the optimizer before any step, or pass the optimizer's class "
                         "(optimizer=torch.optim.AdamW) so initialize builds it on the split "
                         "parameters")
    now = dict(model.named_parameters())
    current = {id(p) for p in now.values()}
    for group in optim.param_groups:
        moved = []
        for p in group["params"]:
            if id(p) in current:
                moved.append(p)
                continue
            name = names_before.get(id(p))
            if name is None or name not in now:
                raise ValueError(
                    f"the optimizer holds a parameter ({name or 'not in the model'}) that "
                    f"tensor_parallel.tp_size's split left without a counterpart; pass the "
                    f"optimizer's class (optimizer=torch.optim.AdamW) or a callable taking the "
                    f"parameters, and initialize builds it on the split model")
            moved.append(now[name])
        group["params"] = moved


def check_plain_module_config(cfg: FlowtrainConfig) -> None:
    """A pipeline section that asks for stages on a model that is not a PipelineModule."""
    stages = cfg.pipeline.stages
    if "pipeline" in cfg.model_fields_set and isinstance(stages, int) and stages > 1 and \
            cfg.pipeline.enabled:
        raise ValueError(f"pipeline.stages is {stages}, but the model is a plain nn.Module: "
                         f"pipeline parallelism needs the model written as "
                         f"flowtrain.pipe.PipelineModule(layers, num_stages={stages}) (as "
                         f"DeepSpeed's PipelineModule), or drop the pipeline section")


def _raw_tp_size(config: ConfigSource) -> int:
    """tensor_parallel.tp_size (or autotp_size) as written, before the full validation (the
    batch rule needs the data-parallel size, which depends on it)."""
    import json

    raw = config
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config, encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, ValueError):
            return 1  # load_config reports the file's problem
    section = raw.get("tensor_parallel") if isinstance(raw, dict) else None
    if not isinstance(section, dict):
        return 1
    sizes = [section.get(k, 1) for k in ("tp_size", "autotp_size")]
    return max([int(v) for v in sizes if isinstance(v, int) and not isinstance(v, bool)] + [1])


def _pipeline_module(model: Any) -> PipelineModule | None:
    """``model`` when it is a PipelineModule (run by the PipelineEngine), else None."""
    from flowtrain.pipe.module import PipelineModule

    return model if isinstance(model, PipelineModule) else None


def _check_pipeline_config(cfg: FlowtrainConfig, model: PipelineModule) -> None:
    stages = cfg.pipeline.stages
    if isinstance(stages, int) and stages != model.num_stages:
        raise ValueError(f"pipeline.stages {stages} in the config, but the PipelineModule has "
                         f"{model.num_stages} stages; make them agree (or set \"auto\")")
    tp = max(cfg.tensor_parallel.tp_size, cfg.tensor_parallel.autotp_size, 1)
    if tp != model.grid.shape.tp:
        raise ValueError(f"tensor_parallel.tp_size {tp} in the config, but the PipelineModule "
                         f"was built with tp_size {model.grid.shape.tp}; make them agree")
    if cfg.pipeline.schedule == "interleaved":
        from flowtrain.plan.schedule import check_interleaving

        check_interleaving(model.num_stages, cfg.grad_accum, cfg.pipeline.virtual_stages)
    from flowtrain.pipe.engine import apply_virtual_stages

    apply_virtual_stages(model, cfg)


def _warm_up_kernels(optimizer: Any) -> None:
    """Compiles (or loads from numba's disk cache) the fused optimizer's CPU kernel now, so the
    first training step is not charged for it."""
    from cuda_numba.optim import FusedAdam, FusedLion, FusedSGD

    names = {FusedAdam: "adam", FusedLion: "lion", FusedSGD: "sgd"}
    name = names.get(type(optimizer))
    if name is not None:
        import cuda_numba

        cuda_numba.warm_up((name,))
