"""A small MLP trained for a few steps; its run directory becomes the --compare fixture."""
import torch
import torch.nn as nn

import flowtrain


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)
    def forward(self, x):
        return x + self.proj(torch.relu(self.fc(x)))

class Net(nn.Module):
    def __init__(self, d=256, n=4):
        super().__init__()
        self.embed = nn.Linear(32, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 8)
    def forward(self, x):
        x = self.embed(x)
        for b in self.layers:
            x = b(x)
        return self.head(x)

torch.manual_seed(0)
flowtrain.init_distributed()
net = Net()
engine, _, _, _ = flowtrain.initialize(model=net, model_parameters=net.parameters(),
                                       config="ds_config.json")
g = torch.Generator().manual_seed(1)
for _step in range(22 * engine.gradient_accumulation_steps()):
    x = torch.randn(engine.train_micro_batch_size_per_gpu(), 32, generator=g)
    y = torch.randint(0, 8, (x.shape[0],), generator=g)
    loss = nn.functional.cross_entropy(engine(x), y)
    engine.backward(loss)
    engine.step()
