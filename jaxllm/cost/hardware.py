"""Hardware profiles: what predictions need (peak FLOP/s, memory, link bandwidths) and, for a
GPU, what XLA's GPU compiler needs to know of the device to compile for it without one
(`jaxllm.backends.gpu_devices`); and the devices' peak FLOP/s, which MFU divides by.
"""

from __future__ import annotations

import dataclasses
import math
import os

from jaxllm.config import ConfigError
from jaxllm.parallel.mesh import host_split

GiB, MiB = 2**30, 2**20

# What JAX lets a process use of a GPU's memory by default (its allocator's preallocation);
# XLA_PYTHON_CLIENT_MEM_FRACTION changes it.
DEFAULT_MEM_FRACTION = 0.75

# Peak dense (no 2:4 sparsity) bf16 tensor-core FLOP/s of one device, by a substring of its
# `device_kind`, the first that matches: NVIDIA's datasheets for the H100 (SXM and PCIe), H200
# SXM, A100 (SXM, 40 and 80 GB alike) and HGX B200 (which print the sparse figure, twice these).
# The profiles below take theirs from here, and so do the train prints' MFU (`metrics.peak_flops`).
PEAK_FLOPS = {
    'H100 PCIe': 756e12,
    'H100': 989e12,
    'H200': 989e12,
    'A100': 312e12,
    'B200': 2.25e15,
}


@dataclasses.dataclass(frozen=True)
class Gpu:
  """One NVIDIA GPU as XLA's GPU compiler sees it (GpuTargetConfigProto's device info), from
  the vendor's public specifications and the CUDA programming guide's table of compute
  capabilities."""
  name: str                 # as the driver reports it (device_kind)
  compute_capability: tuple[int, int]
  sm_count: int
  clock_ghz: float          # boost clock
  memory_bandwidth: float   # bytes/s
  l2_cache: int             # bytes
  fp32_units_per_sm: int
  shared_memory_per_sm: int  # bytes; a block may opt in to all but 1 KiB of it

  def target_config(self, memory: int, cudnn: tuple[int, int, int] | None) -> str:
    """The device as a GpuTargetConfigProto in text form, with `memory` bytes of memory and
    the given cuDNN version (the one a run would use decides the fused kernels offered)."""
    major, minor = self.compute_capability
    lines = [
        'gpu_device_info {',
        '  threads_per_block_limit: 1024', '  threads_per_warp: 32',
        '  shared_memory_per_block: 49152',
        f'  shared_memory_per_block_optin: {self.shared_memory_per_sm - 1024}',
        f'  shared_memory_per_core: {self.shared_memory_per_sm}',
        '  threads_per_core_limit: 2048',
        f'  core_count: {self.sm_count}', f'  fpus_per_core: {self.fp32_units_per_sm}',
        '  block_dim_limit_x: 2147483647', '  block_dim_limit_y: 65535',
        '  block_dim_limit_z: 65535',
        f'  memory_bandwidth: {int(self.memory_bandwidth)}',
        f'  l2_cache_size: {self.l2_cache}', f'  clock_rate_ghz: {self.clock_ghz}',
        f'  device_memory_size: {int(memory)}',
        f'  cuda_compute_capability {{ major: {major} minor: {minor} }}',
        '  registers_per_core_limit: 65536', '  registers_per_block_limit: 65536',
        '}',
        'platform_name: "CUDA"',
        f'device_description_str: "{self.name}"',
    ]
    if cudnn:
      lines.append('dnn_version_info {{ major: {} minor: {} patch: {} }}'.format(*cudnn))
    return '\n'.join(lines) + '\n'


@dataclasses.dataclass(frozen=True)
class Hardware:
  name: str
  description: str
  peak_flops: float        # dense bf16 FLOP/s of one device
  memory: float            # bytes of one device's memory (as the driver reports it)
  devices_per_node: int
  intra_node_bw: float     # bus bandwidth of a ring collective inside a node, bytes/s per device
  inter_node_bw: float     # the same across nodes (one NIC per device)
  gpu: Gpu                 # what the GPU compiler needs to know of the device
  # Fraction of peak that large matmuls reach: the step's compute is timed at this rate.
  matmul_efficiency: float = 0.8
  # Start-up cost of one collective (small-message NCCL latency, roughly), inside / across nodes.
  intra_node_latency: float = 10e-6
  inter_node_latency: float = 20e-6


HOPPER_SHARED_MEMORY = 228 * 1024  # per SM, compute capability 9.0
AMPERE_SHARED_MEMORY = 164 * 1024  # per SM, compute capability 8.0
H100 = Gpu('NVIDIA H100 80GB HBM3', (9, 0), 132, 1.98, 3.35e12, 50 * MiB, 128,
           HOPPER_SHARED_MEMORY)
H200 = Gpu('NVIDIA H200', (9, 0), 132, 1.98, 4.8e12, 50 * MiB, 128, HOPPER_SHARED_MEMORY)
A100_80 = Gpu('NVIDIA A100-SXM4-80GB', (8, 0), 108, 1.41, 2.039e12, 40 * MiB, 64,
              AMPERE_SHARED_MEMORY)
A100_40 = Gpu('NVIDIA A100-SXM4-40GB', (8, 0), 108, 1.41, 1.555e12, 40 * MiB, 64,
              AMPERE_SHARED_MEMORY)

# Peak FLOP/s: `PEAK_FLOPS`; memory bandwidth: NVIDIA's H100, H200 and A100 datasheets. Link
# figures are the assumptions README.md's "See before you launch" lists, as NCCL bus bandwidth
# (nccl-tests' doc/PERFORMANCE.md defines it): H100 ~370 GB/s on NVLink4 (900 GB/s per GPU, both
# directions, in the datasheet), 46–48 GB/s per 400 Gb/s InfiniBand NIC (50 GB/s line rate), an
# 8192³ bf16 matmul at ~81% of peak (public measurements, not ours). A100: NVLink3 rings
# reach ~230 GB/s and 200 Gb/s HDR NICs ~23 GB/s. Memory: the total nvidia-smi reports.
PROFILES = {p.name: p for p in (
    Hardware('h100-nvlink', 'H100 SXM 80 GB, NVLink nodes of 8, 400 Gb/s InfiniBand per GPU',
             PEAK_FLOPS['H100'], 81559 * MiB, 8, 370e9, 47e9, H100),
    Hardware('h200-nvlink', 'H200 141 GB, NVLink nodes of 8, 400 Gb/s InfiniBand per GPU',
             PEAK_FLOPS['H200'], 143771 * MiB, 8, 370e9, 47e9, H200),
    Hardware('a100-80-nvlink', 'A100 SXM 80 GB, NVLink nodes of 8, 200 Gb/s InfiniBand per GPU',
             PEAK_FLOPS['A100'], 81920 * MiB, 8, 230e9, 23e9, A100_80),
    Hardware('a100-40-nvlink', 'A100 SXM 40 GB, NVLink nodes of 8, 200 Gb/s InfiniBand per GPU',
             PEAK_FLOPS['A100'], 40536 * MiB, 8, 230e9, 23e9, A100_40),
)}


def hardware_profile(name: str, device_memory_gb: float = 0.0) -> Hardware:
  """The named profile, with its memory replaced by `device_memory_gb` (GB) if that is set."""
  if name not in PROFILES:
    raise ConfigError(f'--hardware={name!r} is unknown; use one of {", ".join(PROFILES)}.')
  profile = PROFILES[name]
  if not (math.isfinite(device_memory_gb) and device_memory_gb >= 0):
    raise ConfigError(f'--device-memory={device_memory_gb} must be positive (GB).')
  if device_memory_gb:
    profile = dataclasses.replace(profile, memory=device_memory_gb * 1e9)
  return profile


def usable_memory(hardware: Hardware) -> tuple[float, float]:
  """Bytes of a device's memory a JAX process may use, and the fraction that is: on a GPU,
  what its allocator takes (XLA_PYTHON_CLIENT_MEM_FRACTION, default 0.75), not the card."""
  fraction = os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION', str(DEFAULT_MEM_FRACTION))
  try:
    value = float(fraction)
  except ValueError:
    value = -1.0
  if not 0 < value <= 1:
    raise ConfigError(f'XLA_PYTHON_CLIENT_MEM_FRACTION={fraction!r} must be a fraction in '
                      '(0, 1]; unset it for JAX\'s default of 0.75.')
  return hardware.memory * value, value


def axes_across_nodes(mesh_shape: dict[str, int], across_hosts: str,
                      devices_per_node: int) -> set[str]:
  """The mesh axes that span nodes when the devices fill nodes of `devices_per_node`, laid
  out as a run lays them out (mesh.across_hosts, see `jaxllm.parallel.mesh.host_split`)."""
  nodes = max(1, math.prod(mesh_shape.values()) // devices_per_node)
  return {a for a, n in host_split(mesh_shape, nodes, across_hosts).items() if n > 1}
