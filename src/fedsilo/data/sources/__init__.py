"""Raw sources: one module per source, each with ``read_records(raw_dir, rules)``."""

from __future__ import annotations

from types import ModuleType

from fedsilo.data.sources import chexpert, openi, rsna, vinbigdata

SOURCES: dict[str, ModuleType] = {
    "chexpert": chexpert,
    "openi": openi,
    "rsna": rsna,
    "vinbigdata": vinbigdata,
}


def source_module(name: str) -> ModuleType:
    try:
        return SOURCES[name]
    except KeyError:
        raise KeyError(f"unknown source {name!r} (known: {', '.join(SOURCES)})") from None
