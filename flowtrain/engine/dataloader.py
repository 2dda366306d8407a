"""A distributed dataloader that remembers its position, so a resumed run sees exactly the
batches the uninterrupted run would have seen next."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler


class _SkippingSampler(Sampler[int]):
    """Yields the wrapped sampler's indices from position ``start`` on."""

    def __init__(self, inner: DistributedSampler, start: int) -> None:
        self.inner = inner
        self.start = start

    def __iter__(self) -> Iterator[int]:
        for i, index in enumerate(self.inner):
            if i >= self.start:
                yield index

    def __len__(self) -> int:
        return max(0, len(self.inner) - self.start)


class DistributedLoader:
    """Micro-batches of this rank's shard of ``dataset``, reshuffled every epoch with a seed
    shared by all ranks (DistributedSampler), with the epoch and position in its state_dict.

    Iterating gives the rest of the current epoch; the next ``iter()`` starts the next epoch.
    """

    def __init__(self, dataset: Dataset[Any], *, batch_size: int, rank: int, world_size: int,
                 collate_fn: Callable[[list[Any]], Any] | None = None, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, num_workers: int = 0,
                 pin_memory: bool = False) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.sampler: DistributedSampler[int] = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
            drop_last=drop_last)
        self.seed = seed
        self.epoch = 0
        self.batches_taken = 0  # in the current epoch
        self._exhausted = False

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        if self._exhausted:
            self.epoch += 1
            self.batches_taken = 0
            self._exhausted = False
        self.sampler.set_epoch(self.epoch)
        # A generator of its own: starting an iterator must not draw from the global torch RNG,
        # or a run resumed mid-epoch would see different dropout masks than the original.
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        loader = DataLoader(self.dataset, batch_size=self.batch_size, generator=generator,
                            sampler=_SkippingSampler(self.sampler,
                                                     self.batches_taken * self.batch_size),
                            collate_fn=self.collate_fn, drop_last=self.drop_last,
                            num_workers=self.num_workers, pin_memory=self.pin_memory)
        for batch in loader:
            self.batches_taken += 1
            yield batch
        self._exhausted = True

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batches_taken": self.batches_taken,
                "exhausted": self._exhausted}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.batches_taken = int(state["batches_taken"])
        self._exhausted = bool(state.get("exhausted", False))


def rng_state() -> dict[str, Any]:
    """Every random generator a training step may draw from, for an exact resume."""
    import random

    import numpy as np

    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
