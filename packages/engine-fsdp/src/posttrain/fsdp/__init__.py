"""FSDP2 / FSDP1 training engine over Hugging Face models for posttrain."""
