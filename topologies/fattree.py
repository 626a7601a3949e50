"""Three-tier k-ary fat-tree (Al-Fares et al.): k pods of k/2 edge and k/2
aggregation switches, (k/2)^2 core switches, k/2 hosts per edge: k^3/4 hosts."""
from dataclasses import dataclass

from topologies.base import FabricParams, FabricTopo
from topologies.params import ParamError


@dataclass
class FatTreeParams(FabricParams):
    k: int = 4
    host_rate_mbps: float = 100.0
    fabric_rate_mbps: float = 100.0

    def validate(self) -> None:
        super().validate()
        if self.k % 2:
            raise ParamError(f"k must be even, got {self.k}")


class FatTree(FabricTopo):
    kind = "fat-tree"
    Params = FatTreeParams

    def build(self, p: FatTreeParams):
        half = p.k // 2
        cores = [self.add_switch("core", c) for c in range(half * half)]
        for pod in range(p.k):
            aggs = [self.add_switch("agg", pod * half + a) for a in range(half)]
            # aggregation switch a of every pod reaches cores a*half .. a*half+half-1
            for a, agg in enumerate(aggs):
                for core in cores[a * half:(a + 1) * half]:
                    self.add_fabric_link(agg, core, p.fabric_rate_mbps)
            for e in range(half):
                index = pod * half + e
                edge = self.add_switch("edge", index)
                for agg in aggs:
                    self.add_fabric_link(edge, agg, p.fabric_rate_mbps)
                subnet = self.add_subnet(edge, "scale-out", index)
                for _ in range(half):
                    self.add_gpu(subnet, edge, p.host_rate_mbps)
