"""What a ZeRO stage number means, the one place it is compared: whether the stage shards the
optimizer states, partitions the gradients, partitions the parameters. The resolver
(``flowtrain.plan.spec``), the config's checks, the strategy factory and the simulator's memory
model ask these instead of testing the number. A leaf module, so that the config's checks can
ask it without importing the resolver that reads the config."""

from __future__ import annotations

STAGES = (0, 1, 2, 3)


def shards_optimizer(zero_stage: int) -> bool:
    """Whether the stage shards the optimizer states over the data-parallel group (ZeRO 1-3;
    stage 0 replicates them)."""
    return zero_stage >= 1


def partitions_gradients(zero_stage: int) -> bool:
    """Whether the stage keeps only a shard of each gradient (ZeRO 2-3)."""
    return zero_stage >= 2


def partitions_parameters(zero_stage: int | str) -> bool:
    """Whether the stage partitions parameters (ZeRO-3; "auto", as DeepSpeed's zero.Init reads
    a config that leaves the stage to the trainer, counts as 3)."""
    return zero_stage in (3, "auto")
