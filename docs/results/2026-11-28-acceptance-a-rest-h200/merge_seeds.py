"""Three-seed tables for the runs whose seeds 0 and 1 ran in one campaign and seed 2 in another, per-run files gone.

FedBN and FedAvg of pfeddb_office, FedRep and FedAvg of fc_office_dir0_1: seeds 0 and 1 ran on 2026-11-27 (H100,
docs/results/2026-11-27-acceptance-a-h100/<experiment>/*.csv: mean and sample std over the two seeds), seed 2 on
2026-11-28 (H200, the *_seed2 folders here). Two values
are given back exactly (up to the csv's four decimals) by their mean m and sample std s: m - s/sqrt(2) and
m + s/sqrt(2); the three-seed mean and sample std (ddof = 1) follow. Run from this folder:
python merge_seeds.py > three_seeds_merged.md
"""

import csv
import math
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
BEFORE = HERE.parent / "2026-11-27-acceptance-a-h100"


def rows(path: Path) -> dict[str, dict[str, str]]:
    with path.open() as f:
        return {row["method"]: row for row in csv.DictReader(f)}


def table(experiment: str, seed2: str, name: str, methods: tuple[str, ...], columns: list[str], title: str) -> None:
    two, three = rows(BEFORE / experiment / name), rows(HERE / seed2 / name)
    print(f"### {title}\n")
    print("| method | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for method in methods:
        cells = []
        for column in columns:
            m, s = float(two[method][f"{column}_mean"]), float(two[method][f"{column}_std"])
            values = [m - s / math.sqrt(2), m + s / math.sqrt(2), float(three[method][f"{column}_mean"])]
            cells.append(f"{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f}")
        print(f"| {method} | " + " | ".join(cells) + " |")
    print()


OFFICE = ["amazon", "caltech", "dslr", "webcam", "Avg"]
PFEDDB = ("pfeddb_office", "pfeddb_office_fedbn_fedavg_seed2")
table(
    *PFEDDB,
    "pfeddb_office_accuracy.csv",
    ("fedbn", "fedavg"),
    OFFICE,
    "pfeddb_office, final round (300): test accuracy %, mean ± sample std over seeds 0, 1, 2",
)
table(
    *PFEDDB,
    "pfeddb_office_accuracy_best_val.csv",
    ("fedbn", "fedavg"),
    OFFICE,
    "pfeddb_office, at the round of best mean validation accuracy: test accuracy %, mean ± sample std over seeds 0, 1, 2",
)
table(
    "fc_office_dir0_1",
    "fc_office_dir0_1_seed2",
    "fc_office_dir0_1_accuracy.csv",
    ("fedrep", "fedavg"),
    ["Avg"],
    "fc_office_dir0_1, final round (200): mean test accuracy % over the 20 clients, mean ± sample std over seeds 0, 1, 2",
)
