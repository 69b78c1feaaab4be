"""Vision encoder: shapes, pos_embed resampling, DeiT-like local init, clear errors."""

from functools import partial

import pytest
import timm
import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from models.vit import build_vision_encoder, resample_pos_embed


def vit_config(**overrides) -> dict:
    config = dict(
        image_res=32, patch_size=8, vision_width=64, vision_depth=2, vision_heads=4, vision_init=None
    )
    config.update(overrides)
    return config


def deit_like(image_res: int, distilled: bool) -> dict:
    """A DeiT-style checkpoint: classifier head, and for distilled DeiT a dist token + head_dist."""
    torch.manual_seed(0)
    vit = VisionTransformer(
        img_size=image_res,
        patch_size=8,
        embed_dim=64,
        depth=2,
        num_heads=4,
        norm_layer=partial(nn.LayerNorm, eps=1e-6),
        num_classes=10,
    )
    state = vit.state_dict()
    if distilled:
        state["dist_token"] = torch.randn(1, 1, 64)
        pos = state["pos_embed"]
        state["pos_embed"] = torch.cat([pos[:, :1], torch.randn(1, 1, 64), pos[:, 1:]], dim=1)
        state["head_dist.weight"], state["head_dist.bias"] = torch.randn(10, 64), torch.zeros(10)
    return state


def test_tokens_shape():
    torch.manual_seed(0)
    model = build_vision_encoder(vit_config())
    out = model.forward_features(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 1 + 16, 64)
    assert "norm.weight" in model.state_dict()  # final LayerNorm, as in ALBEF checkpoints


@pytest.mark.parametrize("distilled", [False, True])
def test_deit_like_local_file(tmp_path, distilled):
    state = deit_like(32, distilled)
    path = tmp_path / "deit.pth"
    torch.save({"model": state}, path)
    model = build_vision_encoder(vit_config(image_res=64, vision_init=str(path)))
    loaded = model.state_dict()
    assert torch.equal(loaded["blocks.1.mlp.fc2.weight"], state["blocks.1.mlp.fc2.weight"])
    assert loaded["pos_embed"].shape == (1, 1 + 64, 64)
    # The class token's position is kept, the patch grid is resampled 4x4 -> 8x8.
    assert torch.allclose(loaded["pos_embed"][:, 0], state["pos_embed"][:, 0])
    assert model.forward_features(torch.randn(1, 3, 64, 64)).shape == (1, 65, 64)


def test_resample_pos_embed_to_model_grid():
    state = {"visual_encoder.pos_embed": torch.randn(1, 1 + 16, 64), "other": torch.zeros(1)}

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.visual_encoder = build_vision_encoder(vit_config(image_res=64))

    out = resample_pos_embed(state, Holder())
    assert out["visual_encoder.pos_embed"].shape == (1, 65, 64)
    assert out["other"] is state["other"]
    # A constant embedding stays constant under interpolation.
    flat = {"pos_embed": torch.ones(1, 17, 64)}
    assert torch.allclose(
        resample_pos_embed(flat, Holder().visual_encoder, prefix="")["pos_embed"], torch.ones(1)
    )


def test_vision_init_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="missing.pth"):
        build_vision_encoder(vit_config(vision_init=str(tmp_path / "missing.pth")))
    with pytest.raises(ValueError, match="not_a_model"):
        build_vision_encoder(vit_config(vision_init="not_a_model"))

    def offline(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(timm, "create_model", offline)
    with pytest.raises(RuntimeError, match="could not be fetched.*local"):
        build_vision_encoder(vit_config(vision_init="deit_base_patch16_224.fb_in1k"))


def test_wrong_size_checkpoint_is_a_clear_error(tmp_path):
    state = deit_like(32, distilled=False)
    path = tmp_path / "deit.pth"
    torch.save(state, path)
    with pytest.raises((ValueError, RuntimeError), match="deit.pth"):
        build_vision_encoder(vit_config(vision_depth=3, vision_init=str(path)))
    with pytest.raises(ValueError, match="patch_size"):
        build_vision_encoder(vit_config(image_res=36))
    with pytest.raises(ValueError, match="deit.pth"):
        build_vision_encoder(vit_config(vision_width=32, vision_init=str(path)))


def test_conv_stem_replaces_the_patch_projection(tmp_path):
    """vision_stem conv: log2(patch) stride-2 convolutions give the same token grid as the linear stem;
    its weights round-trip through vision_init; bad values name the key."""
    torch.manual_seed(0)
    linear = build_vision_encoder(vit_config())
    conv = build_vision_encoder(vit_config(vision_stem="conv"))
    x = torch.randn(2, 3, 32, 32)
    assert conv.forward_features(x).shape == linear.forward_features(x).shape == (2, 1 + 16, 64)
    convs = [m for m in conv.patch_embed.proj if isinstance(m, nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.stride) for c in convs] == [
        (3, 24, (2, 2)), (24, 48, (2, 2)), (48, 64, (2, 2))]
    # The convolutions see across a patch border (receptive field 15 px > 8): a pixel of patch (0, 0)
    # moves the token of patch (0, 1); the linear stem's token of patch (0, 1) stays put.
    y = x.clone()
    y[:, :, 3, 7] += 1.0
    for stem, moves in ((conv, True), (linear, False)):
        tokens_x, tokens_y = stem.patch_embed(x), stem.patch_embed(y)
        assert (not torch.equal(tokens_x[:, 1], tokens_y[:, 1])) == moves
    path = tmp_path / "stem.pth"
    torch.save(conv.state_dict(), path)
    again = build_vision_encoder(vit_config(vision_stem="conv", vision_init=str(path)))
    assert torch.equal(again.forward_features(x), conv.forward_features(x))
    with pytest.raises(ValueError, match="vision_init"):  # a linear-stem checkpoint does not fit
        torch.save(linear.state_dict(), tmp_path / "linear.pth")
        build_vision_encoder(vit_config(vision_stem="conv", vision_init=str(tmp_path / "linear.pth")))
    with pytest.raises(ValueError, match="vision_stem"):
        build_vision_encoder(vit_config(vision_stem="cnn"))
    with pytest.raises(ValueError, match="power of two"):
        build_vision_encoder(vit_config(vision_stem="conv", patch_size=6, image_res=36))
