"""Megatron-Core engine via Megatron-Bridge, Megatron-FSDP and HF<->Megatron conversion for posttrain.

Importing this package imports nothing heavy; ``posttrain.megatron.engine`` pulls in Megatron-Core, and
building an engine imports Megatron-Bridge (which needs Transformer Engine; see ``posttrain.megatron._deps``).
"""
