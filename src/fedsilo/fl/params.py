"""The params a stage reads: every section of the params file validated, the method entries by their own classes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedsilo import config
from fedsilo.config import Params
from fedsilo.methods import check_methods


def parse_params(raw: dict[str, Any], source: str = "params.yaml") -> Params:
    params = config.parse_params(raw, source)
    check_methods(params, source)
    return params


def load_params(path: str | Path = "params.yaml") -> Params:
    params = config.load_params(path)
    check_methods(params, str(path))
    return params
