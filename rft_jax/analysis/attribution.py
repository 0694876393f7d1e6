r"""Token-level attribution of a GRPO step's entropy change (Theorem 2), as a page to read.

For a few problems, ``k`` completions each are sampled from a policy and scored; GRPO's group
advantages :math:`A` give every completion token its Theorem 2 forecast

.. math::  \Delta H_t = -\alpha\,(S_{*,t} - \mathbb{E}_{p_t}[S]), \qquad \alpha = \eta A \ (r = 1),

the first-order change of that position's entropy under the step on its own logits: positive
(entropy-raising) or negative (entropy-lowering). The page colours each token by it (red lowers,
blue raises), marks the tokens the run's entropy mask (Clip_B / Clip_V) would take out of the loss,
and shows :math:`p_k`, :math:`H`, :math:`S_*`, :math:`\mathbb{E}_p[S]` on hover. A table sums the
forecasts by token class over every token (GRPO's loss) and over the tokens the mask keeps: which
classes carry the entropy decrease, and what the mask removes of it.

A run of multi-turn trajectories (``rollout.environment``) is attributed on its trajectories,
sampled with its environment: the environment's tokens are shown greyed, with no forecast (the
learner reads them but does not train on them), and S_* and the forecast are the model's tokens'.

``rft-jax attribute --model RUN_OR_HF_DIR --data FILE [--out attribution.html]``.
"""

from __future__ import annotations

import dataclasses
import html
import string
from collections import defaultdict
from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from rft_jax.data import MathExample
from rft_jax.entropy import token_stats
from rft_jax.parallel import global_array
from rft_jax.rewards import RewardConfig, score_batch
from rft_jax.rl.advantages import compute_advantages
from rft_jax.rl.config import EntropyMaskConfig, LearnerConfig
from rft_jax.rl.learner import learner_batch
from rft_jax.rl.token_methods import entropy_keep_mask
from rft_jax.sampling import SamplingParams, generate

# token class of a completion's token: (problem, completion text, start, end of the token) -> name
TokenClass = Callable[[MathExample, str, int, int], str]


def character_class(problem: MathExample, text: str, start: int, end: int) -> str:
  """``digit``, ``separator`` (whitespace or punctuation) or ``other``, by the token's text."""
  piece = text[start:end].strip()
  if piece and all(c.isdigit() for c in piece):
    return "digit"
  if not piece or all(c in string.punctuation for c in piece):
    return "separator"
  return "other"


@dataclasses.dataclass
class Completion:
  """One sampled completion, token by token (``[T]`` arrays over its tokens)."""

  problem: MathExample
  tokens: list[str]
  classes: list[str]
  advantage: float
  reward: float
  p: np.ndarray
  entropy: np.ndarray
  s_star: np.ndarray
  expected_s: np.ndarray
  forecast: np.ndarray
  masked: np.ndarray
  environment: np.ndarray | None = None  # [T] bool: an environment's token (multi-turn)


def attribute(model, tokenizer, problems: Sequence[MathExample], *, prompt_fn, k: int, temperature: float,
              max_new_tokens: int, stop_ids: tuple[int, ...], rewards: RewardConfig, lr: float,
              mask: EntropyMaskConfig, seed: int = 0, token_class: TokenClass = character_class,
              mesh=None, trajectories: Callable | None = None) -> list[Completion]:
  """Samples ``k`` completions of each problem with ``model`` and attributes their tokens (see the
  module docstring); ``mask`` is the entropy mask marked (``kind=none``: nothing masked). ``mesh``:
  the one ``model`` is laid out on (None: one device); the rollouts' rows go over its ``data`` axis
  and the forward's inputs are replicated on it. ``trajectories``: a run's multi-turn sampler,
  ``(problems, params, seed) -> (rollouts, texts, scored)`` (rewards its environment's), used
  instead of one completion per sample."""
  params = SamplingParams(n=k, temperature=temperature, max_new_tokens=max_new_tokens,
                          stop_token_ids=stop_ids)
  if trajectories is not None:
    rollouts, _, scored = trajectories(problems, params, seed)
  else:
    rollouts = generate(model, [prompt_fn(p.question) for p in problems], params, seed=seed, mesh=mesh)
    texts = tokenizer.batch_decode(rollouts.completions(), skip_special_tokens=True)
    scored = score_batch(texts, [problems[i].answer for i in rollouts.prompt_index],
                         list(rollouts.finish_reason), [int(x) for x in rollouts.completion_lengths],
                         rewards)
  examples = [problems[i] for i in rollouts.prompt_index]
  advantages = np.asarray(compute_advantages(jnp.asarray(scored.reward, jnp.float32), k))
  batch = learner_batch(rollouts)
  place = (jnp.asarray if mesh is None
           else lambda x: global_array(np.asarray(x), NamedSharding(mesh, PartitionSpec())))
  ids = place(batch.input_ids)
  hidden = model(ids, place(batch.attention_mask), return_hidden=True, mesh=mesh)
  stats = token_stats(hidden[:, :-1], ids[:, 1:], unembedding=model.unembedding(), product_dtype=model.config.dtype,
                      temperature=temperature)
  response = jnp.asarray(batch.response_mask[:, 1:], jnp.float32)
  token_adv = jnp.asarray(advantages)[:, None] * response
  keep = entropy_keep_mask(LearnerConfig(entropy_mask=mask), stats, jnp.asarray(batch.sampler_logp[:, 1:]),
                           token_adv, response)
  forecast = np.asarray(-lr * token_adv * stats.centered)
  stats, keep = [np.asarray(x) for x in stats], np.asarray(keep)
  start = batch.input_ids.shape[1] - rollouts.completion_ids.shape[1] - 1  # position predicting the first
  out = []
  for row, example in enumerate(examples):
    n = int(rollouts.completion_lengths[row])
    columns = slice(start, start + n)
    pieces = [tokenizer.decode([t], skip_special_tokens=False) for t in rollouts.completion_ids[row, :n]]
    offsets = np.cumsum([0] + [len(p) for p in pieces])
    full = "".join(pieces)
    out.append(Completion(
        problem=example, tokens=pieces, advantage=float(advantages[row]), reward=float(scored.reward[row]),
        classes=[token_class(example, full, int(a), int(b)) for a, b in zip(offsets[:-1], offsets[1:])],
        p=np.exp(stats[0][row, columns]), entropy=stats[1][row, columns], s_star=stats[2][row, columns],
        expected_s=stats[3][row, columns], forecast=forecast[row, columns], masked=~keep[row, columns],
        environment=(None if rollouts.completion_mask is None
                     else rollouts.completion_mask[row, :n] == 0)))
  return out


def class_table(completions: Sequence[Completion]) -> list[dict]:
  """Per token class: tokens, and the summed forecast over all of them (GRPO) and over those the
  mask keeps; sorted by the GRPO sum (most entropy-lowering first)."""
  rows = defaultdict(lambda: {"tokens": 0, "masked": 0, "grpo": 0.0, "kept": 0.0})
  for c in completions:
    environment = c.environment if c.environment is not None else np.zeros(len(c.classes), bool)
    for cls, f, m, env in zip(c.classes, c.forecast, c.masked, environment):
      if env:  # an environment's token: not the policy's
        continue
      r = rows[cls]
      r["tokens"] += 1
      r["masked"] += int(m)
      r["grpo"] += float(f)
      r["kept"] += 0.0 if m else float(f)
  return sorted(({"class": k, **v} for k, v in rows.items()), key=lambda r: r["grpo"])


def attribution_html(sections: Sequence[tuple[str, Sequence[Completion]]], mask_name: str | None) -> str:
  """A static page: for each ``(title, completions)`` section, the coloured completions and the
  class table. ``mask_name``: the entropy mask outlined (its title, e.g. ``Clip_B``); None when
  none is (a run without one): the page says so and the table has no mask columns."""
  body = []
  for title, completions in sections:
    scale = max((float(np.abs(c.forecast).max()) for c in completions if len(c.forecast)), default=0.0) or 1.0
    body.append(f"<h2>{html.escape(title)}</h2>")
    for c in completions:
      spans = "".join(_span(c, t, scale) for t in range(len(c.tokens)))
      body.append(f'<p class="row"><span class="meta">{html.escape(c.problem.question)} A={c.advantage:+.2f} '
                  f'reward={c.reward:g}</span><br>{spans}</p>')
    body.append(class_table_html(completions, mask_name))
  if mask_name is not None:
    masked = f"Outlined tokens are those {html.escape(mask_name)} would take out of the loss."
  else:
    masked = ("No entropy mask is marked: the run used none (<code>rft-jax attribute --mask clip_b</code> "
              "outlines the tokens Clip_B would take out).")
  return PAGE.format(masked=masked, body="\n".join(body))


def class_table_html(completions: Sequence[Completion], mask_name: str | None) -> str:
  """:func:`class_table` as an HTML table (without the mask's columns when ``mask_name`` is None)."""
  if mask_name is None:
    head = "<tr><th>class</th><th>tokens</th><th>sum forecast, all (GRPO)</th></tr>"
    cells = "".join(f"<tr><td>{html.escape(r['class'])}</td><td>{r['tokens']}</td><td>{r['grpo']:.3e}</td></tr>"
                    for r in class_table(completions))
    return f"<table>{head}{cells}</table>"
  head = (f"<tr><th>class</th><th>tokens</th><th>{html.escape(mask_name)} masks</th><th>sum forecast, all "
          f"(GRPO)</th><th>sum forecast, kept by {html.escape(mask_name)}</th></tr>")
  cells = "".join(f"<tr><td>{html.escape(r['class'])}</td><td>{r['tokens']}</td><td>{r['masked']}</td>"
                  f"<td>{r['grpo']:.3e}</td><td>{r['kept']:.3e}</td></tr>" for r in class_table(completions))
  return f"<table>{head}{cells}</table>"


def _span(c: Completion, t: int, scale: float) -> str:
  if c.environment is not None and c.environment[t]:
    return (f'<span class="env" title="the environment\'s token (read, not trained on)">'
            f'{html.escape(c.tokens[t])}</span>')
  f = float(c.forecast[t]) / scale
  colour = f"rgba(200,30,30,{-f:.3f})" if f < 0 else f"rgba(30,80,220,{f:.3f})"
  tip = (f"p={c.p[t]:.4f} H={c.entropy[t]:.4f} S*={c.s_star[t]:.3e} E_p[S]={c.expected_s[t]:.3e} "
         f"forecast={c.forecast[t]:.3e} class={c.classes[t]}" + (" masked" if c.masked[t] else ""))
  cls = ' class="masked"' if c.masked[t] else ""
  return f'<span{cls} style="background:{colour}" title="{html.escape(tip)}">{html.escape(c.tokens[t])}</span>'


PAGE = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>Token attribution of the entropy change</title>
<style>body{{font-family:sans-serif;max-width:70em;margin:auto}} .row{{font-family:monospace;white-space:pre-wrap}}
.meta{{color:#666;font-family:sans-serif;font-size:80%}} .masked{{outline:2px solid #000}}
.env{{color:#888;background:#eee;font-style:italic}}
table{{border-collapse:collapse}} td,th{{border:1px solid #ccc;padding:2px 8px}}</style></head><body>
<h1>Token attribution of the entropy change (Theorem 2)</h1>
<p>Each completion token is coloured by its forecast entropy change under one GRPO step on its own
logits, -&alpha; (S<sub>*</sub> - E<sub>p</sub>[S]) with &alpha; = lr &times; A: red lowers the entropy, blue
raises it (shade: size, scaled per section). {masked}
Hover a token for p, H, S<sub>*</sub>, E<sub>p</sub>[S]. In a multi-turn trajectory the environment's
replies are grey and italic: the learner reads them but does not train on them.</p>
{body}
</body></html>
"""
