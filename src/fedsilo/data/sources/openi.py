"""OpenI / Indiana University chest X-ray collection (Demner-Fushman et al. 2016), NLM distribution:

- reports: ``ecgen-radiology/<n>.xml`` (or the ``NLMCXR_reports.tgz`` archive itself), each with ``<MeSH>``
  ``<major>``/``<automatic>`` terms and one ``<parentImage id="CXR<n>_IM-....">`` per image;
- images: ``NLMCXR_png/<parentImage id>.png``;
- views: the PNG release carries none, so a view table is required, either ``nlmcxr_dicom_metadata.csv[.gz]``
  (header dump of the NLM DICOMs, column ``View Position``) or Kaggle's ``indiana_projections.csv``
  (``uid,filename,projection``). Where both exist the projection table wins: on the real files the DICOM header's
  View Position says PA for many lateral images (4,016 frontal vs 838 lateral of the 5,294 filled-in headers,
  against 3,818 / 3,648 in the curated table), so the header only fills images the table lacks. An image in
  neither is excluded as ``unknown view``.

Label rule (DESIGN §3), per image, from the report's MeSH terms (``mesh_fields``, default major only):
- positive (1): a term ``Opacity/<site>/...`` whose site is the lung (``lung`` or ``pulmonary alveoli``);
- negative (0): every major term is ``normal``;
- otherwise excluded (other findings only); lateral views are excluded.
A report is one patient (the collection is de-identified per report), so ``group`` is the report id.
"""

from __future__ import annotations

import re
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Iterator

import numpy as np
import pandas as pd

from fedsilo.config import OpenIRules
from fedsilo.data.download import Remote
from fedsilo.data.sources.base import LabelFileError, finalize, is_hidden, read_csv, require_columns, walk

DOMAIN = "OpenI"
DOMAINS = (DOMAIN,)
# The Indiana University collection as the NLM distributes it; no checksums are published (pin them under checksums).
DOWNLOADS = [
    Remote("https://openi.nlm.nih.gov/imgs/collections/NLMCXR_png.tgz", "NLMCXR_png.tgz", None, True),
    Remote("https://openi.nlm.nih.gov/imgs/collections/NLMCXR_reports.tgz", "NLMCXR_reports.tgz", None, True),
]
LUNG_SITES = ("lung", "pulmonary alveoli")
FRONTAL = {"PA", "AP", "FRONTAL"}
LATERAL = {"LL", "RL", "LATERAL", "LARGE LATERAL"}
_IM = re.compile(r"(IM-\d{4}-\d{4})")


def image_key(uid: str, name: str) -> tuple[str, str]:
    """(report uid, IM-xxxx-yyyy) — the one key the XML ids, DICOM header dump and Kaggle file names share."""
    m = _IM.search(name)
    if not m:
        raise ValueError(name)
    return str(uid), m.group(1)


def _iter_reports(raw_dir: Path) -> Iterator[tuple[str, bytes]]:
    xmls = walk(raw_dir, "ecgen-radiology/*.xml")
    if xmls:
        for p in xmls:
            yield str(p), p.read_bytes()
        return
    archives = walk(raw_dir, "NLMCXR_reports.tgz")
    if not archives:
        raise LabelFileError(f"{raw_dir}: no OpenI reports (ecgen-radiology/*.xml or NLMCXR_reports.tgz)")
    try:
        with tarfile.open(archives[0], "r:gz") as tar:
            for member in tar:
                if member.isfile() and member.name.endswith(".xml") and not any(is_hidden(part) for part in Path(member.name).parts):
                    f = tar.extractfile(member)
                    assert f is not None
                    yield f"{archives[0]}:{member.name}", f.read()
    except (tarfile.TarError, EOFError, OSError) as err:
        raise LabelFileError(f"{archives[0]}: cannot read archive: {err}") from err


def parse_report(name: str, blob: bytes) -> tuple[str, list[str], list[str], list[str]]:
    try:
        root = ET.fromstring(blob)
    except ET.ParseError as err:
        raise LabelFileError(f"{name}: not valid XML: {err}") from err
    uid_el = root.find("uId")
    if uid_el is None or not uid_el.get("id"):
        raise LabelFileError(f"{name}: no <uId id=...> element")
    uid = uid_el.get("id", "").removeprefix("CXR")
    mesh = root.find("MeSH")
    major = [(e.text or "").strip() for e in mesh.findall("major")] if mesh is not None else []
    auto = [(e.text or "").strip() for e in mesh.findall("automatic")] if mesh is not None else []
    images = [e.get("id", "") for e in root.findall("parentImage")]
    return uid, major, auto, images


def is_lung_opacity(term: str) -> bool:
    parts = [p.strip().lower() for p in term.split("/")]
    return parts[0] == "opacity" and any(site in parts[1:] for site in LUNG_SITES)


def read_views(raw_dir: Path) -> dict[tuple[str, str], str]:
    views: dict[tuple[str, str], str] = {}
    found = False
    metas = walk(raw_dir, "nlmcxr_dicom_metadata.csv") + walk(raw_dir, "nlmcxr_dicom_metadata.csv.gz")
    if metas:
        found = True
        df = read_csv(metas[0], dtype=str, usecols=lambda c: c in ("imageid", "View Position"))
        require_columns(df, ("imageid", "View Position"), metas[0])
        for iid, vp in df[["imageid", "View Position"]].itertuples(index=False):
            m = re.match(r"CXR(\d+)_", str(iid))
            vp = str(vp).strip().upper() if isinstance(vp, str) else ""
            if not m or not vp:
                continue
            try:
                key = image_key(m.group(1), iid)
            except ValueError:
                continue
            views[key] = "frontal" if vp in FRONTAL else "lateral" if vp in LATERAL else "unknown"
    for p in walk(raw_dir, "indiana_projections.csv"):
        found = True
        df = read_csv(p, dtype=str)
        require_columns(df, ("uid", "filename", "projection"), p)
        for uid, fn, proj in df[["uid", "filename", "projection"]].itertuples(index=False):
            try:
                views[image_key(uid, fn)] = {"frontal": "frontal", "lateral": "lateral"}.get(
                    str(proj).strip().lower(), "unknown"
                )
            except ValueError:
                continue
    if not found:
        raise LabelFileError(
            f"{raw_dir}: OpenI needs a view table to keep frontal images: nlmcxr_dicom_metadata.csv(.gz) "
            "or indiana_projections.csv"
        )
    return views


def read_records(raw_dir: Path, rules: OpenIRules) -> pd.DataFrame:
    raw_dir = Path(raw_dir)
    views = read_views(raw_dir)
    pngs = {p.stem: p for p in walk(raw_dir, "*.png")}
    rows = []
    for name, blob in _iter_reports(raw_dir):
        uid, major, auto, images = parse_report(name, blob)
        terms = (major if "major" in rules.mesh_fields else []) + (auto if "automatic" in rules.mesh_fields else [])
        if any(is_lung_opacity(t) for t in terms):
            label, why = 1, ""
        elif major and all(t.lower() == "normal" for t in major):
            label, why = 0, ""
        else:
            label, why = -1, "other findings only" if major else "no MeSH terms"
        for iid in images:
            try:
                key = image_key(uid, iid)
            except ValueError:
                continue
            view = views.get(key, "unknown")
            reason = why
            if not reason and view != "frontal":
                reason = "lateral view" if view == "lateral" else "unknown view"
            png = pngs.get(iid)
            rows.append(
                {
                    "id": iid,
                    "label": label,
                    "original_label": "major=" + "|".join(major),
                    "group": f"CXR{uid}",
                    "view": view,
                    "path": str(png.relative_to(raw_dir)) if png is not None else "",
                    "reader": "image",
                    "excluded": reason,
                }
            )
    if not rows:
        raise LabelFileError(f"{raw_dir}: OpenI reports name no images")
    df = pd.DataFrame(rows)
    df["label"] = df["label"].astype(np.int64)
    return finalize(df, DOMAIN)
