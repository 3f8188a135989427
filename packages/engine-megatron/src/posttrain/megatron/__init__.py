"""Megatron-Core engine via Megatron-Bridge, Megatron-FSDP and HF<->Megatron conversion for posttrain."""
