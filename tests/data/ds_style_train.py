"""A training script written the way DeepSpeed's tutorials write one (CIFAR-style), with
``import deepspeed`` replaced by ``import flowtrain as deepspeed``. Only the deepspeed API is used.

    flowtrain launch --nproc-per-node 2 ds_style_train.py --deepspeed \
        --deepspeed_config ds_config.json --save_dir ckpt --result result.json
"""

import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import flowtrain as deepspeed


def add_argument():
    parser = argparse.ArgumentParser(description="toy classifier")
    parser.add_argument("-e", "--epochs", default=4, type=int, help="number of total epochs")
    parser.add_argument("--local_rank", type=int, default=-1,
                        help="local rank passed from distributed launcher")
    parser.add_argument("--save_dir", required=True, type=str)
    parser.add_argument("--result", required=True, type=str)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 3)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def make_dataset(n=128):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0.5).long() + (x[:, 1] > 0).long()  # 3 classes
    return torch.utils.data.TensorDataset(x, y)


def main():
    args = add_argument()
    deepspeed.init_distributed()
    torch.manual_seed(42)
    net = Net()
    trainset = make_dataset()
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=net.parameters(), training_data=trainset)

    criterion = nn.CrossEntropyLoss()
    epoch_losses = []
    for _epoch in range(args.epochs):
        running = []
        for _i, data in enumerate(trainloader):
            inputs, labels = data[0], data[1]
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            running.append(loss.item())
        epoch_losses.append(sum(running) / len(running))

    model_engine.save_checkpoint(args.save_dir, client_state={"epoch": args.epochs})
    weights = {k: v.clone() for k, v in net.state_dict().items()}
    with torch.no_grad():
        for p in net.parameters():
            p.zero_()
    load_path, client_sd = model_engine.load_checkpoint(args.save_dir)
    restored = all(torch.equal(weights[k], v) for k, v in net.state_dict().items())

    if torch.distributed.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump({"epoch_losses": epoch_losses, "load_path": load_path,
                       "client_state": client_sd, "restored": restored,
                       "global_steps": model_engine.global_steps,
                       "lr": model_engine.get_lr()}, f)


if __name__ == "__main__":
    main()
