"""The topology registry: name -> Topo class, and parameters from user input."""
from __future__ import annotations

import dataclasses

from topologies.base import FabricTopo
from topologies.fattree import FatTree
from topologies.leafspine import LeafSpine
from topologies.params import ParamError, parse_value
from topologies.rack import Rack

TOPOLOGIES: dict[str, type[FabricTopo]] = {
    cls.kind: cls for cls in (LeafSpine, Rack, FatTree)
}


def make_params(kind: str, **values):
    """The parameter dataclass of topology `kind`, from keyword values
    (strings are converted to the field's type). Raises ParamError."""
    if kind not in TOPOLOGIES:
        raise ParamError(f"unknown topology {kind!r}; choose one of {', '.join(TOPOLOGIES)}")
    cls = TOPOLOGIES[kind].Params
    fields = {f.name: f for f in dataclasses.fields(cls)}
    converted = {}
    for key, value in values.items():
        if key not in fields:
            raise ParamError(f"topology {kind} has no parameter {key!r} "
                             f"(it has: {', '.join(fields)})")
        converted[key] = parse_value(key, value, fields[key].type)
    params = cls(**converted)
    params.validate()
    return params


def build_topo(kind: str, **values) -> FabricTopo:
    params = make_params(kind, **values)
    return TOPOLOGIES[kind](params)


