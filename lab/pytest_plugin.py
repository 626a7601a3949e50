"""A pytest fixture for testing your own ideas against the lab (loaded by pytest
through the `pytest11` entry point once fabriclab is installed).

    import pytest

    @pytest.mark.fabric("leaf-spine", spines=2, leaves=2, hosts_per_leaf=2)
    def test_spraying_balances_the_spines(fabric_lab):
        fabric_lab.transfers([("g0", "g2", 500_000)], transport="mrc")
        ...

`fabric_lab` is a running lab.api.Lab (root needed: it builds namespaces and OVS
switches), its results and report in the test's tmp_path/lab. Without the marker
it is a leaf-spine of 2 spines, 2 leaves and 2 GPU hosts per leaf.
"""
from __future__ import annotations

import pytest

DEFAULT_FABRIC = ("leaf-spine", {"spines": 2, "leaves": 2, "hosts_per_leaf": 2})


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "fabric(topology, **params): the fabric that the "
                                       "fabric_lab fixture builds")


@pytest.fixture
def fabric_lab(request, tmp_path):
    from lab.api import Lab
    marker = request.node.get_closest_marker("fabric")
    topology, params = DEFAULT_FABRIC
    if marker is not None:
        topology = marker.args[0] if marker.args else topology
        params = marker.kwargs
    with Lab(topology, out=tmp_path / "lab", name=request.node.name, **params) as lab:
        yield lab
