"""Two-tier leaf-spine (Clos): every leaf connects to every spine."""
from dataclasses import dataclass

from topologies.base import FabricParams, FabricTopo


@dataclass
class LeafSpineParams(FabricParams):
    spines: int = 2
    leaves: int = 2
    hosts_per_leaf: int = 2
    host_rate_mbps: float = 100.0
    fabric_rate_mbps: float = 100.0

    @property
    def oversubscription(self) -> float:
        """Host bandwidth into a leaf / its uplink bandwidth (1.0 = non-blocking)."""
        return (self.hosts_per_leaf * self.host_rate_mbps) / (self.spines * self.fabric_rate_mbps)


class LeafSpine(FabricTopo):
    kind = "leaf-spine"
    Params = LeafSpineParams

    def build(self, p: LeafSpineParams):
        spines = [self.add_switch("spine", s) for s in range(p.spines)]
        for l in range(p.leaves):
            leaf = self.add_leaf(l, spines, p.fabric_rate_mbps)
            subnet = self.add_subnet(leaf, "scale-out", l)
            for _ in range(p.hosts_per_leaf):
                self.add_gpu(subnet, leaf, p.host_rate_mbps)
