"""``OUT/index.html``: the figures, their claims and verdicts, Table 1, the token attribution and the
runs behind them, as one static page (no script, no server, nothing fetched)."""

from __future__ import annotations

import dataclasses
import datetime
import html
import os
from typing import Mapping, Sequence

import numpy as np

from rft_jax.analysis.attribution import class_table_html
from rft_jax.figures.claims import Verdict

COLORS = {"held": "#1a7f37", "not held": "#b42318", "unclear": "#9a6700"}


@dataclasses.dataclass(frozen=True)
class FigureSection:
  """One figure: its number and title, the paper's claim, the verdict here, the PNG and its runs."""

  number: str
  title: str
  claim: str
  verdict: Verdict
  image: str
  runs: Sequence[str]


def _badge(status: str) -> str:
  return f'<span class="badge" style="background:{COLORS[status]}">{html.escape(status)}</span>'


def _interval(mean: float, half: float, signed: bool = False) -> str:
  value = f"{mean:+.3f}" if signed else f"{mean:.3f}"
  return value if not np.isfinite(half) else f"{value} &plusmn; {half:.3f}"


def _table1(verdict: Verdict, rows: Sequence[dict], k: int) -> str:
  head = (f"<tr><th>method</th><th>seeds</th><th>Avg@{k}</th><th>Pass@{k}</th><th>Avg@{k} &minus; GRPO</th>"
          f"<th>Pass@{k} &minus; GRPO</th></tr>")
  cells = "".join(
      f"<tr><td>{html.escape(r['method'])}</td><td>{r['seeds']}</td><td>{_interval(*r['avg'])}</td>"
      f"<td>{_interval(*r['pass'])}</td><td>{_interval(*r['avg_diff'], True) if 'avg_diff' in r else ''}</td>"
      f"<td>{_interval(*r['pass_diff'], True) if 'pass_diff' in r else ''}</td></tr>" for r in rows)
  return (f'<section id="table1"><h2>Table 1 at demo scale: Avg@{k} and Pass@{k} {_badge(verdict.status)}</h2>'
          "<p>The paper's claim: Clip_B and Clip_V do better than GRPO. Means over seeds with 95% Student t "
          "intervals; differences paired by seed. A difference whose interval spans 0 is within the noise.</p>"
          f"<table>{head}{cells}</table><p>{html.escape(verdict.sentence)}</p></section>")


def _attribution(sections: Sequence[tuple[str, Sequence]]) -> str:
  parts = ['<section id="attribution"><h2>Token attribution, before and after training</h2>'
           "<p>The same held-out problems (those with the most carries) answered by the start and by each run "
           "after training, every token coloured by its Theorem 2 forecast -&alpha; (S<sub>*</sub> - "
           "E<sub>p</sub>[S]), Clip_B's cut outlined: <a href=\"attribution.html\">attribution.html</a>. Summed "
           "forecasts by token class:</p>"]
  parts += [f"<h3>{html.escape(title)}</h3>{class_table_html(completions, 'Clip_B')}" for title, completions in sections]
  return "".join(parts) + "</section>"


def _runs(runs: Mapping[str, dict]) -> str:
  rows = []
  for name, info in runs.items():
    took = f"{info['seconds']:.0f} s" + (" (reused)" if info["reused"] else "")
    rows.append(f"<tr><td>{html.escape(name)}</td><td><code>{html.escape(' '.join(info['overrides']))}</code></td>"
                f"<td>{took}</td></tr>")
  return ('<section id="runs"><h2>The runs</h2><p>Each from the demo\'s checkpoint with <code>configs/demo.yaml'
          '</code> and these overrides; its whole config is <code>runs/NAME/config.yaml</code> (rerun one with '
          '<code>rft-jax train --config runs/NAME/config.yaml --overwrite</code>).</p>'
          f"<table><tr><th>run</th><th>overrides</th><th>training time</th></tr>{''.join(rows)}</table></section>")


def write_page(out_dir: str, *, sections: Sequence[FigureSection], table: tuple[Verdict, Sequence[dict]],
               runs: Mapping[str, dict], settings, start: dict, noise: float, attribution: Sequence,
               k: int, command: str, seconds: float) -> str:
  """Writes ``out_dir/index.html`` (the images are the PNGs beside it) and returns its path."""
  verdicts = [(s.number, s.title, s.verdict.status) for s in sections] + [("Table 1", f"Avg@{k} and Pass@{k}", table[0].status)]
  summary = "".join(f'<tr><td><a href="#{n.lower().replace(" ", "")}">{html.escape(n)}</a></td>'
                    f"<td>{html.escape(t)}</td><td>{_badge(v)}</td></tr>" for n, t, v in verdicts)
  body = [f"<h1>The paper's figures at demo scale</h1>"
          f"<p>Made by <code>{html.escape(command)}</code> on {datetime.date.today().isoformat()} in "
          f"{seconds / 60:.1f} minutes: {len(runs)} runs of {settings.steps} steps from the demo's checkpoint "
          f"(<code>configs/demo.yaml</code>: two-digit addition, 16 prompts &times; 8 samples per step), "
          f"{settings.heldout} held-out problems evaluated before and after training, {settings.seeds} seed(s) of "
          f"GRPO, Clip_B and Clip_V. At the start: held-out Avg@{k} {start['avg']:.3f}, entropy "
          f"{start['entropy']:.4f} nats / token. Entropy differences count beyond {noise:.4f} (twice the "
          "standard deviation across seeds of a run's final held-out entropy); smaller ones are unclear.</p>",
          f"<table><tr><th></th><th>claim</th><th>here</th></tr>{summary}</table>"]
  for s in sections:
    anchor = s.number.lower().replace(" ", "")
    body.append(f'<section id="{anchor}"><h2>{html.escape(s.number)}: {html.escape(s.title)} '
                f"{_badge(s.verdict.status)}</h2><p><b>Claim.</b> {html.escape(s.claim)}</p>"
                f"<p><b>Here.</b> {html.escape(s.verdict.sentence)}</p>"
                f'<img src="{html.escape(os.path.basename(s.image))}" alt="{html.escape(s.number)}">'
                f"<p class=\"runs\">Runs: {html.escape(', '.join(s.runs))}</p></section>")
  body += [_table1(*table, k=k), _attribution(attribution), _runs(runs)]
  path = os.path.join(out_dir, "index.html")
  with open(path, "w") as f:
    f.write(PAGE.format(body="\n".join(body)))
  return path


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>rft_jax: the paper's figures at demo scale</title>
<style>body{{font-family:sans-serif;max-width:72em;margin:auto;padding:0 1em;line-height:1.4}}
img{{max-width:100%;border:1px solid #ddd}} table{{border-collapse:collapse;margin:0.5em 0}}
td,th{{border:1px solid #ccc;padding:2px 8px;text-align:left}} code{{font-size:90%}}
.badge{{color:#fff;border-radius:4px;padding:1px 7px;font-size:75%;vertical-align:middle}}
.runs{{color:#666;font-size:85%}}</style></head><body>
{body}
</body></html>
"""
