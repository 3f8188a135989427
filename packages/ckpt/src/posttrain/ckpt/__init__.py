"""Crash-safe, reshardable DCP checkpoints and Hugging Face export for posttrain."""
