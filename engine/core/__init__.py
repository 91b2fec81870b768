"""The engine's bookkeeping: scheduler, block manager, KV cache, memory budget, requests, devices."""
