"""The learner: the policy's torch modules and heads, the rollout and GAE, the losses, the
optimizer and the updates (``updates/``: PPO, TRPO, the numpy gradients and PPO's critic
process)."""
