"""benchmarks/gpu.py and its plain-JAX baseline (benchmarks/plain_llama.py), on the CPU.

What the comparison with plain_llama can catch, and what it cannot. plain_llama is jaxllm's
decoder written out as pure functions on one device, but it is not independent of jaxllm:
it makes the same `jax.nn.dot_product_attention` call (same mask, same implementation), the
same casts (compute in model.dtype, fp32 logits and norms), the same rotary half-split
convention and remat names, and takes jaxllm's optimizer (`jaxllm.optim.make_optimizer`) and
weights (`params_from_jaxllm`). So `test_plain_step_equals_jaxllm_step` catches jaxllm's
machinery going wrong where plain_llama does without it: the Flax modules and their
parameter layout, the logical sharding constraints, the hand-written gradients of the
projections, the chunked loss and the embedding lookup, the tied head, the token-mean of the
loss; and it keeps the benchmark's throughput ratio a comparison of like with like. It cannot
catch an error the two share: a wrong attention call, mask or rotary convention, a cast to
the wrong dtype, a wrong AdamW or clipping setup, or any Llama semantics both got wrong in
the same way; nor anything about meshes and collectives (it runs on one device).

The independent references for the model are elsewhere: tests/test_model.py checks attention
and RoPE against numpy written head by head (`test_attention_matches_numpy_reference`,
`test_sharded_attention_matches_numpy_reference`, `test_llama3_rope_scaling_matches_formula`),
the scanned stack against a per-layer loop, the chunked loss against log-softmax over whole
logits, the projections' hand-made gradients against autodiff and the sharded lookup against
numpy; tests/test_hf.py checks whole-model logits against transformers' LlamaForCausalLM
(`test_imported_logits_match_transformers`) and step 1's loss against its cross-entropy
(`test_init_from_hf_trains_from_its_weights_and_exports_the_result`). Meshes and the pipeline
are checked against one device in tests/test_parallel.py and tests/test_pipeline.py. The
learning-rate schedules are checked against their written-out formulas in tests/test_optim.py;
AdamW and its decay mask are optax's and have no independent reference here.
"""

import dataclasses
import math
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import REPO, assert_params_close, load_script, run_main, small_config
from jaxllm.cli import load_config
from jaxllm.cost.cache import MemoryStats
from jaxllm.model.layers import rope_frequencies
from jaxllm.model.remat import REMAT
from jaxllm.optim import make_optimizer
from jaxllm.parallel.mesh import sharding_context
from jaxllm.train import setup


def load_benchmark(name):
  return load_script(os.path.join(REPO, 'benchmarks', f'{name}.py'))


plain_llama = load_benchmark('plain_llama')  # first: gpu.py imports these by name
load_benchmark('timing')
gpu = load_benchmark('gpu')

ONE_DEVICE = ['--config.cpu_devices=1', '--config.mesh.data=1', '--config.mesh.fsdp=1',
              '--config.mesh.tensor=1']


def run_gpu_bench(*args, fresh=True):
  """benchmarks/gpu.py run as a script from the repository root, as a user runs it: in a
  fresh process (one CPU device, as asked), or in this one (`run_main`)."""
  argv = ['python', 'benchmarks/gpu.py', '--config', 'configs/tiny.py', *ONE_DEVICE, *args]
  if not fresh:
    return run_main(argv)
  return subprocess.run([sys.executable, *argv[1:]], cwd=REPO, capture_output=True, text=True,
                        timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize('tied', [False, True])
def test_plain_step_equals_jaxllm_step(tied):
  """From the same weights and batch, one plain step gives jaxllm's loss, gradient norm and
  parameters. Catches a difference between jaxllm's model/step and the plain functions
  (module layout, hand-written gradients, chunked loss, lookup, tied head, loss mean); not
  an error in what both share: the attention call, casts, RoPE convention, the optimizer
  (see the module docstring for the independent references)."""
  cfg = small_config()
  cfg.model.tie_embeddings = tied
  # Adam's first step is g/(|g| + eps): an element with |g| near eps turns rounding noise
  # into a visible change, so eps is raised above the gradients' noise.
  cfg.optim.update(lr=1e-3, eps=1e-6)
  run = setup(cfg, devices=jax.devices()[:1])
  params = plain_llama.params_from_jaxllm(run.state.params)  # before the step donates them
  batch = next(run.batches)
  with sharding_context(run.mesh, run.layout.rules):
    state, want = run.train_step(run.state, batch)

  tx = make_optimizer(cfg.optim, cfg.train.steps)
  step = jax.jit(plain_llama.make_train_step(run.cfg.model, tx))
  new_params, _, got = step(params, tx.init(params), batch)

  np.testing.assert_allclose(got['loss'], want['loss'], rtol=1e-5)
  np.testing.assert_allclose(got['grad_norm'], want['grad_norm'], rtol=1e-5)
  want_params = plain_llama.params_from_jaxllm(state.params)
  assert jax.tree.structure(new_params) == jax.tree.structure(want_params)
  assert_params_close(jax.device_get(new_params), want_params)


def test_plain_rope_and_remat_policies_match_jaxllm():
  """Llama-3 frequency scaling (off in the small config) and the remat names agree. Only the
  names: plain_llama's 'dots' is `dots_with_no_batch_dims_saveable`, jaxllm's keeps the
  values named 'projection', so the policies themselves are not compared. The frequencies'
  independent check is test_model's `test_llama3_rope_scaling_matches_formula`."""
  m = load_config(os.path.join(REPO, 'configs', 'llama3_1b.py')).model
  np.testing.assert_allclose(plain_llama.rope_inv_freq(m), rope_frequencies(m), rtol=1e-6)
  assert set(plain_llama.REMAT) == set(REMAT)


@pytest.mark.slow
def test_gpu_bench_with_plain_on_cpu():
  """The script times both steps and says their losses agree: the command works end to end;
  as a check of the model it has test_plain_step_equals_jaxllm_step's limits."""
  out = run_gpu_bench('--steps', '2', '--warmup', '1', '--plain')
  assert out.returncode == 0, out.stderr
  text = out.stdout
  assert re.search(r'^jaxllm +tokens/s/device [\d,]+ ', text, re.M), text
  assert re.search(r'^plain +tokens/s/device [\d,]+ ', text, re.M), text
  assert 'MFU n/a' in text and 'MFU causal n/a' in text  # a CPU has no known peak
  assert re.search(r'^ratio +jaxllm/plain throughput \d+\.\d+$', text, re.M), text
  assert re.search(r'^loss .*: same$', text, re.M), text
  assert 'versions  jax ' in text and 'command   python benchmarks/gpu.py' in text


@pytest.mark.slow
def test_gpu_bench_largest_remat_fits_deeper():
  # 0.1 GB: on jax 0.10.2's CPU compiler one tiny layer needs ~53 MB whatever the policy,
  # two without remat ~118 MB, four with remat 'full' ~69 MB. (Two policies and four layers
  # at most keep the compiles few; test_layer_search covers the search itself.)
  out = run_gpu_bench('--largest', '--device-memory-gb', '0.1', '--max-layers', '4',
                      '--largest-remat', 'none,full', '--steps', '0')
  assert out.returncode == 0, out.stderr
  layers = {m[1]: int(m[2]) for m in re.finditer(r'^  (\w+) +(\d+) +[\d.,]+M ', out.stdout, re.M)}
  assert set(layers) == {'none', 'full'}, out.stdout
  assert layers['full'] >= layers['none'] >= 1, out.stdout
  assert layers['full'] > layers['none'], out.stdout


@pytest.mark.parametrize('limit, cap, want', [
    (0, 512, 0), (1, 512, 1), (37, 512, 37), (511, 512, 511), (600, 512, 512), (5, 6, 5),
    (9, 6, 6)])
def test_layer_search(limit, cap, want):
  """Doubling then bisection finds the largest fitting count in few tries."""
  tried = []

  def peak_of(layers):
    tried.append(layers)
    return layers  # memory grows with the layers

  assert gpu.search_layers(peak_of, lambda peak: peak <= limit, cap) == (want, want or None)
  assert len(tried) <= 2 * math.ceil(math.log2(cap)) + 1, tried


@pytest.mark.parametrize('args, message', [
    (['--plain', '--config.cpu_devices=2', '--config.mesh.fsdp=2'], '--plain times one device'),
    (['--largest', '--steps', '0'], 'give it with --device-memory-gb'),
    (['--steps', '0'], '--steps=0 must be at least 1'),
])
def test_gpu_bench_bad_input_is_one_line(args, message):
  # A mesh of 2 devices is checked against the devices present: a process with 2 of them.
  out = run_gpu_bench(*args, fresh='--config.cpu_devices=2' in args)
  assert out.returncode == 2, out.stderr
  assert out.stderr.strip().startswith('error: ') and message in out.stderr, out.stderr
  assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_plain_step_without_room_on_the_device_is_refused_in_one_line():
  """On one H100 (60 GiB for the process) the plain step of Llama-3.2-1B at 8 × 4,096 tokens
  needed 68 GiB and died in its first step with the allocator's dump: it is refused before,
  naming the batch. What it already holds (its arguments) is not counted twice."""
  GiB = 2**30

  class Device:
    def __init__(self, stats):
      self.stats = stats

    def memory_stats(self):
      return self.stats

  plain = MemoryStats(arguments=20 * GiB, outputs=20 * GiB, aliases=20 * GiB,
                      temporaries=39 * GiB)
  beside_its_state = Device({'bytes_limit': 60 * GiB, 'bytes_in_use': 20 * GiB})
  refusal = (r'needs 41\.00 GiB beside its state and 40\.00 GiB .* is free.*'
             r'--config\.train\.global_batch')
  with pytest.raises(gpu.ConfigError, match=refusal):
    gpu.check_plain_fits(dataclasses.replace(plain, temporaries=41 * GiB), beside_its_state)
  gpu.check_plain_fits(plain, beside_its_state)
  gpu.check_plain_fits(dataclasses.replace(plain, temporaries=10**15), Device(None))  # a CPU


def test_the_warm_up_runs_on_until_its_seconds_have_passed():
  """Steps go on after `warmup` until `warmup_s` has passed (a GPU's clock settles), before
  the timed ones; the context given wraps only the timed steps."""
  import time as clock
  timing = sys.modules['timing']
  calls, inside = [], []

  def step(state, batch):
    clock.sleep(0.01)
    calls.append(batch)
    return state + 1, {'loss': np.float32(batch)}

  class During:
    def __enter__(self):
      inside.append(len(calls))

    def __exit__(self, *_):
      inside.append(len(calls))

  start = clock.perf_counter()
  step_s, first = timing.timed(step, 0, iter(range(1000)), steps=3, warmup=1, warmup_s=0.2,
                               during=During)
  assert clock.perf_counter() - start >= 0.2
  warm = inside[0]
  assert warm >= 0.2 / 0.01 * 0.5 and inside == [warm, warm + 3]  # the timed ones inside
  assert first['loss'] == 0 and 0.01 <= step_s < 0.1


def test_clocks_are_sampled_from_nvml_and_said_missing_without_it(monkeypatch):
  device = jax.devices()[0]
  monkeypatch.setitem(sys.modules, 'pynvml', None)  # not installed
  with gpu.Clocks(device) as clocks:
    pass
  assert clocks.text().startswith('not sampled (NVML: ')

  class FakeNvml:  # what the NVML bindings answer: MHz, and milliwatts
    NVML_CLOCK_SM = 1
    nvmlInit = nvmlShutdown = staticmethod(lambda: None)
    nvmlDeviceGetHandleByIndex = staticmethod(lambda i: i)
    nvmlDeviceGetClockInfo = staticmethod(lambda handle, which: 1465)
    nvmlDeviceGetPowerUsage = staticmethod(lambda handle: 693_000)

  monkeypatch.setitem(sys.modules, 'pynvml', FakeNvml)
  import time as clock
  with gpu.Clocks(device, interval=0.01) as clocks:
    clock.sleep(0.1)
  assert len(clocks.samples) >= 2 and set(clocks.samples) == {(1465, 693.0)}
  assert re.match(r'SM 1,465–1,465 MHz \(mean 1,465\), power 693–693 W \(mean 693\), \d+ '
                  r'samples while timed$', clocks.text())
