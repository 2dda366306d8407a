"""DeepSpeed's batch rule: train_batch_size = micro batch per GPU x accumulation steps x
data-parallel world size, deriving whichever values the config leaves out."""

from __future__ import annotations

from dataclasses import dataclass

_FIX = ("set the three values so that the product holds, or leave one of them out and "
        "flowtrain derives it")


@dataclass(frozen=True)
class BatchSizes:
    train_batch_size: int
    micro_batch: int
    grad_accum: int


def _divide(total: int, divisor: int, what: str, divisor_text: str) -> tuple[int | None, str]:
    if total % divisor:
        return None, (f"train_batch_size {total} is not divisible by {divisor_text} = {divisor}, "
                      f"so {what} cannot be derived; make train_batch_size a multiple of "
                      f"{divisor} (e.g. {divisor * max(1, total // divisor)})")
    return total // divisor, ""


def resolve_batch(tbs: int | None, micro: int | None, gas: int | None, world: int, *,
                  caller_micro: int | None = None,
                  micro_was_auto: bool = False) -> tuple[BatchSizes | None, list[str]]:
    """Applies the rule; returns the three sizes, or None with the problems found.
    ``caller_micro`` is the micro batch the caller knows (e.g. a dataloader's batch size)."""
    problems: list[str] = []
    if caller_micro is not None:
        if micro is None:
            micro = caller_micro
        elif micro != caller_micro:
            problems.append(
                f"train_micro_batch_size_per_gpu {micro} in the config != micro_batch_size "
                f"{caller_micro} passed to load_config (the dataloader's batch size); make "
                f"them equal or leave the config's value out")
            return None, problems
    msg = ""
    world_text = f"data-parallel world size {world}"
    if tbs is not None and micro is not None and gas is not None:
        pass
    elif tbs is not None and micro is not None:
        gas, msg = _divide(tbs, micro * world, "gradient_accumulation_steps",
                           f"train_micro_batch_size_per_gpu {micro} * {world_text}")
    elif tbs is not None and gas is not None:
        micro, msg = _divide(tbs, gas * world, "train_micro_batch_size_per_gpu",
                             f"gradient_accumulation_steps {gas} * {world_text}")
    elif micro is not None and gas is not None:
        tbs = micro * gas * world
    elif tbs is not None:
        gas = 1
        micro, msg = _divide(tbs, world, "train_micro_batch_size_per_gpu", world_text)
    elif micro is not None:
        gas = 1
        tbs = micro * world
    else:
        if micro_was_auto:
            problems.append(
                "train_micro_batch_size_per_gpu is 'auto': pass a training_data DataLoader "
                "with a batch size or auto_values={'train_micro_batch_size_per_gpu': N} to "
                "flowtrain.initialize (load_config(micro_batch_size=...)), or set it in the "
                "config")
        else:
            problems.append(
                "either train_batch_size or train_micro_batch_size_per_gpu must be set (or pass "
                "a training_data DataLoader with a batch size to flowtrain.initialize, "
                "micro_batch_size=... to load_config)")
        return None, problems
    if tbs is None or micro is None or gas is None:
        problems.append(msg)
        return None, problems
    if tbs != micro * gas * world:
        problems.append(
            f"train_batch_size {tbs} != train_micro_batch_size_per_gpu {micro} * "
            f"gradient_accumulation_steps {gas} * {world_text} (= {micro * gas * world}); "
            f"{_FIX}")
        return None, problems
    return BatchSizes(tbs, micro, gas), problems
