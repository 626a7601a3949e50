"""All-reduce across every GPU host, on real packets: random float32 tensors of
`size_mb`, or one value per host (`values=0.7,0.9,0.6,0.8`: the teaching example,
where every host ends up holding 0.75)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from lab.core.errors import UsageError
from lab.experiments.base import Claim, RunContext
from lab.experiments.common import floor_time_s, model_time_s
from lab.fabric import collective

log = logging.getLogger(__name__)
NAME = "allreduce"
DESCRIPTION = "all-reduce on every GPU host (ring, tree or hier): each result checked, nccl-tests figures"

SCALED_SIZES = ("size_mb",)   # shrink with the link rates on a slow machine (calibrate.py)
# flow ends busy at once at the defaults (a ring over 4: each sends and receives)
BUSY_ENDS = 8

@dataclass
class Params:
    topology: str = "leaf-spine"
    size_mb: float = 1.0          # per GPU
    values: str = ""              # one number per GPU host instead (comma-separated)
    transport: str = "rc"
    algorithm: str = "ring"
    seed: int = 1

    def numbers(self) -> list[float]:
        try:
            return [float(v) for v in self.values.split(",") if v.strip()]
        except ValueError:
            raise UsageError(f"values takes numbers separated by commas, got "
                             f"{self.values!r}") from None

    def validate(self) -> None:
        self.numbers()
        if self.size_mb <= 0:
            raise UsageError(f"size_mb must be positive, got {self.size_mb}")
        if self.algorithm not in collective.ALGORITHMS:
            raise UsageError(f"algorithm must be one of {', '.join(collective.ALGORITHMS)}, "
                             f"got {self.algorithm!r}")
        if self.algorithm == "hier" and self.topology != "rack":
            raise UsageError("algorithm=hier runs inside racks: it needs topology=rack")
        if self.transport not in collective.TRANSPORTS:
            raise UsageError(f"transport must be one of {', '.join(collective.TRANSPORTS)}, "
                             f"got {self.transport!r}")


def tensors_for(p: Params, n_hosts: int) -> list[np.ndarray]:
    if p.values:
        values = p.numbers()
        if len(values) != n_hosts:
            raise UsageError(f"values gives {len(values)} numbers but the fabric has {n_hosts} "
                             f"GPU hosts: give one per host, or shape the fabric (e.g. --set "
                             f"leaves=2 --set hosts_per_leaf=2 for 4)")
        return [np.array([v], np.float32) for v in values]
    elems = max(1, int(p.size_mb * 1e6 / 4))
    rng = np.random.default_rng(p.seed)
    return [rng.standard_normal(elems).astype(np.float32) for _ in range(n_hosts)]


def run(ctx: RunContext) -> dict:
    p = ctx.params
    n = len(ctx.fabric.hosts)
    tensors = tensors_for(p, n)
    log.info(f"{p.algorithm} all-reduce of {tensors[0].nbytes:,} bytes per GPU over {n} "
             f"GPU hosts ({p.transport})")
    m = collective.run(ctx.net, tensors, p.transport, algorithm=p.algorithm)
    if p.values:    # small enough to show: what each host gave and what it holds now
        for h, v in m["per_host"].items():
            log.info(f"  {h}: {v['gave']:g} -> {v['holds']:g}")
    racks = len({h.rack for h in ctx.fabric.hosts}) if p.algorithm == "hier" else 1
    up = ctx.fabric.hosts[0].interface("scale-up").rate_mbps if p.algorithm == "hier" else 0.0
    m["model_time_s"] = model_time_s(p.algorithm, n, m["size_bytes"], m["link_rate_mbps"],
                                     racks, up)
    m["floor_time_s"] = floor_time_s(p.algorithm, n, m["size_bytes"], m["link_rate_mbps"],
                                     racks, up)
    for key in ("results", "expected"):
        m.pop(key)
    log.info(f"time {m['time_s'] * 1000:.1f} ms, busbw {m['busbw_mbps']:.1f} Mb/s "
             f"({m['busbw_over_link']:.0%} of the {m['link_rate_mbps']:.0f} Mb/s link)")
    return m


def claims(params: Params, m: dict) -> list[Claim]:
    if params.values:
        mean = float(np.mean(np.array(params.numbers(), np.float32)))
        agree = Claim("every GPU host holds the mean of the values", m["agree"],
                      {h: v["holds"] for h, v in m["per_host"].items()},
                      f"{mean:g} on every host")
    else:
        agree = Claim("every GPU host holds the numpy mean", m["agree"], m["max_abs_error"],
                      f"<= {m['tolerance']:.2e}")
    return [
        agree,
        Claim("no faster than the wire allows (the alpha-beta bandwidth term, less a "
              "token bucket's burst per phase)",
              m["time_s"] >= m["floor_time_s"], round(m["time_s"], 4),
              f">= {m['floor_time_s']:.4f} s (bandwidth term {m['model_time_s']:.4f} s)",
              "s"),
    ]
