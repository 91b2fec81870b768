"""Tensor parallelism on torch.distributed (docs/multi-gpu.md).

Rank 0 (the engine's own process) schedules, samples and drafts; ranks 1..N-1 are follower
processes it starts (launch.py, follower.py) that repeat each call rank 0 makes into the target
model (mirror.py) on their own shard of the weights (shard.py, parallel_layers.py) and their own
KV cache. Every collective runs with a timeout (group.py); a dead rank ends the engine.
"""
