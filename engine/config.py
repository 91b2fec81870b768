"""Frozen configuration of an engine.

Everything a user can set lives here and is validated once, at construction; a bad value raises a
`ValueError` whose message names the option. What the engine finds out while starting (how many KV
blocks fit, the model's own limits) goes into `EngineLimits`, never back into these objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATION_NAMES = ("auto", "gguf-exact", "gguf", "none")
# The names that keep a GGUF file in its blocks on CPU (engine/models/loader.keeps_gguf_blocks).
GGUF_BLOCK_MODES = ("gguf-exact", "gguf")
ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load and how."""

    model: str | None = None  # None: the embedded default model
    dtype: str = "auto"  # "auto": float32 on CPU, bfloat16 on CUDA
    device: str | None = None  # None: CUDA when available, else CPU
    max_model_len: int | None = None  # None: the model's own limit
    # "auto": a GGUF model on CPU keeps its quantized blocks (native kernels); "gguf-exact":
    # insist on that, with float32 activations (equal to transformers on the dequantized
    # weights); "gguf": the same today, named for llama.cpp's integer arithmetic, which it is to
    # become; "none": dequantize to float weights.
    quantization: str = "auto"
    # Decode/verify steps laid out in fixed padded shapes over persistent buffers
    # (engine/runner/static_runner.py). None: on CUDA, where graphs replay them; off on CPU, where the
    # unpadded flat batch is cheaper.
    padded_steps: bool | None = None
    enforce_eager: bool = False  # no CUDA graphs: padded steps (if on) run eagerly
    # Decode/verify attention: "torch" gathers pages then SDPA (everywhere); "triton" reads the
    # block table in one kernel (engine/attention/triton_backend.py; needs the triton package).
    # "auto": triton on CUDA where installed (measured 1.27x faster a step on an H100), else torch
    attention_backend: str = "auto"
    # Every row of a step computed bitwise as it would be alone, whatever rows share the step, so
    # that bfloat16 verification is exactly decoding (engine/models/invariant_linear.py). CPU
    # float32 and GGUF paths are so already; on CUDA it costs device time (docs/gpu.md).
    batch_invariant: bool = False
    # Ranks the model is sharded over (engine/distributed/, docs/multi-gpu.md): rank 0 is this
    # process, ranks 1..N-1 processes it starts. 1: one process, no collectives.
    tensor_parallel_size: int = 1
    # Decode/verify steps of plain Llama layers in five fused Triton kernels a layer on CUDA
    # (engine/models/fused_layer.py) where "auto"; "off": the torch path. Off by default until
    # their first run on a GPU (benchmarks/device_check.sh fused71) has checked them in bf16.
    fused_kernels: str = "off"

    def __post_init__(self) -> None:
        if self.fused_kernels not in ("auto", "off"):
            raise ValueError(f"--fused-kernels must be auto or off, got {self.fused_kernels!r}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATION_NAMES:
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_NAMES)}, "
                             f"got {self.quantization!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}"
                             f", got {self.attention_backend!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got "
                             f"{self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.padded_steps:
            raise ValueError("--tensor-parallel-size > 1 runs flat steps: a replayed CUDA graph "
                             "would not tell the other ranks to run theirs (drop --padded-steps)")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size and how many blocks (from a memory budget or explicit)."""

    block_size: int = 16
    kv_cache_memory_gib: float | None = None  # None: 1 GiB on CPU; on a GPU what is left of
    # gpu_memory_utilization after the weights and a profiled forward
    num_kv_blocks: int | None = None  # overrides the memory budget when set
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9  # share of the GPU's total memory this server may use

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise ValueError(f"--kv-cache-memory must be > 0 GiB, got {self.kv_cache_memory_gib}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"--num-kv-blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits of one engine step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # Overlap: launch step N+1 before reading step N's tokens (engine/runner/overlap.py). None: on
    # for CUDA, off on CPU.
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}"
            )


SPECULATIVE_METHODS = ("none", "ngram", "suffix", "auto", "eagle", "draft", "layer-skip")
SUFFIX_CACHE_SCOPES = ("tenant", "global")
# K's ceiling where the method does not set 5. Suffix chains follow earlier outputs, often for
# dozens of tokens (vLLM defaults it to the trie depth, 24); 15 drafts are 16 verified rows, the
# most a CPU step takes in one batched call (engine/attention/metadata.py MAX_QUERY_LEN_BATCHED).
DEFAULT_NUM_SPECULATIVE_TOKENS = {"suffix": 15, "auto": 15}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Which proposer guesses tokens and how many at most; the controller picks fewer when
    guessing does not pay."""

    # ngram: on this CPU measured ahead of eagle (benchmarks/results/spec_matrix_cpu_*.json)
    speculative_method: str = "ngram"
    num_speculative_tokens: int | None = None  # the ceiling of K; None: the method's default
    draft_model: str | None = None  # for "draft": HF folder or .gguf
    draft_layers: int | None = None  # for "layer-skip": how many layers the draft runs
    draft_layer_ids: tuple[int, ...] | None = None  # for "layer-skip": exactly these layers
    draft_head: str | None = None  # for "eagle": a trained head's folder (default: the shipped one)
    # For "eagle": an n-gram match of at least this many tokens may be proposed instead of the
    # head's guess (when its recent acceptance is at least the head's); 0: the head only.
    eagle_ngram_min: int = 2
    ngram_max: int = 4
    ngram_min: int = 1
    # For "suffix" (engine/spec_decode/suffix.py): trie depth, draft length per matched token,
    # the path probability a draft stops below, and the global cache of finished requests.
    suffix_max_depth: int = 24
    suffix_max_spec_factor: float = 1.0
    suffix_min_token_prob: float = 0.1
    suffix_cache_max_requests: int = 10000
    # 32 MiB: the C++ trie holds ~734,000 nodes in it (its tables grow by doubling), 28 MB of
    # RSS; at 48 MiB it held 1.05 million in 44-46 MB, and 7,000 requests through the server had
    # grown its RSS by 98 MB against the 100 MB target (docs/performance/agentic.md).
    suffix_cache_max_bytes: int = 32 * 2**20
    suffix_cache_scope: str = "tenant"  # "global": every tenant drafts from every output
    suffix_cache_prompts: bool = False
    adaptive: bool = True  # False: always draft K tokens (for measurements)
    # A prompt's last chunk verifies drafts too (engine/spec_decode/prefill_drafts.py). None:
    # wherever that is lossless and the method guesses from tokens alone (ngram, suffix on CPU).
    draft_at_prefill: bool | None = None

    def __post_init__(self) -> None:
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"--speculative-method must be one of {', '.join(SPECULATIVE_METHODS)}"
                             f", got {self.speculative_method!r}")
        if self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens",
                               DEFAULT_NUM_SPECULATIVE_TOKENS.get(self.speculative_method, 5))
        if not 0 <= self.num_speculative_tokens <= 32:
            raise ValueError("--num-speculative-tokens must be in [0, 32], got "
                             f"{self.num_speculative_tokens}")
        if self.speculative_method == "draft" and not self.draft_model:
            raise ValueError("--speculative-method draft needs --draft-model PATH")
        if self.draft_layers is not None and self.draft_layers < 1:
            raise ValueError(f"--draft-layers must be >= 1, got {self.draft_layers}")
        if self.draft_layer_ids is not None:
            object.__setattr__(self, "draft_layer_ids", tuple(self.draft_layer_ids))
            if not self.draft_layer_ids:
                raise ValueError("--draft-layer-ids must name at least one layer")
        if self.eagle_ngram_min < 0:
            raise ValueError(f"--eagle-ngram-min must be >= 0, got {self.eagle_ngram_min}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= --ngram-min <= --ngram-max, got {self.ngram_min}, "
                             f"{self.ngram_max}")
        self._check_suffix()

    def _check_suffix(self) -> None:
        checks = [
            (2 <= self.suffix_max_depth <= 256,
             f"--suffix-max-depth must be in [2, 256], got {self.suffix_max_depth}"),
            (0 < self.suffix_max_spec_factor < float("inf"),
             f"--suffix-max-spec-factor must be finite and > 0, got "
             f"{self.suffix_max_spec_factor}"),
            (0 <= self.suffix_min_token_prob <= 1,
             f"--suffix-min-token-prob must be in [0, 1], got {self.suffix_min_token_prob}"),
            (self.suffix_cache_max_requests >= 0, "--suffix-cache-max-requests must be >= 0, "
             f"got {self.suffix_cache_max_requests}"),
            (self.suffix_cache_max_bytes >= 0,
             f"--suffix-cache-max-bytes must be >= 0, got {self.suffix_cache_max_bytes}"),
            (self.suffix_cache_scope in SUFFIX_CACHE_SCOPES,
             f"--suffix-cache-scope must be one of {', '.join(SUFFIX_CACHE_SCOPES)}, got "
             f"{self.suffix_cache_scope!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def enabled(self) -> bool:
        return self.speculative_method != "none" and self.num_speculative_tokens > 0


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        # A verify query past 16 rows is attended as a prefill chunk (SDPA), whose sums follow
        # the query's width (engine/attention/metadata.py MAX_QUERY_LEN_BATCHED).
        if self.model.batch_invariant and self.speculative.enabled \
                and self.speculative.num_speculative_tokens > 15:
            raise ValueError("--batch-invariant takes at most 15 speculative tokens (16 verified "
                             f"rows a request), got {self.speculative.num_speculative_tokens}")
        if self.model.tensor_parallel_size > 1 and self.scheduler.async_scheduling:
            raise ValueError("--tensor-parallel-size > 1 does not overlap steps: each step's "
                             "inputs go to the other ranks when it starts (drop "
                             "--async-scheduling)")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Builds a config from flat keyword arguments named like the CLI flags."""
        sections = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                    "speculative": SpeculativeConfig}
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
