"""A rank's model states (parameters, gradients, optimizer states) and the buffers beside
them, as each training stack lays them out: DeepSpeed's ZeRO (arXiv:1910.02054), Megatron-LM's
mixed precision and distributed optimizer, PyTorch FSDP. ``sims.memory`` adds the activations
and picks the pipeline stage that needs the most."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flowtrain.plan.zero_stage import partitions_gradients, partitions_parameters, shards_optimizer
from sims.activation_memory import LOSS_EAGER_FP32, LOSS_FP32_COPY, LOSS_FUSED, Kernels

if TYPE_CHECKING:
    from flowtrain.config.model import FlowtrainConfig

# Adam's optimizer state in bytes per parameter (ZeRO paper Sec. 3.1, "K"): mixed precision
# keeps an fp32 master copy, momentum and variance (4 + 4 + 4); fp32 training only the two
# moments (the parameters are already fp32).
ADAM_K = {True: 12, False: 8}
STAGES = (0, 1, 2, 3)
STATE_LAYOUTS = ("zero", "megatron", "fsdp")


@dataclass(frozen=True)
class Software:
    """How a training stack lays out a rank's memory where stacks differ.

    ``states``: "zero" (DeepSpeed's ZeRO: 16-bit parameters and gradients, fp32 master and
    Adam moments, a stage's shards; gradient buckets of ``reduce_bucket_size``), "megatron"
    (gradients accumulate into a contiguous main-grad buffer of the reduce dtype, no 16-bit
    gradient; its buckets are views into that buffer; zero_stage 1 is the distributed
    optimizer, 2 also shards the gradients, as Apex's DistributedFusedAdam does), "fsdp"
    (PyTorch FSDP: the sharded fp32 parameters are the master copy; stage 3 is FULL_SHARD,
    which gathers a unit and prefetches the next; stages 1-2 SHARD_GRAD_OP, which keeps the
    gathered parameters from forward to backward; stage 0 plain DDP).
    ``pipeline_grads``: with pipeline stages and ZeRO 2-3, whether gradients stay whole until
    the step's last micro-batch ("step": torchtitan, and flowtrain's own plan) or are
    reduce-scattered after each ("micro_batch"). ``kernels``: what its layers save.
    """

    name: str
    states: str = "zero"
    kernels: Kernels = field(default_factory=Kernels)
    pipeline_grads: str = "step"

    def __post_init__(self) -> None:
        if self.states not in STATE_LAYOUTS:
            raise ValueError(f"Software.states must be one of {', '.join(STATE_LAYOUTS)}, got "
                             f"{self.states!r}")
        if self.pipeline_grads not in ("step", "micro_batch"):
            raise ValueError(f"Software.pipeline_grads must be step or micro_batch, got "
                             f"{self.pipeline_grads!r}")


SOFTWARE: dict[str, Software] = {s.name: s for s in (
    Software("deepspeed"),
    # Megatron-LM / Megatron-Core (NeMo, Megatron-Bridge): bias-SwiGLU fusion on for SwiGLU
    # models (--no-bias-swiglu-fusion to turn it off; Megatron-Bridge's Llama providers set
    # bias_activation_fusion), Transformer Engine's fp8 linears keep fp8 inputs, the
    # vocab-parallel cross entropy works on an fp32 copy of the logits
    Software("megatron", "megatron", Kernels(fused_activation=True, fp8_inputs=True,
                                             loss_bytes=LOSS_FP32_COPY)),
    # PyTorch FSDP with eager modules (torchtitan, NeMo AutoModel, metaseq): SwiGLU as silu and
    # mul, the loss an fp32 F.cross_entropy over fp32 logits (torchtitan's output .float())
    Software("fsdp", "fsdp", Kernels(loss_bytes=LOSS_EAGER_FP32)),
    # llm-foundry (Composer FSDP): MPT's default loss is flash-attn's fused cross entropy
    Software("llm-foundry", "fsdp", Kernels(loss_bytes=LOSS_FUSED)),
    # Llama 3's stack (arXiv:2407.21783 Sec. 3.3.2): FSDP that "shards optimizer states and
    # gradients" but does not reshard the parameters after forward, fp32 gradient
    # accumulation and reduce-scatter. Its kernels are not public: its layers are counted as
    # Korthikanti et al. count them (whom its tensor and sequence parallelism cite), the MLP
    # activation one op keeping its input, the loss on an fp32 copy of the logits
    Software("llama3", "fsdp", Kernels(fused_activation=True, loss_bytes=LOSS_FP32_COPY),
             pipeline_grads="micro_batch"),
)}


def positive_int(label: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{label} must be an integer > 0, got {value!r}")
    return value


def model_state_bytes(psi: int, *, stage: int, dp: int, mixed: bool = True,
                      offload_optimizer: bool = False, offload_param: bool = False
                      ) -> dict[str, float]:
    """Per-device bytes of parameters, gradients and Adam state for ``psi`` parameters.

    ZeRO paper (Rajbhandari et al., arXiv:1910.02054, Sec. 5), mixed precision with K = 12:
    baseline (2 + 2 + K)Ψ; stage 1 (P_os) 2Ψ + 2Ψ + KΨ/N_d; stage 2 (P_os+g)
    2Ψ + (2 + K)Ψ/N_d; stage 3 (P_os+g+p) (2 + 2 + K)Ψ/N_d. fp32 training: 4-byte parameters
    and gradients, K = 8.
    ``offload_optimizer`` (ZeRO-Offload) moves the optimizer part, fp32 master included, to the
    host; ``offload_param`` (stage 3 only) moves the parameter shard there too. "host" is what
    was moved; "total" is what stays on the device.
    """
    positive_int("psi (parameter count)", psi)
    positive_int("dp (data-parallel ranks)", dp)
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be one of {STAGES}, got {stage!r}")
    if offload_optimizer and not shards_optimizer(stage):
        raise ValueError("offload_optimizer needs ZeRO stage 1, 2 or 3 (the optimizer it "
                         "moves is ZeRO's), got stage 0")
    if offload_param and not partitions_parameters(stage):
        raise ValueError(f"offload_param needs ZeRO stage 3 (only partitioned parameters can "
                         f"live on the host), got stage {stage}")
    width = 2 if mixed else 4
    params = width * psi / (dp if partitions_parameters(stage) else 1)
    grads = width * psi / (dp if partitions_gradients(stage) else 1)
    optimizer = ADAM_K[mixed] * psi / (dp if shards_optimizer(stage) else 1)
    host = 0.0
    if offload_optimizer:
        host, optimizer = host + optimizer, 0.0
    if offload_param:
        host, params = host + params, 0.0
    return {"parameters": params, "gradients": grads, "optimizer": optimizer,
            "total": params + grads + optimizer, "host": host}


def megatron_state_bytes(psi: int, *, dp: int, distributed: bool, mixed: bool = True,
                         grad_bytes: int = 4, shard_grads: bool = False) -> dict[str, float]:
    """Per-device bytes of Megatron-LM's model states for ``psi`` parameters over ``dp``
    data-parallel ranks (data x context parallel: its distributed optimizer shards over both).

    Megatron-LM docs/user-guide/features/dist_optimizer.md, bytes per parameter: fp16
    parameters and gradients 20, distributed 4 + 16/d; bf16 parameters with fp32 main
    gradients 18, distributed 6 + 12/d; fp32 16, distributed 8 + 8/d. The parameters are
    16-bit (fp32 training: 4), the main gradients ``grad_bytes`` wide for every parameter (the
    grad buffer the backward accumulates into and the reduce runs on), the optimizer an fp32
    master (mixed precision) with two moments, sharded when ``distributed``; a 16-bit main
    gradient is copied to fp32 for the step ("fp32_gradients", the shard's). ``shard_grads``:
    the gradients are reduce-scattered into a shard instead (Apex's DistributedFusedAdam, a
    ZeRO-2 optimizer).
    """
    positive_int("psi (parameter count)", psi)
    positive_int("dp (data-parallel ranks)", dp)
    d = dp if distributed else 1
    grad_width = grad_bytes if mixed else 4
    params = (2 if mixed else 4) * psi
    grads = grad_width * psi / (dp if shard_grads else 1)
    optimizer = ADAM_K[mixed] * psi / d
    fp32_grads = 4 * psi / d if mixed and grad_width < 4 else 0.0
    return {"parameters": params, "gradients": grads, "optimizer": optimizer,
            "fp32_gradients": fp32_grads, "total": params + grads + optimizer + fp32_grads}


def fsdp_state_bytes(psi: int, *, dp: int, stage: int, mixed: bool = True,
                     gathered: bool = False, accumulated_grad_bytes: int = 0
                     ) -> dict[str, float]:
    """Per-device bytes of PyTorch FSDP's model states for ``psi`` parameters sharded over
    ``dp`` ranks: the fp32 parameter shard (the optimizer's master), its fp32 gradient shard
    and Adam's two moments, 16Ψ/N_d in all as ZeRO-3's (2 + 2 + 12)Ψ/N_d. ``gathered``: the
    16-bit parameters stay gathered between forward and backward (SHARD_GRAD_OP, ZeRO stage
    2; or torchtitan's and Llama 3's pipelines, which do not reshard after forward).
    ``accumulated_grad_bytes``: unsharded gradients accumulated over the micro-batches in this
    width before one reduce-scatter (torchtitan's pipeline). Stage 0 is plain DDP: whole fp32
    parameters, gradients and moments (16Ψ)."""
    positive_int("psi (parameter count)", psi)
    positive_int("dp (data-parallel ranks)", dp)
    n = dp if shards_optimizer(stage) else 1
    params = 4 * psi / n + ((2 if mixed else 4) * psi if gathered and shards_optimizer(stage)
                            else 0.0)
    grads = 4 * psi / n + accumulated_grad_bytes * psi
    optimizer = 8 * psi / n
    return {"parameters": params, "gradients": grads, "optimizer": optimizer,
            "total": params + grads + optimizer}


def software_named(software: str | Software) -> Software:
    """``software`` itself, or the preset of that name."""
    if isinstance(software, Software):
        return software
    found = SOFTWARE.get(software)
    if found is None:
        raise ValueError(f"unknown training software {software!r}; choose one of "
                         f"{', '.join(SOFTWARE)}")
    return found


def stage_states(soft: Software, cfg: FlowtrainConfig, psi: int, *, dp: int, pipelined: bool,
                 mixed: bool, width: int, comm_width: int, units: list[int],
                 zero3: tuple[float, float]) -> dict[str, float]:
    """A stage's model states and the buffers beside them, as ``soft`` lays them out.
    ``units``: the stage's FSDP units on one rank (each layer, and the parameters outside the
    layers); ``zero3``: (the largest module, the parameters under the persistence threshold)
    on one rank, for DeepSpeed's ZeRO-3."""
    zero = cfg.zero_optimization
    stage = zero.stage
    gradient_buckets = gathered = fp32_grads = host = 0.0
    whole_grads = pipelined and partitions_gradients(stage) and soft.pipeline_grads == "step"
    # Megatron-Core's ZeRO-3 is its FSDP (Megatron-FSDP): parameters, gradients and optimizer
    # states sharded a unit at a time, as PyTorch's FSDP lays them out
    states_layout = "fsdp" if soft.states == "megatron" and partitions_parameters(stage) \
        else soft.states
    if states_layout == "megatron":
        shard_grads = partitions_gradients(stage) and not partitions_parameters(stage) and \
            not whole_grads
        states = megatron_state_bytes(psi, dp=dp, distributed=shards_optimizer(stage),
                                      mixed=mixed,
                                      grad_bytes=comm_width, shard_grads=shard_grads)
        fp32_grads = states.pop("fp32_gradients")
        states["total"] -= fp32_grads
        if shard_grads and dp > 1:  # a bucket reduce-scattered into the shard
            gradient_buckets = 2 * min(zero.reduce_bucket_size, psi) * comm_width
        if zero.offloads_optimizer and shards_optimizer(stage):
            host = states["optimizer"] + fp32_grads
            states["total"] -= states["optimizer"]
            states["optimizer"] = fp32_grads = 0.0
    elif states_layout == "fsdp":
        # FSDP shards gradients with the optimizer states: its stage 1 is stage 2
        stage = 2 if shards_optimizer(stage) and not partitions_gradients(stage) else stage
        sharded_grads = partitions_gradients(stage)
        whole_grads = pipelined and sharded_grads and soft.pipeline_grads == "step"
        states = fsdp_state_bytes(psi, dp=dp, stage=stage, mixed=mixed,
                                  gathered=(sharded_grads and not partitions_parameters(stage))
                                  or (pipelined and sharded_grads),
                                  accumulated_grad_bytes=comm_width if whole_grads else 0)
        largest = sorted(units, reverse=True) + [0, 0]
        if partitions_parameters(stage) and not pipelined and dp > 1:
            # the unit being computed and the next one, prefetched (FSDP1's
            # limit_all_gathers, FSDP2's implicit prefetch)
            gathered = (largest[0] + largest[1]) * width
        if dp > 1 and shards_optimizer(stage):
            # one unit's unsharded 16-bit gradient, and its copy in the reduce dtype
            gradient_buckets = largest[0] * (width + (comm_width if comm_width != width and
                                                      not whole_grads else 0))
        elif dp > 1:
            gradient_buckets = 2 * min(zero.reduce_bucket_size, psi) * comm_width
    else:
        # flowtrain's pipeline keeps a stage's parameters gathered and its gradients whole
        # through the step (sims.planner), so ZeRO 2-3 shard only the optimizer there
        st = 1 if pipelined and partitions_gradients(stage) else stage
        states = model_state_bytes(psi, stage=st, dp=dp, mixed=mixed,
                                   offload_optimizer=zero.offloads_optimizer and
                                   shards_optimizer(stage),
                                   offload_param=zero.offloads_params and partitions_parameters(st))
        host = states["host"]
        gradient_buckets = 2 * min(zero.reduce_bucket_size, psi) * comm_width if dp > 1 else 0.0
        if partitions_parameters(st) and dp > 1:
            live = min(zero.stage3_max_live_parameters, zero3[0] + zero.stage3_prefetch_bucket_size,
                       psi)
            resident = min(zero3[1], psi) * width * (1 - 1 / dp)
            gathered = live * width + resident
        shard = psi / dp if shards_optimizer(stage) else psi
        step_numel = min(shard, zero.sub_group_size) if partitions_parameters(st) else shard
        fp32_grads = 4 * step_numel if mixed else 0.0
        if zero.offloads_optimizer and shards_optimizer(stage):
            host += fp32_grads + 2 * width * shard  # gradient copy-down and parameter staging
            fp32_grads = 0.0
    states.pop("host", None)
    return {**states, "gradient_buckets": gradient_buckets, "gathered_parameters": gathered,
            "fp32_gradients": fp32_grads, "host": host}
