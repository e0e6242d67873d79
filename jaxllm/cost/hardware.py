"""Hardware profiles: what predictions need (memory, and the measured rates the timing model
times kernels and collectives with, `KernelRates`, each with its public source) and, for a
GPU, what XLA's GPU compiler needs to know of the device to compile for it without one
(`jaxllm.backends.gpu_devices`); peak FLOP/s come from `jaxllm.metrics.PEAK_FLOPS`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

from jaxllm.config import ConfigError
from jaxllm.cost import gemm_rates
from jaxllm.metrics import PEAK_FLOPS
from jaxllm.parallel.mesh import host_split

GiB, MiB = 2**30, 2**20

# What JAX lets a process use of a GPU's memory by default (its allocator's preallocation);
# XLA_PYTHON_CLIENT_MEM_FRACTION changes it.
DEFAULT_MEM_FRACTION = 0.75

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

  def target_config(self, memory: int, cudnn: tuple[int, int, int] | None,
                    cuda: tuple[int, int, int]) -> str:
    """The device as a GpuTargetConfigProto in text form, with `memory` bytes of memory and
    the given cuDNN and CUDA versions (those a run would use decide the kernels offered)."""
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
    lines.append('runtime_version {{ major: {} minor: {} patch: {} }}'.format(*cuda))
    if cudnn:
      lines.append('dnn_version_info {{ major: {} minor: {} patch: {} }}'.format(*cudnn))
    return '\n'.join(lines) + '\n'


# --- what kernels run at, each with its public source -----------------------------------

# Burst against sustained clocks. The GEMM table (`gemm_rates`) and the attention series below
# were measured in short runs with idle gaps between them, at the boost clock: XLA's
# `matmul_perf_table_gen.cc` runs one warm-up and 5×2 short executions per shape, and its
# 4096³ bf16 entry (780.2 TFLOP/s) is a 1,980 MHz burst figure (780.5). A training step runs
# its kernels back to back at the clock the 700 W limit sustains. stas00/ml-engineering
# (branch fast-mamf, compute/accelerator/README.md, "MAMF" against "MSMF") measured both on one
# H200 SXM, the best shape of each: bf16 841.9 TFLOP/s at 1,980 MHz against 708.5 at 1,465 MHz
# and ~693 W; FP8 1,491.9 against 1,288.7. The H100 SXM has the same die and power limit.
# Sustained, every GEMM and attention kernel runs at these shares of its burst rate (f32 GEMMs
# at bf16's); memory-bound kernels keep theirs (HBM has its own clock).
SUSTAINED = {'bf16': 708.5 / 841.9, 'f8': 1288.7 / 1491.9}


@dataclasses.dataclass(frozen=True)
class AttentionSeries:
  """cuDNN flash attention throughput, bf16, TFLOP/s at `lengths` (queries per sequence), by
  (pass, head dim, causal); FLOPs counted as `hlo.attention_kernel` counts them (causal
  halved, backward 2.5× forward)."""
  source: str
  lengths: tuple[int, ...]
  rates: dict


# FlashAttention-3 (Shah et al., arXiv 2407.08608, July 2024), figures 5 and 6, the cuDNN series
# on one H100 SXM (16K tokens per batch, hidden 2048): cuDNN as 2024's runs had it. The paper
# has no causal backward: it is taken as the non-causal backward times the causal forward's
# share of the non-causal forward at that length (an assumption).
_FA3_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
_FA3_FORWARD = {(64, False): (335, 373, 395, 408, 412, 413),
                (64, True): (225, 288, 334, 363, 379, 388),
                (128, False): (497, 574, 617, 609, 600, 595),
                (128, True): (315, 410, 484, 518, 529, 539)}
_FA3_BACKWARD = {64: (266, 348, 395, 417, 432, 433), 128: (305, 408, 465, 499, 518, 516)}
_FA3 = {('forward', d, c): rates for (d, c), rates in _FA3_FORWARD.items()}
_FA3.update({('backward', d, False): b for d, b in _FA3_BACKWARD.items()})
_FA3.update({('backward', d, True): tuple(
    round(x * c / n, 1) for x, c, n in zip(b, _FA3_FORWARD[d, True], _FA3_FORWARD[d, False]))
             for d, b in _FA3_BACKWARD.items()})

# cuDNN 9.19 on one H200: NVIDIA/cudnn-frontend, benchmark/sdpa_benchmark_training/results/
# h200_919_only_cudnn/llama3.1_20260227_034703.csv (Llama-3.1 shapes: 64 query and 8 kv heads,
# head dim 128, batch 1; causal and not, forward and backward) at 2K-32K tokens; 10-25% above
# the 2024 series at 4K-16K. Below 2K it falls off with length as the 2024 series does, and
# head dim 64 keeps the 2024 series (no newer public figure for either; assumptions).
_CUDNN919_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
_CUDNN919_MEASURED = {('forward', 128, True): (484, 591, 644, 673, 688),
                      ('forward', 128, False): (633, 671, 691, 702, 693),
                      ('backward', 128, True): (370, 474, 541, 579, 581),
                      ('backward', 128, False): (504, 560, 594, 612, 572)}
_CUDNN919 = {key: tuple(round(rates[0] * _FA3[key][i] / _FA3[key][2], 1) for i in (0, 1))
             + rates for key, rates in _CUDNN919_MEASURED.items()}
_CUDNN919.update({key: rates + (rates[-1],) for key, rates in _FA3.items() if key[1] == 64})

ATTENTION = {
    '9.19': AttentionSeries('cuDNN 9.19 (NVIDIA/cudnn-frontend SDPA training benchmark, H200)',
                            _CUDNN919_LENGTHS, _CUDNN919),
    '2024': AttentionSeries("cuDNN of mid-2024 (FlashAttention-3's cuDNN series, H100)",
                            _FA3_LENGTHS, _FA3),
}

# NCCL bus bandwidth inside an 8-GPU H100 NVLink node, bytes/s, by collective and group size:
# XLA's measured table (openxla/xla, xla/service/gpu/model/default_collective_perf_table.txtpb,
# key sm_90) at its largest sizes. A collective-permute (and a send) goes over one link: taken
# at the two-GPU all-gather's rate.
H100_NVLINK_BUS = {
    'all-reduce': {2: 250e9, 4: 302e9, 8: 402e9},
    'all-gather': {2: 275e9, 4: 332e9, 8: 352e9},
    'reduce-scatter': {2: 205e9, 4: 287e9, 8: 329e9},
    'all-to-all': {2: 321e9, 4: 351e9, 8: 340e9},
    'collective-permute': {2: 275e9},
}
# Collectives the table has no row of, at the rate of the one that moves bytes alike.
BUS_OF = {'collective-broadcast': 'all-gather', 'ragged-all-to-all': 'all-to-all',
          'send': 'collective-permute', 'recv': 'collective-permute'}


# The share of its datasheet memory bandwidth a Hopper GPU reaches moving a buffer of a given
# size, bytes -> fraction: XLA's measured table (openxla/xla,
# xla/service/gpu/model/gpu_dot_fusion_cost_model.cc, kHopperScaledHbmBandwidthTable). XLA
# takes sizes below the first at its fraction, as here.
HOPPER_MEMORY_CURVE = ((1 * MiB, 0.053), (4 * MiB, 0.191), (8 * MiB, 0.319), (16 * MiB, 0.472),
                       (32 * MiB, 0.589), (64 * MiB, 0.699), (128 * MiB, 0.785),
                       (256 * MiB, 0.825), (512 * MiB, 0.886), (GiB, 0.932), (2 * GiB, 0.941),
                       (4 * GiB, 0.946), (8 * GiB, 0.948))


@dataclasses.dataclass(frozen=True)
class KernelRates:
  """What the timing model (`jaxllm.cost.timing`) times a GPU's kernels with, each from a
  public measurement or named as an assumption where none exists, and what they assume of the
  run: the clocks (`clocks`: 'sustained' through a step, or the 'burst' the tables were
  measured at), the cuDNN whose attention kernels run (`cudnn`, a key of ATTENTION) and
  whether XLA launches the kernels from command buffers (CUDA graphs; `command_buffers`)."""
  gemm: dict               # element type -> TFLOP/s [m][n][k] over gemm_rates.SIZES (burst)
  fp8_ceiling_flops: float  # the most any FP8 GEMM reached (burst): the FP8 table's cap
  memory_bandwidth: float  # the datasheet's, bytes/s
  memory_curve: tuple      # (bytes moved, share of memory_bandwidth reached), by size
  vector_flops: float      # CUDA-core FP32 FLOP/s (elementwise work)
  launch_s: float          # the gap the GPU leaves between two kernels of a stream
  host_launch_s: float     # host time to launch one kernel outside a command buffer
  sm_count: int
  collective_sms: int      # SMs an NCCL kernel holds while it runs
  intra_node_bus: dict     # collective -> {group size: NCCL bus bandwidth, bytes/s}
  intra_node_latency: float
  inter_node_bus: float    # per GPU, any collective
  inter_node_latency: float
  clocks: str = 'sustained'
  cudnn: str = '9.19'
  command_buffers: bool = True

  def assumptions(self) -> dict:
    """What the rates assume of the run, for a report."""
    return {'clocks': self.clocks, 'cudnn': self.cudnn, 'command_buffers': self.command_buffers}

  def sustained(self, kind: str) -> float:
    """The share of a burst rate a kernel of element type `kind` keeps at this profile's
    clocks."""
    return SUSTAINED['f8' if kind == 'f8' else 'bf16'] if self.clocks == 'sustained' else 1.0

  def gemm_rate(self, types: str, batch: int, m: int, n: int, k: int) -> float:
    """FLOP/s of a GEMM of element types 'bf16xbf16->f32' (inputs decide the table): XLA's
    measured rate, interpolated in log size; a batch stacks its rows (m × batch). FP8 rates
    are bounded by physics (twice bf16's rate at the same shape, an H100's tensor cores'
    ratio) and by the most any FP8 GEMM reached; then the clocks' share. A dimension under
    the table's smallest runs the smallest's tiles, in the same time: its rate falls with
    it; above the largest it takes the largest's rate."""
    lhs = types.split('x')[0]
    kind = 'f8' if lhs.startswith('f8') else 'f32' if lhs == 'f32' else 'bf16'
    dims = (m * batch, n, k)
    point = [math.log2(min(max(x, gemm_rates.SIZES[0]), gemm_rates.SIZES[-1]))
             - math.log2(gemm_rates.SIZES[0]) for x in dims]
    rate = _interpolate(self.gemm[kind], point) * 1e12
    if kind == 'f8':
      rate = min(rate, 2 * _interpolate(self.gemm['bf16'], point) * 1e12,
                 self.fp8_ceiling_flops)
    for x in dims:
      rate *= min(1.0, x / gemm_rates.SIZES[0])
    return rate * self.sustained(kind)

  def memory_seconds(self, moved: float) -> float:
    """Seconds a memory-bound kernel takes to read and write `moved` bytes: at the share of
    the bandwidth a transfer of that size reaches, interpolated in log size."""
    if moved <= 0:
      return 0.0
    sizes = [math.log2(b) for b, _ in self.memory_curve]
    x = min(max(math.log2(moved), sizes[0]), sizes[-1])
    i = next(i for i in range(1, len(sizes)) if x <= sizes[i])
    t = (x - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
    share = (1 - t) * self.memory_curve[i - 1][1] + t * self.memory_curve[i][1]
    return moved / (share * self.memory_bandwidth)

  def attention_rate(self, backward: bool, head_dim: int, length: int, causal: bool,
                     window: int = 0) -> float:
    """FLOP/s of a cuDNN flash attention pass (head dims above 64 take the 128 row), from the
    profile's cuDNN series at its clocks. A causal pass with a sliding window of W keys does
    per query block the work of a causal pass of length 2W (W keys each, where the causal
    pass averages half its length): it is taken at that length's rate (an assumption; no
    measurement of windowed kernels is published)."""
    if causal and window:
      length = min(length, 2 * window)
    series = ATTENTION[self.cudnn]
    rates = series.rates['backward' if backward else 'forward', 64 if head_dim <= 64 else 128,
                         causal]
    lengths = [math.log2(n) for n in series.lengths]
    x = min(max(math.log2(max(length, 1)), lengths[0]), lengths[-1])
    i = next(i for i in range(1, len(lengths)) if x <= lengths[i])
    t = (x - lengths[i - 1]) / (lengths[i] - lengths[i - 1])
    return ((1 - t) * rates[i - 1] + t * rates[i]) * 1e12 * self.sustained('bf16')

  def collective_seconds(self, kind: str, group: int, across_nodes: bool, sent: float,
                         calls: int = 1) -> float:
    """Seconds `calls` collectives over `group` devices take to send `sent` bytes from each
    device in all: a start-up latency each, and the bytes at NCCL's bus bandwidth."""
    if across_nodes:
      bandwidth, latency = self.inter_node_bus, self.inter_node_latency
    else:
      sizes = self.intra_node_bus[BUS_OF.get(kind, kind)]
      bandwidth = sizes[min(sizes, key=lambda n: (abs(n - group), n))]
      latency = self.intra_node_latency
    return calls * latency + sent / bandwidth

  def for_flags(self, xla_flags: str) -> KernelRates:
    """The rates with what a program's XLA flags say of the run: command buffers off under
    `--xla_gpu_enable_command_buffer=` (empty) or 2024's `--xla_gpu_graph_level=0`."""
    found = re.findall(r'--xla_gpu_(enable_command_buffer|graph_level)=(\S*)', xla_flags)
    if not found:
      return self
    name, value = found[-1]
    off = value.strip('\'"') == '' if name == 'enable_command_buffer' else value == '0'
    return dataclasses.replace(self, command_buffers=not off)


def _interpolate(table, point: list[float]) -> float:
  """Multilinear interpolation of a nested table at fractional indices `point`."""
  if not point:
    return table
  x, rest = point[0], point[1:]
  low = min(int(x), len(table) - 2)
  t = x - low
  return (1 - t) * _interpolate(table[low], rest) + t * _interpolate(table[low + 1], rest)


# H100 SXM (and H200, the same GH100 compute beside faster memory):
# - GEMMs: XLA's measured H100 table (`gemm_rates`), burst; FP8 GEMMs at most 1,402.6 TFLOP/s,
#   the best FP8 matmul measured on an H100 SXM (stas00/ml-engineering, compute/accelerator,
#   "MAMF", burst); attention: ATTENTION (the H200's SMs and clocks are the H100's); the
#   sustained share of both: SUSTAINED;
# - CUDA cores 67 TFLOP/s FP32: NVIDIA's H100 datasheet;
# - memory: the datasheet's 3.35 / 4.8 TB/s at the shares XLA measured on Hopper by size
#   (HOPPER_MEMORY_CURVE; 0.948 at the largest);
# - launches: 1 µs between two kernels, XLA's estimate (gpu_performance_model_base.h,
#   kKernelLaunchOverhead); outside command buffers the host launches each kernel, 5 µs each:
#   XLA's earlier estimate of a kernel's launch (gpu_performance_model.cc of 2023), beside a
#   measured 2.6-2.8 µs for the CUDA call alone (cudaLaunchKernel's enqueue, CUDA 13;
#   ahrefs/ocannl issue 488) before XLA's own work per kernel;
# - 16 of the 132 SMs held by NCCL while a collective runs: NCCL's CTAs never share an SM with
#   compute, and NCCL uses 16 SMs on a DGX with 8 NICs (NVIDIA/nccl issue 689, its maintainer);
#   one NCCL kernel alone kept 15% of an H100's SMs busy (issue 1432). Compute beside NCCL runs
#   on the SMs left (one study measured 18.9% slower on average, arXiv 2507.03114);
# - NCCL: XLA's table above; 10 µs per collective inside a node (an assumption: XLA estimates
#   5 µs to launch an NCCL kernel and measured 12–20 µs end to end for the smallest ones); 47 GB/s
#   bus bandwidth per 400 Gb/s InfiniBand NIC across nodes (NVIDIA/nccl-tests issue #290, by its
#   maintainers: 46–48 GB/s), 20 µs latency across nodes (an assumption).
def _hopper(memory_bandwidth: float, inter_node_bus: float = 47e9,
            inter_node_latency: float = 20e-6) -> KernelRates:
  return KernelRates(gemm_rates.H100, 1402.6e12, memory_bandwidth, HOPPER_MEMORY_CURVE, 67e12,
                     1e-6, 5e-6, 132, 16, H100_NVLINK_BUS, 10e-6, inter_node_bus,
                     inter_node_latency)


# Google Cloud's A3 (a3-highgpu-8g), where MaxText's published H100 runs ran: 8 H100 SXM on
# NVLink, and across VMs no InfiniBand but GPUDirect-TCPX over four 200 Gb/s NICs for GPU data
# per VM (Google Cloud, "Maximize GPU network bandwidth with GPUDirect-TCPX"): 100 Gb/s,
# 12.5 GB/s, per GPU at line rate, taken as its bus bandwidth (no public NCCL figure); 50 µs
# latency across VMs over TCP (an assumption).
A3_INTER_NODE_BUS = 4 * 200e9 / 8 / 8


@dataclasses.dataclass(frozen=True)
class Hardware:
  name: str
  description: str
  peak_flops: float        # dense bf16 FLOP/s of one device
  memory: float            # bytes of one device's memory (as the driver reports it)
  devices_per_node: int
  gpu: Gpu                 # what the GPU compiler needs to know of the device
  rates: KernelRates | None  # what kernels take; None where no public measurements exist

  def summary(self) -> dict:
    """The profile's scalars, for a JSON report."""
    return {'name': self.name, 'description': self.description, 'peak_flops': self.peak_flops,
            'memory': self.memory, 'devices_per_node': self.devices_per_node,
            'timed': self.rates is not None,
            'assumes': self.rates.assumptions() if self.rates else None}


HOPPER_SHARED_MEMORY = 228 * 1024  # per SM, compute capability 9.0
AMPERE_SHARED_MEMORY = 164 * 1024  # per SM, compute capability 8.0
H100 = Gpu('NVIDIA H100 80GB HBM3', (9, 0), 132, 1.98, 3.35e12, 50 * MiB, 128,
           HOPPER_SHARED_MEMORY)
H200 = Gpu('NVIDIA H200', (9, 0), 132, 1.98, 4.8e12, 50 * MiB, 128, HOPPER_SHARED_MEMORY)
A100_80 = Gpu('NVIDIA A100-SXM4-80GB', (8, 0), 108, 1.41, 2.039e12, 40 * MiB, 64,
              AMPERE_SHARED_MEMORY)
A100_40 = Gpu('NVIDIA A100-SXM4-40GB', (8, 0), 108, 1.41, 1.555e12, 40 * MiB, 64,
              AMPERE_SHARED_MEMORY)

# Peak FLOP/s: `PEAK_FLOPS`; memory bandwidth: NVIDIA's H100, H200 and A100 datasheets; memory:
# the total nvidia-smi reports. The A100 profiles compile the A100's program (memory, kernels,
# collectives) but time nothing: XLA's tables and the attention figures are the H100's.
PROFILES = {p.name: p for p in (
    Hardware('h100-nvlink', 'H100 SXM 80 GB, NVLink nodes of 8, 400 Gb/s InfiniBand per GPU',
             PEAK_FLOPS['H100'], 81559 * MiB, 8, H100, _hopper(H100.memory_bandwidth)),
    Hardware('h200-nvlink', 'H200 141 GB, NVLink nodes of 8, 400 Gb/s InfiniBand per GPU',
             PEAK_FLOPS['H200'], 143771 * MiB, 8, H200, _hopper(H200.memory_bandwidth)),
    Hardware('h100-a3', 'H100 SXM 80 GB, Google Cloud A3 VMs of 8 (NVLink), GPUDirect-TCPX '
             'over 4 × 200 Gb/s NICs per VM', PEAK_FLOPS['H100'], 81559 * MiB, 8, H100,
             _hopper(H100.memory_bandwidth, A3_INTER_NODE_BUS, 50e-6)),
    Hardware('a100-80-nvlink', 'A100 SXM 80 GB, NVLink nodes of 8, 200 Gb/s InfiniBand per GPU',
             PEAK_FLOPS['A100'], 81920 * MiB, 8, A100_80, None),
    Hardware('a100-40-nvlink', 'A100 SXM 40 GB, NVLink nodes of 8, 200 Gb/s InfiniBand per GPU',
             PEAK_FLOPS['A100'], 40536 * MiB, 8, A100_40, None),
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
