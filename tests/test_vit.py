"""Vision encoder: shapes, pos_embed resampling, DeiT-like local init, clear errors."""

from functools import partial

import pytest
import timm
import torch
from conftest import tiny_config
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from grit_io import InputFileError
from models.vit import build_vision_encoder, resample_pos_embed
from training.config_files import ConfigError


def vit_config(**overrides):
    """The typed tiny pre-training config with a 32 px, 2-block, width-64 ViT and `overrides`; a value the
    config refuses raises ConfigError here, at resolution, as in the scripts."""
    values = dict(image_res=32, patch_size=8, vision_width=64, vision_depth=2, vision_heads=4,
                  vision_init=None)
    return tiny_config("pretrain", **{**values, **overrides})


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
    # A file that holds no state dict (a bare tensor, a text file): InputFileError naming the file.
    torch.save(torch.zeros(3), tmp_path / "tensor.pth")
    (tmp_path / "notes.pth").write_text("not weights")
    for name in ("tensor.pth", "notes.pth"):
        with pytest.raises(InputFileError, match=f"vision_init.*{name}"):
            build_vision_encoder(vit_config(vision_init=str(tmp_path / name)))


def test_wrong_size_checkpoint_is_a_clear_error(tmp_path):
    state = deit_like(32, distilled=False)
    path = tmp_path / "deit.pth"
    torch.save(state, path)
    with pytest.raises(InputFileError, match="deit.pth"):
        build_vision_encoder(vit_config(vision_depth=3, vision_init=str(path)))
    # image_res not a multiple of patch_size: refused when the config is resolved (training.config).
    with pytest.raises(ConfigError, match="image_res.*patch_size"):
        vit_config(image_res=36)
    with pytest.raises(InputFileError, match="deit.pth"):
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
    with pytest.raises(InputFileError, match="vision_init"):  # a linear-stem checkpoint does not fit
        torch.save(linear.state_dict(), tmp_path / "linear.pth")
        build_vision_encoder(vit_config(vision_stem="conv", vision_init=str(tmp_path / "linear.pth")))
    # Values the stem cannot take: refused when the config is resolved (training.config), naming the key.
    with pytest.raises(ConfigError, match="vision_stem"):
        vit_config(vision_stem="cnn")
    with pytest.raises(ConfigError, match="power of two"):
        vit_config(vision_stem="conv", patch_size=6, image_res=36)


def reference_interpolation(pos_embed: torch.Tensor, new_grid: int) -> torch.Tensor:
    """The authors' recipe written out plainly: class token kept, patch grid bicubic, no antialiasing."""
    cls, patches = pos_embed[:, :1], pos_embed[:, 1:]
    grid = int(round(patches.shape[1] ** 0.5))
    square = patches.reshape(-1, grid, grid, patches.shape[-1]).permute(0, 3, 1, 2)
    square = torch.nn.functional.interpolate(
        square, size=(new_grid, new_grid), mode="bicubic", align_corners=False, antialias=False
    )
    return torch.cat([cls, square.permute(0, 2, 3, 1).flatten(1, 2)], dim=1)


@pytest.mark.parametrize("old_res,new_res", [(224, 256), (256, 384)])
def test_resampling_is_plain_bicubic_without_antialias(old_res, new_res):
    """224->256 (14x14 -> 16x16) and 256->384 (16 -> 24) px at patch 16: the authors' bicubic
    interpolation to 1e-6, class token untouched, and not the antialiased (timm default) result."""
    from timm.layers import resample_abs_pos_embed

    torch.manual_seed(0)
    old_grid, new_grid = old_res // 16, new_res // 16
    pos = torch.randn(1, 1 + old_grid**2, 768) * 0.02
    model = build_vision_encoder(
        vit_config(image_res=new_res, patch_size=16, vision_width=768, vision_depth=1, vision_heads=12)
    )
    out = resample_pos_embed({"pos_embed": pos}, model, prefix="")["pos_embed"]
    expected = reference_interpolation(pos, new_grid)
    assert out.shape == (1, 1 + new_grid**2, 768)
    assert torch.allclose(out, expected, atol=1e-6, rtol=0)
    assert torch.equal(out[:, 0], pos[:, 0])
    antialiased = (
        resample_abs_pos_embed(pos, new_size=[new_grid, new_grid], old_size=[old_grid, old_grid]),
        torch.cat([pos[:, :1], torch.nn.functional.interpolate(
            pos[:, 1:].reshape(1, old_grid, old_grid, 768).permute(0, 3, 1, 2), size=(new_grid, new_grid),
            mode="bicubic", align_corners=False, antialias=True).permute(0, 2, 3, 1).flatten(1, 2)], dim=1),
    )
    for other in antialiased:
        # Differences of ~1e-3 on values of std 0.02: far above the 1e-6 agreement above.
        assert (out - other).abs().max() > 1e-3


def test_load_paths_resample_without_antialias(tmp_path, caplog):
    """Both ways the scripts load a ViT at another resolution (vision_init, and load_weights for
    --checkpoint, online and momentum towers) give the plain bicubic result and log the grids."""
    import logging

    from models.loading import load_weights

    torch.manual_seed(0)
    small = build_vision_encoder(vit_config(image_res=32))  # 4x4 grid at patch 8
    path = tmp_path / "vit32.pth"
    torch.save(small.state_dict(), path)
    expected = reference_interpolation(small.state_dict()["pos_embed"], 6)

    with caplog.at_level(logging.INFO, logger="models.vit"):
        big = build_vision_encoder(vit_config(image_res=48, vision_init=str(path)))
    assert torch.allclose(big.state_dict()["pos_embed"], expected, atol=1e-6, rtol=0)
    assert any("4x4" in r.getMessage() and "6x6" in r.getMessage() for r in caplog.records)

    class Towers(nn.Module):
        def __init__(self, image_res):
            super().__init__()
            self.visual_encoder = build_vision_encoder(vit_config(image_res=image_res))
            self.visual_encoder_m = build_vision_encoder(vit_config(image_res=image_res))

    source = Towers(32)
    source.visual_encoder.load_state_dict(small.state_dict())
    source.visual_encoder_m.load_state_dict(small.state_dict())
    checkpoint = tmp_path / "checkpoint.pth"
    torch.save({"model": source.state_dict()}, checkpoint)
    target = Towers(48)
    report = load_weights(target, str(checkpoint))
    assert report.resampled == ["visual_encoder.pos_embed", "visual_encoder_m.pos_embed"]
    for tower in ("visual_encoder", "visual_encoder_m"):
        assert torch.allclose(target.state_dict()[f"{tower}.pos_embed"], expected, atol=1e-6, rtol=0)
