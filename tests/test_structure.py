"""The code's layers (README, "Architecture"): every import points down.

Each module belongs to its innermost package (lab/kernel/tcnl.py to lab.kernel,
lab/runner.py to lab); a package may import its own modules and the packages of
the layers below it, never a layer above or another package of its own layer.
Read from the source's import statements, without importing anything."""
from __future__ import annotations

import ast
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LAYERS = [                          # lowest first
    {"topologies", "traffic"},      # pure: fabric descriptions, packets, transports
    {"lab.core"},                   # errors, paths, the run lock and process records
    {"lab.kernel"},                 # rtnetlink, namespaces, BPF and the data path, OVS
    {"controllers"},                # the os-ken apps, over controllers/protocol.py
    {"lab.fabric"},                 # the running fabric: network, agents, telemetry
    {"lab.experiments", "lab.vm"},  # what runs on a fabric; the lab VM
    {"lab"},                        # the session: runner, API, CLI, tour, reports
]
LAYER_OF = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def modules(repo: Path = REPO) -> dict[str, tuple[str, Path]]:
    """module name -> (its package, its file), for every module of the lab's packages."""
    out = {}
    for top in ("topologies", "traffic", "controllers", "lab"):
        for f in (repo / top).rglob("*.py"):
            parts = f.relative_to(repo).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = (".".join(parts[:-1]), f)
    return out


def imports(mods: dict[str, tuple[str, Path]]) -> dict[tuple[str, str], str]:
    """(package, imported package) -> one import that makes the edge, for a message."""
    def resolve(name: str) -> str | None:
        while name not in mods and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in mods else None

    edges = {}
    for name, (pkg, f) in mods.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # `from lab.kernel import tcnl` imports lab.kernel.tcnl
                targets = [resolve(f"{node.module}.{a.name}") or resolve(node.module)
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [resolve(a.name) for a in node.names]
            else:
                continue
            for target in filter(None, targets):
                to = mods[target][0] if target != mods[target][0] else target
                if to != pkg:
                    edges.setdefault((pkg, to), f"{name} imports {target}")
    return edges


def test_every_package_has_a_layer():
    packages = {pkg for pkg, _ in modules().values()}
    assert packages <= set(LAYER_OF), f"packages without a layer: {packages - set(LAYER_OF)}"


def test_imports_point_down():
    upward = [why for (pkg, to), why in imports(modules()).items()
              if to in LAYER_OF and LAYER_OF[to] >= LAYER_OF[pkg]]
    assert not upward, "imports that do not point down:\n" + "\n".join(sorted(upward))


def test_the_check_sees_an_import_that_points_up(tmp_path):
    """The check itself: a kernel module importing the running fabric is caught."""
    kernel = tmp_path / "lab" / "kernel"
    kernel.mkdir(parents=True)
    for pkg in ("topologies", "traffic", "controllers", "lab/fabric"):
        (tmp_path / pkg).mkdir(parents=True, exist_ok=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "lab" / "__init__.py").write_text("")
    (tmp_path / "lab" / "fabric" / "network.py").write_text("")
    (kernel / "__init__.py").write_text("")
    (kernel / "tcnl.py").write_text("from lab.fabric.network import FabricNetwork\n")
    edges = imports(modules(tmp_path))
    assert edges == {("lab.kernel", "lab.fabric"): "lab.kernel.tcnl imports lab.fabric.network"}


def test_every_experiment_meets_the_contract_and_a_module_that_does_not_is_named():
    from lab import runner
    from lab.core.errors import LabError
    from lab.experiments import base
    assert len(runner.available()) >= 10      # each checked as it loads
    half = types.ModuleType("lab.experiments.half")
    half.NAME, half.DESCRIPTION = "half", "no claims, no Params"
    half.run = lambda ctx: {}
    with pytest.raises(LabError, match="half is not an experiment: it has no Params, claims"):
        base.check(half)
    assert base.capture_plan(half, None, None).ports == []
    assert base.topology_defaults(half, "leaf-spine") == {} and base.scaled_sizes(half) == ()
