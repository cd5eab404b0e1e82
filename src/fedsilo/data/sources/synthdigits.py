"""SynthDigits / SynNumbers (Ganin & Lempitsky 2015) as distributed with the DANN code: ``synth_train_32x32.mat`` /
``synth_test_32x32.mat`` in SVHN's format (``X`` 32 x 32 x 3 x N, ``y``), or FedBN's ``SynthDigits/partitions/*.pkl`` +
``SynthDigits/test.pkl``. No scriptable public address exists (the authors share it through Google Drive), so
``download`` needs ``files``. Domain ``SynthDigits`` of Digits-Five."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from fedsilo.data.sources.base import LabelFileError
from fedsilo.data.sources.benchmark import fedbn_digit_records, load_container, records_frame
from fedsilo.data.sources.svhn import mat_records

DOMAIN = "SynthDigits"
DOMAINS = (DOMAIN,)
DOWNLOADS: list = []
__all__ = ["read_records", "load_container", "DOMAINS", "DOWNLOADS"]


def read_records(raw_dir: Path, rules: object = None) -> pd.DataFrame:
    raw_dir = Path(raw_dir)
    rows = fedbn_digit_records(raw_dir, "SynthDigits", DOMAIN)
    if rows is None:
        rows = mat_records(raw_dir, (("synth_train_32x32.mat", "train"), ("synth_test_32x32.mat", "test")), DOMAIN)
        if not rows:
            raise LabelFileError(f"{raw_dir}: no SynthDigits files (expected synth_train_32x32.mat / synth_test_32x32.mat or FedBN's SynthDigits/test.pkl)")
    return records_frame(rows, DOMAIN)
