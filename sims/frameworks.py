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
# the cross-entropy over the logits (sims.layer_ops prices each): "fused" (one kernel reads
# the logits and writes the loss and its fp32 row statistics; backward reads them once and
# writes the gradient), "eager" (torch's F.cross_entropy over fp32-cast logits, its primitive
# kernels), "megatron" (Megatron's vocab-parallel cross-entropy: a kernel per step over fp32
# logits)
LOSSES = ("fused", "eager", "megatron")
# the copies a sharded data-parallel framework makes of each unit's parameters and gradients
# around its collectives, on top of the collectives (``Framework.shard_copy_bytes``): "none";
# "fsdp1" (PyTorch's FullyShardedDataParallel and FairScale's: flat parameters, the gathered
# flat parameter used in place); "fsdp2" (fully_shard: per-parameter sharding)
SHARD_COPIES = ("none", "fsdp1", "fsdp2")


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
    # the cross-entropy's kernels (sims.layer_ops.LOSSES)
    loss: str = "fused"
    # what ZeRO 2-3 copies around its collectives (SHARD_COPIES)
    shard_copies: str = "none"
    # sequence parallelism through torch's DTensor (torchtitan's SequenceParallel on
    # [batch, seq, hidden] activations): the collectives gather and scatter along dim 0, so
    # torch.distributed._functional_collectives copies every all-gather's output into the
    # sequence layout (torch.cat of its chunks along dim 1) and every reduce-scatter's input out
    # of it: a read and a write of the gathered activation around each one
    sp_layout_copies: bool = False
    # data parallel without ZeRO: a tied embedding's gradient split into the head's part,
    # reduced during backward, and the lookup's rows exchanged after (flowtrain's
    # flowtrain.engine.embedding_rows; the others reduce the weight whole once backward is done)
    tied_rows: bool = False
    # the model's layers as the framework writes them: Q, K and V one matmul and the gated
    # MLP's gate and up one (Megatron's linear_qkv and linear_fc1, MPT's Wqkv), or each a
    # linear of its own (Hugging Face's modules, which flowtrain and DeepSpeed train;
    # torchtitan's wq/wk/wv and w1/w3; metaseq's q/k/v projections)
    fused_projections: bool = False
    # pipeline chunks must hold equal numbers of layers (Megatron-Core's TransformerConfig
    # refuses others), unless the embedding and the loss count as layers
    even_chunks: bool = False

    def __post_init__(self) -> None:
        if self.buckets not in BUCKETS:
            raise ValueError(f"Framework.buckets must be one of {', '.join(BUCKETS)}, got "
                             f"{self.buckets!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"Framework.loss must be one of {', '.join(LOSSES)}, got "
                             f"{self.loss!r}")
        if self.shard_copies not in SHARD_COPIES:
            raise ValueError(f"Framework.shard_copies must be one of {', '.join(SHARD_COPIES)}, "
                             f"got {self.shard_copies!r}")
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

    def shard_copy_bytes(self, param_elem: int, reduce_elem: int, *, gathers: bool
                         ) -> tuple[float, float]:
        """Bytes per parameter element of a unit that the framework's copies stream in one
        micro-batch's forward and in its backward (``param_elem``: the gathered parameters'
        element size; ``reduce_elem``: the gradient reduce's; ``gathers``: the unit is gathered
        for each pass, as ZeRO-3 does, not kept between them as ZeRO-2 does).

        - "fsdp1" (torch.distributed.fsdp ``_runtime_utils``: ``_post_backward_hook``,
          ``_reduce_grad``): the forward uses the gathered flat parameter in place. Backward
          produces the flat gradient from the parameters' views (read and write), casts it to
          the reduce dtype where that differs (read, write) and divides it by the pre-divide
          factor, which is above 1 for every world size over 1 (read, write), before the
          reduce-scatter.
        - "fsdp2" (torch.distributed.fsdp ``_fully_shard/_fsdp_collectives``): each all-gather's
          output is copied out into the parameters (``foreach_all_gather_copy_out``: read,
          write), in forward and again in backward where the unit was resharded; the
          gradients are copied, cast to the reduce dtype, into the reduce-scatter's input
          (``foreach_reduce``: read, write); the division rides on the reduce (a pre-multiplied
          sum)."""
        e, r = param_elem, reduce_elem
        if self.shard_copies == "fsdp1":
            return 0.0, 2.0 * e + (e + r if r != e else 0.0) + 2.0 * r
        if self.shard_copies == "fsdp2":
            out = 2.0 * e
            return out, (out if gathers else 0.0) + e + r
        return 0.0, 0.0

    def blocks_sends(self, virtual_stages: int) -> bool:
        return self.blocking_p2p == "always" or \
            (self.blocking_p2p == "1f1b" and virtual_stages == 1)


FRAMEWORKS: dict[str, Framework] = {f.name: f for f in (
    Framework("flowtrain", "flowtrain's engine: DeepSpeed's buckets and ZeRO, sends while it "
                           "computes; a tied embedding's gradient split under data "
                           "parallel", zero1_reduce_scatter=True, tied_rows=True),
    Framework("deepspeed", "DeepSpeed: ZeRO-1 reduce-scatters, its pipeline engine waits on "
                           "each send, its PipelineModule cuts stages by parameter count, "
                           "the model's loss is torch's eager cross-entropy",
              blocking_p2p="always", zero1_reduce_scatter=True, partition="parameters",
              loss="eager"),
    Framework("megatron-deepspeed", "Megatron-DeepSpeed: DeepSpeed's engine (as deepspeed) "
                                    "training Megatron's layers and its vocab-parallel "
                                    "cross-entropy",
              blocking_p2p="always", zero1_reduce_scatter=True, partition="parameters",
              loss="megatron", fused_projections=True),
    Framework("megatron-lm", "Megatron-LM before Megatron-Core (2020-2022): one all-reduce of "
                             "the gradient buffer after the last backward, 1F1B waits on its "
                             "sends, its vocab-parallel cross-entropy", memory="megatron",
              buckets="whole", blocking_p2p="always", zero1_reduce_scatter=True,
              loss="megatron", fused_projections=True),
    Framework("megatron-core", "Megatron-Core (NeMo, Megatron-Bridge): 40M-parameter buckets "
                               "reduced during backward, the distributed optimizer's gathers "
                               "under the next forward, sends overlapped when interleaved, "
                               "the vocab-parallel cross-entropy unfused (its default)",
              memory="megatron", buckets="megatron", param_gather_overlap=True,
              blocking_p2p="1f1b", zero1_reduce_scatter=True, loss="megatron",
              fused_projections=True, even_chunks=True),
    Framework("fsdp", "PyTorch FSDP2 (fully_shard: torchtitan, NeMo AutoModel): a unit per "
                      "transformer block, the next one prefetched, each gather copied out "
                      "into the parameters and the gradients copied into the reduce, the "
                      "model's loss torch's eager cross-entropy; tensor and sequence "
                      "parallelism through DTensor", memory="fsdp",
              fsdp_units=True, loss="eager", shard_copies="fsdp2", sp_layout_copies=True),
    Framework("fsdp1", "PyTorch FSDP1 and FairScale FSDP (metaseq): flat parameters, a unit "
                       "per transformer block, the next one prefetched, the flat gradient "
                       "built, cast and pre-divided before its reduce-scatter, the model's "
                       "loss torch's eager cross-entropy", memory="fsdp", fsdp_units=True,
              loss="eager", shard_copies="fsdp1"),
    Framework("llm-foundry", "llm-foundry (Composer's FSDP1, as fsdp1) with MPT's fused loss",
              memory="llm-foundry", fsdp_units=True, shard_copies="fsdp1",
              fused_projections=True),
    Framework("llama3", "Meta's Llama 3 stack (arXiv:2407.21783 Sec. 3.3.2): FSDP-style "
                        "sharding of gradients and optimizer states with 4D parallelism, "
                        "one layer fewer on the first and the last pipeline stage",
              memory="llama3", zero1_reduce_scatter=True, partition="ends"),
)}


def get_framework(name: str) -> Framework:
    found = FRAMEWORKS.get(name)
    if found is None:
        raise ValueError(f"framework must be one of {', '.join(FRAMEWORKS)}, got {name!r}")
    return found
