"""`profile.start_step` traces a few train steps with jax.profiler into <workdir>/profile."""

from conftest import run_cli


def test_profile_traces_the_chosen_steps(tmp_path):
  workdir = tmp_path / 'run'
  result = run_cli('--config', 'configs/tiny.py', '--config.train.steps=6',
                   '--config.optim.warmup_steps=0',
                   '--config.train.log_every=3', '--config.profile.start_step=2',
                   '--config.profile.steps=2', '--config.eval.every=0',
                   '--config.checkpoint.every=0', f'--workdir={workdir}')
  assert result.returncode == 0, result.stderr[-2000:]
  profile = workdir / 'profile'
  assert f'profile  steps 2–3 traced into {profile}' in result.stdout
  # jax writes plugins/profile/<time>/<host>.xplane.pb (and the trace as JSON beside it).
  xplanes = list(profile.glob('plugins/profile/*/*.xplane.pb'))
  assert len(xplanes) == 1 and xplanes[0].stat().st_size > 0
  assert (xplanes[0].parent / 'perfetto_trace.json.gz').stat().st_size > 0
