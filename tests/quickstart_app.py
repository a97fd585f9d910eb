"""A ClientApp written the way Flower's PyTorch quickstart writes one: it knows nothing of this
project (no import from client_app/, fedmm/ or strategies/), has no query handler, and replies
with ``arrays`` + ``metrics`` holding ``num-examples``.

Each node trains a small MLP on its own synthetic 2-class data, chosen by its partition id.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def load_data(partition_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(partition_id)
    x = torch.randn(64, 8, generator=g)
    y = (x[:, partition_id % 8] > 0).long()  # every client has its own rule: non-IID
    return x, y


app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = load_data(int(context.node_config["partition-id"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    content = RecordDict({
        "arrays": ArrayRecord(model.state_dict()),
        "metrics": MetricRecord({"train_loss": float(loss), "num-examples": len(y)}),
    })
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = load_data(int(context.node_config["partition-id"]))
    with torch.no_grad():
        accuracy = float((model(x).argmax(1) == y).float().mean())
    return Message(content=RecordDict({"metrics": MetricRecord({"accuracy": accuracy, "num-examples": len(y)})}), reply_to=msg)
