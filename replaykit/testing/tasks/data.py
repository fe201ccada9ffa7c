"""Deterministic synthetic data for the four tasks, and the batch layouts a scenario can ask for.

Every sample is one scene: a bright square of one class in one grid cell on a noisy image,
with a box, an angle, keypoints and a mask derived from it. Each task reads the targets its
loss needs. All tensors are generated up front from a seeded ``torch.Generator``; loaders
have no workers and no shuffling, so two runs with one seed see the same batches.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from functools import partial

import lightning as L
import torch
from torch.utils.data import DataLoader, Sampler

TASK_NAMES = ("detection", "pose", "oriented", "segmentation")
LAYOUTS = ("contiguous", "channels_last", "partial_last", "partial_between", "empty_val")

IMAGE_SIZE = 16
CHANNELS = 3
NUM_CLASSES = 3
NUM_KEYPOINTS = 4
STRIDE = 4  # the dense heads' output stride: a 16 px image gives a 4 x 4 grid

Batch = dict[str, torch.Tensor]


class FixedBatches(Sampler[list[int]]):
    """A batch sampler over consecutive indices with the given batch sizes, in order.

    Under data parallelism rank ``rank`` of ``world`` takes every ``world``-th batch.
    """

    def __init__(self, sizes: Sequence[int], rank: int = 0, world: int = 1) -> None:
        self.sizes = list(sizes)
        self.rank, self.world = rank, world

    def __iter__(self) -> Iterator[list[int]]:
        start = 0
        for i, size in enumerate(self.sizes):
            if i % self.world == self.rank:
                yield list(range(start, start + size))
            start += size

    def __len__(self) -> int:
        return len(range(self.rank, len(self.sizes), self.world))


def batch_sizes(n: int, batch_size: int, layout: str) -> list[int]:
    """The training batch sizes of ``n`` samples under ``layout``.

    ``partial_last`` needs ``n % batch_size != 0``; ``partial_between`` puts that remainder
    at batch index 2 (or earlier for short runs) with full batches after it; every other
    layout needs ``n`` to be a multiple of ``batch_size``.
    """
    _check_layout(layout)
    full, rest = divmod(n, batch_size)
    if layout in ("partial_last", "partial_between"):
        if rest == 0 or full < 1 or (layout == "partial_between" and full < 2):
            raise ValueError(
                f"layout {layout!r} needs a partial batch between full ones: got n_train={n}, "
                f"batch_size={batch_size}"
            )
        sizes = [batch_size] * full
        sizes.insert(len(sizes) if layout == "partial_last" else min(2, full - 1), rest)
        return sizes
    if rest:
        raise ValueError(
            f"layout {layout!r} has full batches only: n_train={n} is not a multiple of "
            f"batch_size={batch_size}"
        )
    return [batch_size] * full


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")


def _check_task(task: str) -> None:
    if task not in TASK_NAMES:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASK_NAMES)}")


def make_scenes(
    task: str,
    n: int,
    generator: torch.Generator,
    image_size: int = IMAGE_SIZE,
    num_classes: int = NUM_CLASSES,
    num_keypoints: int = NUM_KEYPOINTS,
) -> Batch:
    """``n`` samples of ``task``: ``image`` (n, 3, S, S) plus the task's targets."""
    _check_task(task)
    g = generator
    grid = image_size // STRIDE
    cls = torch.randint(num_classes, (n,), generator=g)
    row = torch.randint(grid, (n,), generator=g)
    col = torch.randint(grid, (n,), generator=g)
    box = torch.rand(n, 4, generator=g)  # (dx, dy, w, h) in the cell, normalized
    angle = (torch.rand(n, generator=g) - 0.5) * math.pi  # [-pi/2, pi/2)
    kpt = torch.rand(n, num_keypoints, 2, generator=g)
    vis = (torch.rand(n, num_keypoints, generator=g) < 0.8).float()
    image = 0.1 * torch.randn(n, CHANNELS, image_size, image_size, generator=g)

    idx = torch.arange(n)
    one_hot = torch.nn.functional.one_hot(cls, num_classes).float()  # (n, K)
    cell = torch.zeros(n, grid, grid)
    cell[idx, row, col] = 1.0
    pixels = cell.repeat_interleave(STRIDE, 1).repeat_interleave(STRIDE, 2)  # (n, S, S)
    image[idx, cls % CHANNELS] += pixels[idx]
    out: Batch = {"image": image}
    if task == "detection":
        # one-to-many positives: the object's cell and its 4-neighbours; one-to-one: the cell
        kernel = torch.tensor([[[[0.0, 1, 0], [1, 1, 1], [0, 1, 0]]]])
        cross = (torch.nn.functional.conv2d(cell[:, None], kernel, padding=1) > 0).float()
        out["o2m_cls"] = one_hot[:, :, None, None] * cross
        out["o2o_cls"] = one_hot[:, :, None, None] * cell[:, None]
        out["box"] = box[:, :, None, None].expand(n, 4, grid, grid).clone()
    elif task == "oriented":
        out["cls"] = one_hot[:, :, None, None] * cell[:, None]
        out["box"] = box[:, :, None, None].expand(n, 4, grid, grid).clone()
        out["angle"] = angle[:, None, None].expand(n, grid, grid).clone()
    elif task == "pose":
        out["kpt"] = kpt
        out["vis"] = vis
    else:  # segmentation
        out["mask"] = one_hot[:, :, None, None] * pixels[:, None]
        out["present"] = one_hot
    return out


def _collate(data: Batch, channels_last: bool, indices: list[int]) -> Batch:
    index = torch.tensor(indices, dtype=torch.long)
    batch = {key: value[index] for key, value in data.items()}
    if channels_last:
        batch["image"] = batch["image"].contiguous(memory_format=torch.channels_last)
    return batch


class SyntheticDataModule(L.LightningDataModule):
    """Deterministic train/val data for one task, batched according to ``layout``.

    ``n_train`` defaults to six batches (five and a half for the partial layouts, whose
    batch sizes are then ``[B]*5 + [B//2]`` or ``[B, B, B//2, B, B, B]``); ``n_val`` to two
    batches, and to 0 for ``empty_val``. With ``channels_last`` the images arrive in the
    channels-last memory format (the task's own ``channels_last`` option converts too).
    """

    def __init__(
        self,
        task: str,
        n_train: int | None = None,
        batch_size: int = 4,
        layout: str = "contiguous",
        seed: int = 0,
        n_val: int | None = None,
        *,
        image_size: int = IMAGE_SIZE,
        num_classes: int = NUM_CLASSES,
        num_keypoints: int = NUM_KEYPOINTS,
    ) -> None:
        super().__init__()
        _check_task(task)
        _check_layout(layout)
        partial_layout = layout in ("partial_last", "partial_between")
        if partial_layout and batch_size < 2:
            raise ValueError(f"layout {layout!r} needs batch_size >= 2")
        if n_train is None:
            n_train = 5 * batch_size + batch_size // 2 if partial_layout else 6 * batch_size
        if n_val is None:
            n_val = 0 if layout == "empty_val" else 2 * batch_size
        if layout == "empty_val" and n_val != 0:
            raise ValueError("layout 'empty_val' needs n_val=0")
        self.task, self.layout, self.seed = task, layout, seed
        self.batch_size = batch_size
        self.channels_last = layout == "channels_last"
        self.train_sizes = batch_sizes(n_train, batch_size, layout)
        geometry = {
            "image_size": image_size,
            "num_classes": num_classes,
            "num_keypoints": num_keypoints,
        }
        self.train_data = make_scenes(task, n_train, _generator(seed), **geometry)
        self.val_data = make_scenes(task, n_val, _generator(seed + 1_000_003), **geometry)

    @property
    def n_train(self) -> int:
        return sum(self.train_sizes)

    @property
    def n_val(self) -> int:
        return len(self.val_data["image"])

    def _shard(self) -> tuple[int, int]:
        """This process's rank and the world size (0, 1 outside distributed training)."""
        trainer = getattr(self, "trainer", None)
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def _loader(self, data: Batch, sizes: Sequence[int]) -> DataLoader:
        return DataLoader(
            range(sum(sizes)),
            batch_sampler=FixedBatches(sizes, *self._shard()),
            collate_fn=partial(_collate, data, self.channels_last),
            num_workers=0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_data, self.train_sizes)

    def val_dataloader(self) -> DataLoader:
        # An empty set gives an empty loader; Lightning warns that its length is zero and
        # skips the validation loop.
        full, rest = divmod(self.n_val, self.batch_size)
        return self._loader(self.val_data, [self.batch_size] * full + ([rest] if rest else []))


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
