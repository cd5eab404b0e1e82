"""Offline mirrors: small copies of a source in its real raw layout and formats."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from fedsilo.config import ConfigError, MirrorParams


def mirror_writer(source: str) -> Callable[[Path, MirrorParams], None]:
    from fedsilo.data.mirror.benchmarks import WRITERS as BENCH
    from fedsilo.data.mirror.cxr import WRITERS
    from fedsilo.data.mirror.single_domain import WRITERS as SINGLE

    writers = {**WRITERS, **BENCH, **SINGLE}
    try:
        return writers[source]
    except KeyError:
        raise ConfigError(f"no offline mirror for source {source!r} (have: {', '.join(writers)})") from None
