"""Image-text retrieval data (COCO / Flickr30k in ALBEF's json format)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch.utils.data import Dataset

from .pretrain import check_caption, image_and_caption
from .utils import load_json_list, pre_caption, read_image, resolve_image

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


def _check_train(entry: dict) -> None:
    check_caption(entry)
    try:
        hash(entry["image_id"])
    except TypeError:
        raise ValueError(f"'image_id' must be a string or an int, got {entry['image_id']!r}") from None


class RetrievalEvalDataset(Dataset):
    """``[{"image", "caption": [str, ...]}]`` -> (image Tensor (3,H,W), image index int).

    Texts are flattened into ``.text`` (cleaned); ``.img2txt[i]`` lists image i's text indices and
    ``.txt2img[t]`` is text t's image index; ``.image`` holds the json image paths.
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
        for img_id, ann in enumerate(self.ann):
            self.image.append(ann["image"])
            captions = [ann["caption"]] if isinstance(ann["caption"], str) else ann["caption"]
            self.img2txt[img_id] = []
            for caption in captions:
                self.txt2img[len(self.text)] = img_id
                self.img2txt[img_id].append(len(self.text))
                self.text.append(pre_caption(caption, max_words))

    def __len__(self) -> int:
        return len(self.image)

    def __getitem__(self, index: int):
        image = self.transform(read_image(resolve_image(self.image_root, self.image[index])))
        return image, index
