"""The seed papers' own numbers, as data, for the report in the papers' layout (``fedmm-report --paper``).

One :class:`PaperTable` per table, in :data:`PAPER_TABLES` under the name ``--paper`` takes:

- ``kdd_table1``: FedMR, KDD'24 version (``shared/papers/001``), Table 1: test accuracy (%),
  mean ± std, 8 methods × 27 rows (CNN, ResNet-20, VGG-16 × CIFAR-10, CIFAR-100 at α = 0.1,
  0.5, 1.0, IID and FEMNIST).
- ``arxiv_table1``: FedMR, arXiv version (``003``), Table 1: the same rows with SCAFFOLD and
  MOON instead of FedExP, FedASAM and FedMut.
- ``fedrl_table1``, ``fedrl_table2``, ``fedrl_table3``: FedRL (``004``) Tables 1-3: the highest
  test accuracy over 120 rounds; the rounds to reach FedAvg's round-120 accuracy and the
  speed-up; seconds of local training per round.

Source: ``shared/BASELINES.md`` §10 ("What can be reproduced ... and what the papers report"),
which copies part of these tables: 12 of KDD's 27 rows without their ±, 17 of arXiv's 27 rows
with ± for 9 cells, and FedRL's Tables 2 and 3 without the FedAvg row, the FedProx and SCAFFOLD
speed-ups and the FedProx and SCAFFOLD runtimes. The rest was read from the same papers' text
(the tables named above); every number §10 gives agrees with these (checked cell by cell when
this module was written). Not here: FedCross's tables, whose numbers were lost in ``002``'s
text (§10).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Setting(NamedTuple):
    """A row of a FedMR table (a column of a FedRL one): model, dataset and partition as the paper
    names them. ``partition``: the Dirichlet α as written (``0.1``, ``1.0``), ``IID`` or
    ``natural`` (FEMNIST's writers). ``model`` None: any model (FedRL uses one per dataset)."""

    model: str | None
    dataset: str
    partition: str


#: One cell of a paper's table: (value, second). For accuracy: (mean %, its ± or None);
#: rounds to the target: (rounds, speed-up), (None, None) where the paper prints "/" (not
#: reached in its 120 rounds); seconds per round: (seconds, None).
PaperValue = tuple[float | None, float | None]

#: What a table's numbers are: ``final_accuracy`` (at the last round), ``best_accuracy`` (the
#: highest over the rounds), ``rounds_to_reference`` (rounds to reach FedAvg's final accuracy and
#: the speed-up over FedAvg), ``seconds_per_round``.
METRICS = ("final_accuracy", "best_accuracy", "rounds_to_reference", "seconds_per_round")


@dataclass(frozen=True)
class PaperTable:
    """A table of a paper: its methods, its settings and one :data:`PaperValue` per (setting,
    method); ``methods_as_rows``: the paper prints one row per method (FedRL), not per setting."""

    name: str
    source: str           # paper, version and table, as a caption cites it
    what: str             # what the paper's numbers are, at the paper's own horizon
    metric: str           # one of METRICS: what the report computes from our runs
    horizon: str          # the paper's training horizon, as the paper states it
    methods: tuple[str, ...]
    values: dict[Setting, tuple[PaperValue, ...]]   # per setting, one value per method (in ``methods`` order)
    methods_as_rows: bool = False

    def __post_init__(self) -> None:
        assert self.metric in METRICS, self.metric
        for setting, row in self.values.items():
            assert len(row) == len(self.methods), (self.name, setting)

    def value(self, setting: Setting, method: str) -> PaperValue | None:
        """The paper's value of a cell; None where the paper has no such row or column."""
        row = self.values.get(setting)
        return row[self.methods.index(method)] if row is not None and method in self.methods else None


S = Setting

# FedMR KDD'24 (001) Table 1, test accuracy (%) mean ± std.
_KDD_METHODS = ("FedAvg", "FedProx", "FedGen", "CluSamp", "FedExP", "FedASAM", "FedMut", "FedMR")
_KDD_TABLE1: dict[Setting, tuple[PaperValue, ...]] = {
    S("CNN", "CIFAR-10", "0.1"):          ((50.66, 1.18), (50.61, 1.21), (50.27, 2.03), (50.24, 1.04), (53.20, 1.33), (48.83, 1.86), (52.88, 0.59), (54.63, 0.55)),
    S("CNN", "CIFAR-10", "0.5"):          ((54.42, 0.76), (54.28, 1.29), (53.66, 0.68), (55.07, 0.93), (55.12, 0.57), (52.02, 0.43), (57.29, 0.61), (59.81, 0.60)),
    S("CNN", "CIFAR-10", "1.0"):          ((57.03, 0.62), (56.44, 0.68), (56.19, 0.54), (56.16, 0.56), (57.12, 0.34), (55.08, 0.61), (58.88, 0.47), (60.77, 0.48)),
    S("CNN", "CIFAR-10", "IID"):          ((57.21, 0.27), (57.00, 0.11), (57.35, 0.19), (58.13, 0.35), (57.05, 0.15), (54.60, 0.11), (58.81, 0.21), (63.74, 0.18)),
    S("CNN", "CIFAR-100", "0.1"):         ((29.12, 0.52), (29.44, 0.73), (26.14, 0.92), (28.51, 1.14), (30.43, 0.39), (28.95, 0.48), (31.23, 0.35), (34.47, 0.54)),
    S("CNN", "CIFAR-100", "0.5"):         ((32.41, 0.77), (32.48, 0.81), (29.19, 0.67), (32.63, 0.60), (33.12, 0.51), (32.06, 0.98), (34.46, 0.69), (37.41, 0.30)),
    S("CNN", "CIFAR-100", "1.0"):         ((32.66, 0.51), (33.10, 0.41), (29.94, 0.51), (32.65, 0.48), (33.32, 0.38), (32.45, 0.61), (35.12, 0.42), (39.15, 0.30)),
    S("CNN", "CIFAR-100", "IID"):         ((32.75, 0.20), (32.57, 0.21), (30.95, 0.32), (32.77, 0.11), (32.48, 0.14), (32.35, 0.29), (34.49, 0.23), (40.64, 0.17)),
    S("CNN", "FEMNIST", "natural"):       ((82.97, 0.37), (83.15, 0.41), (82.35, 0.40), (82.31, 0.32), (83.28, 0.29), (83.49, 0.27), (83.62, 0.33), (83.76, 0.24)),
    S("ResNet-20", "CIFAR-10", "0.1"):    ((42.14, 3.91), (43.25, 3.18), (44.19, 2.42), (41.64, 2.04), (45.18, 2.43), (45.22, 4.06), (50.75, 1.85), (59.20, 1.22)),
    S("ResNet-20", "CIFAR-10", "0.5"):    ((58.70, 0.86), (59.33, 0.77), (60.64, 0.83), (58.74, 0.82), (59.74, 0.92), (63.49, 1.10), (63.34, 0.70), (72.41, 0.17)),
    S("ResNet-20", "CIFAR-10", "1.0"):    ((64.33, 0.25), (64.75, 0.33), (64.41, 0.29), (63.42, 0.45), (64.48, 0.31), (67.62, 0.41), (68.09, 0.25), (75.16, 0.31)),
    S("ResNet-20", "CIFAR-10", "IID"):    ((65.72, 0.22), (65.95, 0.23), (66.31, 0.23), (65.36, 0.18), (65.58, 0.24), (69.65, 0.10), (69.77, 0.19), (77.48, 0.10)),
    S("ResNet-20", "CIFAR-100", "0.1"):   ((34.22, 1.01), (34.52, 0.68), (35.76, 1.11), (33.23, 0.78), (36.09, 0.71), (37.31, 0.66), (38.79, 0.55), (44.61, 1.48)),
    S("ResNet-20", "CIFAR-100", "0.5"):   ((42.16, 0.43), (41.37, 0.49), (45.03, 0.96), (41.54, 0.52), (41.96, 0.56), (44.29, 0.52), (46.55, 0.55), (54.26, 0.45)),
    S("ResNet-20", "CIFAR-100", "1.0"):   ((43.32, 0.38), (43.00, 0.45), (46.60, 0.39), (43.63, 0.39), (43.68, 0.23), (46.74, 0.31), (48.41, 0.25), (55.72, 0.36)),
    S("ResNet-20", "CIFAR-100", "IID"):   ((45.14, 0.28), (45.40, 0.27), (48.33, 0.25), (44.76, 0.24), (45.04, 0.24), (48.59, 0.20), (48.65, 0.17), (59.24, 0.32)),
    S("ResNet-20", "FEMNIST", "natural"): ((79.09, 0.54), (78.89, 0.50), (79.56, 0.34), (78.75, 0.27), (79.15, 0.34), (81.20, 0.41), (78.98, 0.45), (81.27, 0.31)),
    S("VGG-16", "CIFAR-10", "0.1"):       ((62.28, 5.72), (63.19, 5.15), (65.97, 3.82), (62.00, 3.19), (64.78, 5.69), (65.52, 4.96), (69.15, 2.16), (74.49, 0.92)),
    S("VGG-16", "CIFAR-10", "0.5"):       ((78.82, 0.21), (78.49, 0.26), (78.98, 0.11), (78.09, 0.48), (79.30, 0.43), (79.12, 0.25), (80.07, 0.19), (84.24, 0.37)),
    S("VGG-16", "CIFAR-10", "1.0"):       ((79.53, 0.34), (79.52, 0.30), (80.08, 0.24), (79.67, 0.45), (79.76, 0.20), (80.08, 0.32), (80.85, 0.99), (85.12, 0.13)),
    S("VGG-16", "CIFAR-10", "IID"):       ((79.96, 0.05), (79.79, 0.07), (80.13, 0.05), (79.66, 0.06), (79.89, 0.05), (80.66, 0.09), (82.20, 0.05), (85.66, 0.15)),
    S("VGG-16", "CIFAR-100", "0.1"):      ((47.29, 0.96), (48.02, 0.68), (49.11, 1.60), (47.38, 1.47), (49.36, 0.55), (48.78, 1.03), (51.30, 1.00), (55.33, 0.72)),
    S("VGG-16", "CIFAR-100", "0.5"):      ((55.60, 0.55), (55.45, 0.70), (56.29, 0.84), (54.45, 0.58), (56.40, 0.47), (56.73, 0.41), (58.02, 0.31), (65.07, 0.25)),
    S("VGG-16", "CIFAR-100", "1.0"):      ((56.05, 0.45), (55.75, 0.36), (57.96, 0.32), (55.70, 0.37), (56.69, 0.25), (57.46, 0.25), (58.53, 0.31), (65.66, 0.15)),
    S("VGG-16", "CIFAR-100", "IID"):      ((57.22, 0.28), (56.65, 0.23), (58.47, 0.16), (57.33, 0.17), (57.55, 0.16), (57.96, 0.11), (58.62, 0.08), (66.33, 0.10)),
    S("VGG-16", "FEMNIST", "natural"):    ((83.96, 0.43), (84.27, 0.32), (84.39, 0.28), (83.64, 0.27), (83.99, 0.32), (84.59, 0.21), (83.97, 0.57), (85.36, 0.21)),
}

# FedMR arXiv (003) Table 1, test accuracy (%) mean ± std.
_ARXIV_METHODS = ("FedAvg", "FedProx", "SCAFFOLD", "MOON", "FedGen", "CluSamp", "FedMR")
_ARXIV_TABLE1: dict[Setting, tuple[PaperValue, ...]] = {
    S("CNN", "CIFAR-10", "0.1"):          ((46.12, 2.35), (47.17, 1.65), (49.12, 0.91), (42.61, 2.65), (49.27, 0.85), (47.09, 0.97), (54.22, 1.25)),
    S("CNN", "CIFAR-10", "0.5"):          ((52.82, 0.91), (53.59, 0.88), (54.50, 0.44), (53.56, 1.74), (51.77, 0.73), (54.00, 0.38), (59.13, 0.65)),
    S("CNN", "CIFAR-10", "1.0"):          ((54.78, 0.56), (54.96, 0.60), (56.75, 0.26), (54.51, 1.24), (55.38, 0.66), (55.82, 0.73), (61.10, 0.49)),
    S("CNN", "CIFAR-10", "IID"):          ((57.64, 0.22), (58.34, 0.15), (59.98, 0.22), (57.33, 0.30), (58.71, 0.19), (57.32, 0.21), (62.07, 0.29)),
    S("CNN", "CIFAR-100", "0.1"):         ((28.37, 1.10), (28.11, 1.03), (30.32, 1.05), (28.15, 1.54), (28.18, 0.58), (28.63, 0.63), (33.33, 0.87)),
    S("CNN", "CIFAR-100", "0.5"):         ((30.01, 0.56), (32.16, 0.50), (33.49, 0.73), (30.93, 0.49), (29.55, 0.41), (33.04, 0.41), (36.96, 0.30)),
    S("CNN", "CIFAR-100", "1.0"):         ((32.34, 0.65), (32.78, 0.13), (34.95, 0.58), (31.46, 0.66), (31.88, 0.65), (32.92, 0.31), (38.05, 0.24)),
    S("CNN", "CIFAR-100", "IID"):         ((32.98, 0.20), (33.39, 0.25), (35.11, 0.23), (32.39, 0.19), (32.43, 0.20), (34.97, 0.24), (40.01, 0.11)),
    S("CNN", "FEMNIST", "natural"):       ((81.67, 0.36), (82.10, 0.61), (81.65, 0.21), (81.13, 0.39), (81.95, 0.36), (80.80, 0.40), (82.73, 0.36)),
    S("ResNet-20", "CIFAR-10", "0.1"):    ((45.11, 2.13), (45.45, 3.42), (50.46, 1.76), (46.38, 2.66), (42.71, 3.48), (44.87, 1.65), (62.09, 1.77)),
    S("ResNet-20", "CIFAR-10", "0.5"):    ((60.56, 0.95), (59.52, 0.74), (58.85, 0.85), (60.47, 0.68), (60.29, 0.68), (59.55, 1.00), (74.00, 0.32)),
    S("ResNet-20", "CIFAR-10", "1.0"):    ((62.99, 0.62), (61.47, 0.66), (61.63, 0.78), (61.99, 0.68), (63.81, 0.33), (63.32, 0.71), (76.92, 0.38)),
    S("ResNet-20", "CIFAR-10", "IID"):    ((67.12, 0.27), (66.06, 0.22), (65.20, 0.27), (66.19, 0.22), (65.89, 0.17), (65.62, 0.23), (77.94, 0.14)),
    S("ResNet-20", "CIFAR-100", "0.1"):   ((31.90, 1.16), (33.00, 1.21), (35.71, 0.62), (32.91, 0.70), (32.40, 1.45), (34.34, 0.52), (45.13, 1.05)),
    S("ResNet-20", "CIFAR-100", "0.5"):   ((42.45, 0.53), (42.83, 0.54), (42.33, 1.23), (41.76, 0.22), (42.72, 0.32), (42.07, 0.39), (54.73, 0.27)),
    S("ResNet-20", "CIFAR-100", "1.0"):   ((44.22, 0.36), (44.35, 0.36), (43.28, 0.61), (42.92, 0.67), (44.75, 0.57), (43.29, 0.41), (56.96, 0.31)),
    S("ResNet-20", "CIFAR-100", "IID"):   ((44.42, 0.18), (45.16, 0.24), (44.37, 0.19), (46.13, 0.13), (45.21, 0.19), (43.59, 0.24), (59.25, 0.35)),
    S("ResNet-20", "FEMNIST", "natural"): ((78.47, 0.40), (79.74, 0.54), (76.14, 0.90), (79.50, 0.46), (79.56, 0.34), (79.28, 0.42), (81.27, 0.31)),
    S("VGG-16", "CIFAR-10", "0.1"):       ((63.79, 3.90), (63.35, 4.31), (64.18, 3.86), (60.19, 3.73), (66.52, 1.46), (66.91, 1.83), (74.38, 0.71)),
    S("VGG-16", "CIFAR-10", "0.5"):       ((78.14, 0.67), (77.70, 0.45), (76.22, 1.37), (77.41, 0.77), (78.90, 0.39), (78.82, 0.40), (82.86, 0.37)),
    S("VGG-16", "CIFAR-10", "1.0"):       ((78.55, 0.21), (79.10, 0.28), (76.99, 1.01), (78.81, 0.41), (79.75, 0.26), (80.00, 0.37), (84.45, 0.23)),
    S("VGG-16", "CIFAR-10", "IID"):       ((80.02, 0.05), (80.77, 0.22), (78.80, 0.07), (81.11, 0.12), (80.00, 0.27), (80.96, 0.12), (85.87, 0.23)),
    S("VGG-16", "CIFAR-100", "0.1"):      ((46.60, 1.45), (45.88, 3.35), (45.79, 1.77), (42.74, 1.10), (49.04, 0.63), (48.04, 1.76), (56.60, 0.83)),
    S("VGG-16", "CIFAR-100", "0.5"):      ((55.86, 0.64), (55.79, 0.56), (55.30, 0.61), (53.29, 0.79), (56.40, 0.37), (56.23, 0.34), (65.04, 0.16)),
    S("VGG-16", "CIFAR-100", "1.0"):      ((57.55, 0.51), (57.40, 0.32), (55.43, 0.45), (54.67, 0.55), (57.15, 0.27), (57.95, 0.35), (66.28, 0.34)),
    S("VGG-16", "CIFAR-100", "IID"):      ((58.30, 0.23), (58.49, 0.11), (56.51, 0.08), (57.39, 0.24), (57.62, 0.18), (58.14, 0.20), (66.28, 0.11)),
    S("VGG-16", "FEMNIST", "natural"):    ((84.22, 0.46), (83.98, 0.48), (82.65, 0.74), (79.09, 0.42), (84.69, 0.28), (84.32, 0.36), (85.36, 0.21)),
}

# FedRL (004): 10 clients, all of them every round, Dir(0.5), 120 rounds of 3 local epochs; one
# model per dataset (MNIST, FashionMNIST: 2-conv CNN; CIFAR-10: MOON's CNN; CIFAR-100: ResNet-50).
_FEDRL_SETTINGS = (S(None, "MNIST", "0.5"), S(None, "FashionMNIST", "0.5"), S(None, "CIFAR-10", "0.5"),
                   S(None, "CIFAR-100", "0.5"))


def _by_method(rows: dict[str, tuple[PaperValue, ...]]) -> dict[Setting, tuple[PaperValue, ...]]:
    """FedRL's tables are printed one row per method: turn them into one row per setting."""
    return {setting: tuple(values[i] for values in rows.values()) for i, setting in enumerate(_FEDRL_SETTINGS)}


# Table 1: the highest test accuracy (%) over the 120 rounds ("top-1"; no ± printed).
_FEDRL_TABLE1 = {
    "FedAvg":   ((97.19, None), (77.66, None), (62.97, None), (65.12, None)),
    "FedProx":  ((97.28, None), (77.85, None), (63.17, None), (64.86, None)),
    "SCAFFOLD": ((97.55, None), (73.49, None), (59.86, None), (51.67, None)),
    "SOLO":     ((81.76, None), (53.78, None), (37.96, None), (25.35, None)),
    "FedRL":    ((97.72, None), (81.27, None), (63.45, None), (65.63, None)),
}
# Table 2: rounds to first surpass FedAvg's round-120 accuracy, and the speed-up 120 / rounds.
_NOT_REACHED: PaperValue = (None, None)
_FEDRL_TABLE2 = {
    "FedAvg":   ((120, 1.00), (120, 1.00), (120, 1.00), (120, 1.00)),
    "FedProx":  ((86, 1.40), (91, 1.32), (97, 1.24), _NOT_REACHED),
    "SCAFFOLD": ((104, 1.15), _NOT_REACHED, _NOT_REACHED, _NOT_REACHED),
    "FedRL":    ((51, 2.35), (50, 2.40), (80, 1.50), (59, 2.03)),
}
# Table 3: seconds of local training per round (all clients), mean over the 120 rounds, RTX 3090.
_FEDRL_TABLE3 = {
    "FedAvg":   ((40.64, None), (40.96, None), (73.91, None), (217.46, None)),
    "FedProx":  ((53.17, None), (51.35, None), (87.99, None), (351.37, None)),
    "SCAFFOLD": ((49.25, None), (48.19, None), (79.30, None), (319.52, None)),
    "FedRL":    ((47.84, None), (47.98, None), (82.31, None), (297.89, None)),
}

_FEDMR_HORIZON = "its number of rounds is not stated in its text"
_FEDRL_HORIZON = "120 rounds of 3 local epochs, 10 clients, all of them every round"

PAPER_TABLES: dict[str, PaperTable] = {
    table.name: table
    for table in (
        PaperTable("kdd_table1", "FedMR, KDD'24, Table 1", "test accuracy (%)", "final_accuracy", _FEDMR_HORIZON,
                   _KDD_METHODS, _KDD_TABLE1),
        PaperTable("arxiv_table1", "FedMR, arXiv version, Table 1", "test accuracy (%)", "final_accuracy",
                   _FEDMR_HORIZON, _ARXIV_METHODS, _ARXIV_TABLE1),
        PaperTable("fedrl_table1", "FedRL, Table 1", "highest test accuracy (%) over the rounds", "best_accuracy",
                   _FEDRL_HORIZON, tuple(_FEDRL_TABLE1), _by_method(_FEDRL_TABLE1), methods_as_rows=True),
        PaperTable("fedrl_table2", "FedRL, Table 2", "rounds to first reach FedAvg's accuracy at its last round, "
                   "and the speed-up over FedAvg", "rounds_to_reference", _FEDRL_HORIZON, tuple(_FEDRL_TABLE2),
                   _by_method(_FEDRL_TABLE2), methods_as_rows=True),
        PaperTable("fedrl_table3", "FedRL, Table 3", "seconds of local training per round", "seconds_per_round",
                   _FEDRL_HORIZON, tuple(_FEDRL_TABLE3), _by_method(_FEDRL_TABLE3), methods_as_rows=True),
    )
}
