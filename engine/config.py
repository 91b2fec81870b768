"""Frozen configuration of an engine.

Everything a user can set lives here and is validated once, at construction; a bad value raises a
`ValueError` whose message names the option. What the engine finds out while starting (how many KV
blocks fit, the model's own limits) goes into `EngineLimits`, never back into these objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load and how."""

    model: str | None = None  # None: the embedded default model
    dtype: str = "auto"  # "auto": float32 on CPU, bfloat16 on CUDA
    device: str | None = None  # None: CUDA when available, else CPU
    max_model_len: int | None = None  # None: the model's own limit

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size and how many blocks (from a memory budget or explicit)."""

    block_size: int = 16
    kv_cache_memory_gib: float | None = None  # None: 1 GiB on CPU, 80% of free GPU memory
    num_kv_blocks: int | None = None  # overrides the memory budget when set
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise ValueError(f"--kv-cache-memory must be > 0 GiB, got {self.kv_cache_memory_gib}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"--num-kv-blocks must be >= 1, got {self.num_kv_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits of one engine step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}"
            )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Builds a config from flat keyword arguments named like the CLI flags."""
        sections = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}
        parts: dict[str, dict] = {name: {} for name in sections}
        for key, value in kwargs.items():
            owner = next((n for n, c in sections.items() if key in c.__dataclass_fields__), None)
            if owner is None:
                raise ValueError(f"unknown engine option {key!r}")
            parts[owner][key] = value
        return cls(**{name: sections[name](**values) for name, values in parts.items()})


@dataclass(frozen=True)
class EngineLimits:
    """What the engine found while starting: fixed for its lifetime."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
