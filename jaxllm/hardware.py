"""Hardware profiles for predicting step time and memory fit before anything runs."""

from __future__ import annotations

import dataclasses
import math

from jaxllm.config import ConfigError
from jaxllm.mesh import host_split

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Hardware:
  name: str
  description: str
  peak_flops: float        # dense bf16 FLOP/s of one device
  memory: float            # bytes of one device's memory
  devices_per_node: int
  intra_node_bw: float     # bus bandwidth of a ring collective inside a node, bytes/s per device
  inter_node_bw: float     # the same across nodes (one NIC per device)
  # Fraction of peak that large matmuls reach: the step's compute is timed at this rate.
  matmul_efficiency: float = 0.8
  # Start-up cost of one collective (small-message NCCL latency, roughly), inside / across nodes.
  intra_node_latency: float = 10e-6
  inter_node_latency: float = 20e-6


# H100 figures: ../docs performance model (NCCL bus bandwidth ~370 GB/s on NVLink4, 46–48 GB/s
# per 400 Gb/s InfiniBand NIC, an 8192³ bf16 matmul at ~81% of peak). A100: NVLink3 rings
# reach ~230 GB/s and 200 Gb/s HDR NICs ~23 GB/s.
PROFILES = {p.name: p for p in (
    Hardware('h100-nvlink', 'H100 SXM 80 GB, NVLink nodes of 8, 400 Gb/s InfiniBand per GPU',
             989e12, 80 * GiB, 8, 370e9, 47e9),
    Hardware('h200-nvlink', 'H200 141 GB, NVLink nodes of 8, 400 Gb/s InfiniBand per GPU',
             989e12, 141e9, 8, 370e9, 47e9),
    Hardware('a100-80-nvlink', 'A100 SXM 80 GB, NVLink nodes of 8, 200 Gb/s InfiniBand per GPU',
             312e12, 80 * GiB, 8, 230e9, 23e9),
    Hardware('a100-40-nvlink', 'A100 SXM 40 GB, NVLink nodes of 8, 200 Gb/s InfiniBand per GPU',
             312e12, 40 * GiB, 8, 230e9, 23e9),
)}


def hardware_profile(name: str, device_memory_gb: float = 0.0) -> Hardware:
  """The named profile, with its memory replaced by `device_memory_gb` (GB) if that is set."""
  if name not in PROFILES:
    raise ConfigError(f'--hardware={name!r} is unknown; use one of {", ".join(PROFILES)}.')
  profile = PROFILES[name]
  if device_memory_gb < 0:
    raise ConfigError(f'--device-memory={device_memory_gb} must be positive (GB).')
  if device_memory_gb:
    profile = dataclasses.replace(profile, memory=device_memory_gb * 1e9)
  return profile


def axes_across_nodes(mesh_shape: dict[str, int], across_hosts: str,
                      devices_per_node: int) -> set[str]:
  """The mesh axes that span nodes when the devices fill nodes of `devices_per_node`, laid
  out as a run lays them out (mesh.across_hosts, see `jaxllm.mesh.host_split`)."""
  nodes = max(1, math.prod(mesh_shape.values()) // devices_per_node)
  return {a for a, n in host_split(mesh_shape, nodes, across_hosts).items() if n > 1}
