"""The EAGLE-3 draft head as published checkpoints define it (EAGLE, SpecForge, `speculators`;
vLLM's and SGLang's `llama_eagle3`), on our paged KV and CPU kernels.

Where it differs from our own head (engine/spec_decode/eagle_head.py):

    g_t = fc([a_1 ; a_2 ; a_3])          the target's residual stream entering three layers,
                                         raw (not normalized), a [3 H_target -> H] projection
    residual = g  (or hidden_norm(g) with norm_before_residual)
    x = [input_layernorm(embed(x_{t+1})) ; hidden_norm(g)]      2H wide, into q/k/v only
    h = residual + o_proj(attention(x))
    p = h + mlp(post_attention_layernorm(h))                    the "pre-norm" output
    logits = lm_head(norm(p))            over the draft vocabulary; draft id d is target id
                                         d + d2t[d]

Drafting feeds p (not norm(p)) back in place of g, as vLLM's and SGLang's proposers do. The
interface is the one EagleProposer reads from EagleHead: `kept_columns`, `target_features`,
`embed`, `forward`, `draft_logits`, `token_ids`, `arch`, `feature_layers`.

`train_forward` is the same computation over dense [batch, time] sequences in plain torch, for
`specserve train-draft --architecture eagle3` (the inference path runs fused CPU kernels without
gradients); a test holds the two equal. Training reads the interface the trainer reads from
EagleHead: `trained_parameters`, `init_weights`, `attach_lm_head`, `train_first`,
`train_forward`, `train_normed`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.architecture import LlamaArchitecture
from engine.models.decoder_layer import Attention
from engine.models.layers import MLP, Linear, RMSNorm, RotaryEmbedding, rms_norm
from engine.spec_decode.dense_layer import causal_attention, gated_mlp
from engine.spec_decode.eagle_head import init_head_weights


@dataclass
class PublishedHeadInfo:
    """Where a published head came from, for logs and the controller's prior."""

    format: str  # "eagle3" (EAGLE / SpecForge layout) or "speculators-eagle3"
    folder: str
    training: dict | None = None  # no held-out acceptance is published in the checkpoint


class Eagle3Layer(nn.Module):
    """EAGLE-3's one decoder layer: q/k/v read [embeddings ; features] (2H), the residual
    stream is the features alone."""

    def __init__(self, arch: LlamaArchitecture, norm_before_residual: bool):
        super().__init__()
        hidden = arch.hidden_size
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(hidden, arch.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, arch.rms_norm_eps)
        # Our Attention sized for a 2H input, its output projection back to H.
        self.self_attn = Attention(replace(arch, hidden_size=2 * hidden))
        self.self_attn.o_proj = Linear(arch.num_heads * arch.head_dim, hidden, bias=arch.o_bias)
        self.mlp = MLP(arch)

    def forward(self, features, next_embeds, rope, k_cache, v_cache, meta) -> torch.Tensor:
        normed = self.hidden_norm(features)
        residual = normed if self.norm_before_residual else features
        x = torch.cat([self.input_layernorm(next_embeds), normed], dim=-1)
        h = self.self_attn(x, rope, k_cache, v_cache, meta, residual=residual)
        return self.mlp(self.post_attention_layernorm(h), residual=h)


class Eagle3Head(nn.Module):
    def __init__(self, arch: LlamaArchitecture, target_arch: LlamaArchitecture,
                 feature_layers: Sequence[int], draft_vocab_size: int, *,
                 norm_before_residual: bool = False, own_embeddings: bool = False,
                 fc_bias: bool = False):
        """`arch`: the head's own layer (one layer); `feature_layers`: the target layers whose
        outputs the head reads, in our numbering (output of layer i; EAGLE-3's id i + 1)."""
        super().__init__()
        self.arch = replace(arch, num_layers=1, layer_windows=(), sparse_layers=())
        self.target_arch = target_arch
        self.feature_layers = tuple(feature_layers)
        hidden = arch.hidden_size
        self.fc = Linear(len(self.feature_layers) * target_arch.hidden_size, hidden, bias=fc_bias)
        self.layer = Eagle3Layer(self.arch, norm_before_residual)
        self.norm = RMSNorm(hidden, arch.rms_norm_eps)
        self.lm_head = Linear(hidden, draft_vocab_size)
        # The head's own embeddings where the checkpoint has them; else the target's.
        self.embed_tokens = nn.Embedding(target_arch.vocab_size, hidden) if own_embeddings \
            else None
        # Target vocabulary id of each draft-vocabulary row: arange + d2t.
        self.register_buffer("token_ids", torch.zeros(draft_vocab_size, dtype=torch.long))
        with torch.device("cpu"):
            self.rotary = RotaryEmbedding(self.arch)
        self.config = PublishedHeadInfo("eagle3", "")

    @property
    def draft_vocab_size(self) -> int:
        return self.token_ids.shape[0]

    @torch.inference_mode()
    def kept_columns(self, hidden: torch.Tensor) -> torch.Tensor:
        """The feature layers' columns of the target's `hidden_states` rows."""
        return hidden[:, self.target_arch.hidden_size:]

    def target_features(self, kept: torch.Tensor, final_norm: RMSNorm) -> torch.Tensor:
        """[n, H] g_t = fc of the raw feature-layer outputs (EAGLE-3 normalizes nothing here;
        `final_norm` is unused, taken for EagleHead's signature)."""
        return self.fc(kept.to(self.norm.weight.dtype).contiguous())

    def embed(self, token_ids: torch.Tensor, target) -> torch.Tensor:  # [n, H]
        if self.embed_tokens is None:
            return target.embed(token_ids)
        return self.embed_tokens(token_ids)

    @torch.inference_mode()
    def forward(self, features: torch.Tensor,  # [n, H] g_t or the head's own p
                next_embeds: torch.Tensor,  # [n, H] embedding of token t+1
                positions: torch.Tensor,  # [n] t
                kv_cache, meta) -> torch.Tensor:  # [n, H] p, the pre-norm output
        dtype = self.norm.weight.dtype
        k_cache, v_cache = kv_cache[0]
        return self.layer(features.to(dtype), next_embeds.to(dtype),
                          self.rotary.at(positions, dtype), k_cache, v_cache, meta)

    @torch.inference_mode()
    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:  # [n, draft_vocab] float32
        return self.lm_head(self.norm(features)).float()

    # ------------------------------------------------------------------ training
    def trained_parameters(self) -> dict[str, nn.Parameter]:
        """All but the LM head, which holds the target's rows of the draft vocabulary."""
        return {name: p for name, p in self.named_parameters() if not name.startswith("lm_head.")}

    def init_weights(self, generator: torch.Generator | None = None, std: float = 0.02) -> None:
        init_head_weights(self.trained_parameters(), generator, std)

    @torch.no_grad()
    def attach_lm_head(self, target) -> None:
        """Copies the target LM head's rows for `token_ids` (dequantized from GGUF blocks)."""
        rows = target.lm_head.embedding(self.token_ids.to(target.norm.weight.device))
        self.lm_head.weight = nn.Parameter(rows.to(self.norm.weight.dtype).clone(),
                                           requires_grad=False)
        self.lm_head.packed_weight = None

    def train_first(self, layers: torch.Tensor) -> torch.Tensor:  # [B, T, k H_target] -> [B, T, H]
        """g_t from the raw feature layers' outputs, as `target_features` computes it."""
        return F.linear(layers, self.fc.weight, self.fc.bias)

    def train_forward(self, features: torch.Tensor,  # [B, T, H] g_t or the head's own p
                      next_embeds: torch.Tensor,  # [B, T, H] embedding of token t+1
                      positions: torch.Tensor | None = None) -> torch.Tensor:  # [B, T, H] p
        """The inference computation with autograd: causal attention over each sequence."""
        layer, a = self.layer, self.arch
        attn = layer.self_attn
        if positions is None:
            positions = torch.arange(features.shape[1], device=features.device)
        normed = _norm(features, layer.hidden_norm)
        residual = normed if layer.norm_before_residual else features
        x = torch.cat([_norm(next_embeds, layer.input_layernorm), normed], dim=-1)  # [B, T, 2H]
        attended = causal_attention(x, attn, a, self.rotary, positions)
        h = residual + F.linear(attended, attn.o_proj.weight, attn.o_proj.bias)
        return h + gated_mlp(_norm(h, layer.post_attention_layernorm), layer.mlp,
                             a.intermediate_size)

    def train_normed(self, prenorm: torch.Tensor) -> torch.Tensor:  # [B, T, H]
        """norm(p): what the LM head reads, compared with the target's next final feature."""
        return _norm(prenorm, self.norm)


def _norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    return rms_norm(x, norm.weight, norm.eps)
