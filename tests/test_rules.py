"""The rules a run shards by: `derive` against the cases written out, and validation that
leaves the config as it found it."""

import copy

import pytest

from conftest import small_config
from jaxllm.config import default_config
from jaxllm.parallel.rules import derive, kv_heads_fit, mesh_axes
from jaxllm.validate import validate

MESH = dict(data=1, fsdp=1, pipe=1, tensor=1)


@pytest.mark.parametrize('kv_heads, tensor, replicated', [
    (2, 4, True),    # two devices share each K/V head (tiny over tensor=4)
    (8, 16, True),   # Llama-3-8B over tensor=16
    (1, 2, True),
    (4, 2, False),   # each device holds two whole K/V heads
    (4, 4, False),
    (3, 2, False),   # neither: left for the parameter check to name
])
def test_kv_heads_are_kept_whole_where_devices_share_them(kv_heads, tensor, replicated):
  model = default_config().model
  model.update(num_heads=4 * kv_heads, num_kv_heads=kv_heads)
  rules = default_config().sharding.rules
  before = copy.deepcopy(rules)
  layout = derive(rules, {**MESH, 'tensor': tensor}, model)
  kv = () if replicated else ('tensor',)
  assert (layout.rules['kv_heads'], layout.rules['act_kv_heads']) == (kv, kv)
  # Everything else is the configured table, and the configured table is untouched.
  assert {k: v for k, v in layout.rules.items() if 'kv_heads' not in k} == {
      k: mesh_axes(v) for k, v in before.items() if 'kv_heads' not in k}
  assert rules == before


def test_the_batch_shards_and_zero_follow_the_mesh():
  rules = default_config().sharding.rules
  model = default_config().model
  layout = derive(rules, dict(data=2, fsdp=4, pipe=1, tensor=1), model, zero=1)
  assert (layout.batch_shards, layout.zero) == (8, 1)
  # ZeRO splits over data: with one data device there is nothing to split.
  assert derive(rules, dict(data=1, fsdp=8, pipe=1, tensor=1), model, zero=2).zero == 0


def test_kv_heads_fit_is_the_one_rule():
  assert [p for p in range(1, 17) if kv_heads_fit(8, p)] == [1, 2, 4, 8, 16]
  assert [p for p in range(1, 13) if kv_heads_fit(3, p)] == [1, 3, 6, 9, 12]


def test_validation_never_changes_the_config():
  """K/V heads fewer than tensor: validation accepts the config and leaves every field as it
  was (what follows for the run is `derive`'s, on its own copy)."""
  cfg = small_config(fsdp=1, tensor=8)
  before = copy.deepcopy(cfg)
  validate(cfg, dict(cfg.mesh))
  assert cfg.to_dict() == before.to_dict()
