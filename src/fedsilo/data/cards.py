"""What a harmonized dataset's data card promises of its arrays, checked by whatever reads them.

Harmonize writes ``images.npy`` and ``records.parquet`` and their sha256 into ``card.json``; a run, the onboard
stage, a site's card and ``fedsilo site evaluate`` hash the arrays again before reading them (:func:`refuse_changed_arrays`):
what they record of the data (a run's config hash, metrics.json, MLflow tags; a site's fingerprint) is then the data
they read. Kept apart from :mod:`fedsilo.data.harmonize` (every source reader, OpenCV): a Flower SuperNode's
ClientApp imports this at every message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedsilo.config import ConfigError
from fedsilo.utils.io import file_sha256

__all__ = ["ARRAYS", "changed_arrays", "data_record", "refuse_changed_arrays"]

# the arrays harmonize writes and hashes into card.json
ARRAYS = ("images.npy", "records.parquet")


def changed_arrays(folder: Path, card: dict[str, Any]) -> list[str]:
    """The harmonized arrays (:data:`ARRAYS`) in ``folder`` whose sha256, hashed anew, is no longer the one harmonize
    wrote into ``card``: a file edited or replaced after harmonize."""
    return [a for a in ARRAYS if file_sha256(Path(folder) / a) != card["sha256"].get(a)]


def refuse_changed_arrays(folder: Path, card: dict[str, Any], rerun: str) -> None:
    """ConfigError when an array of the harmonized ``folder`` is not the one its ``card`` hashes (:func:`changed_arrays`):
    whatever reads it would be recorded (data card, fingerprint, MLflow tags, config hash) as reading the card's data."""
    changed = changed_arrays(folder, card)
    if changed:
        raise ConfigError(f"{folder}: {', '.join(changed)} changed after harmonize wrote card.json (its sha256 is no longer "
                          f"the card's, which every record of a run would name); {rerun} rather than editing the arrays")


def data_record(card: dict[str, Any], split_path: Path) -> dict[str, Any]:
    """What a run (metrics.json's ``data``, a part of its config hash) or the onboard stage records of the data it read:
    the card's array hashes (checked by :func:`refuse_changed_arrays` first) and the split file's sha256."""
    return {"harmonized_sha256": card["sha256"], "split_sha256": file_sha256(split_path)}
