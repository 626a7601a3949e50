"""Two-tier leaf-spine (Clos): every leaf connects to every spine.

planes > 1: that many leaf-spines side by side, sharing nothing but the GPUs: every GPU
has one NIC per plane, into its leaf of that plane (a multi-plane fabric: one 800G NIC
split into planes, each a fabric of its own). Plane 0 is the scale-out network; plane p
is network "plane<p>", addressed 10.(10+p).S.H.
"""
from dataclasses import dataclass

from topologies.base import FabricParams, FabricTopo, plane_network


@dataclass
class LeafSpineParams(FabricParams):
    spines: int = 2
    leaves: int = 2
    hosts_per_leaf: int = 2
    host_rate_mbps: float = 100.0
    fabric_rate_mbps: float = 100.0
    planes: int = 1

    @property
    def oversubscription(self) -> float:
        """Host bandwidth into a leaf / its uplink bandwidth (1.0 = non-blocking)."""
        return (self.hosts_per_leaf * self.host_rate_mbps) / (self.spines * self.fabric_rate_mbps)


class LeafSpine(FabricTopo):
    kind = "leaf-spine"
    Params = LeafSpineParams

    def build(self, p: LeafSpineParams):
        gpus: list[list[str]] = []           # per leaf position, its GPUs
        for plane in range(p.planes):
            spines = [self.add_switch("spine", plane * p.spines + s) for s in range(p.spines)]
            for l in range(p.leaves):
                leaf = self.add_leaf(plane * p.leaves + l, spines, p.fabric_rate_mbps)
                subnet = self.add_subnet(leaf, plane_network(plane), l)
                if plane == 0:
                    gpus.append([self.add_gpu(subnet, leaf, p.host_rate_mbps)
                                 for _ in range(p.hosts_per_leaf)])
                else:
                    for gpu in gpus[l]:
                        self.add_plane_nic(gpu, plane, subnet, leaf, p.host_rate_mbps)
