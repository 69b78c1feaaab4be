"""Image transforms (ALBEF recipe) built from torchvision.

Pre-training uses ``train_transform(image_res)`` (crop scale 0.2-1.0); fine-tuning uses
``train_transform(image_res, scale=(0.5, 1.0))``; evaluation uses ``test_transform(image_res)``.
"""

from __future__ import annotations

import torch
from torchvision import transforms
from torchvision.transforms import InterpolationMode

__all__ = ["ALBEF_MEAN", "ALBEF_STD", "ALBEF_RANDAUG_OPS", "AlbefRandAugment", "train_transform",
           "test_transform"]

# CLIP's statistics, which ALBEF (and hence GRIT-VLP) normalise with.
ALBEF_MEAN = (0.48145466, 0.4578275, 0.40821073)
ALBEF_STD = (0.26862954, 0.26130258, 0.27577711)

# ALBEF's RandAugment op set: torchvision's minus every op that changes hue or saturation
# (Color, Contrast, Posterize, Solarize), because captions name colours.
ALBEF_RANDAUG_OPS = ("Identity", "AutoContrast", "Equalize", "Brightness", "Sharpness",
                     "ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")

# ALBEF shifts by at most 10 px on its 256 px crops; torchvision's default (150/331 of the side)
# would push small objects out of a 64 px synthetic image.
_TRANSLATE_FRACTION = 10.0 / 256.0


class AlbefRandAugment(transforms.RandAugment):
    """torchvision RandAugment restricted to ALBEF's ops; magnitude m of 10 levels as in ALBEF."""

    def __init__(self, num_ops: int = 2, magnitude: int = 7, num_levels: int = 10,
                 fill: tuple[int, int, int] = (128, 128, 128)):
        # num_levels + 1 bins make bin m equal to m / num_levels of each op's maximum, ALBEF's scale.
        super().__init__(num_ops=num_ops, magnitude=magnitude, num_magnitude_bins=num_levels + 1,
                         interpolation=InterpolationMode.BILINEAR, fill=list(fill))

    def _augmentation_space(self, num_bins: int,
                            image_size: tuple[int, int]) -> dict[str, tuple[torch.Tensor, bool]]:
        space = super()._augmentation_space(num_bins, image_size)
        space["TranslateX"] = (torch.linspace(0.0, _TRANSLATE_FRACTION * image_size[1], num_bins), True)
        space["TranslateY"] = (torch.linspace(0.0, _TRANSLATE_FRACTION * image_size[0], num_bins), True)
        return {name: space[name] for name in ALBEF_RANDAUG_OPS}


def _to_normalized_tensor() -> list:
    return [transforms.ToTensor(), transforms.Normalize(ALBEF_MEAN, ALBEF_STD)]


def train_transform(image_res: int, scale: tuple[float, float] = (0.2, 1.0), hflip: bool = True,
                    randaugment: bool = True) -> transforms.Compose:
    """PIL image -> Tensor (3, image_res, image_res): random resized crop, flip, RandAugment, normalise.

    ``hflip`` defaults to True as in ALBEF, but a horizontal flip swaps "left of" and "right of",
    so configs for data with spatial captions (the synthetic set) should turn it off.
    """
    ops: list = [transforms.RandomResizedCrop(image_res, scale=scale,
                                              interpolation=InterpolationMode.BICUBIC)]
    if hflip:
        ops.append(transforms.RandomHorizontalFlip())
    if randaugment:
        ops.append(AlbefRandAugment(num_ops=2, magnitude=7))
    return transforms.Compose(ops + _to_normalized_tensor())


def test_transform(image_res: int) -> transforms.Compose:
    """PIL image -> Tensor (3, image_res, image_res): bicubic resize without crop, normalise."""
    return transforms.Compose(
        [transforms.Resize((image_res, image_res), interpolation=InterpolationMode.BICUBIC)]
        + _to_normalized_tensor()
    )
