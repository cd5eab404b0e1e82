"""Raw sources: one module per source, each with ``read_records(raw_dir, rules)`` (and, for array formats,
``load_container``), its ``DOMAINS`` and the official ``DOWNLOADS`` where a scriptable public address exists. A
source whose distribution names its classes (CIFAR's meta files, EMNIST's mapping) also has ``classes(raw_dir)``;
the others a ``CLASSES`` constant (digits: none, 0-9)."""

from __future__ import annotations

from types import ModuleType

from fedsilo.config import ConfigError
from fedsilo.data.sources import (
    chest_xray4_released,
    chexpert,
    cifar10,
    cifar100,
    cinic10,
    domainnet,
    emnist,
    femnist,
    fmnist,
    kather_crc,
    mnist,
    mnist_m,
    office31,
    office_caltech10,
    openi,
    pacs,
    rsna,
    svhn,
    synthdigits,
    usps,
    vinbigdata,
)

SOURCES: dict[str, ModuleType] = {
    "chexpert": chexpert,
    "openi": openi,
    "rsna": rsna,
    "vinbigdata": vinbigdata,
    "mnist": mnist,
    "svhn": svhn,
    "usps": usps,
    "synthdigits": synthdigits,
    "mnist_m": mnist_m,
    "office_caltech10": office_caltech10,
    "pacs": pacs,
    "domainnet": domainnet,
    "office31": office31,  # pFedDIL's Office-31 stream
    # single-domain datasets (FedeCouple's and CD2-pFed's tables), split by label skew
    "cifar10": cifar10,
    "cifar100": cifar100,
    "fmnist": fmnist,
    "emnist": emnist,
    "cinic10": cinic10,
    "femnist": femnist,  # LEAF's FEMNIST: EMNIST-style characters grouped by writer (FedeCouple's Table V)
    "kather_crc": kather_crc,  # Kather et al.'s colorectal H&E patches: HISTO-FED's two public centres (CD2-pFed)
    "chest_xray4_released": chest_xray4_released,  # the four CXR domains, as the pFedDB authors released them
}


def source_module(name: str) -> ModuleType:
    try:
        return SOURCES[name]
    except KeyError:
        raise ConfigError(f"unknown source {name!r} (known: {', '.join(SOURCES)})") from None
