"""How the class names a source of your own writes (class folders, a table's label values, slide annotations' classes)
map to the dataset's classes: :class:`ClassMap`, shared by the readers and the slides' region annotations."""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

from fedsilo.config import table_word
from fedsilo.data.sources.base import LabelFileError
from fedsilo.data.sources.benchmark import norm_name


def class_key(name: str) -> str:
    """A class name as every source of your own compares it: case, spaces, '_', '-' and Unicode normalization aside,
    and a number by its value (``1`` and ``1.0``: a label column that went through pandas with a blank in it)."""
    return norm_name(table_word(name))


class ClassMap:
    """A source's class names (class folders, a table's label values) -> the dataset's classes: through the rules'
    ``classes`` (keys compared by ``fold``), else the class of the same name (``fold`` of both equal); ``None`` for
    a value in ``skip``; any other value an error naming it and the two keys that would take it. ``what`` names a value
    in messages (``class folder``, ``label``); ``hint`` adds to that advice for a value no key maps (the folder
    layout's sentence, the region annotations' ``ignore``)."""

    def __init__(self, rules, key: str, what: str, fold: Callable[[str], str] = class_key,
                 hint: Callable[[str], str] = lambda value: ""):
        self.rules, self.key, self.what, self.fold, self.hint = rules, key, what, fold, hint
        self._map = {fold(k): v for k, v in rules.classes.items()}
        self._skip = {fold(v) for v in rules.skip}

    def mapped(self, value: str) -> Optional[str]:
        """The class ``classes`` maps ``value`` to, or None."""
        return self._map.get(self.fold(value))

    def skipped(self, value: str) -> bool:
        return self.fold(value) in self._skip

    def names(self, values: Iterable[str]) -> set[str]:
        """The class names the values give (mapped through ``classes``; skipped ones left out): the class list of a
        ``kind: image_folder`` dataset that names none."""
        return {self.mapped(v) or v for v in values if not self.skipped(v)}

    def resolver(self, classes: Sequence[str]) -> Callable[[str, str], Optional[str]]:
        """``resolve(value, where)``: the dataset class ``value`` is (None when skipped), or the error naming ``where``."""
        index = {c: i for i, c in enumerate(classes)}
        loose: dict[str, str] = {}
        for c in classes:
            loose.setdefault(self.fold(c), c)
        memo: dict[str, Optional[str]] = {}

        def resolve(value: str, where: str) -> Optional[str]:
            if value in memo:
                return memo[value]
            if self.skipped(value):
                memo[value] = None
                return None
            cls = self.mapped(value)
            target = cls if cls is not None else value  # a mapped class is matched to the list as loosely as a name
            cls = target if target in index else loose.get(self.fold(target))
            if cls not in index:
                cls = target
                target = (f"{self.key}.classes maps it to {cls!r}, which is not among them" if self.mapped(value) is not None else
                          f"map it with {self.key}.classes: {{{value}: <class>}} or leave it out with {self.key}.skip: "
                          f"[{value}]{self.hint(value)}")
                raise LabelFileError(f"{where}: {self.what} {value!r} is not a class of this dataset (classes: "
                                     f"{', '.join(classes)}); {target}")
            memo[value] = cls
            return cls

        return resolve
