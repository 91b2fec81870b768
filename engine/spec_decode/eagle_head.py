"""An EAGLE-style draft head: one decoder layer that predicts the target's next feature.

The target's feature at position t is its final hidden state after the final norm (what its LM
head reads), f_t; or, for a head trained with `feature_layers` (EAGLE-3), a projection of the
outputs of a low, a middle and a high layer, each RMS-normalized: f_t = reduce([l_t ; m_t ; h_t]),
a [3H -> H] projection. The head reads f_t fused with the embedding of token t+1 and predicts the
target's next final feature:

    x = fuse([f_t ; embed(x_{t+1})])        a [2H -> H] projection
    y = decoder_layer(x)                    the target's layer architecture, the head's weights
    f^_{t+1} = norm(y)

Its logits are the target's own LM head rows for the `draft_vocab` most frequent output tokens
(the full 49152-row head would cost ~20% of a target step per draft token on CPU); drafts are
never outside that set, and their distribution q is zero there, so verification stays exact.
Drafting K tokens runs the head K times, feeding f^ back in place of f, with its own one-layer
paged KV at the target's positions.

`train_forward` is the same computation over dense [batch, time] sequences in plain torch (the
inference path uses fused CPU kernels that have no gradients); a test holds the two equal.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.architecture import LlamaArchitecture
from engine.models.layers import Linear, RMSNorm, RotaryEmbedding, rms_norm
from engine.models.decoder_layer import DecoderLayer
from engine.models.stack import CompiledStack, run_stack, stack_applies
from engine.quant.kernels import cpu_ops_for
from engine.spec_decode.dense_layer import causal_attention, gated_mlp

WEIGHTS_FILE = "eagle_head.safetensors"
CONFIG_FILE = "eagle_head.json"


@dataclass
class EagleHeadConfig:
    """What a saved head was trained for and on; the target must match `target_arch`."""

    target_arch: dict  # LlamaArchitecture fields of the target
    draft_vocab_size: int
    target_name: str = ""
    training: dict | None = None  # data, steps, held-out acceptance: for the reader
    feature_layers: list[int] | None = None  # EAGLE-3: the target layers read; None: the last

    def arch(self) -> LlamaArchitecture:
        return LlamaArchitecture(**self.target_arch)


class EagleHead(nn.Module):
    def __init__(self, target_arch: LlamaArchitecture, draft_vocab_size: int,
                 feature_layers: Sequence[int] | None = None):
        super().__init__()
        self.target_arch = target_arch
        self.feature_layers = tuple(feature_layers or ())
        if any(not 0 <= i < target_arch.num_layers for i in self.feature_layers):
            raise ValueError(f"feature layers {list(self.feature_layers)} outside the target's "
                             f"{target_arch.num_layers} layers")
        # One dense layer, attending to every earlier position whatever the target's windows
        # and experts are.
        self.arch = replace(target_arch, num_layers=1, layer_windows=(), sparse_layers=())
        hidden = target_arch.hidden_size
        self.fuse = Linear(2 * hidden, hidden)
        self.reduce = Linear(len(self.feature_layers) * hidden, hidden) \
            if self.feature_layers else None
        self.layer = DecoderLayer(self.arch)
        self.norm = RMSNorm(hidden, target_arch.rms_norm_eps)
        # Target vocabulary id of each draft-vocabulary row, and those rows of the target's LM
        # head: copied from the target at load time (`attach_lm_head`), never saved or trained.
        self.register_buffer("token_ids", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.lm_head = Linear(hidden, draft_vocab_size)
        with torch.device("cpu"):
            self.rotary = RotaryEmbedding(self.arch)
        self._compiled_stack = CompiledStack()

    def init_weights(self, generator: torch.Generator | None = None, std: float = 0.02) -> None:
        init_head_weights(self.trained_parameters(), generator, std)

    @property
    def draft_vocab_size(self) -> int:
        return self.token_ids.shape[0]

    def trained_parameters(self) -> dict[str, nn.Parameter]:
        return {name: p for name, p in self.named_parameters() if not name.startswith("lm_head.")}

    @torch.no_grad()
    def attach_lm_head(self, target) -> None:
        """Copies the target LM head's rows for `token_ids` (dequantized from GGUF blocks)."""
        rows = target.lm_head.embedding(self.token_ids.to(_device_of(target)))
        self.lm_head.weight = nn.Parameter(rows.to(self.fuse.weight.dtype).clone(),
                                           requires_grad=False)
        self.lm_head.packed_weight = None

    # ----------------------------------------------------------------- inference
    def embed(self, token_ids: torch.Tensor, target) -> torch.Tensor:  # [n, H]
        """Token embeddings as the head reads them: the target's own."""
        return target.embed(token_ids)

    @torch.inference_mode()
    def kept_columns(self, hidden: torch.Tensor) -> torch.Tensor:
        """The columns of the target's `hidden_states` rows (the last layer's output, then the
        feature layers' when the target was asked for them) that `target_features` reads."""
        size = self.target_arch.hidden_size
        return hidden[:, size:] if self.reduce is not None else hidden[:, :size]

    def target_features(self, kept: torch.Tensor, final_norm: RMSNorm) -> torch.Tensor:
        """[n, H] f_t from `kept_columns` rows."""
        if self.reduce is None:
            return final_norm(kept.contiguous())
        fused = cpu_ops_for(kept)
        if fused is not None:  # one kernel where torch's rms_norm runs several (~0.1 ms on CPU)
            size = self.target_arch.hidden_size
            unit = torch.ones(size, dtype=kept.dtype)
            features = fused.rms_norm(kept.contiguous().view(-1, size), unit,
                                      self.target_arch.rms_norm_eps).view(kept.shape)
        else:
            features = normalize_layers(kept, self.target_arch)
        return self.reduce(features.to(self.reduce.weight.dtype).contiguous())

    @torch.inference_mode()
    def forward(self, features: torch.Tensor,  # [n, H] f_t (the target's or the head's own)
                next_embeds: torch.Tensor,  # [n, H] embedding of token t+1
                positions: torch.Tensor,  # [n] t
                kv_cache, meta) -> torch.Tensor:  # [n, H] f^_{t+1}
        x = self.fuse(torch.cat([features, next_embeds], dim=-1).to(self.fuse.weight.dtype))
        fused = cpu_ops_for(x)
        # The compiled stack where it applies (Q8_0 weights beside an integer target): the
        # layer's ~15 Python-dispatched ops cost a draft step ~0.65 ms on CPU.
        stack = self._compiled_stack.get(fused, [self.layer], self.arch, self.rotary) \
            if stack_applies(fused, kv_cache, meta) else None
        if stack is not None:
            run_stack(stack, x, positions, kv_cache, meta, [0])
        else:
            k_cache, v_cache = kv_cache[0]
            x = self.layer(x, self.rotary.at(positions, x.dtype), k_cache, v_cache, meta)
        return self.norm(x)

    @torch.inference_mode()
    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:  # [n, draft_vocab] float32
        return self.lm_head(features).float()

    # ------------------------------------------------------------------ training
    def train_forward(self, features: torch.Tensor,  # [B, T, H]
                      next_embeds: torch.Tensor,  # [B, T, H]
                      positions: torch.Tensor | None = None) -> torch.Tensor:  # [B, T, H]
        """The inference computation with autograd: causal attention over each sequence."""
        a, layer = self.arch, self.layer
        if positions is None:
            positions = torch.arange(features.shape[1], device=features.device)
        x = F.linear(torch.cat([features, next_embeds], dim=-1), self.fuse.weight)
        attended = causal_attention(_norm(x, layer.input_layernorm), layer.self_attn, a,
                                    self.rotary, positions)
        x = x + F.linear(attended, layer.self_attn.o_proj.weight, layer.self_attn.o_proj.bias)
        x = x + gated_mlp(_norm(x, layer.post_attention_layernorm), layer.mlp,
                          a.intermediate_size)
        return _norm(x, self.norm)

    def train_logits(self, features: torch.Tensor) -> torch.Tensor:
        return F.linear(features, self.lm_head.weight)

    def train_first(self, inputs: torch.Tensor) -> torch.Tensor:  # [B, T, k H or H] -> [B, T, H]
        """f_t from the batch's inputs: the feature layers' projection, or the final features."""
        return inputs if self.reduce is None else self.reduce(inputs)

    def train_normed(self, predicted: torch.Tensor) -> torch.Tensor:
        return predicted  # train_forward ends in the head's norm already

    # --------------------------------------------------------------- save / load
    def save(self, folder: Path, config: EagleHeadConfig) -> None:
        """float16 weights (half the size; the head is far less precise than that) + config."""
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        tensors = {name: p.detach().to(torch.float16).contiguous().cpu()
                   for name, p in self.trained_parameters().items()}
        tensors["token_ids"] = self.token_ids.cpu().to(torch.int32).contiguous()
        save_file(tensors, str(folder / WEIGHTS_FILE))
        (folder / CONFIG_FILE).write_text(json.dumps(asdict(config), indent=1) + "\n")


def load_head(folder: Path, target, device: torch.device, dtype: torch.dtype,
              for_training: bool = False) -> EagleHead:
    """Loads a head saved by `EagleHead.save` for `target`; raises ValueError on a mismatch.
    Repacked for the CPU's fast kernels (Q8_0 where the target runs integer ones) unless
    `for_training` (train_forward reads the plain weights)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise ValueError(f"{folder} is not a draft head folder (it needs {CONFIG_FILE} and "
                         f"{WEIGHTS_FILE}; `specserve train-draft` writes them)")
    config = EagleHeadConfig(**json.loads((folder / CONFIG_FILE).read_text()))
    if _shape(config.arch()) != _shape(target.arch):
        raise ValueError(f"the draft head in {folder} was trained for another model "
                         f"({config.target_name or 'unnamed'}: hidden size "
                         f"{config.arch().hidden_size}, vocabulary {config.arch().vocab_size})")
    head = EagleHead(target.arch, config.draft_vocab_size, config.feature_layers)
    tensors = load_file(str(folder / WEIGHTS_FILE))
    with torch.no_grad():
        for name, param in head.trained_parameters().items():
            param.copy_(tensors[name].float())
        head.token_ids.copy_(tensors["token_ids"].long())
    head = head.to(device=device, dtype=dtype).eval()
    head.attach_lm_head(target)
    if not for_training:
        # Beside a target on the integer kernels (llama.cpp's arithmetic), the head's weights go
        # to Q8_0 on them too: a draft step streams ~9 MB instead of ~36 MB of float32.
        integer = target.on_integer_kernels()
        for module in head.modules():
            if isinstance(module, Linear):
                if integer:
                    module.quantize_to_q8_0()
                else:
                    module.pack_for_cpu()
    head.config = config
    return head


@torch.no_grad()
def init_head_weights(params: dict[str, nn.Parameter], generator: torch.Generator | None,
                      std: float) -> None:
    """Random projections (normal, std 0.02 as in Llama's initializer), unit norms."""
    for name, param in params.items():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, std, generator=generator)


def normalize_layers(outputs: torch.Tensor, arch: LlamaArchitecture) -> torch.Tensor:
    """[..., k * H] feature layers' outputs, each RMS-normalized (no weight) in float32: their
    scales differ by orders of magnitude, and training data keeps them in float16."""
    hidden = arch.hidden_size
    split = outputs.float().unflatten(-1, (-1, hidden))
    return F.rms_norm(split, (hidden,), eps=arch.rms_norm_eps).flatten(-2)


def default_feature_layers(arch: LlamaArchitecture) -> list[int]:
    """A low, a middle and a high layer, as EAGLE-3 reads them."""
    n = arch.num_layers
    return sorted({min(2, n - 1), n // 2, max(n - 3, 0)})


def _shape(arch: LlamaArchitecture) -> tuple:
    return (arch.vocab_size, arch.hidden_size, arch.intermediate_size, arch.num_heads,
            arch.num_kv_heads, arch.head_dim)


def _norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    return rms_norm(x, norm.weight, norm.eps)


def _device_of(model) -> torch.device:
    return model.norm.weight.device
