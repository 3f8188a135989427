"""transformers rollout for posttrain: the CPU default (``rollout.name=hf``).

``HFRollout`` generates in left-padded batches with a KV cache and takes weights through engine-core's
bucketed, checksummed weight-sync protocol.
"""

from .rollout import HFRollout
from .sampling import process_logits, select_tokens

__all__ = ["HFRollout", "process_logits", "select_tokens"]
