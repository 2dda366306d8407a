"""A small MLP trained as a 2-stage 1F1B pipeline for a few steps; its run directory becomes
the pipeline --compare fixture."""
import torch
import torch.nn as nn

import flowtrain
from flowtrain.pipe import PipelineModule


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)
    def forward(self, x):
        return x + self.proj(torch.relu(self.fc(x)))

torch.manual_seed(0)
flowtrain.init_distributed()
layers = [nn.Linear(32, 128), *(Block(128) for _ in range(4)), nn.Linear(128, 8)]
module = PipelineModule(layers, num_stages=2, loss_fn=nn.functional.cross_entropy,
                        partition_method="parameters")
engine, _, _, _ = flowtrain.initialize(model=module, config="ds_config.json")
g = torch.Generator().manual_seed(1)
for _ in range(6):
    engine.train_batch(iter([(torch.randn(32, 32, generator=g),
                              torch.randint(0, 8, (32,), generator=g))
                             for _ in range(4)]))
engine.destroy()
