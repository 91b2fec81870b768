"""Building blocks of a decoder: a layout-aware linear layer, RMSNorm and rotary embeddings."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.models import invariant_linear
from engine.models.architecture import LlamaArchitecture
from engine.models.triton_ops import ops_for as triton_ops_for
from engine.quant.formats import quantize_q8_0
from engine.quant.gguf_weight import GGUFWeight, PackedTensor
from engine.quant.kernels import cpu_ops_for, cpu_ops_on

# oneDNN tunes a packed weight's blocking for an expected number of rows; 8 suits decode
# batches and draft verification alike (1, 4 and 16 rows measured within ~10% of their best).
PACK_ROWS_HINT = 8


class Linear(nn.Module):
    """y = x W^T + b, with W stored [out, in] as in checkpoints.

    On CPU in float32 the weight is repacked into oneDNN's blocked layout once loaded
    (`pack_for_cpu`). Decoding is bound by how fast weights stream from memory, and for the few
    rows a decode or verify step multiplies, MKL's plain sgemm streams them at 4-8 GB/s on this
    machine while the packed oneDNN kernel reaches 15-22 GB/s for 1 to 16 rows.

    A weight loaded from GGUF blocks (`load` given a PackedTensor) stays in them: `gguf` holds it
    and the float32 `weight` is left empty; the compiled kernel multiplies the blocks directly.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed_weight: torch.Tensor | None = None
        self.gguf: GGUFWeight | None = None
        self.row_invariant = False  # --batch-invariant: the row-invariant kernel where it applies

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T + b, plus `residual` where given: on a GPU in the GEMM's epilogue (one kernel
        where a product and a sum were two), elsewhere as the same sum as before. With
        --batch-invariant a GPU step of at most 64 rows runs the row-invariant kernel
        (invariant_linear.py), so a verified row rounds as a decoded one."""
        if self.row_invariant and invariant_linear.applies(x, self.weight):
            return invariant_linear.linear(x, self.weight, self.bias, residual)
        if residual is not None and x.device.type == "cuda" and self.gguf is None \
                and self.packed_weight is None and self.bias is None and x.dim() == 2:
            return torch.addmm(residual, x, self.weight.t())
        y = self._project(x)
        return y if residual is None else residual + y

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        if self.gguf is not None:
            y = self.gguf.matmul(x)
            return y if self.bias is None else y.add_(self.bias)
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias,
                                                      "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, in_features]
        """Rows of W by id: a tied vocabulary matrix doubles as the token embedding."""
        if self.gguf is not None:
            return self.gguf.rows(ids)
        if self.packed_weight is not None and self.weight.numel() == 0:
            # Only the packed copy is kept: read W^T back through the kernel (x = identity).
            eye = torch.eye(self.in_features, dtype=self.weight.dtype, device=ids.device)
            unbiased = torch.ops.mkldnn._linear_pointwise(eye, self.packed_weight, None,
                                                          "none", [], "")
            return unbiased.t().index_select(0, ids)
        return F.embedding(ids, self.weight)

    @torch.no_grad()
    def quantize_to_q8_0(self) -> None:
        """Replaces a float weight by its Q8_0 blocks on the integer kernels (a quarter of the
        bytes to stream per call): for draft heads, whose drafts may differ from the float
        ones'; verification keeps the output exact whatever they are."""
        weight = self.weight.detach()
        self.keep_in_blocks()
        self.gguf.add(PackedTensor(quantize_q8_0(weight), 8, tuple(weight.shape)), 0)
        self.gguf.use_integer_kernels()
        self.packed_weight = None

    def keep_in_blocks(self) -> None:
        """Makes this layer's weight a GGUF one: no float32 storage is ever allocated for it."""
        self.gguf = GGUFWeight(self.out_features, self.in_features)
        self.weight = nn.Parameter(torch.empty(0, device=self.weight.device), requires_grad=False)

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor | PackedTensor, out_offset: int = 0) -> None:
        """Copies a checkpoint weight ([out, in]) or bias ([out]) into rows out_offset onward."""
        if isinstance(tensor, PackedTensor):
            if name == "weight" and self.gguf is not None:
                self.gguf.add(tensor, out_offset)
                return
            tensor = tensor.dequantize()
        getattr(self, name).narrow(0, out_offset, tensor.shape[0]).copy_(tensor)

    @torch.no_grad()
    def pack_for_cpu(self, keep_plain_weight: bool = False) -> None:
        """Switches to the packed oneDNN kernel where it applies (CPU, float32)."""
        weight = self.weight
        if self.gguf is not None or weight.device.type != "cpu" or weight.dtype != torch.float32 \
                or not torch.backends.mkldnn.is_available():
            return
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(),
                                                                      PACK_ROWS_HINT)
        if not keep_plain_weight:
            # The packed copy replaces the plain one; keep only its shape and dtype.
            self.weight = nn.Parameter(weight.detach().new_empty(0), requires_grad=False)


class MLP(nn.Module):
    def __init__(self, arch: LlamaArchitecture, intermediate_size: int | None = None):
        super().__init__()
        self.intermediate_size = size = intermediate_size or arch.intermediate_size
        self.gate_up_proj = Linear(arch.hidden_size, 2 * size, bias=arch.mlp_bias)
        self.down_proj = Linear(size, arch.hidden_size, bias=arch.mlp_bias)
        self.gelu = arch.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x, residual: torch.Tensor | None = None):
        gate_up = self.gate_up_proj(x)
        fused = cpu_ops_for(gate_up) or triton_ops_for(gate_up)
        if fused is not None and not self.gelu:
            return self.down_proj(fused.silu_mul(gate_up), residual)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        activated = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(activated * up, residual)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = cpu_ops_for(x)
        if fused is not None:
            return fused.rms_norm(x.contiguous(), self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The plain-torch RMSNorm (differentiable; the fused CPU kernel is not). Normalises in
    float32 whatever the weights' dtype; `F.rms_norm` is one fused kernel on devices that have
    one, where the written-out formula is five or more."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with cos/sin tables precomputed for every position."""

    def __init__(self, arch: LlamaArchitecture):
        super().__init__()
        positions = torch.arange(arch.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, arch.rope_inv_freq())  # [max_pos, head_dim // 2]
        angles = torch.cat([freqs, freqs], dim=-1)  # [max_pos, head_dim]
        scale = arch.rope_attention_factor()
        self.register_buffer("cos", angles.cos() * scale, persistent=False)
        self.register_buffer("sin", angles.sin() * scale, persistent=False)
        # sin with its first half negated: rotate_half(x) * sin == x.roll(D/2) * sin_rolled,
        # one roll instead of a negation and a concatenation.
        half = arch.head_dim // 2
        self.register_buffer("sin_rolled", torch.cat([-self.sin[:, :half], self.sin[:, half:]],
                                                     dim=-1), persistent=False)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> "RotaryStep":
        """The rotation of one step's tokens, looked up once for every layer."""
        fused = cpu_ops_on(positions.device, dtype)
        if fused is not None:  # the fused op indexes the full tables itself
            return RotaryStep(positions, self.cos, self.sin, fused)
        return RotaryStep(positions, self.cos[positions].unsqueeze(1).to(dtype),
                          self.sin_rolled[positions].unsqueeze(1).to(dtype), None)


@dataclass
class RotaryStep:
    """Rotates the queries and keys of one step's tokens (the same positions in every layer)."""

    positions: torch.Tensor  # [T]
    cos: torch.Tensor  # torch path: [T, 1, D] at the positions; fused: the full table
    sin: torch.Tensor  # torch path: sin_rolled [T, 1, D] at the positions; fused: the full sin
    fused: object | None  # the CPU extension whose rotary_ applies, or None

    def rotate(self, qk: torch.Tensor, num_heads: int) -> torch.Tensor:
        """qk: [T, num_heads + num_kv_heads, D], each token's query heads then its key heads,
        rotated together: four kernels for both on the torch path."""
        if self.fused is not None:  # in place: qk is a fresh view of this step's projection
            self.fused.rotary_(qk[:, :num_heads], qk[:, num_heads:], self.cos, self.sin,
                               self.positions)
            return qk
        return qk * self.cos + qk.roll(qk.shape[-1] // 2, -1) * self.sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
