"""posttrain-envs: environments and tools for multi-turn RL (``calculator``), registered by entry point."""
