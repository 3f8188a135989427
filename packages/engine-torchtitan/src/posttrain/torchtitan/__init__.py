"""TorchTitan training engine (torchtitan models and parallelisms over Hugging Face checkpoints) for
posttrain."""
