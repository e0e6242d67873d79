"""MaxText's own H100 train step, compiled here without a GPU, written out as optimized HLO.

    /path/to/maxtext-venv/bin/python benchmarks/maxtext.py --maxtext MAXTEXT --run a3_1vm \
        --out DIR/a3_1vm.hlo.txt [key=value ...]

Run it with the python of a venv that has MaxText's dependencies beside jax 0.10.2 and its CUDA
plugin (jaxllm's own environment lacks them; benchmarks/README.md says how to make one).
`--maxtext` is a MaxText checkout's root (the one holding src/maxtext), `--run` one of `RUNS`:
a published MaxText run on H100s, with its settings and XLA flags as published. Trailing
`key=value` arguments override MaxText config fields, as on MaxText's own command line.

The step is built the way MaxText's `train_compile` builds it (its config parsing, model, train
step, shardings and jit), on compile-only H100s from `jaxllm.backends.gpu_devices` instead of
`train_compile`'s mesh, which needs a local GPU for GPU targets; across VMs, with MaxText's
hybrid mesh over 8-GPU hosts. It prints the XLA flags used and those dropped or renamed, the
compile time and the program's memory analysis, and writes `compiled.as_text()` to `--out`,
after a first line of the flags it was compiled with (`jaxllm.cost.hlo.FLAGS_LINE`), which the
timing model reads (command buffers on or off).
"""

import argparse
import functools
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The a3 1vm script's flags (src/maxtext/configs/gpu/a3/llama_2_7b/1vm.sh, today's).
A3_FLAGS = """
  --xla_dump_to=$OUTPUT_PATH/$RUN_NAME/HLO_dumps/
  --xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_triton_gemm=false
  --xla_gpu_enable_command_buffer='' --xla_gpu_enable_highest_priority_async_stream=true
  --xla_gpu_all_reduce_combine_threshold_bytes=134217728
  --xla_gpu_all_gather_combine_threshold_bytes=134217728
  --xla_gpu_reduce_scatter_combine_threshold_bytes=67108864 --xla_gpu_pipeline_all_gather=on
  --xla_gpu_pipeline_reduce_scatter=on --xla_gpu_pipeline_all_reduce=on
  --xla_gpu_enable_while_loop_double_buffering=true
  --xla_gpu_enable_all_gather_combine_by_dim=false
  --xla_gpu_enable_reduce_scatter_combine_by_dim=false
  --xla_disable_hlo_passes=rematerialization""".split()


def a3_2024_flags(all_reduce_combine: int) -> list[str]:
  """The flags of MaxText's a3 llama_2_7b scripts as they published the runs (commit
  efb6d9e4a, 2024-04-09, MaxText/configs/a3/llama_2_7b/{1,2,4,8}vm.sh), which differ only in
  the all-reduce combine threshold."""
  return f"""
  --xla_dump_to=$OUTPUT_PATH/$RUN_NAME/HLO_dumps/
  --xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_async_all_gather=true
  --xla_gpu_enable_async_reduce_scatter=true --xla_gpu_enable_triton_gemm=false
  --xla_gpu_simplify_all_fp_conversions --xla_gpu_graph_level=0
  --xla_gpu_enable_async_all_reduce=true --xla_gpu_enable_highest_priority_async_stream=true
  --xla_gpu_all_reduce_combine_threshold_bytes={all_reduce_combine}
  --xla_gpu_all_gather_combine_threshold_bytes=134217728
  --xla_gpu_reduce_scatter_combine_threshold_bytes=67108864
  --xla_gpu_enable_pipelined_all_gather=true --xla_gpu_enable_pipelined_reduce_scatter=true
  --xla_gpu_enable_pipelined_all_reduce=true --xla_gpu_enable_while_loop_double_buffering=true
  --xla_gpu_enable_triton_softmax_fusion=false --xla_gpu_enable_all_gather_combine_by_dim=false
  --xla_gpu_enable_reduce_scatter_combine_by_dim=false
  --xla_disable_hlo_passes=rematerialization""".split()


# NVIDIA JAX-Toolbox's, as its MaxText README had them when it published the run (2024-05-01,
# rosetta/rosetta/projects/maxtext/README.md; Triton GEMMs off until 2025-05-27).
JAX_TOOLBOX_FLAGS = """
  --xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_async_all_gather=true
  --xla_gpu_enable_async_reduce_scatter=true --xla_gpu_enable_triton_gemm=false
  --xla_gpu_simplify_all_fp_conversions --xla_gpu_graph_level=0
  --xla_gpu_enable_async_all_reduce=true --xla_gpu_enable_highest_priority_async_stream=true
  --xla_gpu_all_reduce_combine_threshold_bytes=1073741824
  --xla_gpu_all_gather_combine_threshold_bytes=1073741824
  --xla_gpu_reduce_scatter_combine_threshold_bytes=134217728
  --xla_gpu_enable_pipelined_all_gather=true --xla_gpu_enable_pipelined_reduce_scatter=true
  --xla_gpu_enable_pipelined_all_reduce=true --xla_gpu_enable_while_loop_double_buffering=true
  --xla_gpu_enable_triton_softmax_fusion=false --xla_gpu_enable_all_gather_combine_by_dim=false
  --xla_gpu_enable_reduce_scatter_combine_by_dim=false
  --xla_disable_hlo_passes=rematerialization""".split()

# MaxText's a3 llama_2_7b command of 2024 (1vm.sh at efb6d9e4a), on today's base.yml; the
# logits' matmul in fp32 as base.yml then defaulted (today's default is bf16).
A3_2024_SETTINGS = ('model_name=llama2-7b hardware=gpu per_device_batch_size=4 '
                    'max_target_length=4096 enable_checkpointing=false attention=cudnn_flash_jax '
                    'remat_policy=minimal_flash use_iota_embed=true scan_layers=false '
                    'dataset_type=synthetic logits_dot_in_fp32=true ici_fsdp_parallelism=8')


def a3_run(vms: int, all_reduce_combine: int, tflops: int) -> dict:
  return dict(
      about=f'MaxText a3 llama_2_7b/{vms}vm.sh (2024): {8 * vms} H100s on {vms} A3 VMs, fsdp 8 '
            f'in a VM{", data across VMs" if vms > 1 else ""} (published {tflops} '
            'TFLOP/s/GPU)',
      config='src/maxtext/configs/base.yml', vms=vms,
      settings=f'run_name=a3_{vms}vm dcn_data_parallelism={vms} {A3_2024_SETTINGS}',
      xla_flags=a3_2024_flags(all_reduce_combine))


# Both published runs use Transformer Engine's attention (cudnn_flash_te), which cannot be
# installed here; cudnn_flash_jax calls the same cuDNN flash kernels through JAX's own API.
RUNS = {
    'a3_1vm': a3_run(1, 134217728, 492),
    'a3_2vm': a3_run(2, 67108864, 422),
    'a3_4vm': a3_run(4, 536870912, 407),
    'a3_8vm': a3_run(8, 1073741824, 409),
    'jax_toolbox': dict(
        about='JAX-Toolbox MaxText Llama-2-7B: 8 H100s, fsdp 8, global batch 16 (0.721 s/step)',
        config='src/maxtext/configs/base.yml', vms=1,
        settings='run_name=jax_toolbox model_name=llama2-7b per_device_batch_size=2 '
                 'scan_layers=false remat_policy=minimal_flash attention=cudnn_flash_jax '
                 'max_target_length=4096 use_iota_embed=true logits_dot_in_fp32=false '
                 'enable_checkpointing=false dataset_type=synthetic hardware=gpu_multiprocess',
        xla_flags=JAX_TOOLBOX_FLAGS),
    'llama3_8b': dict(
        about='Llama-3-8B on 8 H100s, fsdp 8, batch 1/GPU, seq 8192, remat full, a3 flags',
        config='src/maxtext/configs/gpu/models/llama3_8b.yml', vms=1,
        settings='run_name=llama3_8b dcn_data_parallelism=1 ici_fsdp_parallelism=8 '
                 'per_device_batch_size=1 max_target_length=8192 remat_policy=full '
                 'attention=cudnn_flash_jax',
        xla_flags=A3_FLAGS),
}

# Flag names that jax 0.10.2's XLA does not know (it aborts on unknown flags), and what it
# calls the same switch.
RENAMED = {
    '--xla_gpu_pipeline_all_gather=on': '--xla_gpu_enable_pipelined_all_gather=true',
    '--xla_gpu_pipeline_reduce_scatter=on': '--xla_gpu_enable_pipelined_reduce_scatter=true',
    '--xla_gpu_pipeline_all_reduce=on': '--xla_gpu_enable_pipelined_all_reduce=true',
    '--xla_gpu_graph_level=0': '--xla_gpu_enable_command_buffer=',
}
# Flags left out, and why.
DROPPED = {
    '--xla_dump_to': 'writes dump files; the HLO is written with --out instead',
    '--xla_gpu_enable_async_all_gather': 'removed from XLA (collectives are always async)',
    '--xla_gpu_enable_async_reduce_scatter': 'removed from XLA (collectives are always async)',
    '--xla_gpu_enable_async_all_reduce': 'removed from XLA (collectives are always async)',
    '--xla_gpu_simplify_all_fp_conversions': 'removed from XLA',
    '--xla_gpu_enable_triton_softmax_fusion': 'removed from XLA',
}
# What train_compile itself adds for GPU targets: sharded autotuning can hang an AOT compile.
TRAIN_COMPILE_FLAGS = ['--xla_gpu_shard_autotuning=false']


def flags_for_jax_0_10(published):
  """The published flags as jax 0.10.2 accepts them, and a line per flag changed."""
  used, changed = [], []
  for flag in published:
    name = flag.split('=')[0]
    if flag in RENAMED:
      used.append(RENAMED[flag])
      changed.append(f'{flag} -> {RENAMED[flag]} (renamed: 0.10.2 does not know the name)')
    elif name in DROPPED:
      changed.append(f'{flag} dropped ({DROPPED[name]})')
    elif flag == "--xla_gpu_enable_command_buffer=''":
      # In the a3 script the quotes sit inside a double-quoted XLA_FLAGS, so they reach XLA
      # as two characters; what the script means is "no command buffers", written plainly.
      used.append('--xla_gpu_enable_command_buffer=')
      changed.append(f'{flag} -> --xla_gpu_enable_command_buffer= (no command buffers, unquoted)')
    else:
      used.append(flag)
  return used + TRAIN_COMPILE_FLAGS, changed


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--maxtext', required=True, help="a MaxText checkout's root")
  parser.add_argument('--run', required=True, choices=sorted(RUNS))
  parser.add_argument('--out', required=True, help='where the optimized HLO text goes')
  parser.add_argument('overrides', nargs='*', help='MaxText config key=value overrides')
  args = parser.parse_args()
  run = RUNS[args.run]

  # XLA reads XLA_FLAGS once, when the first backend starts: set them before anything starts.
  xla_flags, changed = flags_for_jax_0_10(run['xla_flags'])
  os.environ['XLA_FLAGS'] = ' '.join(xla_flags)
  sys.path[:0] = [os.path.join(os.path.abspath(args.maxtext), 'src'), REPO]
  import jax
  # No GPU here: the CPU is the live backend, and the CUDA plugin only compiles.
  jax.config.update('jax_platforms', 'cpu')
  jax.config.update('jax_default_prng_impl', 'unsafe_rbg')  # as train_compile sets it

  from types import SimpleNamespace
  from flax.linen import partitioning as nn_partitioning
  from jax.experimental import mesh_utils
  from jax.sharding import AxisType, Mesh
  from maxtext.common.common_types import ShardMode
  from maxtext.configs import pyconfig
  from maxtext.trainers.pre_train import train, train_compile
  from maxtext.utils import maxtext_utils, sharding
  from jaxllm.backends import gpu_devices, lowering_for
  from jaxllm.cost.hardware import PROFILES
  from jaxllm.cost.hlo import FLAGS_LINE

  argv = ['maxtext', os.path.join(args.maxtext, run['config']), 'compile_topology=a3',
          f'compile_topology_num_slices={run["vms"]}', *run['settings'].split(),
          *args.overrides]
  config = pyconfig.initialize(argv)
  # Compile-only GPUs all say slice 0: MaxText's hybrid mesh groups them by host (8 a VM).
  maxtext_utils.mesh_utils = SimpleNamespace(**{
      **vars(mesh_utils), 'create_hybrid_device_mesh': functools.partial(
          mesh_utils.create_hybrid_device_mesh, process_is_granule=True)})

  # train_compile's mesh, over compile-only H100s rather than jax.devices() on a local GPU.
  devices = gpu_devices(PROFILES['h100-nvlink'], config.num_target_devices)
  jax.config.update('jax_remove_size_one_mesh_axis_from_type',
                    config.remove_size_one_mesh_axis_from_type)
  axis_type = AxisType.Explicit if config.shard_mode == ShardMode.EXPLICIT else AxisType.Auto
  mesh = Mesh(maxtext_utils.create_device_mesh(config, devices), config.mesh_axes,
              axis_types=(axis_type,) * len(config.mesh_axes))

  print(f'run: {args.run}: {run["about"]}')
  print('command line:', ' '.join(argv[1:]))
  print(f'model {config.model_name}, {config.num_target_devices} x {devices[0].device_kind}, '
        f'mesh {dict(mesh.shape)}, global batch {config.global_batch_size_to_train_on}, '
        f'seq {config.max_target_length}, remat {config.remat_policy}, '
        f'attention {config.attention}, dtype {config.dtype}, '
        f'weights {config.weight_dtype}, scan_layers {config.scan_layers}')
  print('XLA flags used:\n  ' + '\n  '.join(xla_flags))
  print('XLA flags changed:\n  ' + ('\n  '.join(changed) or '(none)'))

  # From here on, train_compile's own steps: shaped state and batch, shardings, jit.
  start = time.perf_counter()
  with lowering_for(devices):
    shaped_args, shaped_kwargs, state_shardings, _, model = (
        train_compile.get_shaped_inputs(mesh, config))
    params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(
        config, state_shardings)
    input_state_shardings = sharding.build_zero1_input_state_mesh_shardings(
        config, state_shardings, params_shardings)
    data_sharding = sharding.get_input_data_sharding(config, mesh)
    step, in_shardings, out_shardings, static_argnums, donate_argnums = (
        maxtext_utils.get_functional_train_with_signature(
            train.train_step, data_sharding, input_state_shardings, model, config,
            params_shardings))
    compiled = train_compile.jit_and_compile(
        step, shaped_args, shaped_kwargs, mesh, in_shardings, out_shardings, static_argnums,
        donate_argnums, config, nn_partitioning.axis_rules(config.logical_axis_rules))
  seconds = time.perf_counter() - start

  text = compiled.as_text()
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, 'w') as f:
    f.write(f'{FLAGS_LINE}{" ".join(xla_flags)}\n{text}')
  memory = compiled.memory_analysis()
  gib = lambda n: f'{n / 2**30:.2f} GiB'
  print(f'lowered and compiled in {seconds:.1f} s')
  print(f'memory per device: arguments {gib(memory.argument_size_in_bytes)}, '
        f'outputs {gib(memory.output_size_in_bytes)}, '
        f'aliased {gib(memory.alias_size_in_bytes)}, '
        f'temporaries {gib(memory.temp_size_in_bytes)}, '
        f'code {memory.generated_code_size_in_bytes} bytes')
  print(f'  (bytes: argument {memory.argument_size_in_bytes}, '
        f'temp {memory.temp_size_in_bytes}, output {memory.output_size_in_bytes})')
  print(f'wrote {len(text)} characters of optimized HLO to {args.out}')


if __name__ == '__main__':
  main()
