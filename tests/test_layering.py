"""The package's subpackages import downward only: engine (the application: CLI, config, loop) ->
integrations -> train -> rollout -> quant -> kernels. Read from the source with `ast`, so imports inside
functions count, and so do module names written out whole as strings (importlib.import_module)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent  # the repository root is the package `bitrl`
LAYERS = ["kernels", "quant", "rollout", "train", "integrations", "engine"]  # lowest first
RANK = {name: i for i, name in enumerate(LAYERS)}
MODULE_NAME = re.compile(r"bitrl(\.\w+)+")


def module_of(path: Path) -> list[str]:
    """["bitrl", "rollout", "decoder"] for rollout/decoder.py; a package's __init__.py is the package."""
    parts = ["bitrl", *path.relative_to(ROOT).with_suffix("").parts]
    return parts[:-1] if parts[-1] == "__init__" else parts


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every bitrl import in the file: top level or lazy, absolute or
    relative, and every string constant that is a whole bitrl module name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_of(path) if path.name == "__init__.py" else module_of(path)[:-1]  # what `.` means
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                names = [node.module] if node.module else [alias.name for alias in node.names]
                found += [(node.lineno, ".".join([*base, name])) for name in names]
            elif node.module == "bitrl":  # `from bitrl import rollout` names a subpackage, `__version__` not
                found += [
                    (node.lineno, f"bitrl.{a.name}" if (ROOT / a.name).is_dir() else "bitrl")
                    for a in node.names
                ]
            else:
                found.append((node.lineno, node.module))
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and MODULE_NAME.fullmatch(node.value)
        ):
            found.append((node.lineno, node.value))
    return [(line, name) for line, name in found if name == "bitrl" or name.startswith("bitrl.")]


def package_files() -> list[Path]:
    return sorted(f for layer in LAYERS for f in (ROOT / layer).rglob("*.py"))


def test_every_subpackage_has_a_layer():
    """A new subpackage must be placed in LAYERS before it can import or be imported."""
    shipped = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert shipped == set(LAYERS), shipped ^ set(LAYERS)


def test_the_root_package_imports_nothing():
    """`import bitrl` (done by any `bitrl.x` import) must not pull in a subpackage."""
    assert imported_modules(ROOT / "__init__.py") == []


@pytest.mark.parametrize("path", package_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_go_downward_only(path):
    layer = module_of(path)[1]
    upward = []
    for line, name in imported_modules(path):
        target = name.split(".")[1] if "." in name else None  # bare `bitrl`: the root, which imports nothing
        if target is not None and target != layer and RANK.get(target, len(LAYERS)) > RANK[layer]:
            upward.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not upward, f"{layer} sits below them in {' -> '.join(reversed(LAYERS))}:\n" + "\n".join(upward)


def test_the_check_sees_lazy_relative_and_string_imports(tmp_path, monkeypatch):
    """The parser itself: an import inside a function, relative ones and a module name given as a string are
    all found; a docstring naming a module is not an import."""
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    module = tmp_path / "rollout" / "sub" / "mod.py"
    module.parent.mkdir(parents=True)
    (tmp_path / "kernels").mkdir()
    module.write_text(
        "def f():\n"
        "    from bitrl.train import lora\n"
        "from ...engine import loop\n"
        "from .. import decoder\n"
        "from bitrl import kernels, __version__\n"
        "NAME = 'bitrl.engine.cli'\n"
        "DOC = 'see bitrl.engine.cli for more'\n"
    )
    assert sorted(imported_modules(module)) == [
        (2, "bitrl.train"),
        (3, "bitrl.engine"),
        (4, "bitrl.rollout.decoder"),
        (5, "bitrl"),
        (5, "bitrl.kernels"),
        (6, "bitrl.engine.cli"),
    ]
