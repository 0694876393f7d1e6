r"""A model with LoRA adapters, from a loaded base model and back to plain weights.

:func:`add_adapters` turns a loaded :class:`~rft_jax.models.Qwen` into the same model with fresh
adapters (:mod:`rft_jax.models.lora`; ``B = 0``, so it computes what the base computes), sharing
the base's arrays. :func:`merged` gives the plain model of a LoRA model, each targeted weight
replaced by

.. math:: W' = W + \frac{\alpha}{r} A B

(reshaped to ``W``'s heads; summed in float32, stored in ``W``'s dtype), its other parameters
shared: a ``Qwen`` without adapters, whose structure is the base model's. What reads weights
directly reads the merged model: the sampler's decode kernels
(:mod:`rft_jax.models.decode.feature_major`, the cache path), the Hugging Face export
(:func:`~rft_jax.models.save_hf` merges by itself).

The merged weights are a copy of the targeted weights (all the layers' matrices with the default
targets), made once per call: with a bfloat16 base, ``W'`` is rounded to bfloat16 where the
learner's forward adds the adapters' product in the compute dtype, so sampler and learner
log-probabilities then differ by that rounding (float32: by summation order only).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from rft_jax.models.lora import ROUTER, LoraConfig, adapter_name, merge_adapter
from rft_jax.models.model import Qwen
from rft_jax.parallel.multihost import global_array
from rft_jax.parallel.sharding import DEFAULT_RULES, Rules, state_shardings

Path = tuple[str, ...]


def has_adapters(model: nnx.Module) -> bool:
  """Whether ``model`` holds LoRA adapters (``nnx.LoRAParam`` variables)."""
  return bool(jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))


@functools.cache
def _graphdef(config) -> nnx.GraphDef:
  """The structure of a model of ``config`` (built abstractly, nothing allocated)."""
  return nnx.split(nnx.eval_shape(lambda: Qwen(config, rngs=nnx.Rngs(0))))[0]


def add_adapters(model: Qwen, lora: LoraConfig, *, seed: int = 0, mesh: Mesh | None = None,
                 rules: Rules = DEFAULT_RULES) -> Qwen:
  """``model`` with fresh LoRA adapters on ``lora.targets`` (``A`` He-uniform from ``seed``,
  ``B`` zeros), its base arrays shared, not copied; with ``mesh`` the adapters are laid out on
  it by their logical axes (``rules``)."""
  if model.config.lora is not None:
    raise ValueError("add_adapters: the model already has LoRA adapters")
  config = model.config.replace(lora=lora)

  @jax.jit
  def init_adapters():  # only the adapters are returned: XLA drops the base's initialisation
    return nnx.state(Qwen(config, rngs=nnx.Rngs(seed)), nnx.LoRAParam)

  adapters = init_adapters()
  if mesh is not None:
    adapters = jax.tree.map(global_array, adapters, state_shardings(adapters, mesh, rules))
  return nnx.merge(_graphdef(config), nnx.state(model), adapters)


def adapted_weights(config) -> dict[Path, tuple[Path, Path]]:
  """Each weight an adapter targets (its path in the model's state) -> the paths of its
  adapter's ``A`` and ``B`` (``config.lora``'s targets). On a mixture-of-experts model the
  feed-forward targets are the stacked experts' weights (and the shared expert's, Qwen2-MoE),
  ``router`` the router's."""
  owners = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "attn",
            "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp", ROUTER: "mlp"}
  out = {}
  for target in config.lora.targets:
    owner = ("layers", owners[target])
    adapter = owner + (adapter_name(target),)
    weight = target
    if config.is_moe and target != ROUTER and owners[target] == "mlp":
      weight = "expert_" + target.removesuffix("_proj")
      if config.shared_expert_intermediate_size:
        shared = owner + ("shared_expert",)
        out[shared + (target,)] = (shared + (adapter_name(target), "lora_a"),
                                   shared + (adapter_name(target), "lora_b"))
    out[owner + (weight,)] = (adapter + ("lora_a",), adapter + ("lora_b",))
  return out


@functools.partial(jax.jit, static_argnums=(2, 3))
def _merged_weights(weights: dict, adapters: dict, scale: float, shardings: tuple) -> dict:
  """:func:`~rft_jax.models.lora.merge_adapter` of each stacked ``W [L, ...]`` with its adapter's
  ``A [L, (E,) in, r]``, ``B [L, (E,) r, out]``, laid out as ``shardings`` says (``(path,
  NamedSharding)`` pairs; absent: as XLA chooses)."""
  shardings = dict(shardings)
  out = {}
  for path, w in weights.items():
    out[path] = merge_adapter(w, *adapters[path], scale)
    if path in shardings:
      out[path] = jax.lax.with_sharding_constraint(out[path], shardings[path])
  return out


def merged(model: Qwen) -> Qwen:
  """The plain model (no adapters) computing what the LoRA ``model`` computes, the adapters
  folded into the weights they adapt (see the module docstring); ``model`` itself when it has
  none. The merged weights keep their sharding (the base weights')."""
  config = model.config
  if config.lora is None:
    return model
  flat = dict(nnx.to_flat_state(nnx.state(model)))
  targets = adapted_weights(config)
  weights = {p: flat[p].get_value() for p in targets}
  adapters = {p: (flat[a].get_value(), flat[b].get_value()) for p, (a, b) in targets.items()}
  shardings = tuple((p, w.sharding) for p, w in weights.items()
                    if isinstance(getattr(w, "sharding", None), NamedSharding))
  new = _merged_weights(weights, adapters, config.lora.scale, shardings)
  dropped = {p for pair in targets.values() for p in pair}
  base = [(p, v.replace(new[p]) if p in new else v) for p, v in flat.items() if p not in dropped]
  return nnx.merge(_graphdef(config.replace(lora=None)), nnx.from_flat_state(base))
