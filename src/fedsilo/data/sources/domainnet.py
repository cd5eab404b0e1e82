"""DomainNet (Peng et al. 2019), cleaned release: per-domain zips (``clipart.zip`` ... unpacked to
``<domain>/<class>/<file>.jpg``) and the official split lists ``<domain>_train.txt`` / ``<domain>_test.txt``
(``<domain>/<class>/<file> <index of 345 classes>`` per line).

The pFedDB / FedBN benchmark keeps a 10-class subset (``CLASSES``); images of the other 335 classes are recorded as
excluded (reason ``class not in the 10-class subset``) from the split lists, without touching their files. Images of
the subset get ``subset`` train / test from the lists (empty for a file in no list); a listed file that is missing
is kept and quarantined by harmonize.

FedBN's DomainNet copy (its ``domainnet_dataset`` release, which pFedDB's DomainNet scripts read) carries its own split
lists ``<domain>_train.pkl`` / ``<domain>_test.pkl`` (pickled (paths, class names)) beside the domain folders: where a
domain has them, they set the subset of every image of the 10 classes (an image in neither list: empty), in place of
the official lists, so that ``test_from: official`` and FedBN's sizes (``n_train_of_smallest``) follow FedBN's split.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from fedsilo.data.download import Remote
from fedsilo.data.sources.base import LabelFileError, is_hidden, walk
from fedsilo.data.sources.benchmark import (
    IMAGE_SUFFIXES,
    fedbn_split_lists,
    find_dirs,
    list_lines,
    no_domain_folder,
    norm_name,
    records_frame,
    require_every_class,
)

DISTRIBUTED_ARCHIVES = "*.zip"  # a local folder of the per-domain zips is unpacked by fetch, as download mode does
DOMAINS = ("clipart", "infograph", "painting", "quickdraw", "real", "sketch")
CLASSES = ("bird", "feather", "headphones", "ice_cream", "teapot", "tiger", "whale", "windmill", "wine_glass", "zebra")
DOMAIN_ALIASES = {d: d for d in DOMAINS}
_NORM_CLASSES = {norm_name(c): c for c in CLASSES}
_ROOT = "http://csr.bu.edu/ftp/visda/2019/multi-source/"
# Addresses from the dataset page (ai.bu.edu/M3SDA); clipart and painting are the cleaned versions under groundtruth/.
# The publisher gives no checksums; these sha512 prefixes are the ones kwcoco's grab_domainnet records for the same
# files. Pin a full sha256 under sources.domainnet.checksums to tighten them.
_SHA512 = {
    "clipart.zip": "3bcfb9ec1b4061e8d5b0b887d4ebd4a708732787fc563c6dfc2d",
    "infograph.zip": "47841f0d1b8606e4b02d508b250484d54f5cf04ef6c4875c6c5a39c",
    "painting.zip": "4c98b02563075948668a298c488660fda1d1a7ed85fd69caa7985fba",
    "quickdraw.zip": "127cce1dd57fc99992f8614de77d03ae8ed6af242973f7a013ec0a",
    "real.zip": "751713d4592d1278b50bf69787988cfae280cabdac80ee34ec4016e",
    "sketch.zip": "369b8b6d78ac61bfcc85f660d878ba5fc701524b82bbc2eb65ca9a",
    "clipart_train.txt": "400985ce2a0878df2d8e54f1996c4fc253e577c1f91136304e553b",
    "clipart_test.txt": "4d34a4a540d8b139499581875e2d18bbedd37c347233523d66beaf",
    "infograph_train.txt": "d9ed4d86e2ea20b44315699964b6b7dc09442f0539300444d9329d",
    "infograph_test.txt": "700f2b5deaad3923b0b8b85aeb694b73f24b13255cf48db3e770eaf",
    "quickdraw_train.txt": "7410e8a1debd769e0412725a0fcc646d83055d297b5f44a92f50308",
    "quickdraw_test.txt": "07a97e84d723f58dea67683ae5ddf013ebc5d33b76deca9a5d34f72",
    "real_train.txt": "a5a510fec614018546510d55c378bca008fcfd51062f6414583639e",
    "real_test.txt": "9586235e335340f065de720f99332bc906aa0ab147006a1a7ea4925",
    "sketch_train.txt": "ee92102f2b98f11765e6a97afbab15c60f2bac6e30fa7e1bc5a7db",
    "sketch_test.txt": "7384fc06670979911d7e1e9a34ba8a6cd20e9e77d6bc3536c739ff4",
}


def _remote(name: str, url: str, unpack: bool) -> Remote:
    digest = _SHA512.get(name)
    return Remote(url, name, f"sha512:{digest}" if digest else None, unpack)


DOWNLOADS = [
    _remote(f"{d}.zip", _ROOT + ("groundtruth/" if d in ("clipart", "painting") else "") + f"{d}.zip", True) for d in DOMAINS
] + [_remote(f"{d}_{s}.txt", f"{_ROOT}domainnet/txt/{d}_{s}.txt", False) for d in DOMAINS for s in ("train", "test")]


def _lists(raw_dir: Path, domain: str) -> list[tuple[str, str, str, int]]:
    """(subset, class folder, relative path as listed, line number) for every line of the domain's split lists."""
    out = []
    for subset in ("train", "test"):
        hits = walk(raw_dir, f"{domain}_{subset}.txt")
        if not hits:
            continue
        form = "'<domain>/<class>/<file> <label>'"
        for n, listed, label, line in list_lines(hits[0], form):
            if len(Path(listed).parts) < 3:
                raise LabelFileError(f"{hits[0]}: line {n}: expected {form}, got {line!r}")
            out.append((subset, Path(listed).parts[-2], listed, int(label) if label.isdigit() else -1))
    return out


def read_records(raw_dir: Path, rules: object = None) -> pd.DataFrame:
    raw_dir = Path(raw_dir)
    dirs = find_dirs(raw_dir, DOMAIN_ALIASES)
    if not dirs:
        raise no_domain_folder(raw_dir, DOMAIN_ALIASES, "DomainNet", ", ".join(DOMAINS))
    frames = []
    for domain in DOMAINS:
        if domain not in dirs:
            continue
        ddir = dirs[domain]
        rows: dict[str, dict] = {}
        for subset, cls_folder, listed, orig in _lists(raw_dir, domain):
            key = "/".join(Path(listed).parts[-2:])
            cls = _NORM_CLASSES.get(norm_name(cls_folder))
            f = ddir / key
            rows[key] = {
                "id": f"{domain}/{key}", "label": CLASSES.index(cls) if cls else -1, "original_label": f"{cls_folder} ({orig})",
                "group": "", "view": "", "path": f.relative_to(raw_dir).as_posix() if cls and f.exists() else "",
                "reader": "image", "excluded": "" if cls else "class not in the 10-class subset", "subset": subset,
            }
        for cdir in sorted(p for p in ddir.iterdir() if p.is_dir() and not is_hidden(p.name)):
            cls = _NORM_CLASSES.get(norm_name(cdir.name))
            if cls is None:
                continue  # other classes: counted from the lists above, their files are never read
            for f in sorted(cdir.iterdir()):
                key = f"{cdir.name}/{f.name}"
                if f.suffix.lower() in IMAGE_SUFFIXES and not is_hidden(f.name) and key not in rows:
                    rows[key] = {
                        "id": f"{domain}/{key}", "label": CLASSES.index(cls), "original_label": cdir.name, "group": "", "view": "",
                        "path": f.relative_to(raw_dir).as_posix(), "reader": "image", "excluded": "", "subset": "",
                    }
        fedbn = fedbn_split_lists(raw_dir, domain, DOMAIN_ALIASES)
        if fedbn:  # FedBN's lists decide the 10 classes' subsets (the other classes keep the official lists' record)
            for key, row in rows.items():
                if not row["excluded"]:
                    row["subset"] = fedbn.get(key, "")
        # every DomainNet domain holds each of the 10 classes (a listed image missing on disk still counts: quarantined)
        require_every_class([r for r in rows.values() if not r["excluded"]], CLASSES, ddir, "DomainNet (10-class subset)")
        frames.append(records_frame(list(rows.values()), domain))
    return pd.concat(frames, ignore_index=True)
