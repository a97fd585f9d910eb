"""The LSTMs of the text tasks, as LEAF's reference models (and the FedMR authors' CharLSTM).

Both are :class:`LayeredModel` s whose blocks are what FedMR's layer granularity recombines and
FedRL reviews: the embedding, the whole stacked LSTM (its two layers' weights travel together;
with ``granularity: tensor`` each LSTM weight and bias is recombined on its own), and the
classifier block(s). The LSTM output is read at the **last time step**, padding included, as
LEAF's models do.
"""

from __future__ import annotations

import torch
from torch import nn

from fedmm.models.layered import LayeredModel


class LastStep(nn.Module):
    """``[B, T, H] -> [B, H]``: the output of the last time step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, -1]


class StackedLSTM(nn.Module):
    """A multi-layer ``batch_first`` LSTM returning its output sequence only (a plain tensor, so
    that every block of a LayeredModel returns one)."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden_size, num_layers, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return out


def build_char_lstm(vocab_size: int, num_classes: int) -> LayeredModel:
    """Shakespeare: Embedding(80, 8) → 2-layer LSTM 256 → Linear(256, 80) on the last step
    (LEAF ``shakespeare.stacked_lstm``; the FedMR repo's CharLSTM). 819,920 parameters."""
    return LayeredModel([
        nn.Embedding(vocab_size, 8),
        StackedLSTM(8, 256, 2),
        nn.Sequential(LastStep(), nn.Linear(256, num_classes)),
    ])


def build_sent_lstm(vocab_size: int, num_classes: int, embedding_dim: int = 100) -> LayeredModel:
    """Sent140: Embedding(vocab, embedding_dim, padding 0) → 2-layer LSTM 100 → Linear(100, 128)
    + ReLU on the last step → Linear(128, 2) (LEAF ``sent140.stacked_lstm``)."""
    return LayeredModel([
        nn.Embedding(vocab_size, embedding_dim, padding_idx=0),
        StackedLSTM(embedding_dim, 100, 2),
        nn.Sequential(LastStep(), nn.Linear(100, 128), nn.ReLU(inplace=True)),
        nn.Sequential(nn.Linear(128, num_classes)),
    ])
