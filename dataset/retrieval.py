"""Image-text retrieval data (COCO / Flickr30k in ALBEF's json format)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor

from .bad_samples import blank_image
from .pretrain import PLACEHOLDER_CAPTION, ImageCaptionDataset, check_caption
from .utils import EmptyTextError, pre_caption, read_image, resolve_image

__all__ = ["RetrievalEvalDataset", "RetrievalTrainDataset"]


class RetrievalTrainDataset(ImageCaptionDataset):
    """``[{"image", "caption", "image_id"}]`` -> (image Tensor (3,H,W), caption str, img_id int).

    ``img_id`` is a contiguous 0..K-1 id per distinct json image_id (in order of first appearance),
    so captions of the same image are known positives of each other.
    """

    required = ("image", "caption", "image_id")

    def __init__(self, files: str | Sequence[str], transform: Callable, image_root: str = "",
                 max_words: int = 30) -> None:
        super().__init__(files, transform, image_root, max_words)
        self.img_ids: dict = {}
        for ann in self.ann:
            self.img_ids.setdefault(ann["image_id"], len(self.img_ids))

    @staticmethod
    def check_entry(entry: dict) -> None:
        """A caption as check_caption wants it, and a hashable image_id (it keys img_ids)."""
        check_caption(entry)
        try:
            hash(entry["image_id"])
        except TypeError:
            raise ValueError(f"'image_id' must be a string or an int, got {entry['image_id']!r}") from None

    def __getitem__(self, index: int) -> tuple[Tensor, str, int]:
        image, caption = self.image_and_caption(index)
        return image, caption, self.img_ids[self.ann[index]["image_id"]]

    def placeholder(self, index: int) -> tuple[Tensor, str, int]:
        """An item of the right shapes standing in for bad entry `index` (masked out of every loss).

        Its img_id, -1 - index, is no real image's (those are 0..K-1) and no other placeholder's, so
        the model's image-id positives never join it to a real pair or another bad one.
        """
        return blank_image(self.transform), PLACEHOLDER_CAPTION, -1 - index


class RetrievalEvalDataset(ImageCaptionDataset):
    """``[{"image", "caption": [str, ...]}]`` -> (image Tensor (3,H,W), image index int).

    Texts are flattened into ``.text`` (cleaned); ``.img2txt[i]`` lists image i's text indices and
    ``.txt2img[t]`` is text t's image index; ``.image`` holds the json image paths (image i is entry i).
    A caption empty after cleaning is a bad sample: it is left out of all three (text indices stay
    contiguous) and named in ``.bad_texts``; an entry whose captions are all empty keeps its image
    with an empty ``img2txt`` list (the evaluation leaves such an image out, models.retrieval_eval).
    An unreadable image is only found when read (ImageReadError; see dataset.bad_samples).
    """

    def __init__(self, files: str | Sequence[str], transform: Callable, image_root: str = "",
                 max_words: int = 30) -> None:
        super().__init__(files, transform, image_root, max_words)
        self.text: list[str] = []
        self.image: list[str] = []
        self.img2txt: dict[int, list[int]] = {}
        self.txt2img: dict[int, int] = {}
        self.bad_texts: list[str] = []  # reasons, as dataset.bad_samples.SkipBadSamples words them
        for img_id, ann in enumerate(self.ann):
            self.image.append(ann["image"])
            captions = [ann["caption"]] if isinstance(ann["caption"], str) else ann["caption"]
            self.img2txt[img_id] = []
            for caption in captions:
                try:
                    text = pre_caption(caption, max_words)
                except EmptyTextError as err:
                    self.bad_texts.append(f"entry {img_id}: {err}")
                    continue
                self.txt2img[len(self.text)] = img_id
                self.img2txt[img_id].append(len(self.text))
                self.text.append(text)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        image = self.transform(read_image(resolve_image(self.image_root, self.image[index])))
        return image, index

    def placeholder(self, index: int) -> tuple[Tensor, int]:
        """An item of the right shapes standing in for unreadable image `index` (left out of the scores)."""
        return blank_image(self.transform), index
