"""The PPO / GRPO trainer: rollout, rewards, advantages and actor/critic updates."""
