"""Fabric topologies: each a Mininet Topo class with a parameter dataclass (registry.py),
and the plain description they produce (fabric.py), which needs no Mininet."""
