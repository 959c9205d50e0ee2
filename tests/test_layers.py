"""The layer table of docs/design.md holds: no module imports from a layer below its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fp16fx"

#: docs/design.md's table, top to bottom: a module may import from its own row and rows above.
LAYERS = [
    ("tree", ["tree", "flat", "segments", "dtensors"]),
    ("scaling", ["scaling"]),
    ("transforms", ["transforms"]),
    (
        "step",
        [
            "consensus",
            "precision",
            "init_arguments",
            "state",
            "prepare",
            "step",
            "saved_format",
            "checkpoint",
        ],
    ),
    ("compile", ["compile"]),
    ("distributed", ["distributed"]),
    ("facade", ["facade", "fp16_utils", "apex_checkpoint"]),
    ("cli", ["cli", "train", "bench", "__main__"]),
]
RANK = {top: rank for rank, (_, tops) in enumerate(LAYERS) for top in tops}


#: ``import fp16fx`` itself: the package's ``__init__`` imports every layer, the bottom one's
#: clients included, so only the bottom layer may import it whole.
WHOLE = "fp16fx.__init__"


def _layer_of(module: str) -> int:
    """Returns the row of ``fp16fx.<top>...``'s layer."""
    if module == WHOLE:
        return len(LAYERS) - 1
    top = module.split(".")[1]
    if top not in RANK:
        raise AssertionError(f"fp16fx.{top} is in no layer of docs/design.md's table")
    return RANK[top]


def _fp16fx_imports(source: str, name: str) -> set[str]:
    """Returns the ``fp16fx.*`` modules that module ``name`` (its text ``source``) imports, at
    the top or inside functions: absolute, relative, or the package whole (:data:`WHOLE`)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "fp16fx":
                    found.add(WHOLE)
                elif alias.name.startswith("fp16fx."):
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # from . import x, from ..y import z: resolved against the package
                package = name.split(".")[: -node.level]
                module = ".".join([*package, module] if module else package)
            if module == "fp16fx":  # from fp16fx import tree, buckets
                found |= {f"fp16fx.{a.name}" for a in node.names}
            elif module.startswith("fp16fx."):
                found.add(module)
    return found


def test_relative_and_whole_package_imports_are_seen():
    """A relative import, or ``import fp16fx`` in a layer above the bottom one, would
    otherwise slip past the table."""
    source = "import fp16fx\nfrom . import flat\nfrom ..transforms import chain\n"
    found = _fp16fx_imports(source, "fp16fx.facade.fast")
    assert found == {WHOLE, "fp16fx.facade", "fp16fx.transforms"}


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_from_a_layer_below_it(path):
    name = "fp16fx." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    own = _layer_of(name)
    upward = sorted(m for m in _fp16fx_imports(path.read_text(), name) if _layer_of(m) > own)
    assert not upward, f"{name} ({LAYERS[own][0]}) imports from a lower layer: {upward}"


def test_the_table_matches_the_docs():
    table = (PACKAGE.parent / "docs" / "design.md").read_text()
    rows = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")]
    layers = [r for r in rows if r not in ("layer", "---")]
    assert [name.split(" /")[0] for name in layers] == [name for name, _ in LAYERS]


#: The table's "may not", where an import shows it: transforms know nothing of FP16, loss
#: scales or flat buffers; the loss-scale math touches no params (nor their buffers).
FORBIDDEN = {
    "transforms": {"fp16fx.flat", "fp16fx.scaling", "fp16fx.dtensors"},
    "scaling": {"fp16fx.flat", "fp16fx.segments", "fp16fx.dtensors"},
}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_what_its_layer_may_not_know(path):
    name = "fp16fx." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    forbidden = FORBIDDEN.get(LAYERS[_layer_of(name)][0], set())
    imported = _fp16fx_imports(path.read_text(), name)
    known = sorted(m for m in imported if any(m == f or m.startswith(f + ".") for f in forbidden))
    assert not known, f"{name} imports {known}, which its layer may not know about"
