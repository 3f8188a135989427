"""vLLM rollout and the trainer -> vLLM weight-sync bridge for posttrain."""
