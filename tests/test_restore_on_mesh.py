"""A run's checkpoint restored on the run's mesh in its dtypes, and exported from there (issue 60).

A run with ``model.param_dtype=bfloat16`` on 8 fake devices (data=4 x model=2) saves its state;
``restore_policy`` (what ``eval``, ``export``, ``attribute`` and the policy loader call) brings it
back with every array still sharded over both axes and still bfloat16, without reading the
Hugging Face weights and without any live array ever holding an unsharded copy of a parameter;
``rft-jax export`` of it loads in transformers with the run's own logits. Only the parameters are
read (orbax's partial restore), not AdamW's moments. ``rft-jax plan``, training
and the restore build the state with the same recipe (:func:`rft_jax.train.run_state.run_state`).
"""

import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from rft_jax.train import checkpoint as checkpoint_lib
from rft_jax.train.config import load_config, to_yaml
from rft_jax.train.run_state import load_model, run_mesh, run_state

HF_ATOL = 2e-5


def make_run(tmp_path, *extra):
  """A run directory whose step-1 checkpoint holds the starting state built as training builds it
  (no step taken: the test is of the state's layout, not of learning)."""
  from loop_fixtures import make_loop_files, overrides

  setup = make_loop_files(tmp_path)
  run = tmp_path / "run"
  cfg = load_config(None, overrides(setup, run, 1, "model.param_dtype=bfloat16", *extra))
  mesh = run_mesh(cfg)
  built = run_state(cfg, mesh, load_model(cfg, cfg.model.path, mesh))
  os.makedirs(run)
  (run / "config.yaml").write_text(to_yaml(cfg))
  saver = checkpoint_lib.RunCheckpointer(str(run / "checkpoints"))
  saver.save(1, built.state, {})
  saver.wait()
  saver.close()
  return run, cfg, mesh, built


def sharded_over_both_axes(x) -> bool:
  spec = tuple(x.sharding.spec)
  flat = {a for part in spec if part is not None for a in (part if isinstance(part, tuple) else (part,))}
  return {"data", "model"} <= flat


class LiveArrays:
  """Samples ``jax.live_arrays()`` every millisecond while inside, the arrays live on entry left
  out: the largest single-device shard and the largest per-device total of the new ones seen."""

  def __init__(self):
    self.largest_shard = self.peak_per_device = 0
    self._stop = threading.Event()

  def _sample(self):
    while not self._stop.is_set():
      per_device = {}
      for x in jax.live_arrays():
        if id(x) in self._before:
          continue
        try:
          shards = x.addressable_shards
        except Exception:  # deleted between the listing and the read
          continue
        for s in shards:
          size = int(np.prod(s.data.shape)) * x.dtype.itemsize
          self.largest_shard = max(self.largest_shard, size)
          per_device[s.device] = per_device.get(s.device, 0) + size
      self.peak_per_device = max([self.peak_per_device, *per_device.values()])
      self._stop.wait(0.001)

  def __enter__(self):
    self._before = {id(x) for x in jax.live_arrays()}
    self._thread = threading.Thread(target=self._sample, daemon=True)
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()


def test_a_bfloat16_run_restores_sharded_on_its_mesh_and_exports(tmp_path, monkeypatch):
  from hf_fixtures import hf_logits, hf_model
  from rft_jax import cli

  run, cfg, mesh, built = make_run(tmp_path)
  ids = np.random.default_rng(0).integers(0, 128, (2, 9))
  own = np.asarray(built.learner.model(built.state)(jnp.asarray(ids)))
  params = nnx.state(built.model, nnx.Param)
  full_f32 = max(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(params))  # one parameter, unsharded float32
  state_per_device = sum(int(np.prod(s.data.shape)) * x.dtype.itemsize
                         for x in jax.tree.leaves(built.state) for s in x.addressable_shards[:1])
  del built, params
  # The restore never reads the Hugging Face weights (the abstract state is its target).
  monkeypatch.setattr("rft_jax.train.run_state.load_model", lambda *a, **k: pytest.fail("loaded the HF weights"))
  monkeypatch.setattr("rft_jax.models.load_hf", lambda *a, **k: pytest.fail("loaded the HF weights"))
  with LiveArrays() as live:
    model, restored_cfg, step = checkpoint_lib.restore_policy(str(run))
  assert step == 1 and restored_cfg.model.param_dtype == "bfloat16"
  weights = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert all(x.dtype == jnp.bfloat16 for x in weights)
  assert all(isinstance(x.sharding, NamedSharding) and x.sharding.mesh.shape == mesh.shape for x in weights)
  matrices = [x for x in weights if x.size >= 512]  # the embedding and every layer's projections
  assert len(matrices) == 8 and all(sharded_over_both_axes(x) for x in matrices)
  assert live.largest_shard < full_f32 / 2, (live.largest_shard, full_f32)  # no unsharded parameter
  # Only the parameters are read: the new arrays stay under one shard of the whole train state
  # (restoring it all, AdamW's moments included, peaks at twice that).
  assert live.peak_per_device < state_per_device, (live.peak_per_device, state_per_device)
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(ids))), own, atol=HF_ATOL, rtol=1e-5)
  monkeypatch.undo()

  out = tmp_path / "hf"
  assert cli.main(["export", str(run), str(out)]) == 0
  np.testing.assert_allclose(hf_logits(hf_model(out), ids), own, atol=HF_ATOL, rtol=1e-5)


def test_restore_on_a_mesh_the_user_names(tmp_path):
  """The same checkpoint on a smaller mesh (2 devices, data=2): the arrays follow that mesh."""
  from rft_jax.parallel import make_mesh

  run, *_ = make_run(tmp_path)
  mesh = make_mesh(data=2, model=1, devices=jax.devices()[:2])
  model, _, _ = checkpoint_lib.restore_policy(str(run), mesh=mesh)
  weights = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert all(x.sharding.mesh.shape == mesh.shape and x.dtype == jnp.bfloat16 for x in weights)


def test_plan_training_and_restore_build_one_state(tmp_path):
  """The abstract state (restore, plan) and the concrete one (training) agree leaf by leaf in
  path, shape, dtype and sharding, for a LoRA run and for PPO's actor-critic state."""
  from loop_fixtures import make_loop_files, overrides

  setup = make_loop_files(tmp_path)
  for extra in (["model.lora.rank=4", "model.lora.alpha=8"], ["learner.advantage=gae"]):
    cfg = load_config(None, overrides(setup, tmp_path / "run", 1, "model.param_dtype=bfloat16", *extra))
    mesh = run_mesh(cfg)
    concrete = run_state(cfg, mesh, load_model(cfg, cfg.model.path, mesh)).state
    abstract = run_state(cfg, mesh).state
    leaves = lambda tree: {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}
    want, got = leaves(concrete), leaves(abstract)
    assert want.keys() == got.keys(), extra
    for path, x in want.items():
      assert (got[path].shape, got[path].dtype) == (x.shape, x.dtype), (extra, path)
      assert got[path].sharding.is_equivalent_to(x.sharding, x.ndim), (extra, path)


@pytest.mark.parametrize("command", ["export", "eval"])
def test_plan_says_what_eval_and_export_need_per_device(tmp_path, capsys, command):
  """``rft-jax plan --command eval|export``: the restored state's bytes per device (sharded over
  the run's mesh, in its dtypes), and export's one tensor at a time or eval's sampler; a
  --k below 1 is one line, exit 2."""
  from loop_fixtures import make_loop_files, overrides
  from rft_jax import cli
  from rft_jax.plan.commands import plan_command
  from rft_jax.plan.devices import topology

  setup = make_loop_files(tmp_path)
  cfg = load_config(None, overrides(setup, tmp_path / "run", 1, "model.param_dtype=bfloat16"))
  config = tmp_path / "run.yaml"
  config.write_text(to_yaml(cfg))
  assert cli.main(["plan", str(config), "--command", command, "--topology", "cpu:8"]) == 0
  out = capsys.readouterr().out
  assert "restore  the policy's bfloat16 parameters, sharded" in out and out.rstrip().endswith("fits: yes")
  assert ("export   one tensor at a time" in out) == (command == "export")
  assert cli.main(["plan", str(config), "--command", command, "--k", "0", "--topology", "cpu:8"]) == 2
  assert capsys.readouterr().err.strip().splitlines() == ["rft-jax plan: error: --k 0: must be >= 1 (samples per question)"]
  report = plan_command(cfg, topology("cpu:8"), command)
  mesh = run_mesh(cfg)
  state = run_state(cfg, mesh).state
  per_device = lambda tree: sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
                                for x in jax.tree.leaves(tree))
  assert report["restore"]["parameter_bytes"] == per_device(state.params) and report["mesh"] == {"data": 4, "model": 2}
  assert report["restore"]["not_read_bytes"] == per_device(state.opt_state) + per_device(state.step)
  # The parameters split over the 8 devices (the few small replicated ones aside), in bfloat16.
  total = sum(x.size * 2 for x in jax.tree.leaves(state.params))
  assert total / 8 <= report["restore"]["parameter_bytes"] < total / 2
  if command == "export":
    assert 0 < report["export"]["largest_shard_bytes"] < report["restore"]["parameter_bytes"]
    assert report["export"]["host_bytes"] == 128 * 32 * 4  # the embedding, in the float32 the tiny checkpoint declares
  else:
    assert report["sampler"]["rollouts_per_call"] == 64 * 8 and report["sampler"]["total_bytes"] > 0
  assert report["peak_bytes"] >= report["restore"]["total_bytes"] and report["fits"]


def test_export_and_eval_take_a_mesh_and_refuse_a_bad_one_in_one_line(tmp_path, capsys):
  """``--mesh`` restores on the mesh named (export's output then equals the default's); a malformed
  one, or one larger than the devices, is one line, exit 2, nothing written."""
  from rft_jax import cli

  run, *_ = make_run(tmp_path)
  for value, problem in (("2y4", "expected DATAxMODEL"), ("4x4", "make_mesh")):
    out = tmp_path / f"bad{value}"
    assert cli.main(["export", str(run), str(out), "--mesh", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"rft-jax export: error: --mesh {value}") and problem in err[0], err
    assert not out.exists()
  assert cli.main(["eval", "--model", str(run), "--data", str(tmp_path / "q.jsonl"), "--mesh", "0x2"]) == 2
  assert capsys.readouterr().err.strip().splitlines() == [
      "rft-jax eval: error: --mesh 0x2: expected DATAxMODEL, two positive sizes such as 2x4"]
  assert cli.main(["export", str(run), str(tmp_path / "small"), "--mesh", "2x1"]) == 0
  assert cli.main(["export", str(run), str(tmp_path / "default")]) == 0
  for name in ("config.json", "model.safetensors"):
    assert (tmp_path / "small" / name).read_bytes() == (tmp_path / "default" / name).read_bytes()
