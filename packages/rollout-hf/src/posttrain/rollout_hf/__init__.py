"""transformers-generate rollout for posttrain: the CPU default."""
