"""A code change always reaches the results, and interrupted work leaves nothing behind that changes a hash."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml

from fedsilo.codehash import TRAIN_CODE, train_code_sha256
from fedsilo.utils.io import atomic_dir, atomic_file, clean_stale
from tests.conftest import small_params

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "fedsilo"


def _cli(root: Path, pythonpath: Path, *args: str, wait: bool = True):
    cmd = [sys.executable, "-m", "fedsilo.cli", "--root", str(root), "--params", str(root / "params.yaml"), *args]
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    env.pop("MLFLOW_TRACKING_URI", None)
    if not wait:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return r


def _kill_after_round(proc: subprocess.Popen, ckpt: Path, rnd: int) -> int:
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if ckpt.exists():
            try:
                done = torch.load(ckpt, weights_only=False)["round"]
            except Exception:  # noqa: BLE001 - read between write and rename
                done = 0
            if done >= rnd:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                return done
        time.sleep(0.05)
    raise AssertionError(f"the run ended (rc {proc.returncode}) before round {rnd} could be interrupted")


def test_a_code_edit_is_never_resumed_from_an_old_checkpoint_and_a_finished_run_trains_again(mirror_root, tmp_path):
    """Issue 17.1: a run interrupted mid-way, then the learning-rate line of client/local.py edited (in a copy of the
    package), then the stage rerun: it must start afresh with the new code, not resume the old rounds."""
    pkg = tmp_path / "pkg"
    shutil.copytree(SRC, pkg / "fedsilo", ignore=shutil.ignore_patterns("__pycache__"))
    root = tmp_path / "proj"
    (root / "data").mkdir(parents=True)
    shutil.copytree(mirror_root / "data" / "harmonized", root / "data" / "harmonized")
    # a checkpoint after every round (not auto's timed schedule): the run is interrupted after round 1
    (root / "params.yaml").write_text(yaml.safe_dump(small_params(rounds=4, count_flops=False, checkpoint_every=1)))
    _cli(root, pkg, "split", "--experiment", "quick")
    train = ("train", "--experiment", "quick", "--method", "fedavg", "--seed", "0")
    ckpt = root / "state" / "quick" / "fedavg" / "seed0" / "checkpoint.pt"

    killed_at = _kill_after_round(_cli(root, pkg, *train, wait=False), ckpt, 1)
    assert killed_at < 4
    old = torch.load(ckpt, weights_only=False)

    local = pkg / "fedsilo" / "client" / "local.py"
    code = local.read_text()
    sgd = "torch.optim.SGD(params, lr=lr_now(cfg.lr),"  # the optimizer FedAvg trains with (train.optimizer: sgd)
    assert code.count(sgd) == 1
    local.write_text(code.replace(sgd, "torch.optim.SGD(params, lr=lr_now(cfg.lr) * 0.1,"))
    # what a run killed while writing its outputs leaves beside them: removed when the stage starts again
    stale = [root / "results" / "quick" / "fedavg" / ".seed0.abc_123.tmp", root / "results" / "quick" / "fedavg" / ".seed0.xyz987.old"]
    for s in stale:
        (s / "x").mkdir(parents=True)
    (stale[0] / "final_model.pt").write_bytes(b"trunc")

    _cli(root, pkg, *train)
    run = root / "results" / "quick" / "fedavg" / "seed0"
    met = json.loads((run / "metrics.json").read_text())
    hist = json.loads((run / "history.json").read_text())
    assert met["config_hash"] != old["config_hash"] and met["code"]["source_sha256"]
    assert [h["round"] for h in hist] == list(range(1, 5))  # trained from round 1, not resumed after killed_at
    assert hist[0]["eval"] != old["history"][0]["eval"], "round 1 should be the edited code's round 1"
    assert not any(s.exists() for s in stale)
    assert not ckpt.exists(), "a finished run keeps no checkpoint: `dvc repro -f` trains it again"
    # (that a rerun of the same code and params gives the same numbers is test_resume_tracking's keep_client_models case)


def test_the_code_hash_covers_each_files_path_as_well_as_its_bytes(tmp_path):
    """A module renamed (moved from fl/ to utils/, or within a package) is another program even with the same bytes:
    the hash takes each file's path below the package with its contents."""
    for part in TRAIN_CODE:
        f = tmp_path / part if part.endswith(".py") else tmp_path / part / "__init__.py"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(f"# {part}\n")
    (tmp_path / "fl" / "engine.py").write_text("ROUNDS = 3\n")
    before = train_code_sha256(tmp_path)
    (tmp_path / "fl" / "engine.py").rename(tmp_path / "fl" / "runner.py")
    assert train_code_sha256(tmp_path) != before
    (tmp_path / "fl" / "runner.py").rename(tmp_path / "fl" / "engine.py")
    assert train_code_sha256(tmp_path) == before


def test_a_methods_code_follows_its_imports_of_every_form_and_nothing_else(tmp_path):
    """A method's files: the common code, the naming files, and every module of the methods package it or the common
    code imports: absolute, relative, ``from package import module``, a name the package re-exports, inside a
    function, a subpackage's module with its ``__init__.py``, through other modules; not a method nothing imports. A
    name added to ``__all__`` changes no method's hash; an import added is followed in the same process."""
    from fedsilo.codehash import method_code_files, method_code_sha256

    files = {
        "client/__init__.py": "", "models/__init__.py": "", "utils/__init__.py": "", "config/base.py": "",
        "config/train.py": "", "fl/__init__.py": "from fedsilo.methods import Method\n",
        "methods/__init__.py": "from fedsilo.methods.base import Method\nfrom fedsilo.methods.alpha import Alpha\n"
                               "__all__ = ['Method', 'Alpha']\n",
        "methods/registry.py": "from fedsilo.methods.alpha import Alpha\nREGISTRY = {'alpha': Alpha}\n",
        "methods/base.py": "", "methods/helpers.py": "", "methods/rel.py": "", "methods/lazy.py": "", "methods/beta.py": "",
        "methods/sub/__init__.py": "", "methods/sub/deep.py": "from ..rel import R\n",
        "methods/alpha.py": "from fedsilo.methods import helpers\nfrom fedsilo.methods.sub.deep import D\n\n\n"
                            "def build():\n    import fedsilo.methods.lazy\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)

    def methods_files() -> set[str]:
        got = {f.relative_to(tmp_path).as_posix() for f in method_code_files("fedsilo.methods.alpha", tmp_path)}
        return {f for f in got if f.startswith("methods/")}

    assert methods_files() == {"methods/__init__.py", "methods/registry.py", "methods/base.py", "methods/alpha.py",
                               "methods/helpers.py", "methods/sub/__init__.py", "methods/sub/deep.py", "methods/rel.py",
                               "methods/lazy.py"}
    before = method_code_sha256("fedsilo.methods.alpha", tmp_path)
    init = tmp_path / "methods" / "__init__.py"
    init.write_text("from fedsilo.methods.beta import Beta\n" + files["methods/__init__.py"].replace("'Alpha']", "'Alpha', 'Beta']"))
    assert method_code_sha256("fedsilo.methods.alpha", tmp_path) == before
    (tmp_path / "methods" / "lazy.py").write_text("from fedsilo.methods import beta\n")
    assert "methods/beta.py" in methods_files()


def test_every_train_stage_depends_on_the_code_its_checkpoint_key_hashes():
    """Each pipeline's code_fingerprint stage depends on the code the checkpoint key hashes and writes one file per
    method (the root's also the hash of all of it); every train stage of every dvc.yaml depends on its method's file,
    every onboard stage on pFedDB's (one file in place of the code's folders per stage)."""
    files = subprocess.run(["git", "ls-files", "*dvc.yaml"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    assert "dvc.yaml" in files and len(files) >= 8
    code_deps = {f"src/fedsilo/{p}" for p in TRAIN_CODE} | {"src/fedsilo/codehash.py"}
    code = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["code_fingerprint"]
    assert code["cmd"] == "fedsilo code-fingerprint" and code["outs"] == ["data/code/train.json", "data/code/methods"]
    assert set(code["deps"]) == code_deps | {"data/checked/params.json"} and code["params"] == ["methods"]
    # the hash reads the source files (*.py): the training code holds no other file it would miss
    tracked = subprocess.run(["git", "ls-files", *(f"src/fedsilo/{p}" for p in TRAIN_CODE)], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.split()
    assert tracked and all(f.endswith(".py") for f in tracked)
    seen = data_stages = 0
    for f in files:
        stages = yaml.safe_load((REPO / f).read_text())["stages"]
        method_code = "data/code/methods" if f == "dvc.yaml" else "data/code/${paper}/${scale}"
        if f != "dvc.yaml":  # a paper's own code stage: its methods keys, into its own folder
            own = stages["code_fingerprint"]
            assert set(own["deps"]) == code_deps | {"data/checked/${paper}/${scale}/params.json"} and own["outs"] == [method_code], f
            assert own["cmd"] == "fedsilo --params ${params_file} code-fingerprint" and own["params"] == [{"${params_file}": ["methods"]}], f
        for name, st in stages.items():
            body = st.get("do", st)
            cmd = str(body.get("cmd", ""))
            # a split's and a dataset's own code, their params' schemas with it: a changed default rebuilds them
            if " split " in cmd:
                data_stages += 1
                assert {"src/fedsilo/data/splits.py", "src/fedsilo/config/base.py", "src/fedsilo/config/split.py"} <= set(body["deps"]), f
            if " harmonize " in cmd:
                data_stages += 100
                assert {"src/fedsilo/data", "src/fedsilo/config/base.py", "src/fedsilo/config/data.py"} <= set(body["deps"]), f
            if " train " in cmd:
                seen += 1
                assert f"{method_code}/${{item.method}}.json" in body.get("deps", []), f"{f}: stage {name} does not depend on its method's code"
            elif " onboard " in cmd:  # pFedDB's onboarding: its code file (the shared code imports the onboarding module)
                assert f"{method_code}/pfeddb.json" in body.get("deps", []), f"{f}: stage {name} does not depend on the training code"
    assert seen >= 8 and data_stages == 100 + len(files)  # the root's harmonize, a split stage in every file


def test_under_dvc_code_fingerprint_refuses_a_checkout_whose_code_is_not_the_code_that_runs(tmp_path, capsys, monkeypatch):
    """A second checkout beside a virtual environment installed from the first: `dvc repro` there hashed the second
    checkout's code into dvc.lock while its train stages ran the first's (said in a warning). Under DVC (its DVC_STAGE
    set) a difference in the training code is refused and nothing written; the same code elsewhere is no difference;
    by hand it is a warning (a run's metrics.json names the code that ran)."""
    from fedsilo.cli import main

    pkg = tmp_path / "src" / "fedsilo"
    shutil.copytree(SRC, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setenv("DVC_STAGE", "code_fingerprint")
    assert main(["-q", "--root", str(tmp_path), "code-fingerprint"]) == 0  # a copy of the same code
    assert "whose training code is not this checkout's" not in capsys.readouterr().err
    written = (tmp_path / "data/code/train.json").read_text()
    (pkg / "methods" / "fedbn.py").write_text((pkg / "methods" / "fedbn.py").read_text() + "# an edit in this checkout\n")
    assert main(["-q", "--root", str(tmp_path), "code-fingerprint"]) == 2
    err = capsys.readouterr().err
    assert f"fedsilo runs from {SRC}, whose training code is not this checkout's {pkg}" in err and f"PYTHONPATH={pkg.parent}" in err
    assert (tmp_path / "data/code/train.json").read_text() == written  # nothing written
    monkeypatch.delenv("DVC_STAGE")
    assert main(["-q", "--root", str(tmp_path), "code-fingerprint"]) == 0
    assert "whose training code is not this checkout's" in capsys.readouterr().err


def test_the_code_fingerprint_is_the_checkpoint_keys_and_follows_any_edit_of_the_training_code(tmp_path, capsys):
    """`fedsilo code-fingerprint` writes the sha256 of the checkout's training code (its --root's src/fedsilo), the
    one the checkpoint key holds of the code it runs (code_fingerprint's source_sha256); an edit of any training-code
    file, a comment in a method, changes it; a file outside the training code (the report's) does not; a root
    without src/fedsilo is refused."""
    from fedsilo.cli import main
    from fedsilo.fl.run import code_fingerprint

    assert main(["-q", "--root", str(tmp_path), "code-fingerprint"]) == 2
    assert "src/fedsilo: no such folder: code-fingerprint hashes the training code of the checkout" in capsys.readouterr().err
    pkg = tmp_path / "src" / "fedsilo"
    shutil.copytree(SRC, pkg, ignore=shutil.ignore_patterns("__pycache__"))

    def written() -> dict:
        assert main(["-q", "--root", str(tmp_path), "code-fingerprint"]) == 0
        return json.loads((tmp_path / "data/code/train.json").read_text())

    def of_methods() -> dict:
        return {f.stem: json.loads(f.read_text()) for f in (tmp_path / "data/code/methods").glob("*.json")}

    first = written()
    assert first["sha256"] == train_code_sha256() == code_fingerprint("cpu")["source_sha256"] and first["files"] > 50
    # one file per methods key of the params file: the code its runs depend on, the hash its runs' checkpoints hold
    by = of_methods()
    assert set(by) == set(yaml.safe_load((REPO / "params.yaml").read_text())["methods"])
    assert by["fedbn"]["module"] == "fedsilo.methods.fedbn" and "methods/sharing.py" in by["fedbn"]["files"]
    assert "methods/ditto.py" not in by["fedbn"]["files"] and "methods/registry.py" in by["fedbn"]["files"]  # its logic only
    assert {"methods/pfeddb/__init__.py", "methods/pfeddb/model.py", "methods/phased.py"} <= set(by["pfeddb"]["files"])
    assert by["fedbn"]["sha256"] == code_fingerprint("cpu", "fedsilo.methods.fedbn")["source_sha256"]
    (pkg / "report" / "__init__.py").write_text((pkg / "report" / "__init__.py").read_text() + "# a comment\n")
    assert written() == first and of_methods() == by
    # of the params code, the whole file's checks and loaders, the data's and the splits' schemas and the error
    # messages retrain nothing (the harmonize and split stages depend on theirs; a split reaches a run through its file)
    for part in ("pipeline", "errors", "data", "split"):
        (pkg / "config" / f"{part}.py").write_text((pkg / "config" / f"{part}.py").read_text() + "# a comment\n")
    assert written() == first and of_methods() == by
    # a method's module edited: its own file changes, not the others'
    (pkg / "methods" / "fedbn.py").write_text((pkg / "methods" / "fedbn.py").read_text() + "# a comment\n")
    assert written()["sha256"] != first["sha256"] == train_code_sha256()
    after = of_methods()
    assert {k for k in by if after[k]["sha256"] != by[k]["sha256"]} == {"fedbn"}
    # a method added (a module nothing imports yet): no method's file changes; a base edited: each built on it
    (pkg / "methods" / "fedavgm.py").write_text('"""A new method."""\n\n\nclass FedAvgM:\n    name = "fedavgm"\n')
    registry = pkg / "methods" / "registry.py"  # and registered: its import and its place in the table
    table = registry.read_text()
    assert table.count("    for cls in (") == 1  # the table's first entry: whatever else a contributor registered
    registry.write_text("from fedsilo.methods.fedavgm import FedAvgM\n" + table.replace("    for cls in (", "    for cls in (FedAvgM, "))
    written()
    assert of_methods() == after
    assert "methods/fedavgm.py" not in after["fedbn"]["files"] and "methods/pfeddb/onboarding.py" in after["fedbn"]["files"]
    # the registry's own logic (resolving a method's params and base) runs in every run: an edit of it reruns them all
    registry.write_text(registry.read_text() + "\n\ndef _resolved_otherwise() -> int:\n    return 1\n")
    written()
    assert all(v["sha256"] != after[k]["sha256"] for k, v in of_methods().items())
    after = of_methods()
    (pkg / "methods" / "sharing.py").write_text((pkg / "methods" / "sharing.py").read_text() + "# a comment\n")
    written()
    changed = {k for k, v in of_methods().items() if v["sha256"] != after[k]["sha256"]}
    assert {"fedavg", "fedprox", "fedbn", "pfeddb", "single"} == changed
    # how a run trains (its params' defaults and checks): every method's runs
    after = of_methods()
    (pkg / "config" / "train.py").write_text((pkg / "config" / "train.py").read_text() + "# a comment\n")
    written()
    assert all(v["sha256"] != after[k]["sha256"] for k, v in of_methods().items())


def test_the_whole_files_checks_change_no_value_of_a_runs_training():
    """The whole params file's checks and loaders (config/pipeline.py, outside every run's code hash) leave each
    experiment's train and onboarding sections as config/train.py alone makes them: the root's params.yaml and each
    paper's file at both scales (a paper-scale file's own sections; joining it with the root needs its datasets there)."""
    from fedsilo.config import ExperimentParams, PaperParams, load_params

    files = [REPO / "params.yaml", *sorted(REPO.glob("pipelines/*/params.yaml")), *sorted(REPO.glob("pipelines/*/paper/params.yaml"))]
    seen = 0
    for f in files:
        raw = yaml.safe_load(f.read_text())
        whole = PaperParams.model_validate(raw) if f.parent.name == "paper" else load_params(f)
        for e, ex in raw["experiments"].items():
            alone = ExperimentParams.model_validate(ex)
            assert (whole.experiments[e].train, whole.experiments[e].onboarding) == (alone.train, alone.onboarding), f"{f}: {e}"
            seen += 1
    assert len(files) == 11 and seen > 100


def _config_names_used(path: Path) -> set[str]:
    """The names a module takes from fedsilo.config: ``from fedsilo.config import X`` and ``config.X`` after ``from
    fedsilo import config``."""
    import ast

    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    aliased = False
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "fedsilo.config":
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module == "fedsilo" and any(a.name == "config" for a in node.names):
            aliased = True
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fedsilo.config."):
            names |= {f"{node.module}:{a.name}" for a in node.names}
    if aliased:
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "config"}
    return names


def test_the_params_code_a_run_hashes_holds_what_the_training_code_takes_from_it():
    """Of fedsilo.config, every run's code hash holds base.py and train.py only (TRAIN_CODE): whatever else the training
    code takes from the package is a message (errors.py) or the whole file's loaders and checks (pipeline.py), which
    change no value of a run's section (the next test); config/__init__.py only gathers names. fl/predict.py (a trained
    model's predictions on new images) prepares them by the dataset's harmonization (data.py): no run's training."""
    import ast

    hashed = {f"fedsilo.{p.removesuffix('.py').replace('/', '.')}" for p in TRAIN_CODE if p.startswith("config/")}
    assert hashed == {"fedsilo.config.base", "fedsilo.config.train"}
    loaders = {"Params", "parse_params", "load_params"}  # the whole params file, read and checked
    init = ast.parse((SRC / "config" / "__init__.py").read_text())
    assert all(isinstance(n, ast.ImportFrom) or (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)) for n in init.body)
    defined: dict[str, str] = {}  # a name of the package -> the module that defines it
    for f in (SRC / "config").glob("*.py"):
        for n in ast.parse(f.read_text()).body:
            targets = [n.name] if isinstance(n, (ast.FunctionDef, ast.ClassDef)) else [
                t.id for t in [*getattr(n, "targets", []), *([n.target] if isinstance(n, ast.AnnAssign) else [])] if isinstance(t, ast.Name)]
            defined.update(dict.fromkeys(targets, f"fedsilo.config.{f.stem}"))
    assert defined["TrainParams"] == "fedsilo.config.train" and defined["Params"] == "fedsilo.config.pipeline"

    checked = 0
    for part in TRAIN_CODE:
        if part.startswith("config/"):
            continue
        base = SRC / part
        for f in sorted(base.rglob("*.py")) if base.is_dir() else [base]:
            for name in _config_names_used(f):
                checked += 1
                name = name.split(":")[-1]
                where = defined.get(name, "nowhere in fedsilo.config")
                ok = where in hashed or where == "fedsilo.config.errors" or name in loaders or (
                    f.relative_to(SRC).as_posix() == "fl/predict.py" and where == "fedsilo.config.data")
                assert ok, f"{f.relative_to(SRC)} takes {name} from {where}, which no run's code hash holds"
    assert checked > 30


_HOLD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from fedsilo.utils.io import atomic_dir, atomic_file
    kind, target = sys.argv[1], Path(sys.argv[2])
    with (atomic_dir(target) if kind == "dir" else atomic_file(target)) as tmp:
        if kind == "dir":
            (tmp / "part.bin").write_bytes(b"half")
        else:
            tmp.write_bytes(b"half")
        print("inside", flush=True)
        time.sleep(60)
    """
)


@pytest.mark.parametrize("kind,target", [("dir", "data/raw/pacs"), ("dir", "results/quick/fedbn/seed1"), ("file", "state/quick/fedbn/seed1/checkpoint.pt")])
def test_a_write_killed_with_sigkill_leaves_nothing_the_next_write_or_dvc_sees(tmp_path, kind, target):
    """Issue 17.2: a fetch, a train output or a checkpoint killed midway leaves a temporary sibling; DVC ignores it
    (.dvcignore) and the next write of the same path removes it, never touching a neighbour's (seed10 beside seed1)."""
    path = tmp_path / target
    path.parent.mkdir(parents=True)
    neighbour = path.parent / f".{path.name}0.abcd1234.tmp"  # e.g. seed10's temporary: not ours
    neighbour.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, kind, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "inside"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = [p for p in path.parent.iterdir() if p != neighbour]
    assert len(left) == 1 and left[0].name.startswith(f".{path.name}.") and left[0].name.endswith(".tmp")
    rel = left[0].relative_to(tmp_path).as_posix()
    dvc = shutil.which("dvc", path=str(Path(sys.executable).parent))
    if dvc:
        r = subprocess.run([dvc, "check-ignore", "-q", rel], cwd=REPO, capture_output=True)
        assert r.returncode == 0, f"{rel} is not ignored by .dvcignore"
        r = subprocess.run([dvc, "check-ignore", "-q", target], cwd=REPO, capture_output=True)
        assert r.returncode != 0, f"{target} itself must not be ignored"
    writer = atomic_dir if kind == "dir" else atomic_file
    with writer(path) as tmp:
        if kind == "dir":
            (tmp / "ok").write_text("done")
        else:
            tmp.write_text("done")
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, neighbour.name])
    assert clean_stale(path) == []


def test_a_failed_rename_puts_the_previous_result_back(tmp_path, monkeypatch):
    """A permission error while swapping a new result in leaves the old result in place and no `.old` folder."""
    import fedsilo.utils.io as io

    out = tmp_path / "seed0"
    with atomic_dir(out) as tmp:
        (tmp / "metrics.json").write_text("old")
    real = os.replace

    def refuse_new(src, dst):
        if Path(src).name.endswith(".tmp") and Path(dst) == out:
            raise PermissionError(13, "Permission denied", str(dst))
        return real(src, dst)

    monkeypatch.setattr(io.os, "replace", refuse_new)
    with pytest.raises(PermissionError):
        with atomic_dir(out) as tmp:
            (tmp / "metrics.json").write_text("new")
    assert (out / "metrics.json").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["seed0"]


def test_atomic_outputs_get_the_permissions_of_an_ordinary_write(tmp_path):
    """Issue 17.10: results were created 0700/0600 (mkdtemp/mkstemp), unreadable to others' tools."""
    old = os.umask(0o022)
    try:
        with atomic_dir(tmp_path / "seed0") as tmp:
            (tmp / "history.json").write_text("{}")
            from fedsilo.utils.io import write_json

            write_json(tmp / "metrics.json", {"a": 1})
        assert (tmp_path / "seed0").stat().st_mode & 0o777 == 0o755
        assert (tmp_path / "seed0" / "metrics.json").stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(old)
