"""GPU racks: a fast scale-up domain per rack beside a slower scale-out network.

Each rack has an NVSwitch stand-in; every GPU has a scale-up NIC into it (by
default 9x the scale-out rate: NVLink's 900 GB/s per GPU against a 100 GB/s
NIC) and a scale-out NIC into the rack's leaf of a leaf-spine.

planes > 1: the scale-out network is that many leaf-spines side by side (a leaf per rack
and `spines` spines in each), every GPU a scale-out NIC port on each, as on a multi-plane
leaf-spine (topologies/leafspine.py); the scale-up domain stays one per rack.
"""
from dataclasses import dataclass

from topologies.base import FabricParams, FabricTopo, plane_network


@dataclass
class RackParams(FabricParams):
    racks: int = 2
    gpus_per_rack: int = 4
    spines: int = 2
    scaleout_rate_mbps: float = 100.0
    fabric_rate_mbps: float = 100.0
    scaleup_factor: float = 9.0
    planes: int = 1

    @property
    def scaleup_rate_mbps(self) -> float:
        return self.scaleout_rate_mbps * self.scaleup_factor


class Rack(FabricTopo):
    kind = "rack"
    Params = RackParams

    def build(self, p: RackParams):
        spines = [self.add_switch("spine", s) for s in range(p.spines)]
        gpus: list[list[str]] = []           # per rack, its GPUs
        for r in range(p.racks):
            leaf = self.add_leaf(r, spines, p.fabric_rate_mbps)
            nvswitch = self.add_switch("nvswitch", r)
            scaleout = self.add_subnet(leaf, "scale-out", r)
            scaleup = self.add_subnet(nvswitch, "scale-up", r)
            gpus.append([])
            for _ in range(p.gpus_per_rack):
                gpu = self.add_gpu(scaleout, leaf, p.scaleout_rate_mbps, rack=r)
                self.add_scaleup_nic(gpu, scaleup, nvswitch, p.scaleup_rate_mbps)
                gpus[r].append(gpu)
        for plane in range(1, p.planes):
            spines = [self.add_switch("spine", plane * p.spines + s) for s in range(p.spines)]
            for r in range(p.racks):
                leaf = self.add_leaf(plane * p.racks + r, spines, p.fabric_rate_mbps)
                subnet = self.add_subnet(leaf, plane_network(plane), r)
                for gpu in gpus[r]:
                    self.add_plane_nic(gpu, plane, subnet, leaf, p.scaleout_rate_mbps)
