"""The methods the demo and the figures compare, as the config overrides that make each from
plain GRPO on the demo's task: ``rft-jax demo``'s variants (:mod:`rft_jax.demo.run`) and the
runs of ``rft-jax figures`` (:mod:`rft_jax.figures.runs`) read them here."""

from rft_jax.demo.paths import MOE_CHECKPOINT

# The demo's variants when none are named: the paper's three.
DEFAULT_VARIANTS = ("grpo", "clip_b", "clip_v")
_MOE = f"model.path={MOE_CHECKPOINT}"  # absolute: found from any directory
_PPO = ("learner.advantage=gae", "critic.optim.lr=5e-5", "critic.micro_batch_size=16")
METHODS: dict[str, tuple[str, ...]] = {
    "grpo": ("learner.entropy_mask.kind=none",),
    # The released cuts (Clip_B mu- = 2.5, Clip_V mu- = 8.5, negative samples only). Clip_V's
    # cap on the masked share is raised from the released 1e-4, sized for batches of millions
    # of tokens, which would allow less than one token of a ~2,700-token demo batch; at 2% it
    # does not bind (the cut masks far less: the tokens % column of
    # docs/results/demo.md#every-method-on-the-demo).
    "clip_b": ("learner.entropy_mask.kind=clip_b",),
    "clip_v": ("learner.entropy_mask.kind=clip_v", "learner.entropy_mask.max_frac=0.02"),
    # The paper's Table 3 comparisons (rft_jax.rl.token_methods). Clip-Cov and KL-Cov keep verl's
    # covariance bounds and coefficient; their token shares are raised from verl's 2e-4 (under
    # one token of a demo batch) to 0.2% (about 5 tokens), as Clip_V's cap is above.
    # verl's Qwen2.5-7B recipe clips the ratio at 1 (configs/qwen2_5_7b_clip_cov.yaml).
    "clip_cov": ("learner.entropy_method.kind=clip_cov", "learner.entropy_method.clip_cov_ratio=0.002",
                 "learner.eps_low=1.0", "learner.eps_high=1.0"),
    # KL-Cov's penalty |log p - log p_old| and its gradient vanish on an on-policy update (ratio 1),
    # as in verl: with one update per batch it is GRPO. It acts from the second mini-batch on.
    "kl_cov": ("learner.entropy_method.kind=kl_cov", "learner.entropy_method.kl_cov_ratio=0.002",
               "learner.mini_batches=4"),
    "forking": ("learner.entropy_method.kind=forking",),  # the top 20% of tokens by entropy
    "unlikely": ("learner.beta_rank=0.25",),  # the authors' released recipe
    # GSPO (rft_jax.rl.objectives.gspo): a sequence-level ratio and its narrow clip (3e-4 / 4e-4). Like
    # KL-Cov it differs from GRPO only off-policy, so it takes 4 updates a batch.
    # verl's decoupled token-level TIS (rft_jax.rl.rollout_correction): the sampler's and the
    # learner's log-probs differ by float rounding here (one float32 model), so it measures the
    # mismatch and weights by about 1.
    "tis": ("learner.rollout_correction.importance_sampling=token",
            "learner.rollout_correction.importance_weight_cap=2.0"),
    "gspo": ("learner.objective=gspo", "learner.loss_agg=seq-mean-token-mean", "learner.mini_batches=4"),
    # A closed loop (rft_jax.rl.token_methods.entropy_target): Clip_B's cut chosen per batch to
    # hold the training batches' entropy near 0.02 nats/token (GRPO's falls from about 0.024 in
    # the first quarter of the run to 0.015 in the last).
    "target": ("learner.entropy_mask.kind=clip_b", "learner.entropy_mask.target_entropy=0.02"),
    # PPO with a GAE critic (the paper's Table 4), alone and with the masks (which then read the sign
    # of each token's GAE advantage, Appendix E.4). The critic learns at the demo policy's rate.
    "ppo": _PPO,
    "ppo_clip_b": (*_PPO, "learner.entropy_mask.kind=clip_b"),
    "ppo_clip_v": (*_PPO, "learner.entropy_mask.kind=clip_v", "learner.entropy_mask.max_frac=0.02"),
    # GRPO training LoRA adapters (rank 16, alpha 32, every projection) instead of all the weights;
    # the adapters learn at 10x the full model's rate, the usual LoRA practice. Not yet run
    # against the full-weight variants.
    "lora": ("learner.entropy_mask.kind=none", "model.lora.rank=16", "model.lora.alpha=32",
             "learner.optim.lr=5e-4"),
    # The demo's mixture-of-experts model (rft_jax/demo/build_moe.py: 8 experts, top-2, warm-started
    # as the dense model is) under GRPO and Clip_B, the learner routing each token by its own router
    # or, with rollout routing replay, by the experts the sampler chose (router/routing_mismatch: the
    # share of tokens whose experts the learner's router would choose differently).
    "moe_grpo": ("learner.entropy_mask.kind=none", _MOE),
    "moe_grpo_replay": ("learner.entropy_mask.kind=none", _MOE, "learner.routing_replay=true"),
    "moe_clip_b": ("learner.entropy_mask.kind=clip_b", _MOE),
    "moe_clip_b_replay": ("learner.entropy_mask.kind=clip_b", _MOE, "learner.routing_replay=true"),
}
