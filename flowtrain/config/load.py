"""``load_config``: reads a DeepSpeed JSON config (path or dict), rewrites aliases, resolves
"auto", validates, checks ZeRO keys against each other, applies the batch rule and the support
gate, and reports all problems at once (and warns about keys that ZeRO ignores)."""

from __future__ import annotations

import copy
import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from flowtrain.config.aliases import normalize
from flowtrain.config.auto import BATCH_KEYS, AutoContext, resolve_auto, steps_for_epochs
from flowtrain.config.batch import resolve_batch
from flowtrain.config.explain import error_locs, explain
from flowtrain.config.fields import ConfigError, ConfigWarning, show
from flowtrain.config.model import FlowtrainConfig
from flowtrain.config.params import (
    OPTIMIZER_PARAMS,
    SCHEDULER_PARAMS,
    canonical_optimizer,
    check_params,
    optimizer_type_problem,
)
from flowtrain.config.support import unsupported_features
from flowtrain.config.zero import check_zero, legacy_offload_conflicts
from flowtrain.env import FIRST_WORLD_SIZE

_PRUNE_ROUNDS = 4


# what a config arrives as: a ds_config.json path or its parsed dict
ConfigSource = str | os.PathLike[str] | Mapping[str, Any]


def load_config(config: ConfigSource, *, world_size: int = 1,
                model: torch.nn.Module | None = None, optimizer_given: bool = False,
                scheduler_given: bool = False, micro_batch_size: int | None = None,
                total_num_steps: int | None = None, check_supported: bool = True,
                auto_values: Mapping[str, Any] | None = None,
                dataset_length: int | None = None,
                epochs: float | None = None) -> FlowtrainConfig:
    """Returns the validated config; raises ``ConfigError`` listing every problem found.

    ``world_size`` is the data-parallel world size of the batch rule. ``model``,
    ``optimizer_given``/``scheduler_given`` (an optimizer/scheduler object is passed to the
    engine, so the config's "auto" params for it are dropped), ``micro_batch_size`` (e.g. the
    dataloader's batch size), ``total_num_steps`` and ``auto_values`` (dotted key path -> value)
    are used to resolve "auto"; so are ``dataset_length`` (the training Dataset's) and
    ``epochs``, which count a scheduler's "auto" total_num_steps. A dict is never modified.
    """
    for name, value, optional in (("world_size", world_size, False),
                                  ("micro_batch_size", micro_batch_size, True),
                                  ("total_num_steps", total_num_steps, True)):
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"load_config: {name} must be an integer > 0, got {value!r}")
    if dataset_length is not None and (isinstance(dataset_length, bool) or
                                       not isinstance(dataset_length, int) or dataset_length < 0):
        raise ValueError(f"load_config: dataset_length must be an integer >= 0, got "
                         f"{dataset_length!r}")
    if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, (int, float))
                               or not epochs > 0):
        raise ValueError(f"load_config: epochs must be a number > 0, got {epochs!r}")
    source, raw = _read(config)
    ctx = AutoContext(world_size=world_size, model=model, optimizer_given=optimizer_given,
                      scheduler_given=scheduler_given, micro_batch_size=micro_batch_size,
                      total_num_steps=total_num_steps, values=dict(auto_values or {}),
                      dataset_length=dataset_length, epochs=epochs)
    problems: list[str] = []
    legacy_offload_conflicts(raw.get("zero_optimization"), problems)
    normalize(raw, problems)
    auto = resolve_auto(raw, ctx)
    problems += auto.problems
    later: list[str] = []
    cfg, bad_locs = _validate(raw, later)
    notes: list[str] = []
    if cfg is not None:
        cfg = _check_sections(cfg, ctx, later)
        # Keys that contradict each other are reported like the batch rule's: one line each,
        # with every other problem, whatever check_supported says.
        zero_problems, notes = check_zero(cfg.zero_optimization, cfg.pipeline.stages,
                                          broken=lambda path: _is_broken(path, bad_locs))
        later += zero_problems
        notes += _inert_keys(cfg)
    problems += [p for p in later if p.split(":", 1)[0] not in auto.unresolved]
    for note in notes:
        # stacklevel 2: the warning points at the caller of load_config.
        warnings.warn(note, ConfigWarning, stacklevel=2)
    if cfg is not None:
        batch_broken = any(loc and loc[0] in BATCH_KEYS for loc in bad_locs)
        if not batch_broken:
            tbs, gas = cfg.train_batch_size, cfg.gradient_accumulation_steps
            first = _first_attempt_world(world_size)
            if first is not None:
                # an elastic restart on fewer ranks: the first attempt's global batch, with
                # the accumulation derived again for this world
                before, _ = resolve_batch(tbs, cfg.train_micro_batch_size_per_gpu, gas, first,
                                          caller_micro=micro_batch_size)
                if before is not None:
                    tbs, gas = before.train_batch_size, None
                    warnings.warn(f"elastic restart: the data-parallel world is {world_size} "
                                  f"(the job started with {first}); train_batch_size {tbs} "
                                  f"is kept, gradient_accumulation_steps derived again",
                                  ConfigWarning, stacklevel=2)
            sizes, batch_problems = resolve_batch(
                tbs, cfg.train_micro_batch_size_per_gpu, gas, world_size,
                caller_micro=micro_batch_size,
                micro_was_auto="train_micro_batch_size_per_gpu" in auto.batch_auto)
            problems += batch_problems
            if sizes is not None:
                cfg = cfg.model_copy(update={
                    "train_batch_size": sizes.train_batch_size,
                    "train_micro_batch_size_per_gpu": sizes.micro_batch,
                    "gradient_accumulation_steps": sizes.grad_accum})
                _record_batch(cfg, auto.batch_auto, auto.resolved, micro_batch_size, world_size)
                if auto.steps_from_data:
                    cfg = _steps_from_data(cfg, ctx, auto.resolved)
        if check_supported:
            problems += unsupported_features(cfg)
    if problems:
        raise ConfigError(problems, source)
    assert cfg is not None
    cfg._dp_world_size = world_size
    cfg._auto_resolved = dict(sorted(auto.resolved.items()))
    return cfg


def _first_attempt_world(dp_world: int) -> int | None:
    """The data-parallel world size of a restarted job's first attempt, when the launcher says
    it differed from this one's (FLOWTRAIN_FIRST_WORLD_SIZE beside WORLD_SIZE)."""
    try:
        first = int(os.environ.get(FIRST_WORLD_SIZE, ""))
        total = int(os.environ.get("WORLD_SIZE", ""))
    except ValueError:
        return None
    if first == total or total <= 0 or first <= 0 or (dp_world * first) % total:
        return None
    return dp_world * first // total


def _steps_from_data(cfg: FlowtrainConfig, ctx: AutoContext,
                     resolved: dict[str, tuple[Any, str]]) -> FlowtrainConfig:
    """The scheduler's "auto" total_num_steps counted from the Dataset, now that the batch
    sizes are known."""
    if cfg.scheduler is None or ctx.dataset_length is None or ctx.epochs is None:
        return cfg
    total, per_epoch = steps_for_epochs(ctx.dataset_length, ctx.epochs, cfg.micro_batch,
                                        cfg.grad_accum, ctx.world_size,
                                        cfg.dataloader_drop_last)
    params = dict(cfg.scheduler.params, total_num_steps=total)
    resolved["scheduler.params.total_num_steps"] = (
        total, f"{ctx.epochs:g} epochs of {per_epoch} optimizer steps (a Dataset of "
               f"{ctx.dataset_length} samples over {ctx.world_size} ranks, micro batch "
               f"{cfg.micro_batch}, accumulation {cfg.grad_accum})")
    return cfg.model_copy(update={"scheduler": cfg.scheduler.model_copy(
        update={"params": params})})


def _record_batch(cfg: FlowtrainConfig, batch_auto: set[str],
                  resolved: dict[str, tuple[Any, str]], caller_micro: int | None,
                  world_size: int) -> None:
    """The final value of each batch key that was "auto", with where it came from."""
    for key in batch_auto:
        value = getattr(cfg, key)
        if key in resolved:
            continue
        if key == "train_micro_batch_size_per_gpu" and caller_micro is not None:
            resolved[key] = (value, "the training_data DataLoader's batch_size")
        else:
            resolved[key] = (value, f"the batch rule: train_batch_size = micro batch x "
                                    f"gradient_accumulation_steps x data-parallel world size "
                                    f"{world_size}")


def _read(config: str | os.PathLike[str] | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    if isinstance(config, Mapping):
        raw: Any = copy.deepcopy(dict(config))
        source = "config dict"
    elif isinstance(config, (str, os.PathLike)):
        path = Path(config)
        source = f"config file {path}"
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ConfigError([f"cannot read the file: {exc.strerror or exc}"], source) from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError([f"the file is not UTF-8 text: byte 0x{data[exc.start]:02x} at "
                               f"offset {exc.start}; save it as UTF-8 JSON"], source) from None
        duplicates: list[str] = []
        try:
            raw = json.loads(text, object_pairs_hook=lambda pairs: _no_dupes(pairs, duplicates))
        except json.JSONDecodeError as exc:
            raise ConfigError([f"invalid JSON at line {exc.lineno} column {exc.colno}: "
                               f"{exc.msg}"], source) from None
        except RecursionError:
            raise ConfigError(["the JSON is nested too deeply to read (thousands of levels); "
                               "a config is a few levels deep"], source) from None
        except ValueError as exc:  # an integer literal past Python's digit limit
            raise ConfigError([f"invalid JSON: {exc}; config numbers are at most a few "
                               f"digits long"], source) from None
        if duplicates:
            raise ConfigError(duplicates, source)
    else:
        raise TypeError(f"load_config: config must be a path or a dict, got "
                        f"{type(config).__name__}")
    if not isinstance(raw, dict):
        raise ConfigError([f"expected a JSON object ({{...}}) at the top level, got "
                           f"{show(raw)[:60]}"], source)
    return source, raw


def _no_dupes(pairs: list[tuple[str, Any]], duplicates: list[str]) -> dict[str, Any]:
    # json.loads keeps the last of two equal keys without a word; that hides edits that lost.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            duplicates.append(f"{key}: the key appears twice in the same object; keep one")
        out[key] = value
    return out


def _prune(data: dict[str, Any], loc: tuple[Any, ...]) -> None:
    """Removes the value at ``loc`` (or its nearest existing ancestor) so that the rest of the
    config can still be checked for further problems."""
    node: Any = data
    for i, part in enumerate(loc):
        if not isinstance(node, dict) or part not in node:
            break
        if i == len(loc) - 1 or not isinstance(node[part], dict):
            del node[part]
            return
        _parent, node = node, node[part]
    else:
        return
    if i > 0:  # a missing required key: drop the section that lacks it
        _prune(data, loc[:i])


def _validate(raw: dict[str, Any],
              problems: list[str]) -> tuple[FlowtrainConfig | None, list[tuple[Any, ...]]]:
    """Validates ``raw``. On errors, records them and validates again with the bad values
    removed, so that the later checks still run on the rest and every problem is reported."""
    try:
        return FlowtrainConfig.model_validate(raw), []
    except ValidationError as exc:
        problems += explain(exc, FlowtrainConfig)
        locs = error_locs(exc)
    pruned = copy.deepcopy(raw)
    all_locs = list(locs)
    for _ in range(_PRUNE_ROUNDS):
        for loc in locs:
            _prune(pruned, loc)
        try:
            return FlowtrainConfig.model_validate(pruned), all_locs
        except ValidationError as exc:
            locs = error_locs(exc)
            all_locs += locs
    return None, all_locs


def _is_broken(path: str, bad_locs: list[tuple[Any, ...]]) -> bool:
    """Whether the value at dotted ``path`` (or a key inside it, or a section around it) failed
    validation, so that the validated config holds a default in its place."""
    parts = tuple(path.split("."))
    for loc in bad_locs:
        keys = tuple(str(p) for p in loc)
        n = min(len(keys), len(parts))
        if keys[:n] == parts[:n]:
            return True
    return False


def _inert_keys(cfg: FlowtrainConfig) -> list[str]:
    """A note for each DeepSpeed key the config turns on that changes nothing in flowtrain, so a
    user is told rather than left to believe it took effect. Neither changes what is trained."""
    notes = []
    if cfg.sparse_gradients:
        notes.append("sparse_gradients true has no effect in flowtrain: embedding gradients are "
                     "all-reduced densely, which gives the same values as DeepSpeed's sparse "
                     "reduce; remove the key to silence this")
    if cfg.dump_state:
        notes.append("dump_state true has no effect in flowtrain: it does not print "
                     "DeepSpeed's engine-state dump at initialize; remove the key to silence "
                     "this")
    if cfg.disable_allgather:
        notes.append("disable_allgather true has no effect in flowtrain: ZeRO gathers the "
                     "updated parameters as it always does (or shares one host copy); remove "
                     "the key to silence this")
    if cfg.seq_parallel_communication_data_type != "fp32":  # DeepSpeed's default
        notes.append(f"seq_parallel_communication_data_type "
                     f"{cfg.seq_parallel_communication_data_type} has no effect in flowtrain: it "
                     f"sets the dtype of DeepSpeed-Ulysses sequence-parallel all-to-alls, which "
                     f"flowtrain does not run; remove the key to silence this")
    return notes


def _check_sections(cfg: FlowtrainConfig, ctx: AutoContext,
                    problems: list[str]) -> FlowtrainConfig:
    """Checks that span keys: precision exclusivity, optimizer and scheduler params by type
    (skipped when the caller passes its own optimizer/scheduler: the params are then unused)."""
    update: dict[str, Any] = {}
    # DeepSpeedConfig asserts the same: "bfloat16 and fp16 modes cannot be simultaneously enabled".
    if cfg.fp16.enabled and cfg.bf16.enabled:
        problems.append("fp16.enabled and bf16.enabled are both true; enable at most one of them")
    pipe = cfg.pipeline
    if pipe.schedule == "interleaved" and pipe.virtual_stages < 2:
        problems.append(f"pipeline.virtual_stages {pipe.virtual_stages}: pipeline.schedule "
                        f"'interleaved' needs at least 2 model chunks per stage")
    if pipe.schedule != "interleaved" and pipe.virtual_stages > 1:
        problems.append(f"pipeline.virtual_stages {pipe.virtual_stages} needs pipeline.schedule "
                        f"'interleaved', not {pipe.schedule!r}")
    if cfg.checkpoint.auto_resume and not cfg.checkpoint.save_dir:
        problems.append("checkpoint.auto_resume true needs checkpoint.save_dir, the directory "
                        "the script saves its checkpoints into (where the latest one is "
                        "loaded from at initialize); set it, or auto_resume false")
    if cfg.optimizer is not None:
        canon = canonical_optimizer(cfg.optimizer.type)
        if canon is None:
            problems.append(optimizer_type_problem(cfg.optimizer.type))
            update["optimizer"] = None  # already reported; keeps the support gate quiet
        else:
            schema = OPTIMIZER_PARAMS.get(canon)
            if schema is not None and not ctx.optimizer_given:
                _, more = check_params(schema, cfg.optimizer.params, "optimizer.params")
                problems += more
            update["optimizer"] = cfg.optimizer.model_copy(update={"type": canon})
    if cfg.scheduler is not None and not ctx.scheduler_given:
        filled, more = check_params(SCHEDULER_PARAMS[cfg.scheduler.type], cfg.scheduler.params,
                                    "scheduler.params")
        problems += more
        if filled is not None:
            update["scheduler"] = cfg.scheduler.model_copy(update={"params": filled})
    return cfg.model_copy(update=update) if update else cfg
