"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3 dense, Phi-3, Gemma 2/3, SmolLM2) on
a paged KV cache; its layers are in decoder_layer.py.

`forward` can run any subset of the layers and still apply the final norm and LM head: the
layer-skip proposer drafts with it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from engine.attention import triton_backend
from engine.attention.metadata import AttentionMetadata
from engine.models.architecture import LlamaArchitecture
from engine.models.checkpoint_names import Place, parts_of, place_of
from engine.models import fused_layer
from engine.models.decoder_layer import DecoderLayer
from engine.models.layers import Linear, RMSNorm, RotaryEmbedding
from engine.models.stack import CompiledStack, run_stack, stack_applies
from engine.quant.gguf_weight import PackedTensor
from engine.quant.kernels import cpu_ops_for, load_kernel

logger = logging.getLogger(__name__)


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: LlamaArchitecture):
        super().__init__()
        self.arch = arch
        # The heads this process's KV cache holds: the model's, or one tensor-parallel rank's
        # (engine/distributed/shard_model.py). Every KVCache of this model is built from it.
        self.kv_arch = arch
        # A tied model has one vocabulary matrix: the LM head's, which doubles as the embedding.
        self.embed_tokens = (
            None if arch.tie_word_embeddings else nn.Embedding(arch.vocab_size, arch.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size)
        # Layers whose outputs `hidden_states` returns beside the last one (an EAGLE-3 draft
        # head reads them); set once, before the first step.
        self.feature_layers: tuple[int, ...] = ()
        self._compiled_stack = CompiledStack()
        # Tables computed on CPU even under a meta-device context: torch's meta implementation of
        # arange imports sympy (~40 MB of resident memory) for nothing.
        self.build_rotary(torch.device("cpu"))

    def build_rotary(self, device: torch.device) -> None:
        """(Re)computes the rotation tables on `device` (a model moved off the meta device
        has them empty): one, and Gemma 3's second one for its sliding-window layers."""
        with torch.device("cpu"):
            self.rotary = RotaryEmbedding(self.arch).to(device)
            self.local_rotary = RotaryEmbedding(self.arch.local_rope_arch()).to(device) \
                if self.arch.local_rope is not None else None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        if self.embed_tokens is None:
            x = self.lm_head.embedding(input_ids)
        else:
            x = self.embed_tokens(input_ids)
        return x if self.arch.embed_scale is None else x * self.arch.embed_scale

    def set_attention_backend(self, name: str) -> None:
        """Raises ValueError where the backend cannot run (the triton package missing)."""
        if name == "triton":
            triton_backend.check_available()
        for layer in self.layers:
            layer.self_attn.backend = name

    def use_batch_invariant_kernels(self, device: torch.device, dtype: torch.dtype,
                                    attention_backend: str) -> None:
        """--batch-invariant: on CUDA every projection of at most MAX_ROWS rows runs the
        row-invariant kernel, and decode and verify queries (up to 16 rows a request) the
        Triton attention kernel; the CPU's float32 and GGUF kernels are row-invariant already.
        Raises ValueError where neither holds."""
        if device.type == "cpu":
            if dtype != torch.float32:
                raise ValueError("--batch-invariant on CPU needs --dtype float32 (its bfloat16 "
                                 "products are not row-invariant)")
            return
        head_dim = self.arch.head_dim
        plain = all(layer.self_attn.options.plain for layer in self.layers)
        if attention_backend != "triton" or not plain or head_dim < 16 \
                or head_dim & (head_dim - 1):
            raise ValueError("--batch-invariant needs --attention-backend triton and a model "
                             "whose attention the Triton kernel takes (plain causal, a power-of-"
                             f"two head size; this one: {head_dim}, plain={plain}): SDPA's "
                             "results depend on the query's width")
        triton_backend.check_available()
        for module in self.modules():
            if isinstance(module, Linear):
                module.row_invariant = True

    def use_fused_kernels(self, mode: str, device: torch.device, dtype: torch.dtype) -> int:
        """--fused-kernels: 'auto' runs the decode and verify steps of the layers that
        fused_layer.py computes in its five kernels, on CUDA in bfloat16/float16; 'off' keeps
        the torch path. Returns how many layers took it."""
        on = mode == "auto" and fused_layer.device_allows(device, dtype)
        for layer in self.layers:
            layer.fused = on and fused_layer.layer_allows(layer)
        return sum(layer.fused for layer in self.layers)

    def pack_for_cpu(self) -> None:
        """Repacks every projection for the CPU's fastest kernel (no-op elsewhere)."""
        for module in self.modules():
            if isinstance(module, Linear):
                tied_head = module is self.lm_head and self.embed_tokens is None
                module.pack_for_cpu(keep_plain_weight=tied_head)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],  # per layer (k_cache, v_cache)
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [num_logits] rows of the batch whose logits are needed
        layer_ids: Sequence[int] | None = None,  # None: all layers
    ) -> torch.Tensor:  # [num_logits, vocab] float32
        hidden = self.hidden_states(input_ids, positions, kv_caches, meta, layer_ids)
        return self.logits(hidden, logits_indices)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """[num_rows, vocab] float32: final norm and LM head at the given rows only (Gemma 2's
        logits soft-capped)."""
        logits = self.lm_head(self.norm(hidden[rows, :self.arch.hidden_size])).float()
        cap = self.arch.final_softcap
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)

    @torch.inference_mode()
    def hidden_states(self, input_ids, positions, kv_caches, meta: AttentionMetadata,
                      layer_ids: Sequence[int] | None = None,
                      capture_features: bool = True) -> torch.Tensor:
        """[num_tokens, hidden] after the decoder layers (before the final norm); writes KV.
        With `feature_layers` (every layer run, `capture_features`): [num_tokens, hidden *
        (1 + n)], the last layer's output followed by each feature layer's, in their order."""
        x = self.embed(input_ids)
        order = list(range(self.arch.num_layers)) if layer_ids is None else list(layer_ids)
        captured = []
        # Runs of layers between captures: the outputs of a run's last layer are kept.
        cuts = sorted(self.feature_layers) if layer_ids is None and capture_features else []
        runs = [order[start:end + 1] for start, end in
                zip([0] + [c + 1 for c in cuts], cuts + [len(order) - 1]) if start <= end]
        fused = cpu_ops_for(x)
        stack = self._decoder_stack(fused, kv_caches) \
            if stack_applies(fused, kv_caches, meta) else None
        rope = local_rope = None
        if stack is None:
            rope = self.rotary.at(positions, x.dtype)
            local_rope = self.local_rotary.at(positions, x.dtype) if self.local_rotary else None
        for run in runs:
            if stack is not None:
                run_stack(stack, x, positions, kv_caches, meta, run)
            else:
                for i in run:
                    k_cache, v_cache = kv_caches[i]
                    layer = self.layers[i]
                    x = layer(x, local_rope if layer.local_rope else rope, k_cache, v_cache, meta)
            if run[-1] in cuts:
                captured.append(x.clone())
        if not captured:
            return x
        by_layer = dict(zip(cuts, captured))
        return torch.cat([x] + [by_layer[i] for i in self.feature_layers], dim=-1)

    def _decoder_stack(self, fused, kv_caches):
        """The compiled decoder stack (models/stack.py) holding every layer's weights, or None
        where it does not apply."""
        return self._compiled_stack.get(fused, self.layers, self.arch, self.rotary)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies Hugging Face-named tensors into this model, fusing q/k/v and gate/up.

        Raises ValueError naming a tensor that has no place here, or parameters left unfilled.
        """
        modules = dict(self.named_modules())
        filled: set[str] = set()
        for name, tensor in named_tensors:
            place = self._place(name)
            if place is None:
                continue
            module_name, param_name, out_offset, part = place
            module = modules.get(module_name)
            if module is None or not hasattr(module, param_name):
                raise ValueError(f"checkpoint tensor {name!r} has no place in this model")
            if isinstance(module, Linear):
                module.load(param_name, tensor, out_offset)
            elif isinstance(module, RMSNorm) and self.arch.norm_weight_offset:
                with torch.no_grad():  # Gemma stores w and applies 1 + w
                    module.weight.copy_(tensor.float() + self.arch.norm_weight_offset)
            else:
                if isinstance(tensor, PackedTensor):  # e.g. an untied embedding in GGUF blocks
                    tensor = tensor.dequantize()
                with torch.no_grad():
                    getattr(module, param_name).copy_(tensor)
            # A checkpoint that stores a fused projection whole (Phi-3's qkv_proj and
            # gate_up_proj) fills every part of it at once.
            parts = [part] if part else parts_of(f"{module_name}.{param_name}")
            filled.update(f"{module_name}.{param_name}{p}" for p in parts)
        expected = {f"{n}{part}" for n, _ in self.named_parameters() for part in parts_of(n)}
        missing = sorted(expected - filled)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
        unfilled = [n for n, m in modules.items()
                    if isinstance(m, Linear) and m.gguf is not None and not m.gguf.complete]
        if unfilled:
            raise ValueError(f"GGUF weights do not cover every row of {unfilled[:3]}")

    def keep_in_blocks(self, weight_names: Iterable[str]) -> None:
        """Marks the projections these checkpoint weights go to as GGUF-packed (call on the meta
        device, before storage is allocated)."""
        modules = dict(self.named_modules())
        for name in weight_names:
            place = self._place(name)
            if place is not None and place[1] == "weight":
                module = modules.get(place[0])
                if isinstance(module, Linear) and module.gguf is None:
                    module.keep_in_blocks()

    def use_integer_kernels(self) -> None:
        """GGUF projections move to int8 activations and integer dot products where their format
        allows (engine/quant/int8.py): llama.cpp's arithmetic, --quantization gguf. Raises
        ValueError where SPECSERVE_INT8_ISA names a variant this CPU lacks."""
        kernel = load_kernel()
        if kernel is not None:
            try:
                variant = kernel.int8_isa()
            except RuntimeError as error:
                raise ValueError(str(error).splitlines()[0]) from None
            logger.info("integer GGUF kernels: %s", variant)
        for module in self.modules():
            if isinstance(module, Linear) and module.gguf is not None:
                module.gguf.use_integer_kernels()

    def on_integer_kernels(self) -> bool:
        """Whether any projection runs llama.cpp's integer arithmetic (--quantization gguf)."""
        return any(isinstance(m, Linear) and m.gguf is not None and m.gguf.on_integer_kernels
                   for m in self.modules())

    def gguf_format_names(self) -> list[str]:
        return sorted({f for m in self.modules() if isinstance(m, Linear) and m.gguf
                       for f in m.gguf.format_names})

    def gguf_weights(self) -> list:
        """Every projection's GGUFWeight (engine/quant/gguf_weight.py), the LM head's included."""
        return [m.gguf for m in self.modules() if isinstance(m, Linear) and m.gguf is not None]

    def gguf_bytes(self) -> int:
        return sum(weight.nbytes for weight in self.gguf_weights())

    def _place(self, name: str) -> Place | None:
        return place_of(name, self.arch, tied_embeddings=self.embed_tokens is None)

