"""A params error as one line per problem: the dotted key the user wrote (a tagged union's tag, which pydantic puts
into the path, left out), what is wrong, and a near miss of an unknown key. Messages only: no run's numbers depend on
this module."""

from __future__ import annotations

import types
from typing import Annotated, Any, NamedTuple, Optional, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ValidationError,
)

from fedsilo.config.base import ConfigError, Strict


def _discriminator(annotation: Any) -> Optional[str]:
    """The key a tagged union in ``annotation`` is told apart by (a split's ``protocol``, a dataset's ``kind``), through
    Optional and a mapping's or a list's items; None where it holds none."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        found = [m.discriminator for m in args[1:] if isinstance(getattr(m, "discriminator", None), str)]
        return found[0] if found else _discriminator(args[0])
    if origin in (dict, list, tuple) and args:
        return _discriminator(args[-1] if origin is dict else args[0])
    if origin in (Union, types.UnionType):
        return next((d for d in map(_discriminator, args) if d), None)
    return None


class _Walk(NamedTuple):
    model: Optional[type]     # the params model the path ends at (None: not followed to one model)
    members: list[type]       # where its last step was a tagged union's member: the union's members
    tag_key: Optional[str]    # and the key that tells them apart (a split's protocol, a dataset's kind)
    tag: Any                  # and the member's tag pydantic put into the path
    loc: tuple                # the path without the tags pydantic put into it


def _walk(model: Optional[type], loc: tuple) -> _Walk:
    """Follow an error's ``loc`` through ``model``'s fields, stepping into a mapping's values or a list's items and
    into the member of a tagged union whose tag pydantic wrote into the path (``datasets.x.digits5.image_size``)."""
    out, parts = [], list(loc)
    members: list[type] = []
    tag_key, tag = None, None
    while parts:
        part = parts.pop(0)
        out.append(part)
        field = model.model_fields.get(str(part)) if model is not None else None
        if field is None:
            model, members, tag_key, tag = None, [], None, None
            continue
        found, inside = _models_in(field.annotation)
        if inside and parts:
            out.append(parts.pop(0))  # the mapping's key or the list's index
        key = field.discriminator if isinstance(field.discriminator, str) else _discriminator(field.annotation)
        member = next((m for m in found if key and parts and key in m.model_fields
                       and parts[0] in get_args(m.model_fields[key].annotation)), None)
        if member is not None:
            model, members, tag_key, tag = member, found, key, parts.pop(0)
        else:
            model, members, tag_key, tag = (found[0] if len(found) == 1 else None), [], None, None
    return _Walk(model, members, tag_key, tag, tuple(out))


def _drop_union_tags(loc: tuple, model: Optional[type]) -> tuple:
    """``loc`` without the tags pydantic put into it (the user never wrote them), where following it through
    ``model``'s fields meets a tagged union."""
    return _walk(model, loc).loc


# a method trained needs its entry, even a registered method run with its defaults (`fedsilo methods` lists them)
METHOD_ENTRY_HINT = "; every method trained needs an entry under methods (`{m}: {{}}`: a registered method with its defaults; `fedsilo methods` lists them)"
# where a method of one's own that fedsilo does not know yet was left out
REGISTER_HINT = ("; a method of your own is known once its class is in REGISTRY of src/fedsilo/methods/registry.py "
                 "(README, \"Adding a method\"), and trained once it has an entry under methods")


def not_defined(section: str, name: str, params: Any) -> ConfigError:
    """``<section>.<name>: not defined in <params file>`` with a near miss among the section's keys: the error of a
    command naming an experiment or dataset its params file lacks."""
    hint = did_you_mean(name, getattr(params, section)) or defined_elsewhere(params.source, section, name)
    return ConfigError(f"{section}.{name}: not defined in {params.source}{hint}")


def defined_elsewhere(params_file: Any, section: str, name: str) -> str:
    """`` (defined in pipelines/f2dc/params.yaml: add --params pipelines/f2dc/params.yaml)`` when ``name`` is not in the
    params file read but the repository's paper pipelines beside it (``pipelines/*/params.yaml`` and their
    ``paper/params.yaml``) define it under ``section``: a paper's experiment named without its params file."""
    from pathlib import Path

    import yaml

    here = Path(str(params_file)).parent
    found = []
    for other in [*sorted(here.glob("pipelines/*/params.yaml")), *sorted(here.glob("pipelines/*/paper/params.yaml"))]:
        try:
            raw = yaml.safe_load(other.read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(raw, dict) and isinstance(raw.get(section), dict) and name in raw[section]:
            found.append(str(other))
    if not found:
        return ""
    return f" (defined in {', '.join(found)}: add --params {found[0]})"


def did_you_mean(name: str, known: Any) -> str:
    """`` (did you mean 'x'?)`` when ``name`` is a near miss of one of ``known`` (a typo), else ""."""
    import difflib

    # never the name itself (a key valid in another section, given in the wrong one)
    close = difflib.get_close_matches(str(name), [str(k) for k in known if str(k) != str(name)], n=1, cutoff=0.75)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _all_keys() -> set[str]:
    """Every key of every params model loaded so far (the sections' and the imported methods' own): the names an
    unknown key may be a typo of."""
    out: set[str] = set()
    todo: list[type] = [Strict]
    while todo:
        cls = todo.pop()
        out.update(getattr(cls, "model_fields", {}))
        todo.extend(cls.__subclasses__())
    return out


def _models_in(annotation: Any) -> tuple[list[type], bool]:
    """The params models an annotation holds (through Optional, Union, Annotated) and whether they sit in a container
    (a mapping, list or tuple: the next part of an error's location is a key or an index)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation], False
    if origin is Annotated:
        return _models_in(args[0])
    if origin in (Union, types.UnionType):
        found, inside = [], False
        for a in args:
            m, c = _models_in(a)
            found += m
            inside = inside or c
        return found, inside
    if origin in (dict, list, tuple):
        m, _ = _models_in(args[-1] if origin is dict else args[0]) if args else ([], False)
        return m, True
    return [], False


def _fields_at(model: Optional[type], loc: tuple) -> Optional[set[str]]:
    """The keys of the params model at error location ``loc`` (its parent's path) under ``model``, or None where the
    path is not followed to one model (then every known key is a candidate)."""
    found = _walk(model, loc).model
    return set(found.model_fields) if found is not None else None


def _other_members_key(model: Optional[type], loc: tuple, key: Any) -> str:
    """`` (a key of protocol label_skew, not of domain_multi_clients)`` where an unknown key under a tagged union's
    member (a split, a dataset) is one of another member's: the tag was changed and the old settings stayed."""
    w = _walk(model, loc)
    if w.model is None or not w.members:
        return ""
    tags = [t for m in w.members if m is not w.model and str(key) in m.model_fields and w.tag_key in m.model_fields
            for t in get_args(m.model_fields[w.tag_key].annotation)]
    if not tags:
        return ""
    shown = ", ".join(map(str, tags[:5])) + (", ..." if len(tags) > 5 else "")
    return f" (a key of {w.tag_key} {shown}, not of {w.tag})"


def _new_value(value: Any, msg: str) -> bool:
    """Whether pydantic's message ``msg`` does not show ``value`` already (a number in it is the limit, as in "greater
    than 0", unless it is the input's own "(got ...)"; a text is shown quoted), and its repr is short enough."""
    shown = repr(value)
    if len(shown) > 80:
        return False
    return f"(got {shown})" not in msg if isinstance(value, (int, float, list, tuple)) else shown not in msg


def format_validation_error(err: ValidationError, prefix: str = "", model: Optional[type] = None) -> str:
    """One line: ``<dotted key>: <what is wrong>`` per error, joined by ``; ``. A validator's own message (which
    names its key already where the check spans several) is shown without pydantic's ``Value error,`` prefix. An
    unknown key's near miss is looked for among the keys of its own section (``model``: the params model validated)."""
    lines = []
    for e in err.errors():
        ctx = e.get("ctx") or {}
        loc = _drop_union_tags(tuple(e["loc"]), model) + ((ctx["field"],) if "field" in ctx else ())
        dotted = ".".join(str(p) for p in loc)
        key = f"{prefix}{dotted}" if dotted else prefix.rstrip(".")
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            own = _fields_at(model, tuple(e["loc"])[:-1]) if model is not None else None
            other = _other_members_key(model, tuple(e["loc"])[:-1], loc[-1]) if model is not None and loc else ""
            msg = "unknown key" + (other or (did_you_mean(loc[-1], own if own is not None else _all_keys()) if loc else ""))
        elif e["type"] == "value_error" and "error" in ctx:
            msg = str(ctx["error"])
        elif e["type"] != "missing" and isinstance(e.get("input"), (str, int, float, list, tuple, bool)) and _new_value(e["input"], msg):
            msg += f" (got {e['input']!r})"  # what was written: `compile: ture`, `rounds: ten`, `head_layers: 0`, `mu: [0.1]`
        lines.append(f"{key}: {msg}" if key else msg)
    return "; ".join(lines)
