"""vLLM rollout and the trainer -> vLLM weight-sync bridge for posttrain.

``rollout.VLLMRollout`` (registered as rollout ``vllm``) drives vLLM; ``extension.WeightSyncWorkerExtension``
runs inside vLLM's workers and loads checksummed weight buckets in place; ``transport`` moves the buckets (by
reference, POSIX shared memory or CUDA IPC). Importing this package imports neither vLLM nor the submodules.
"""
