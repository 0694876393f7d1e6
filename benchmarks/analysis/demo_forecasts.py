"""How well the two first-order forecasts of the entropy change track the measured change.

For each run directory (e.g. the demo's ``runs/demo/grpo``; steps logged every
``learner.forecast_every``): the Pearson correlation of each forecast with the measured change,
and the median ratio forecast / measured (1 = right scale):

* ``entropy/forecast``: Corollary 4, ``-lr Cov_B(A, S_* - E_p[S])``, a step in logit space;
* ``entropy/first_order``: the jvp of the mean entropy along the parameters' actual change.

    rft-jax demo variants=grpo,clip_b run_dir=runs/forecasts
    python benchmarks/analysis/demo_forecasts.py runs/forecasts/grpo runs/forecasts/clip_b
"""

from __future__ import annotations

import argparse

import numpy as np

from rft_jax.analysis.plots import forecast_correlation
from rft_jax.train.metrics_log import read_metrics

FORECASTS = ("entropy/forecast", "entropy/first_order")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("run_dirs", nargs="+")
  args = parser.parse_args()
  print(f"{'run':<28} {'steps':>5} " + " ".join(f"{name + ' r':>24} {'median ratio':>12}" for name in FORECASTS))
  for run_dir in args.run_dirs:
    records = [r for r in read_metrics(run_dir) if r.get("entropy/measured") is not None]
    cells = []
    for name in FORECASTS:
      pairs = np.array([(r[name], r["entropy/measured"]) for r in records if r.get(name) is not None])
      ratio = np.median(pairs[:, 0] / pairs[:, 1]) if len(pairs) else float("nan")
      cells.append(f"{forecast_correlation(records, name):>24.3f} {ratio:>12.3g}")
    print(f"{run_dir[-28:]:<28} {len(records):>5} " + " ".join(cells))


if __name__ == "__main__":
  main()
