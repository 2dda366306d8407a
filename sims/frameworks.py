"""The training frameworks ``flowtrain simulate`` plans for: what each does with a step that a
ds_config has no key for (how gradients are bucketed and reduced, whether parameter gathers
overlap the next forward, whether pipeline sends block, how ZeRO-3 cuts its units, how memory
is laid out). ``flowtrain`` is the engine this project runs; the others let a user plan a run
of the framework they will train with, and ``benchmarks/sim_published.py`` set each published
run on its own."""

from __future__ import annotations

from dataclasses import dataclass

# gradient buckets: "config" (the ds_config's reduce_bucket_size, flowtrain's and DeepSpeed's
# rule), "whole" (one buffer of the stage's gradients, reduced after the last backward:
# Megatron-LM's local DDP), "megatron" (max(40M, 1M x dp) parameters: Megatron-Core's DDP)
BUCKETS = ("config", "whole", "megatron")
# pipeline sends: "never" block the stage, "always" do, or only in plain 1F1B ("1f1b")
BLOCKING = ("never", "always", "1f1b")
WHOLE_STAGE = 2**62


@dataclass(frozen=True)
class Framework:
    """One framework's behaviours (``memory``: its ``sims.memory.SOFTWARE`` layout)."""

    name: str
    summary: str
    memory: str = "deepspeed"
    buckets: str = "config"
    # ZeRO 1-2: the updated parameters gathered under the next step's forward
    param_gather_overlap: bool = False
    blocking_p2p: str = "never"
    # ZeRO-3 units: a transformer block each (PyTorch FSDP) instead of a module each
    fsdp_units: bool = False
    # ZeRO-1 reduce-scatters the gradients instead of all-reducing them
    zero1_reduce_scatter: bool = False
    # how a model is cut into pipeline stages (flowtrain.plan.partition.PARTITIONS)
    partition: str = "layers"

    def __post_init__(self) -> None:
        if self.buckets not in BUCKETS:
            raise ValueError(f"Framework.buckets must be one of {', '.join(BUCKETS)}, got "
                             f"{self.buckets!r}")
        if self.blocking_p2p not in BLOCKING:
            raise ValueError(f"Framework.blocking_p2p must be one of {', '.join(BLOCKING)}, "
                             f"got {self.blocking_p2p!r}")

    def bucket_numel(self, dp: int, config_numel: int) -> int:
        """The gradient bucket size in elements for ``dp`` data-parallel ranks."""
        if self.buckets == "whole":
            return WHOLE_STAGE
        if self.buckets == "megatron":
            return max(40_000_000, 1_000_000 * dp)
        return config_numel

    def blocks_sends(self, virtual_stages: int) -> bool:
        return self.blocking_p2p == "always" or \
            (self.blocking_p2p == "1f1b" and virtual_stages == 1)


FRAMEWORKS: dict[str, Framework] = {f.name: f for f in (
    Framework("flowtrain", "flowtrain's engine: DeepSpeed's buckets and ZeRO, sends while it "
                           "computes, ZeRO-1 all-reduces"),
    Framework("deepspeed", "DeepSpeed (and Megatron-DeepSpeed): ZeRO-1 reduce-scatters, its "
                           "pipeline engine waits on each send, its PipelineModule cuts "
                           "stages by parameter count", blocking_p2p="always",
              zero1_reduce_scatter=True, partition="parameters"),
    Framework("megatron-lm", "Megatron-LM before Megatron-Core (2020-2022): one all-reduce of "
                             "the gradient buffer after the last backward, 1F1B waits on its "
                             "sends", memory="megatron", buckets="whole",
              blocking_p2p="always", zero1_reduce_scatter=True),
    Framework("megatron-core", "Megatron-Core (NeMo, Megatron-Bridge): 40M-parameter buckets "
                               "reduced during backward, the distributed optimizer's gathers "
                               "under the next forward, sends overlapped when interleaved",
              memory="megatron", buckets="megatron", param_gather_overlap=True,
              blocking_p2p="1f1b", zero1_reduce_scatter=True),
    Framework("fsdp", "PyTorch FSDP (torchtitan, NeMo AutoModel, metaseq): a unit per "
                      "transformer block, the next one prefetched", memory="fsdp",
              fsdp_units=True),
    Framework("llm-foundry", "llm-foundry (Composer's FSDP) with MPT's fused loss",
              memory="llm-foundry", fsdp_units=True),
    Framework("llama3", "Meta's Llama 3 stack (arXiv:2407.21783 Sec. 3.3.2): FSDP-style "
                        "sharding of gradients and optimizer states with 4D parallelism",
              memory="llama3", zero1_reduce_scatter=True),
)}


def get_framework(name: str) -> Framework:
    found = FRAMEWORKS.get(name)
    if found is None:
        raise ValueError(f"framework must be one of {', '.join(FRAMEWORKS)}, got {name!r}")
    return found
