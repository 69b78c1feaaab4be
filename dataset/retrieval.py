"""Image-text retrieval data (COCO / Flickr30k in ALBEF's json format)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch.utils.data import Dataset

from .bad_samples import blank_image
from .pretrain import PLACEHOLDER_CAPTION, check_caption, image_and_caption
from .utils import EmptyTextError, load_json_list, pre_caption, read_image, resolve_image

__all__ = ["RetrievalEvalDataset", "RetrievalTrainDataset"]


class RetrievalTrainDataset(Dataset):
    """``[{"image", "caption", "image_id"}]`` -> (image Tensor (3,H,W), caption str, img_id int).

    ``img_id`` is a contiguous 0..K-1 id per distinct json image_id (in order of first appearance),
    so captions of the same image are known positives of each other.
    """

    def __init__(self, files: str | Sequence[str], transform: Callable, image_root: str = "",
                 max_words: int = 30):
        self.ann = load_json_list(files, required=("image", "caption", "image_id"), check=_check_train)
        self.transform = transform
        self.image_root = image_root
        self.max_words = max_words
        self.img_ids: dict = {}
        for ann in self.ann:
            self.img_ids.setdefault(ann["image_id"], len(self.img_ids))

    def __len__(self) -> int:
        return len(self.ann)

    def __getitem__(self, index: int):
        ann = self.ann[index]
        image, caption = image_and_caption(ann, self.transform, self.image_root, self.max_words)
        return image, caption, self.img_ids[ann["image_id"]]

    def placeholder(self, index: int):
        """An item of the right shapes standing in for bad entry `index` (masked out of every loss).

        Its img_id, -1 - index, is no real image's (those are 0..K-1) and no other placeholder's, so
        the model's image-id positives never join it to a real pair or another bad one.
        """
        return blank_image(self.transform), PLACEHOLDER_CAPTION, -1 - index


def _check_train(entry: dict) -> None:
    check_caption(entry)
    try:
        hash(entry["image_id"])
    except TypeError:
        raise ValueError(f"'image_id' must be a string or an int, got {entry['image_id']!r}") from None


class RetrievalEvalDataset(Dataset):
    """``[{"image", "caption": [str, ...]}]`` -> (image Tensor (3,H,W), image index int).

    Texts are flattened into ``.text`` (cleaned); ``.img2txt[i]`` lists image i's text indices and
    ``.txt2img[t]`` is text t's image index; ``.image`` holds the json image paths (image i is entry i).
    A caption empty after cleaning is a bad sample: it is left out of all three (text indices stay
    contiguous) and named in ``.bad_texts``; an entry whose captions are all empty keeps its image
    with an empty ``img2txt`` list (the evaluation leaves such an image out, models.retrieval_eval).
    An unreadable image is only found when read (ImageReadError; see dataset.bad_samples).
    """

    def __init__(self, files: str | Sequence[str], transform: Callable, image_root: str = "",
                 max_words: int = 30):
        self.ann = load_json_list(files, required=("image", "caption"), check=check_caption)
        self.transform = transform
        self.image_root = image_root
        self.max_words = max_words
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

    def __len__(self) -> int:
        return len(self.image)

    def __getitem__(self, index: int):
        image = self.transform(read_image(resolve_image(self.image_root, self.image[index])))
        return image, index

    def placeholder(self, index: int):
        """An item of the right shapes standing in for unreadable image `index` (left out of the scores)."""
        return blank_image(self.transform), index
