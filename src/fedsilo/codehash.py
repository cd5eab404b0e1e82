"""The training code as hashes: what a run's checkpoint key holds of the code, and what a train stage's DVC dependency
is (``data/code/methods/<key>.json`` for the root's, ``data/code/<paper>/<scale>/<key>.json`` for a paper's, written by
each pipeline's ``code_fingerprint`` stage). One file per method in place of the code's folders in each of the
thousands of train stages' deps keeps ``dvc status`` and ``dvc repro`` quick (DVC hashes the folders once, for
``code_fingerprint``), and scopes a code edit: a method's hash covers the code every run shares (:data:`COMMON`, with
what it imports of ``fedsilo.methods``) and the modules its own module imports, directly or through others, so
adding a method, or editing one, reruns that method's runs only; an edit of a module the shared code imports
(``base.py``, ``sharing.py``) reruns every method. ``data/code/train.json`` hashes all of :data:`TRAIN_CODE` (what a
deployment's checkpoint holds)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional

# The parts of the package (relative to src/fedsilo) whose code decides a run's numbers: the ``code_fingerprint`` stage
# depends on them (tests/test_code_reaches_results.py checks it and that every train stage depends on its output),
# and the checkpoint key hashes them.
TRAIN_CODE = ("client", "fl", "methods", "models", "utils", "config/base.py", "config/train.py")
PACKAGE = Path(__file__).resolve().parent


def train_code_files(pkg: Optional[Path] = None, parts: tuple[str, ...] = TRAIN_CODE) -> list[Path]:
    """The source files of ``parts`` (default: :data:`TRAIN_CODE`) under ``pkg`` (default: this package), in the order
    they are hashed."""
    pkg = PACKAGE if pkg is None else Path(pkg)
    out: list[Path] = []
    for part in parts:
        base = pkg / part
        out += sorted(base.rglob("*.py")) if base.is_dir() else [base]
    return out


def code_sha256(files: list[Path], pkg: Path) -> str:
    """sha256 over ``files`` (each one's path below ``pkg`` and its bytes, in the order given; of a naming file of
    the methods package, :data:`NAMING`, its logic only)."""
    h = hashlib.sha256()
    naming = {pkg / n for n in NAMING}
    for f in files:
        h.update(f.relative_to(pkg).as_posix().encode() + b"\0")
        h.update((_naming_logic(f) if f in naming else f.read_bytes()) + b"\0")
    return h.hexdigest()


def train_code_sha256(pkg: Optional[Path] = None) -> str:
    """sha256 over the source files of :data:`TRAIN_CODE` (each one's path below ``pkg`` and its bytes)."""
    pkg = PACKAGE if pkg is None else Path(pkg)
    return code_sha256(train_code_files(pkg), pkg)


# what every method's runs share: all of TRAIN_CODE but the methods package, and of the methods package what that code
# imports (the engine's base.py, sharing.py, pFedDB for onboarding and catch-up: an edit of those reruns every method).
# methods/__init__.py and registry.py import every method and hold the table of names: their logic (resolving a
# method's params, its base) is hashed for every method with their method imports and tables left out, so adding a
# method to them changes no other method's hash
COMMON = tuple(p for p in TRAIN_CODE if p != "methods")
NAMING = ("methods/__init__.py", "methods/registry.py")
NAME_TABLES = ("REGISTRY", "__all__")


def _module_file(pkg: Path, dotted: str) -> Optional[Path]:
    """The source file of ``fedsilo.<dotted>`` under ``pkg`` (a module or a package's ``__init__.py``), if any."""
    base = pkg.joinpath(*dotted.split("."))
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file():
            return f
    return None


def _reexports(pkg: Path) -> dict[str, str]:
    """What ``methods/__init__.py`` imports from its modules: name -> the module (``Method`` -> ``fedsilo.methods.base``),
    so ``from fedsilo.methods import Method`` is followed to base.py."""
    import ast

    init = pkg / "methods" / "__init__.py"
    out: dict[str, str] = {}
    if init.is_file():
        for node in ast.walk(ast.parse(init.read_text(), str(init))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fedsilo.methods.") and not node.level:
                out.update({a.asname or a.name: node.module for a in node.names})
    return out


# a file's parsed imports, by (file, its size and modification time, what the package re-exports): one
# code_fingerprint hashes every methods key of a params file, each key's walk reading the same shared files
_IMPORTS: dict[tuple[Path, int, int, tuple[tuple[str, str], ...]], set[Path]] = {}


def _imported_methods_modules(pkg: Path, f: Path, reexports: dict[str, str]) -> set[Path]:
    """The files of ``fedsilo.methods`` that ``f`` imports anywhere in its text (a function's lazy import too)."""
    st = f.stat()
    key = (f, st.st_size, st.st_mtime_ns, tuple(sorted(reexports.items())))
    if key not in _IMPORTS:
        _IMPORTS[key] = _parse_imports(pkg, f, reexports)
    return set(_IMPORTS[key])


def _parse_imports(pkg: Path, f: Path, reexports: dict[str, str]) -> set[Path]:
    import ast

    package = f.relative_to(pkg).parent.parts  # methods/pfeddb/method.py, methods/pfeddb/__init__.py: ('methods', 'pfeddb')
    out: set[Path] = set()
    for node in ast.walk(ast.parse(f.read_text(), str(f))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, up level - 1
                root = ".".join(package[: len(package) - node.level + 1])
                mod = f"fedsilo.{root}" + (f".{node.module}" if node.module else "")
            else:
                mod = node.module or ""
            names = [mod] + [f"{mod}.{a.name}" for a in node.names]  # `from x import y`: y may be a module of x
            if mod == "fedsilo.methods":  # a name the package re-exports: the module it comes from
                names += [reexports[a.name] for a in node.names if a.name in reexports]
        for name in names:
            if name.startswith("fedsilo.methods"):
                target = _module_file(pkg, name.removeprefix("fedsilo."))
                if target is not None:
                    out.add(target)
    return out


def method_code_files(module: str, pkg: Optional[Path] = None) -> list[Path]:
    """The files a method's runs depend on: :data:`COMMON`'s, the naming files (:data:`NAMING`, hashed without their
    method imports and tables) and, from the method class's module ``module`` (``fedsilo.methods.ditto``) and from
    the common files, every module of ``fedsilo.methods`` they import, directly or through the others."""
    pkg = PACKAGE if pkg is None else Path(pkg)
    start = _module_file(pkg, module.removeprefix("fedsilo."))
    if start is None:
        raise FileNotFoundError(f"{module}: no source file under {pkg}")
    naming = [pkg / n for n in NAMING]
    reexports = _reexports(pkg)
    common = train_code_files(pkg, COMMON)
    seen: set[Path] = set()
    # the naming files import every method: their imports are not followed, only the common code's and the method's
    todo = [start] + sorted({t for f in common for t in _imported_methods_modules(pkg, f, reexports)} - set(naming))
    while todo:
        f = todo.pop()
        if f in seen or f in naming:
            continue
        seen.add(f)
        # importing a module of a subpackage (methods/pfeddb/method.py) runs the subpackage's __init__.py first
        todo += [d / "__init__.py" for d in f.parents if d != pkg / "methods" and pkg / "methods" in d.parents and (d / "__init__.py").is_file()]
        todo += sorted(_imported_methods_modules(pkg, f, reexports) - seen)
    return common + [n for n in naming if n.is_file()] + sorted(seen)


def _naming_logic(f: Path) -> bytes:
    """A naming file's code without its imports of method modules and its name tables (:data:`NAME_TABLES`): what
    adding a method to it leaves as it was."""
    import ast

    tree = ast.parse(f.read_text(), str(f))

    def kept(node: ast.stmt) -> bool:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            return not any(m.startswith("fedsilo.methods") for m in mods)
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        return not any(isinstance(t, ast.Name) and t.id in NAME_TABLES for t in targets)

    tree.body = [n for n in tree.body if kept(n)]
    return ast.unparse(tree).encode()


def method_code_sha256(module: str, pkg: Optional[Path] = None) -> str:
    """sha256 over :func:`method_code_files` (each one's path below ``pkg`` and its bytes; a naming file's logic only)."""
    pkg = PACKAGE if pkg is None else Path(pkg)
    return code_sha256(method_code_files(module, pkg), pkg)
