"""Vision encoder: a timm VisionTransformer built from the config, pretrained weights adapted at load time."""

from __future__ import annotations

import logging
import math
import os
from functools import partial
from typing import Any

import timm
import torch
from timm.layers import PatchDropout
from timm.models import checkpoint_seq
from timm.models.vision_transformer import VisionTransformer
from torch import Tensor, nn
from torch.nn import functional as F

from grit_io import InputFileError
from models.layer_norm import LayerNorm, set_amp_layer_norm
from models.state_dicts import check_shapes, read_weights_file

logger = logging.getLogger(__name__)

_WEIGHT_EXTS = (".pth", ".pt", ".bin", ".safetensors", ".ckpt")
# Classifier / distillation parts of ImageNet checkpoints that the feature extractor does not have.
_DROPPED_PREFIXES = ("head.", "head_dist.", "fc_norm.", "dist_token")


class VisionEncoder(VisionTransformer):
    """timm's VisionTransformer whose gradient checkpointing acts only in training mode with grad on."""

    @property
    def grad_checkpointing(self) -> bool:
        """Whether forward_features checkpoints its blocks now (timm reads this flag on every forward)."""
        # timm checkpoints whatever the mode; gated here like models.bert's layers, so that evaluation
        # and no_grad passes (GRIT's feature pass, momentum encoders) run the blocks plainly.
        return self._grad_checkpointing and self.training and torch.is_grad_enabled()

    @grad_checkpointing.setter
    def grad_checkpointing(self, enable: bool) -> None:
        self._grad_checkpointing = bool(enable)

    def forward_features(self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        """Images (B,3,H,W) -> tokens (B,1+P,D), or (B,1+K,D) while the patch dropout drops (FLIP).

        While it drops and the stem is the linear patch projection, only the K kept patches are projected
        (not in timm, which projects all P and then drops): the projection and the positional embedding act
        on each patch alone, so the tokens are timm's, from the same draw of the global generator, at
        K/P of the stem's FLOPs. Otherwise timm's forward_features.
        """
        drop = self.patch_drop
        if (attn_mask is not None or is_causal or not self._projects_kept_only(drop)
                or tuple(x.shape[-2:]) != tuple(self.patch_embed.img_size)):  # timm says what is wrong
            return super().forward_features(x, attn_mask=attn_mask, is_causal=is_causal)
        proj = self.patch_embed.proj
        p = proj.kernel_size[0]
        patches = x.unfold(2, p, p).unfold(3, p, p)  # (B,C,gh,gw,p,p)
        patches = patches.permute(0, 2, 3, 1, 4, 5).flatten(3).flatten(1, 2)  # (B,P,C*p*p), kernel's order
        batch, count = patches.shape[:2]
        keep = max(1, int(count * (1.0 - drop.prob)))  # timm's patch_dropout_forward: its draw, its count
        index = torch.argsort(torch.randn(batch, count, device=x.device), dim=-1)[:, :keep]
        if drop.ordered:
            index = index.sort(dim=-1).values
        kept = patches.gather(1, index[..., None].expand(-1, -1, patches.shape[-1]))
        tokens = self.patch_embed.norm(F.linear(kept, proj.weight.flatten(1), proj.bias))
        pos = self.pos_embed[0, 1:].index_select(0, index.flatten()).view(batch, keep, -1)
        cls = (self.cls_token + self.pos_embed[:, :1]).expand(batch, -1, -1)
        x = self.norm_pre(self.pos_drop(torch.cat([cls, tokens + pos], dim=1)))
        x = checkpoint_seq(self.blocks, x) if self.grad_checkpointing else self.blocks(x)
        return self.norm(x)

    def _projects_kept_only(self, drop: nn.Module) -> bool:
        """Whether forward_features can project the kept patches alone: a dropping PatchDropout and timm's
        plain layout (a non-overlapping linear stem, one [CLS], absolute positions including it, no dropout
        of the positional embeddings)."""
        proj = getattr(self.patch_embed, "proj", None)
        return (isinstance(drop, PatchDropout) and drop.training and drop.prob > 0
                and isinstance(proj, nn.Conv2d) and proj.kernel_size == proj.stride
                and proj.padding == (0, 0) and proj.dilation == (1, 1) and proj.groups == 1
                and self.patch_embed.flatten and not self.dynamic_img_size
                and not getattr(self.patch_embed, "dynamic_img_pad", False) and self.cls_token is not None
                and self.reg_token is None and not self.no_embed_class and self.pos_embed is not None
                and drop.num_prefix_tokens == 1
                # timm's pos_drop acts before the draw, on every token: with p > 0 the orders would differ
                and not (isinstance(self.pos_drop, nn.Dropout) and self.pos_drop.p > 0))


# The vision_init value naming the ViT pre-trained on the synthetic world (dataset/synthetic_vit.py).
SYNTHETIC = "synthetic"
# The config keys that shape the ViT: a synthetic ViT file records them, and its name spells them.
VIT_KEYS = ("image_res", "patch_size", "vision_width", "vision_depth", "vision_heads", "vision_stem")
# How to make the synthetic ViT file when it is missing (named in the error).
_MAKE_SYNTHETIC = "python -m tools.vit_pretrain --config CONFIG"


def build_vision_encoder(config: Any) -> VisionEncoder:
    """The configured ViT; its forward_features maps images (B,3,H,W) to tokens (B,1+P,D).

    config: the resolved task config (training.config.TaskConfig, any task); reads image_res, patch_size,
    vision_width, vision_depth, vision_heads, vision_drop_path, vision_stem, grad_checkpointing,
    amp_layer_norm, vision_init and, for vision_init 'synthetic', synthetic_root. grad_checkpointing:
    timm checkpoints every block while training. vision_init 'synthetic' only loads the file
    synthetic_vit_path(config); training.inputs.prepare_inputs (every task script) or tools.vit_pretrain
    makes it.
    """
    model = VisionEncoder(
        img_size=config.image_res,
        patch_size=config.patch_size,
        embed_dim=config.vision_width,
        depth=config.vision_depth,
        num_heads=config.vision_heads,
        mlp_ratio=4.0,
        qkv_bias=True,
        norm_layer=partial(LayerNorm, eps=1e-6),
        num_classes=0,
        global_pool="",
        class_token=True,
        drop_path_rate=config.vision_drop_path,
    )
    if config.vision_stem == "conv":
        model.patch_embed.proj = conv_stem(config.patch_size, config.vision_width)
    # Only each block's input is kept, the rest is recomputed in backward; torch.utils.checkpoint
    # restores the RNG state (its default, kept by timm's checkpoint_seq): drop_path redraws its masks.
    model.set_grad_checkpointing(config.grad_checkpointing)
    set_amp_layer_norm(model, config.amp_layer_norm)
    init = config.vision_init
    if init == SYNTHETIC:
        init = synthetic_vit_path(config)
        if not os.path.isfile(init):
            # Made before the model is built, not here: generating trains a ViT on the synthetic world
            # (dataset/), which models/ does not import.
            raise FileNotFoundError(
                f"vision_init 'synthetic': the pre-trained synthetic ViT {init} does not exist; make it with "
                f"`{_MAKE_SYNTHETIC}` (any task script also makes it before building the model)")
    if init:
        load_vision_init(model, init)
    return model


def patch_dropout(model: VisionTransformer, rate: float) -> nn.Module:
    """timm's PatchDropout for `model`: drops `rate` of each image's patch tokens in training mode, its
    prefix tokens ([CLS]) kept (FLIP's image-token dropout; config key image_token_drop)."""
    return PatchDropout(rate, num_prefix_tokens=model.num_prefix_tokens)


def vit_shape(config: Any) -> dict[str, int | str]:
    """The ViT-shaping keys (VIT_KEYS) of the config (training.config.TaskConfig) as plain ints and a str."""
    # Plain types: a value of a YAML scalar subclass would make the saved file need unpickling.
    return {k: (str if k == "vision_stem" else int)(getattr(config, k)) for k in VIT_KEYS}


def synthetic_vit_path(config: Any) -> str:
    """Where `vision_init: synthetic` finds the ViT of the config's shape:
    <synthetic_root>/vit_r{image_res}_p{patch}_w{width}_d{depth}_h{heads}_{stem}.pth.

    config: the resolved task config (training.config.TaskConfig); reads synthetic_root and VIT_KEYS.
    """
    root = config.synthetic_root
    if not root:
        raise ValueError("config key 'vision_init' is 'synthetic' (the ViT pre-trained on the synthetic "
                         "world), which needs 'synthetic_root'; set vision_init to null or to a weights file")
    tag = "r{image_res}_p{patch_size}_w{vision_width}_d{vision_depth}_h{vision_heads}_{vision_stem}"
    return os.path.join(root, f"vit_{tag.format(**vit_shape(config))}.pth")


def conv_stem(patch: int, width: int) -> nn.Sequential:
    """log2(patch) 3x3 stride-2 convolutions (B,3,H,W) -> (B,width,H/patch,W/patch), in place of the
    linear patch projection (config vision_stem: conv; not in the paper).

    Why: a ViT trained from scratch on little data does not learn what small shapes look like inside
    a patch (Xiao et al. 2021, "Early convolutions help transformers see better"). The paper's ViT
    starts from ImageNet DeiT and sees; the tiny CPU configs start from nothing, and with the linear
    stem their ViT never told a circle from a square (docs/synthetic-world.md, 'Does GRIT help the tiny
    model?').
    Channels grow 3/8, 3/4, 1 x width (for patch 8), GELU between the convolutions.
    """
    n = patch.bit_length() - 1  # a power of two >= 2 (training.config checks patch_size for vision_stem conv)
    channels = [3] + [(3 * width) >> (n - i) for i in range(n - 1)] + [width]
    layers: list[nn.Module] = []
    for i in range(n):
        layers.append(nn.Conv2d(channels[i], channels[i + 1], kernel_size=3, stride=2, padding=1))
        if i < n - 1:
            layers.append(nn.GELU())
    return nn.Sequential(*layers)


def load_vision_init(model: VisionTransformer, init: str) -> list[str]:
    """Load `init` (local weights file or timm pretrained tag) into model; returns the dropped keys."""
    if os.path.isfile(init):
        state, source = read_vit_state_dict(init), init
    elif init.endswith(_WEIGHT_EXTS) or init.startswith((".", "/", "~")):
        raise FileNotFoundError(f"config key 'vision_init': no such file: {init!r}")
    else:
        state, source = _timm_pretrained_state_dict(init, model), f"timm:{init}"
    state, dropped = _strip_classifier(state)
    state = resample_pos_embed(state, model, prefix="")
    own = model.state_dict()
    check_shapes(state, own,
                 f"vision_init {init!r} does not fit the configured ViT (vision_width/heads/patch_size)",
                 limit=4)
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise InputFileError(
            f"vision_init {init!r} does not fit the configured ViT (vision_width/depth/heads/patch_size): "
            f"missing {result.missing_keys[:6]}, unexpected {result.unexpected_keys[:6]}"
        )
    logger.info("ViT weights from %s; dropped: %s", source, ", ".join(sorted(dropped)) or "none")
    return dropped


def read_vit_state_dict(path: str) -> dict[str, Tensor]:
    """A ViT state dict from a .pth/.bin/.safetensors file (unwraps 'model'/'state_dict', ALBEF prefixes);
    InputFileError naming the file when it holds none."""
    state = read_weights_file(path, "vision_init")
    for key in ("model", "state_dict"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise InputFileError(f"vision_init {path!r} does not hold a state dict of tensors")
    state = {k.removeprefix("module."): v for k, v in state.items()}
    # An ALBEF / GRIT-VLP checkpoint: take the (online) vision tower only.
    if any(k.startswith("visual_encoder.") for k in state):
        state = {k[len("visual_encoder.") :]: v for k, v in state.items() if k.startswith("visual_encoder.")}
    return state


def _timm_pretrained_state_dict(tag: str, model: VisionTransformer) -> dict[str, Tensor]:
    if not timm.is_model(tag):
        raise ValueError(
            f"config key 'vision_init': {tag!r} is neither an existing file nor a timm model name"
        )
    try:
        pretrained = timm.create_model(
            tag, pretrained=True, num_classes=0, global_pool="", img_size=model.patch_embed.img_size
        )
    except Exception as err:  # network / hub errors come in many types; all mean "no weights here"
        raise RuntimeError(
            f"vision_init {tag!r}: the timm pretrained weights could not be fetched ({type(err).__name__}: "
            f"{err}); download them elsewhere and set vision_init to the local .pth/.safetensors file"
        ) from err
    return pretrained.state_dict()


def _strip_classifier(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], list[str]]:
    """Drop classifier heads and DeiT's distillation token (and its position embedding)."""
    out = {k: v for k, v in state.items() if not k.startswith(_DROPPED_PREFIXES)}
    dropped = [k for k in state if k not in out]
    if "dist_token" in state and "pos_embed" in out:
        # Distilled DeiT: positions are [cls, dist, patches...]; keep cls + patches.
        pos = out["pos_embed"]
        out["pos_embed"] = torch.cat([pos[:, :1], pos[:, 2:]], dim=1)
    return out, dropped


def resample_pos_embed(state_dict: dict, model: nn.Module, prefix: str = "visual_encoder.") -> dict:
    """Resample every `{prefix}...pos_embed` (1,1+P',D) in state_dict to the model's grid (1,1+P,D)."""
    return resample_pos_embed_report(state_dict, model, prefix)[0]


def resample_pos_embed_report(
    state_dict: dict, model: nn.Module, prefix: str = "visual_encoder."
) -> tuple[dict, list[str]]:
    """Like resample_pos_embed, also returning the keys that were resampled (each logged with its grids)."""
    own = model.state_dict()
    out, resampled = dict(state_dict), []
    for key, value in state_dict.items():
        if not (key.startswith(prefix) and key.endswith("pos_embed")) or key not in own:
            continue
        target = own[key]
        # Different widths cannot be resampled: left as is for the caller's shape check to report.
        if value.shape == target.shape or value.dim() != 3 or value.shape[-1] != target.shape[-1]:
            continue
        old_grid, new_grid = _square_grid(key, value.shape[1] - 1), _square_grid(key, target.shape[1] - 1)
        out[key] = interpolate_pos_embed(value, new_grid, num_extra_tokens=1)
        resampled.append(key)
        logger.info("%s: position embeddings resampled from a %dx%d to a %dx%d patch grid",
                    key, old_grid, old_grid, new_grid, new_grid)
    return out, resampled


def interpolate_pos_embed(pos_embed: Tensor, new_grid: int, num_extra_tokens: int = 1) -> Tensor:
    """(B, E+g*g, D) -> (B, E+new_grid**2, D): the E extra (class) tokens kept in front, the g x g patch
    grid resampled bicubically (align_corners=False, no antialiasing), as ALBEF / GRIT-VLP do.

    timm's resample_abs_pos_embed antialiases when shrinking, which the authors' code does not.
    Computed in float32, returned in the input's dtype.
    """
    extra, patches = pos_embed[:, :num_extra_tokens], pos_embed[:, num_extra_tokens:]
    batch, n_patches, dim = patches.shape
    grid = _square_grid("pos_embed", n_patches)
    if grid == new_grid:
        return pos_embed
    patches = patches.float().reshape(batch, grid, grid, dim).permute(0, 3, 1, 2)
    patches = F.interpolate(
        patches, size=(new_grid, new_grid), mode="bicubic", align_corners=False, antialias=False
    )
    patches = patches.permute(0, 2, 3, 1).flatten(1, 2).to(pos_embed.dtype)
    return torch.cat([extra, patches], dim=1)


def _square_grid(key: str, n_patches: int) -> int:
    side = math.isqrt(n_patches)
    if side * side != n_patches:
        raise ValueError(f"{key}: {n_patches} patch positions do not form a square grid")
    return side


def check_vision_text_widths(config: Any, encoder_width: int) -> None:
    """The fusion layers' cross-attention reads image tokens: config.vision_width must equal the
    encoder_width of the config's bert_config file (InputFileError naming both otherwise)."""
    if config.vision_width != encoder_width:
        raise InputFileError(
            f"config key 'vision_width' ({config.vision_width}) must equal 'encoder_width' ({encoder_width}) "
            f"in bert_config {config.bert_config!r}"
        )


__all__ = [
    "VisionEncoder",
    "build_vision_encoder",
    "conv_stem",
    "check_vision_text_widths",
    "SYNTHETIC",
    "VIT_KEYS",
    "load_vision_init",
    "read_vit_state_dict",
    "interpolate_pos_embed",
    "resample_pos_embed",
    "resample_pos_embed_report",
    "synthetic_vit_path",
    "vit_shape",
]
