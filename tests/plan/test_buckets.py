"""flowtrain.engine.buckets: ZeRO 2-3's transient bucket buffers hold exactly the gradients that
landed, zeros where none did (an unused parameter, the padding) even when the pool's buffer
comes back dirty from a reduce, and a second arrival before the hand-over adds."""

from __future__ import annotations

import torch

from flowtrain.engine.buckets import GradBuckets
from flowtrain.plan import plan_buckets


def _model() -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(5, 3), "unused": torch.nn.Linear(2, 2),
                                 "b": torch.nn.Linear(3, 1)})
    return model, list(model.parameters())


def _buckets(params: list[torch.nn.Parameter]) -> GradBuckets:
    specs = [(f"p{i}", tuple(p.shape), "float32", 4) for i, p in enumerate(params)]
    plan = plan_buckets(specs, bucket_numel=10_000)  # one bucket holds them all
    # pad_to 4: the bucket (35 elements) gets a padding tail, as ZeRO pads to the world size
    buckets = GradBuckets(params, plan, pad_to=4, transient=True)
    buckets.install_hooks()
    # the pool's next buffer is dirty, as one coming back from a reduce is
    buckets.release(torch.full((buckets.numels[0],), float("nan")))
    return buckets


def _expected(model: torch.nn.Module, buckets: GradBuckets, x: torch.Tensor,
              passes: int) -> torch.Tensor:
    """Bucket 0 as it should be: each used parameter's gradient summed over ``passes`` at its
    slot, zeros at the unused parameter's slots and the padding."""
    used = [p for n, p in model.named_parameters() if not n.startswith("unused")]
    sums = [torch.zeros_like(p) for p in used]
    for _ in range(passes):
        grads = torch.autograd.grad(model["b"](model["a"](x)).sum(), used)
        sums = [s + g for s, g in zip(sums, grads)]
    of = {id(p): s for p, s in zip(used, sums)}
    out = torch.zeros(buckets.numels[0])
    for slot in buckets.plan[0].slots:
        grad = of.get(id(buckets.params[slot.index]))
        if grad is not None:
            out[slot.offset:slot.offset + slot.numel] = grad.reshape(-1)
    return out


def test_transient_bucket_holds_the_gradients_and_zeros_elsewhere() -> None:
    model, params = _model()
    buckets = _buckets(params)
    x = torch.randn(4, 5)
    model["b"](model["a"](x)).sum().backward()
    taken = buckets.take(0)
    assert torch.equal(taken, _expected(model, buckets, x, 1))
    assert all(p.grad is None for p in params)


def test_a_second_arrival_in_the_same_buffer_adds() -> None:
    """Two backwards before the bucket is handed over (a hook firing twice, as reentrant
    activation checkpointing can): the slot holds the sum."""
    model, params = _model()
    buckets = _buckets(params)
    x = torch.randn(4, 5)
    for _ in range(2):
        model["b"](model["a"](x)).sum().backward()
    taken = buckets.take(0)
    assert torch.allclose(taken, _expected(model, buckets, x, 2))
    # the next buffer starts afresh: only the new gradients, although the pool's is dirty
    buckets.release(taken)
    model["b"](model["a"](x)).sum().backward()
    assert torch.equal(buckets.take(0), _expected(model, buckets, x, 1))
