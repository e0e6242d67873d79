"""The timing model on small programs written out by hand, each timed by hand here from the
profile's rates: kernels in program order, loops for their trip counts, collectives hidden by
the kernels between their start and done and exposed for the rest, GEMMs beside them on the
SMs NCCL leaves. (On compiled programs: test_gpu_program and test_analyze.)"""

import dataclasses
import re

import pytest

from jaxllm.cost import gemm_rates, timing
from jaxllm.cost.hardware import PROFILES

RATES = PROFILES['h100-nvlink'].rates
LAUNCH = RATES.launch_s
# At a step's sustained clocks a GEMM keeps MSMF/MAMF of its burst rate (one H200, bf16).
SUSTAINED = 708.5 / 841.9
N = 1024  # GEMMs of N×N×N: a point of XLA's measured table, 252.8 TFLOP/s on an H100 (burst)
GEMM = 2 * N**3 / (252.8e12 * SUSTAINED)
SHARE = 1 - 16 / 132  # of the SMs, those NCCL leaves to a GEMM while a collective runs
BESIDE = GEMM / SHARE  # a GEMM run entirely beside a collective

COMPUTATIONS = f"""HloModule m, is_scheduled=true

%gemm (p0: bf16[{N},{N}], p1: bf16[{N},{N}]) -> bf16[{N},{N}] {{
  %p0 = bf16[{N},{N}]{{1,0}} parameter(0)
  %p1 = bf16[{N},{N}]{{1,0}} parameter(1)
  ROOT %dot = bf16[{N},{N}]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

%sum (x: f32[], y: f32[]) -> f32[] {{
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(%x, %y)
}}
"""


def program(entry: str, extra: str = '') -> str:
  """A module of the computations above, `extra` ones and an entry of `entry`'s lines."""
  return f'{COMPUTATIONS}{extra}\nENTRY %main () -> bf16[{N},{N}] {{\n{entry}\n}}\n'


def gather(devices: int = 8) -> str:
  """An all-gather of the weight over `devices`, started, a GEMM between, then done."""
  group = ','.join(str(i) for i in range(devices))
  rows = N // devices
  return f"""  %a = bf16[{N},{N}]{{1,0}} parameter(0)
  %w = bf16[{rows},{N}]{{1,0}} parameter(1)
  %ag = (bf16[{rows},{N}]{{1,0}}, bf16[{N},{N}]{{1,0}}) all-gather-start(%w), channel_id=1, replica_groups={{{{{group}}}}}, dimensions={{0}}, use_global_device_ids=true
  %k1 = bf16[{N},{N}]{{1,0}} fusion(%a, %a), kind=kCustom, calls=%gemm
  %agd = bf16[{N},{N}]{{1,0}} all-gather-done(%ag)
  ROOT %k2 = bf16[{N},{N}]{{1,0}} fusion(%agd, %a), kind=kCustom, calls=%gemm"""


def step(text: str, devices: int = 8) -> timing.Timing:
  return timing.step_time(text, RATES, devices, timing.node_crossing(8, devices))


def test_a_gemm_takes_its_flops_at_the_measured_rate_and_the_step_s_clocks():
  t = step(program(gather()))
  assert t.by_category['gemm'] == pytest.approx(2 * GEMM)
  assert t.by_category['launch'] == pytest.approx(2 * LAUNCH)
  assert [k.count for k in t.kernels if k.category == 'gemm'] == [1, 1]
  burst = timing.step_time(program(gather()), dataclasses.replace(RATES, clocks='burst'), 8,
                           timing.node_crossing(8, 8))
  assert burst.by_category['gemm'] == pytest.approx(2 * 2 * N**3 / 252.8e12)


@pytest.mark.parametrize('devices', [8, 16], ids=['inside a node', 'across nodes'])
def test_a_collective_is_exposed_for_what_the_kernels_between_do_not_hide(devices):
  t = step(program(gather(devices)), devices)
  bandwidth, latency = ((352e9, 10e-6) if devices == 8 else (47e9, 20e-6))
  sent = (devices - 1) / devices * N * N * 2  # bytes one device sends to gather N×N bf16
  gathered = latency + sent / bandwidth
  assert t.comm_s == pytest.approx(gathered)
  assert GEMM <= gathered * SHARE  # the first GEMM runs wholly beside the gather, slower
  exposed = max(0.0, gathered - (BESIDE + LAUNCH))
  assert exposed > 0
  assert t.by_category['contention'] == pytest.approx(BESIDE - GEMM)
  assert t.by_category['exposed_comm'] == pytest.approx(exposed)
  assert t.step_s == pytest.approx(BESIDE + LAUNCH + exposed + GEMM + LAUNCH)
  assert t.hidden_comm_s == pytest.approx(gathered - exposed)


def test_a_collective_with_enough_work_between_is_hidden():
  between = '\n'.join(f'  %k{i}b = bf16[{N},{N}]{{1,0}} fusion(%a, %a), kind=kCustom, calls=%gemm'
                      for i in range(3))
  text = program(gather().replace('  %agd', between + '\n  %agd'))
  t = step(text)
  gathered = t.comm_s
  assert BESIDE + LAUNCH < gathered < 2 * (GEMM + LAUNCH)  # it ends during the second GEMM
  assert t.by_category['exposed_comm'] == 0
  # The second GEMM runs beside the gather until it ends, then at full speed.
  second = GEMM + (gathered - (BESIDE + LAUNCH)) * (1 - SHARE)
  assert t.by_category['contention'] == pytest.approx(BESIDE - GEMM + second - GEMM)
  assert t.step_s == pytest.approx(5 * (GEMM + LAUNCH) + t.by_category['contention'])


def test_a_synchronous_all_reduce_stops_the_kernels():
  entry = f"""  %a = bf16[{N},{N}]{{1,0}} parameter(0)
  %x = f32[262144]{{0}} parameter(1)
  %ar = f32[262144]{{0}} all-reduce(%x), channel_id=1, replica_groups={{{{0,1,2,3}}}}, use_global_device_ids=true, to_apply=%sum
  ROOT %k = bf16[{N},{N}]{{1,0}} fusion(%a, %a), kind=kCustom, calls=%gemm"""
  t = step(program(entry))
  reduced = 10e-6 + 2 * 3 / 4 * 262144 * 4 / 302e9  # ring all-reduce over 4 GPUs
  assert t.by_category['exposed_comm'] == pytest.approx(reduced)
  assert t.step_s == pytest.approx(reduced + GEMM + LAUNCH)


LOOP = f"""
%body (s: (s32[], bf16[{N},{N}])) -> (s32[], bf16[{N},{N}]) {{
  %s = (s32[], bf16[{N},{N}]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %v = bf16[{N},{N}]{{1,0}} get-tuple-element(%s), index=1
  %k = bf16[{N},{N}]{{1,0}} fusion(%v, %v), kind=kCustom, calls=%gemm
  ROOT %t = (s32[], bf16[{N},{N}]{{1,0}}) tuple(%i, %k)
}}

%cond (c: (s32[], bf16[{N},{N}])) -> pred[] {{
  %c = (s32[], bf16[{N},{N}]{{1,0}}) parameter(0)
  ROOT %p = pred[] constant(true)
}}
"""


def test_a_loop_runs_its_body_for_its_trip_count():
  entry = f"""  %a = bf16[{N},{N}]{{1,0}} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[{N},{N}]{{1,0}}) tuple(%zero, %a)
  %loop = (s32[], bf16[{N},{N}]{{1,0}}) while(%init), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"7"}}}}
  ROOT %out = bf16[{N},{N}]{{1,0}} get-tuple-element(%loop), index=1"""
  t = step(program(entry, LOOP))
  assert t.step_s == pytest.approx(7 * (GEMM + LAUNCH))
  assert [k.count for k in t.kernels] == [7]


def test_a_collective_started_in_one_iteration_is_waited_for_in_the_next():
  """XLA pipelines a loop's collectives: the start carried to the next iteration's done."""
  body = f"""
%body (s: (bf16[{N},{N}], (bf16[128,{N}], bf16[{N},{N}]))) -> (bf16[{N},{N}], (bf16[128,{N}], bf16[{N},{N}])) {{
  %s = (bf16[{N},{N}]{{1,0}}, (bf16[128,{N}]{{1,0}}, bf16[{N},{N}]{{1,0}})) parameter(0)
  %v = bf16[{N},{N}]{{1,0}} get-tuple-element(%s), index=0
  %prev = (bf16[128,{N}]{{1,0}}, bf16[{N},{N}]{{1,0}}) get-tuple-element(%s), index=1
  %w = bf16[{N},{N}]{{1,0}} all-gather-done(%prev)
  %part = bf16[128,{N}]{{1,0}} slice(%w), slice={{[0:128], [0:{N}]}}
  %next = (bf16[128,{N}]{{1,0}}, bf16[{N},{N}]{{1,0}}) all-gather-start(%part), channel_id=1, replica_groups={{{{0,1,2,3,4,5,6,7}}}}, dimensions={{0}}, use_global_device_ids=true
  %k = bf16[{N},{N}]{{1,0}} fusion(%v, %w), kind=kCustom, calls=%gemm
  ROOT %t = (bf16[{N},{N}]{{1,0}}, (bf16[128,{N}]{{1,0}}, bf16[{N},{N}]{{1,0}})) tuple(%k, %next)
}}

%cond (c: (bf16[{N},{N}], (bf16[128,{N}], bf16[{N},{N}]))) -> pred[] {{
  %c = (bf16[{N},{N}]{{1,0}}, (bf16[128,{N}]{{1,0}}, bf16[{N},{N}]{{1,0}})) parameter(0)
  ROOT %p = pred[] constant(true)
}}
"""
  entry = f"""  %a = bf16[{N},{N}]{{1,0}} parameter(0)
  %w = bf16[128,{N}]{{1,0}} parameter(1)
  %first = (bf16[128,{N}]{{1,0}}, bf16[{N},{N}]{{1,0}}) all-gather-start(%w), channel_id=2, replica_groups={{{{0,1,2,3,4,5,6,7}}}}, dimensions={{0}}, use_global_device_ids=true
  %init = (bf16[{N},{N}]{{1,0}}, (bf16[128,{N}]{{1,0}}, bf16[{N},{N}]{{1,0}})) tuple(%a, %first)
  %loop = (bf16[{N},{N}]{{1,0}}, (bf16[128,{N}]{{1,0}}, bf16[{N},{N}]{{1,0}})) while(%init), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"5"}}}}
  ROOT %out = bf16[{N},{N}]{{1,0}} get-tuple-element(%loop), index=0"""
  t = step(program(entry, body))
  gathered = 10e-6 + 7 / 8 * N * N * 2 / 352e9
  sliced = RATES.memory_seconds(2 * 128 * N * 2) + LAUNCH  # reads and writes 128 rows
  assert gathered > BESIDE + LAUNCH  # so the gathers set the pace
  # Gathers and slices alternate: the first gather, then in each of the 5 iterations a
  # slice of the last gather and the next gather (the GEMMs run beside them); the last one
  # started is never waited for, and still counts.
  assert t.step_s == pytest.approx(6 * gathered + 5 * sliced)
  assert t.comm_s == pytest.approx(6 * gathered)
  assert {k.name: k.count for k in t.kernels} == {'first': 1, 'next': 5, 'part': 5, 'k': 5}


DUS = f"""
%update (buffer: f32[32,{N},{N}], row: f32[1,{N},{N}], i: s32[]) -> f32[32,{N},{N}] {{
  %buffer = f32[32,{N},{N}]{{2,1,0}} parameter(0)
  %row = f32[1,{N},{N}]{{2,1,0}} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = f32[32,{N},{N}]{{2,1,0}} dynamic-update-slice(%buffer, %row, %i, %z, %z)
}}

%take (buffer: f32[32,{N},{N}], i: s32[]) -> bf16[1,{N},{N}] {{
  %buffer = f32[32,{N},{N}]{{2,1,0}} parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = f32[1,{N},{N}]{{2,1,0}} dynamic-slice(%buffer, %i, %z, %z), dynamic_slice_sizes={{1,{N},{N}}}
  ROOT %c = bf16[1,{N},{N}]{{2,1,0}} convert(%ds)
}}
"""


def test_memory_kernels_move_only_what_they_touch():
  """A stack updated in place writes one row; a row sliced out of a stack reads one row."""
  entry = f"""  %stack = f32[32,{N},{N}]{{2,1,0}} parameter(0)
  %row = f32[1,{N},{N}]{{2,1,0}} parameter(1)
  %i = s32[] parameter(2)
  %u = f32[32,{N},{N}]{{2,1,0}} fusion(%stack, %row, %i), kind=kLoop, calls=%update
  ROOT %t = bf16[1,{N},{N}]{{2,1,0}} fusion(%u, %i), kind=kLoop, calls=%take"""
  t = step(program(entry, DUS))
  moved = {k.name: k.bytes for k in t.kernels}
  row = N * N * 4
  index = 4  # the s32 row number each reads
  assert moved == {'u': 2 * row + index, 't': row + row // 2 + index}  # f32 row; bf16 row out
  assert t.by_category['memory'] == pytest.approx(
      RATES.memory_seconds(2 * row + index) + RATES.memory_seconds(1.5 * row + index))


def test_an_asynchronous_fusion_moves_what_its_fusion_would():
  """jax 0.11's XLA runs a loop's stacking updates as `fusion-start` … `fusion-done` (as
  written in its Llama-3-8B program). Timed as a copy of its operands and tuple, they were
  predicted 30.8 ms where one H100 measured 0.32 (benchmarks/README.md): each writes one row
  in place, as the same fusion in line does, and its done launches nothing."""
  entry = f"""  %stack = f32[32,{N},{N}]{{2,1,0}} parameter(0)
  %row = f32[1,{N},{N}]{{2,1,0}} parameter(1)
  %i = s32[] parameter(2)
  %us = ((f32[32,{N},{N}]{{2,1,0}}, f32[1,{N},{N}]{{2,1,0}}, s32[]), f32[32,{N},{N}]{{2,1,0}}, u32[]) fusion-start(%stack, %row, %i), kind=kLoop, calls=%update
  %u = f32[32,{N},{N}]{{2,1,0}} fusion-done(%us)
  ROOT %t = bf16[1,{N},{N}]{{2,1,0}} fusion(%u, %i), kind=kLoop, calls=%take"""
  t = step(program(entry, DUS))
  row = N * N * 4
  assert {k.name: k.bytes for k in t.kernels} == {'us': 2 * row + 4, 't': row + row // 2 + 4}
  assert t.by_category['memory'] == pytest.approx(
      RATES.memory_seconds(2 * row + 4) + RATES.memory_seconds(1.5 * row + 4))


# --- what the model once left untimed ----------------------------------------------------

def test_a_loop_of_unknown_trip_count_is_named_as_timed_once():
  entry = f"""  %a = bf16[{N},{N}]{{1,0}} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[{N},{N}]{{1,0}}) tuple(%zero, %a)
  %loop = (s32[], bf16[{N},{N}]{{1,0}}) while(%init), condition=%cond, body=%body
  ROOT %out = bf16[{N},{N}]{{1,0}} get-tuple-element(%loop), index=1"""
  t = step(program(entry, LOOP))
  assert [k.count for k in t.kernels] == [1]
  assert t.untimed == ['while loop %loop: trip count unknown, its body timed once']


SEND_RECV = ('frontend_attributes={_xla_send_recv_source_target_pairs='
             '{{0,1},{1,2},{2,3},{3,0}}}')


def test_send_and_recv_are_timed_as_one_transfer_each_way():
  """A pipeline's point-to-point pair: the send's bytes go out while the recv's come in, on
  their own links, so the pair takes one transfer's time; the kernels between hide it."""
  entry = f"""  %a = bf16[{N},{N}]{{1,0}} parameter(0)
  %token = token[] after-all()
  %recv = (bf16[{N},{N}]{{1,0}}, u32[], token[]) recv(%token), channel_id=1, {SEND_RECV}
  %send = (bf16[{N},{N}]{{1,0}}, u32[], token[]) send(%a, %token), channel_id=2, {SEND_RECV}
  %k1 = bf16[{N},{N}]{{1,0}} fusion(%a, %a), kind=kCustom, calls=%gemm
  %recv-done = (bf16[{N},{N}]{{1,0}}, token[]) recv-done(%recv), channel_id=1
  %got = bf16[{N},{N}]{{1,0}} get-tuple-element(%recv-done), index=0
  %send-done = token[] send-done(%send), channel_id=2
  ROOT %k2 = bf16[{N},{N}]{{1,0}} fusion(%got, %a), kind=kCustom, calls=%gemm"""
  t = step(program(entry), devices=4)
  sent = 10e-6 + N * N * 2 / 275e9  # over one link, at the two-GPU all-gather's rate
  assert {k.name: k.category for k in t.kernels} == {
      'recv': 'collective', 'send': 'collective', 'k1': 'gemm', 'k2': 'gemm'}
  assert t.comm_s == pytest.approx(2 * sent)  # each way
  assert sent > BESIDE + LAUNCH  # the first GEMM runs beside the send, the second waits
  assert t.step_s == pytest.approx(sent + GEMM + LAUNCH)


@pytest.mark.parametrize('kind, bandwidth, sent', [
    ('collective-broadcast', 352e9, N * N * 2),           # the root's bytes reach every device
    ('ragged-all-to-all', 340e9, 7 / 8 * N * N * 2)],    # at most its whole output, 7/8 of it sent
    ids=['collective-broadcast', 'ragged-all-to-all'])
def test_broadcasts_and_ragged_all_to_alls_are_collectives(kind, bandwidth, sent):
  group = ','.join(str(i) for i in range(8))
  operands = ('%a' if kind == 'collective-broadcast' else
              '%a, %out, %offsets, %sizes, %offsets, %sizes')
  entry = f"""  %a = bf16[{N},{N}]{{1,0}} parameter(0)
  %out = bf16[{N},{N}]{{1,0}} parameter(1)
  %offsets = s64[8]{{0}} parameter(2)
  %sizes = s64[8]{{0}} parameter(3)
  %x = bf16[{N},{N}]{{1,0}} {kind}({operands}), channel_id=1, replica_groups={{{{{group}}}}}
  ROOT %k = bf16[{N},{N}]{{1,0}} fusion(%x, %a), kind=kCustom, calls=%gemm"""
  t = step(program(entry))
  moved = 10e-6 + sent / bandwidth
  assert [k.category for k in t.kernels] == ['collective', 'gemm']
  assert t.comm_s == pytest.approx(moved)
  assert t.step_s == pytest.approx(moved + GEMM + LAUNCH)  # synchronous: nothing beside it


BRANCHES = f"""
%wait (p: (bf16[128,{N}], bf16[{N},{N}])) -> bf16[{N},{N}] {{
  %p = (bf16[128,{N}]{{1,0}}, bf16[{N},{N}]{{1,0}}) parameter(0)
  %w = bf16[{N},{N}]{{1,0}} all-gather-done(%p)
  ROOT %g = bf16[{N},{N}]{{1,0}} fusion(%w, %w), kind=kCustom, calls=%gemm
}}

%skip (q: (bf16[128,{N}], bf16[{N},{N}])) -> bf16[{N},{N}] {{
  %q = (bf16[128,{N}]{{1,0}}, bf16[{N},{N}]{{1,0}}) parameter(0)
  %v = bf16[{N},{N}]{{1,0}} all-gather-done(%q)
  ROOT %c = bf16[{N},{N}]{{1,0}} copy(%v)
}}
"""


def test_a_collective_started_outside_a_conditional_is_waited_for_inside():
  entry = f"""  %pred = pred[] parameter(0)
  %w = bf16[128,{N}]{{1,0}} parameter(1)
  %ag = (bf16[128,{N}]{{1,0}}, bf16[{N},{N}]{{1,0}}) all-gather-start(%w), channel_id=1, replica_groups={{{{0,1,2,3,4,5,6,7}}}}, dimensions={{0}}, use_global_device_ids=true
  ROOT %r = bf16[{N},{N}]{{1,0}} conditional(%pred, %ag, %ag), true_computation=%wait, false_computation=%skip"""
  t = step(program(entry, BRANCHES))
  gathered = 10e-6 + 7 / 8 * N * N * 2 / 352e9
  # The longer branch: it waits for the gather, then multiplies.
  assert t.step_s == pytest.approx(gathered + GEMM + LAUNCH)
  assert t.by_category['exposed_comm'] == pytest.approx(gathered)


# --- the rates: what each kernel runs at -------------------------------------------------

def test_fp8_gemm_rates_are_bounded_by_physics_then_sustained():
  """An H100's FP8 tensor cores do exactly twice bf16's work per clock: no FP8 rate above
  twice bf16's at the same shape, nor above the best FP8 matmul measured (1,402.6); XLA's
  table has rows above both. Then the FP8 share of a sustained clock."""
  burst = dataclasses.replace(RATES, clocks='burst')
  sizes = gemm_rates.SIZES
  bounded = 0
  for i, m in enumerate(sizes):
    for j, n in enumerate(sizes):
      for k, depth in enumerate(sizes):
        table = gemm_rates.H100['f8'][i][j][k]
        bf16 = gemm_rates.H100['bf16'][i][j][k]
        rate = burst.gemm_rate('f8e4m3fnxf8e4m3fn->bf16', 1, m, n, depth) / 1e12
        assert rate == pytest.approx(min(table, 2 * bf16, 1402.6))
        bounded += table > min(2 * bf16, 1402.6)
        assert RATES.gemm_rate('f8e4m3fnxf8e4m3fn->bf16', 1, m, n, depth) == pytest.approx(
            rate * 1e12 * 1288.7 / 1491.9)
  assert bounded >= 19  # the rows above twice bf16's, and those above the best measured


def test_a_dimension_under_the_table_s_smallest_takes_the_smallest_s_time():
  """An 8-wide router matmul runs the same 256-wide tiles as a 256-wide one."""
  time = lambda m, n, k: 2 * m * n * k / RATES.gemm_rate('bf16xbf16->f32', 1, m, n, k)
  assert time(16384, 8, 4096) == pytest.approx(time(16384, 256, 4096))
  assert time(64, 64, 64) == pytest.approx(time(256, 256, 256))
  assert time(16384, 512, 4096) > time(16384, 256, 4096)


@pytest.mark.parametrize('cudnn, forward', [('9.19', 644), ('2024', 529)])
def test_attention_runs_at_the_rates_of_the_profile_s_cudnn(cudnn, forward):
  """Causal forward, head dim 128, 8K tokens: cuDNN 9.19's published figure, or the 2024
  series a run of that year used; both at the sustained clocks' share."""
  rates = dataclasses.replace(RATES, cudnn=cudnn)
  assert rates.attention_rate(False, 128, 8192, True) == pytest.approx(
      forward * 1e12 * SUSTAINED)


SMALL = """
%scale (x: f32[256]) -> f32[256] {
  %x = f32[256]{0} parameter(0)
  ROOT %y = f32[256]{0} add(%x, %x)
}
"""


def test_without_command_buffers_the_host_launches_every_kernel():
  """A chain of tiny kernels runs at the host's pace when it launches each one (5 µs); from
  a command buffer, at the GPU's (1 µs apart). GEMMs longer than a launch hide it."""
  tiny = '\n'.join(f'  %s{i} = f32[256]{{0}} fusion(%x), kind=kLoop, calls=%scale'
                   for i in range(10))
  entry = f"""  %x = f32[256]{{0}} parameter(0)
{tiny}
  %a = bf16[{N},{N}]{{1,0}} parameter(1)
  %k1 = bf16[{N},{N}]{{1,0}} fusion(%a, %a), kind=kCustom, calls=%gemm
  %k2 = bf16[{N},{N}]{{1,0}} fusion(%a, %a), kind=kCustom, calls=%gemm
  ROOT %k3 = bf16[{N},{N}]{{1,0}} fusion(%a, %a), kind=kCustom, calls=%gemm"""
  text = program(entry, SMALL)
  each = RATES.memory_seconds(2 * 256 * 4)
  assert step(text).step_s == pytest.approx(10 * (each + LAUNCH) + 3 * (GEMM + LAUNCH))
  off = timing.step_time(text, RATES.for_flags('--xla_gpu_enable_command_buffer='), 8,
                         timing.node_crossing(8, 8))
  host = 5e-6
  # The GPU waits for each kernel's launch, the first GEMM's too; the next GEMMs are launched
  # while the one before runs.
  assert off.step_s == pytest.approx(11 * host + 3 * (GEMM + LAUNCH))
  assert off.by_category['launch'] == pytest.approx(off.step_s - 10 * each - 3 * GEMM)


@pytest.mark.parametrize('flags, on', [
    ('', True), ('--xla_gpu_enable_command_buffer=', False),
    ("--xla_gpu_enable_command_buffer=''", False), ('--xla_gpu_graph_level=0', False),
    ('--xla_gpu_enable_command_buffer=FUSION,CUBLAS', True)])
def test_a_program_s_flags_say_whether_command_buffers_run(flags, on):
  assert RATES.for_flags(f'--xla_gpu_enable_latency_hiding_scheduler=true {flags}'
                         ).command_buffers == on


TRITON = f"""  %a = bf16[{N},{N}]{{1,0}} parameter(0)
  ROOT %g = bf16[{N},{N}]{{1,0}} custom-call(%a, %a), custom_call_target="__gpu$xla.gpu.triton", backend_config={{"name":"grouped_gemm"}}"""


def test_a_custom_call_is_timed_by_its_named_cost():
  """A grouped GEMM written as a Triton kernel: without a cost, a memory-bound kernel on its
  operands and result; with one, the GEMMs its cost function names."""
  t = step(program(TRITON))
  assert [(k.category, k.bytes) for k in t.kernels] == [('memory', 3 * N * N * 2)]
  groups = lambda insts, inst: timing.CustomCallCost(
      gemms=tuple(('bf16xbf16->bf16', 1, N // 4, N, N) for _ in range(4)))
  t = timing.step_time(program(TRITON), RATES, 1, timing.node_crossing(8, 1),
                       {'__gpu$xla.gpu.triton': groups})
  quarter = 2 * N**3 / 4 / RATES.gemm_rate('bf16xbf16->bf16', 1, N // 4, N, N)
  assert [(k.category, k.flops) for k in t.kernels] == [('gemm', 2 * N**3)]
  assert t.by_category['gemm'] == pytest.approx(4 * quarter)


# --- against a profile: the trace read and joined to the prediction ----------------------

def test_a_trace_s_kernels_join_the_prediction_of_the_same_instructions(tmp_path):
  """A CPU trace of a program with a loop: every kernel the model times is found in the
  trace under its instruction's name, as often per step as the model runs it (the loop body
  three times), nothing in the trace is left over, and the GEMMs are GEMMs in both."""
  import jax
  import jax.numpy as jnp

  from jaxllm.cost import trace

  def loss(x, w):
    y, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=3)
    return (y * 2 + 1).sum()

  x, w = jnp.ones((128, 128)), jnp.full((128, 128), 0.01)
  compiled = jax.jit(jax.grad(loss)).lower(x, w).compile()
  text = compiled.as_text()
  compiled(x, w).block_until_ready()
  jax.profiler.start_trace(str(tmp_path))
  for _ in range(2):
    out = compiled(x, w)
  out.block_until_ready()
  jax.profiler.stop_trace()

  measured = trace.read(str(tmp_path), trace.module_name(text), trace.containers(text))
  predicted = timing.step_time(text, RATES, 1, timing.node_crossing(8, 1))
  c = trace.compare(predicted, measured, steps=2)
  assert {r.name for r in c.rows} == {k.name for k in predicted.kernels}  # all joined
  assert all(r.measured_count == r.predicted_count and r.measured_s > 0 for r in c.rows)
  loop = [r for r in c.rows if '/while/body/' in r.op]
  assert loop and {r.predicted_count for r in loop} == {3}
  gemms = {r.name for r in c.rows if r.category == 'gemm'}
  assert len(gemms) == 2  # the forward's matmul and the backward's (x's gradient is not asked)
  assert c.measured['gemm'] == pytest.approx(
      sum(sum(measured.durations[n]) for n in gemms) / 2)
  assert 0 <= c.measured['gaps'] < c.measured_step_s
  text_table = trace.format_comparison(c, top=3)
  for label in trace.LABELS.values():
    assert re.search(rf'^{label} +[\d,.]+ +[\d,.]+ ', text_table, re.M), text_table
  assert 'predicted but not in the trace 0 (0.000 ms); in the trace but launching nothing to ' \
         'the model 0 (0.000 ms)' in text_table
  assert len(re.findall(r'^  +[\d,.]+ +[\d,.]+ +[\d.]+ +\d+/\d+ ', text_table, re.M)) == 3


@pytest.mark.slow
def test_the_kernel_check_runs_end_to_end_on_a_cpu_trace(tmp_path):
  """benchmarks/kernels.py as a user runs it: the tiny model's step traced on a CPU device,
  every kernel of it joined to the model's prediction."""
  import subprocess
  import sys

  from conftest import REPO
  result = subprocess.run(
      [sys.executable, 'benchmarks/kernels.py', '--config', 'configs/tiny.py',
       '--config.cpu_devices=1', '--config.mesh.data=1', '--config.mesh.fsdp=1',
       '--config.mesh.tensor=1', '--steps', '2', '--warmup', '1', '--trace-dir',
       str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  assert re.search(r'^2 steps of jit_train_step on 1 × cpu traced into ', out, re.M), out
  joined = re.search(r'^joined (\d+) instructions; predicted but not in the trace 0 ', out, re.M)
  assert joined and int(joined[1]) > 50, out
  for label in ('GEMMs', 'memory-bound', 'gaps between kernels'):
    assert re.search(rf'^{label} +[\d,.]+ +[\d,.]+ ', out, re.M), out
  assert len(re.findall(r'^  +[\d,.]+ +[\d,.]+ +[\d.–]+ +[\d.]+/[\d.]+ ', out, re.M)) == 10, out


def test_a_program_written_out_with_its_flags_is_predicted_with_them(tmp_path):
  """`benchmarks/maxtext.py` writes a program after a line of the flags it was compiled with;
  `analyze --hlo` reads them (command buffers off here), and the rest of the program alike."""
  from jaxllm import analyze
  from jaxllm.cost import hlo, report
  text = program(gather()).replace('HloModule m,', 'HloModule m, num_partitions=8,')
  flagged = f'{hlo.FLAGS_LINE}--xla_gpu_enable_command_buffer= --xla_gpu_enable_triton_gemm=false\n{text}'
  (tmp_path / 'program.hlo.txt').write_text(flagged)
  assert analyze.read_hlo_flags(['analyze', '--hlo', str(tmp_path / 'program.hlo.txt')])[::2] == (
      flagged, 8)
  assert hlo.written_flags(text) == ('', text)
  assert hlo.written_flags(flagged) == (
      '--xla_gpu_enable_command_buffer= --xla_gpu_enable_triton_gemm=false', text)
  plain, off = (report.program_report(t, PROFILES['h100-nvlink'], 8, 8)['prediction']
                for t in (text, flagged))
  assert plain['assumes']['command_buffers'] and not off['assumes']['command_buffers']
  assert off['gemm_s'] == plain['gemm_s'] and off['kernel_launches'] == 2
  # The host launches the gather (5 µs), then the first GEMM (10 µs): the GEMM starts late,
  # and less of it runs beside the gather; the host has launched the second GEMM by its turn.
  host, gathered = 5e-6, 10e-6 + 7 / 8 * N * N * 2 / 352e9
  beside = (host + gathered - 2 * host) * SHARE  # the first GEMM's work done beside it
  first = host + gathered + GEMM - beside
  assert off['step_s'] == pytest.approx(first + LAUNCH + GEMM + LAUNCH)
  assert off['launch_s'] == pytest.approx(2 * host + 2 * LAUNCH)


def cudnn_forward(scores: str, window: int) -> str:
  """The entry of a program running cuDNN's causal attention forward on q[1, 1024, 8, 128],
  with `scores` as the backend config's intermediate_tensor_shape."""
  return f"""  %q = bf16[1,1024,8,128]{{3,2,1,0}} parameter(0)
  %k = bf16[1,1024,4,128]{{3,2,1,0}} parameter(1)
  ROOT %fwd = (bf16[1,8,1024,128]{{3,1,2,0}}, f32[1,8,1024]{{2,1,0}}, u8[256]{{0}}) custom-call(%q, %k, %k), custom_call_target="__cudnn$fmhaSoftmax", operand_layout_constraints={{bf16[1,1024,8,128]{{3,2,1,0}}, bf16[1,1024,4,128]{{3,2,1,0}}, bf16[1,1024,4,128]{{3,2,1,0}}}}, backend_config={{"cudnn_fmha_backend_config":{{"fmha_scale":0.0883,"intermediate_tensor_shape":{scores},"is_flash_attention":true,"mask_type":"CAUSAL","max_seg_per_batch":1,"seed":42,"sliding_window_length":{window}}},"operation_queue_id":"0"}}"""


@pytest.mark.parametrize('window', [0, 256])
@pytest.mark.parametrize('scores', [
    # as XLA of jax 0.10 writes the scores' shape (the deviceless programs of this suite)
    '{"element_type":"BF16","dimensions":[1,8,1024,1024],"tuple_shapes":[]}',
    # as XLA of jax 0.11.2 wrote it on an H200 (2026-11-27): dimensions first, as strings
    '{"dimensions":["1","8","1024","1024"],"element_type":"BF16","is_dynamic_dimension":'
    '[false,false,false,false],"layout":{"minor_to_major":["3","2","1","0"],"tiles":[]},'
    '"tuple_shapes":[]}'])
def test_attention_is_counted_from_either_layout_of_its_backend_config(scores, window):
  """cuDNN attention's FLOPs come from the scores' shape in its backend config: 4·B·N·T·S·H,
  halved by the causal mask, or the band's W·T − W²/2 pairs under a window; timed at the
  profile's attention rate, not left at zero as a layout the parser missed would leave it."""
  t = step(program(cudnn_forward(scores, window)), 1)
  [kernel] = [k for k in t.kernels if k.category == 'attention']
  pairs = 256 * 1024 - 256**2 / 2 if window else 1024 * 1024 / 2
  assert kernel.flops == 4 * 8 * pairs * 128
  assert kernel.seconds == pytest.approx(
      kernel.flops / RATES.attention_rate(False, 128, 1024, True, window))
