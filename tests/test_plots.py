"""``rft-jax plot``: one colour per run, one line style per series, written beside the first run."""

import json
import os

import pytest
from matplotlib.colors import to_hex

from rft_jax import cli
from rft_jax.analysis.plots import FRACTION_STYLES, draw_runs, plot_runs
from rft_jax.train.metric_names import logged_names

RUNS = 4


def write_run(run_dir, index: int, steps: int = 20, namespaced: bool = False) -> str:
  """A small ``metrics.jsonl``: run ``index``'s steps start at ``100 * index`` (which tells the
  runs' lines apart), with an evaluation every 5 steps and the entropy forecast; under the names
  runs log today (``namespaced``) or the flat names of runs written before them."""
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
    for step in range(100 * index, 100 * index + steps):
      record = {"step": step, "time": 0.0, "entropy": 1.0 - 0.001 * (step % 100), "accuracy": 0.5 + 0.01 * index,
                "clip_frac_low": 0.01, "clip_frac_high": 0.02, "mask_frac": 0.003 * (index + 1),
                "entropy_change_forecast": 0.1 * (step % 7), "entropy_change_measured": 0.09 * (step % 7)}
      if step % 5 == 0:
        record.update({"eval_heldout_avg@4": 0.4 + 0.01 * index, "eval_heldout_pass@4": 0.8,
                       "eval_heldout_entropy": 0.7, "eval_aime_avg@32": 0.1, "eval_aime_entropy": 0.9})
      f.write(json.dumps(logged_names(record) if namespaced else record) + "\n")
  return str(run_dir)


@pytest.fixture(params=[False, True], ids=["flat-names", "namespaced"])
def run_dirs(tmp_path, request):
  return [write_run(tmp_path / f"run{i}", i, namespaced=request.param) for i in range(RUNS)]


def test_each_run_has_one_colour_and_each_series_one_style(run_dirs):
  import matplotlib.pyplot as plt

  fig = draw_runs(run_dirs)
  try:
    for ax in fig.axes[:3]:
      colours_of_run, styles_of_series = {}, {}
      for line in ax.get_lines():
        run = int(line.get_xdata()[0]) // 100
        colours_of_run.setdefault(run, set()).add(to_hex(line.get_color()))
        if not line.get_label().startswith("_"):  # the faint per-step lines have no label
          styles_of_series.setdefault(line.get_label(), set()).add((line.get_linestyle(), line.get_marker()))
      assert sorted(colours_of_run) == list(range(RUNS)), ax.get_title()
      assert all(len(c) == 1 for c in colours_of_run.values()), ax.get_title()  # a run: one colour
      assert len(set.union(*colours_of_run.values())) == RUNS, ax.get_title()  # runs: different ones
      assert all(len(s) == 1 for s in styles_of_series.values()), ax.get_title()  # a series: one style
      assert len(set.union(*styles_of_series.values())) == len(styles_of_series), ax.get_title()
    fractions = {line.get_label() for line in fig.axes[2].get_lines() if not line.get_label().startswith("_")}
    assert {"mask/frac", "actor/pg_clipfrac_low", "actor/pg_clipfrac_high"} <= fractions <= set(FRACTION_STYLES)
    assert {"heldout/avg@4", "aime/avg@32", "train acc"} <= {t.get_text() for t in fig.axes[1].get_legend().get_texts()}
    assert {"heldout/entropy", "aime/entropy", "training batch"} <= {
        t.get_text() for t in fig.axes[0].get_legend().get_texts()}
    scatter_colours = {to_hex(c.get_facecolor()[0]) for c in fig.axes[3].collections}
    assert len(scatter_colours) == RUNS
  finally:
    plt.close(fig)


def test_plot_writes_beside_the_first_run_by_default(run_dirs, tmp_path, monkeypatch, capsys):
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  monkeypatch.chdir(elsewhere)
  assert cli.main(["plot", *run_dirs]) == 0
  out = os.path.join(run_dirs[0], "plots.png")
  assert capsys.readouterr().out.strip() == out
  assert os.path.getsize(out) > 10_000
  assert os.listdir(elsewhere) == []  # nothing under ./runs
  assert plot_runs(run_dirs[1:], str(tmp_path / "p" / "x.png")) == str(tmp_path / "p" / "x.png")


def test_runs_of_the_same_name_keep_apart(tmp_path):
  import matplotlib.pyplot as plt

  dirs = [write_run(tmp_path / "a" / "grpo", 0), write_run(tmp_path / "b" / "grpo", 1)]
  fig = draw_runs(dirs)
  try:
    labels = {t.get_text() for t in fig.axes[0].get_legend().get_texts()}
    assert {os.path.join("a", "grpo"), os.path.join("b", "grpo")} <= labels
  finally:
    plt.close(fig)
