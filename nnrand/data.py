"""Datasets for the training harness: a procedurally generated default and CIFAR-10/100 from their archives.

Every dataset is held whole as uint8 tensors (N, 3, 32, 32) so it can sit on the GPU; normalisation,
augmentation and shuffling are batched tensor ops with their own seeds.

``synthetic`` (the default; code, not files)
    Ten shape families drawn on a coloured background, 32x32 RGB:

        0 disc   1 ring   2 square   3 frame (hollow square)   4 triangle   5 cross (plus)
        6 stripes (a disc filled with a grating)   7 bar (thin ellipse)   8 pair (two small discs)
        9 half_disc

    Each image: the shape's signed distance field, anti-aliased over one pixel, at a random centre
    (+-OFFSET px), radius (RADIUS px), rotation (any angle) and aspect ratio (ASPECT), painted in a random
    foreground colour kept at least MIN_CONTRAST from the background where a few redraws allow it. The
    background is a colour from a ten-colour palette with per-image jitter and a linear gradient.
    Then, independently per image: with probability MORPH_P a second shape of another class is blended
    into the mask with weight MORPH_ALPHA (the label stays the first class: these are the ambiguous
    examples); with probability OCCLUDE_P an opaque rectangle of random colour covers part of the image;
    global contrast/brightness jitter; Gaussian pixel noise of per-image sigma NOISE_SIGMA.

    Subgroups: the palette colour is the *background cue*. In the majority (group 0) the background is
    palette[class]; in the minority (group 1) it is the palette colour of another, random class.
    The minority is MINORITY["train"] of the training set and MINORITY["test"] of the test set, so a
    model that leans on the background cue loses accuracy on group 1 and per-group accuracy is
    measurable (training with ``augment(..., shuffle_channels=True)``, the CPU default of nnrand.train,
    takes the cue away). Groups refer to the drawn shape; training labels are then flipped to a random other
    class for LABEL_NOISE of the training images (the test labels are clean). ``Dataset.extra`` keeps
    the clean training labels (``train_true_y``), the palette index of each background (``*_cue``) and
    the morph flags (``*_morph``).

    Difficulty (H200, ResNet-18, 10 epochs, deterministic kernels, bench/dev/synthetic_difficulty.py):
    89.5% test top-1, 94.9% on the majority, 69.4% on the minority with these constants; a more
    saturated palette (0.4) or more occlusion and noise let the background cue win (61-70% overall,
    2% minority), a paler one (0.12) leaves little gap (95.2% / 90.4%).

    The generator draws everything from ``numpy.random.default_rng([seed, split])``, so the same seed
    gives the same bytes; 10k + 2k images take about 3 s on a 2-core CPU.

``digits`` (extra ``nnrand[data]``: scikit-learn; offline, the data ship inside the package)
    scikit-learn's handwritten digits (``sklearn.datasets.load_digits``, the test part of the UCI
    "Optical Recognition of Handwritten Digits" set, E. Alpaydin 1998): 1797 grey 8x8 images of digits
    0-9 with pixel values 0..16. Each is scaled to 0..255, upsampled 4x to 32x32 by bilinear
    interpolation (half-pixel centres, edges clamped, as ``F.interpolate(..., align_corners=False)``)
    in float64, rounded and copied into three equal channels: white ink on black.
    Split (fixed, not seeded): the file's first DIGITS_TRAIN = 1437 images train, the last 360 test,
    contiguous and unshuffled like scikit-learn's own examples (141-146 training and 33-37 test images
    per class). ``n_train`` / ``n_test`` take a seeded subset of each part, as for CIFAR.
    Subgroups, by a feature of the image: group 1 ("faint") are the images whose total ink (sum of
    the 8x8 values) is below the first quartile of their class's training images (thresholds from the
    training part, applied to both), group 0 the rest; about a quarter of each split. ``extra`` keeps
    the ink (``*_ink``) and the thresholds' class-wise values (``ink_threshold``, (10,)).

``cifar10`` / ``cifar100``
    Read from the python-version archives in ``data_dir`` (checked against their md5 before anything
    is unpickled) with ``tarfile`` + ``pickle``; optional download with an atomic write. ``n_train`` /
    ``n_test`` take a seeded subset (kept in archive order). Groups are unknown: all -1.
"""
from __future__ import annotations

import colorsys
import functools
import hashlib
import io
import os
import pickle
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

DATASETS = ("synthetic", "cifar10", "cifar100", "digits")
# Training and test images of the fixed datasets (the synthetic one draws as many as asked)
SPLIT_SIZES = {"cifar10": (50_000, 10_000), "cifar100": (50_000, 10_000), "digits": (1437, 360)}


class DatasetError(RuntimeError):
    """A dataset archive is missing, corrupt (md5 mismatch) or malformed."""


@dataclass
class Dataset:
    name: str
    classes: list[str]
    train_x: torch.Tensor  # (N, 3, 32, 32) uint8
    train_y: torch.Tensor  # (N,) int64
    test_x: torch.Tensor  # (M, 3, 32, 32) uint8
    test_y: torch.Tensor  # (M,) int64
    train_group: torch.Tensor  # (N,) int64: 0 majority, 1 minority, -1 unknown
    test_group: torch.Tensor  # (M,) int64
    mean: tuple[float, float, float]  # per channel, of train_x / 255
    std: tuple[float, float, float]
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # per-example side information

    def to(self, device) -> "Dataset":
        move = lambda t: t.to(device)  # noqa: E731
        return Dataset(self.name, list(self.classes), move(self.train_x), move(self.train_y),
                       move(self.test_x), move(self.test_y), move(self.train_group), move(self.test_group),
                       self.mean, self.std, {k: move(v) for k, v in self.extra.items()})

    @property
    def num_classes(self) -> int:
        return len(self.classes)


def load_dataset(name: str, *, data_dir: str | os.PathLike | None = None, seed: int = 0,
                 n_train: int | None = None, n_test: int | None = None, download: bool = False,
                 url: str | None = None) -> Dataset:
    """The dataset ``name`` (one of DATASETS) on the CPU. ``seed`` draws the synthetic images or the
    CIFAR/digits subset; ``download``/``url`` only concern CIFAR (see :func:`download_archive`)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid datasets: {', '.join(DATASETS)}")
    for arg, v in (("n_train", n_train), ("n_test", n_test)):
        if v is not None and v < 1:
            raise ValueError(f"{arg} must be >= 1, got {v}")
    if name == "synthetic":
        return _synthetic_memo(seed, N_TRAIN if n_train is None else n_train, N_TEST if n_test is None else n_test)
    if name == "digits":
        return load_digits_dataset(seed=seed, n_train=n_train, n_test=n_test)
    return load_cifar(name, data_dir=data_dir, seed=seed, n_train=n_train, n_test=n_test,
                      download=download, url=url)


# --------------------------------------------------------------------------------------------------
# Tensor ops used by the training loop


def _normalize_table(mean: tuple, std: tuple) -> torch.Tensor:
    levels = torch.arange(256, dtype=torch.float64) / 255.0
    m = torch.tensor(mean, dtype=torch.float64).view(3, 1)
    s = torch.tensor(std, dtype=torch.float64).view(3, 1)
    return ((levels.view(1, 256) - m) / s).to(torch.float32)  # (3, 256)


def normalize(x: torch.Tensor, ds: Dataset) -> torch.Tensor:
    """uint8 (N, 3, H, W) -> float32 (x / 255 - mean) / std, on x's device.

    A uint8 channel takes 256 values, so the result is a lookup in a table computed once in float64 on
    the CPU: the same bits on every device (torch's CUDA division by a scalar multiplies by the
    reciprocal, which rounds differently from the CPU's true division)."""
    table = _normalize_table(tuple(ds.mean), tuple(ds.std)).to(x.device)
    channel = torch.arange(3, device=x.device).view(1, 3, 1, 1)
    return table[channel, x.long()]


def _reflect(i: torch.Tensor, size: int) -> torch.Tensor:
    # Mirror without repeating the edge pixel (numpy/torch "reflect"); valid while pad < size.
    i = i.abs()
    return torch.where(i > size - 1, 2 * (size - 1) - i, i)


def augment(x: torch.Tensor, generator: torch.Generator, *, pad: int = 4, mode: str = "reflect",
            flip: bool = True, shuffle_channels: bool = False) -> torch.Tensor:
    """Random crop (pad ``pad`` px with ``mode`` = "reflect" or "zero", crop back to H x W) and random
    horizontal flip of a batch (N, C, H, W) of any dtype; with ``shuffle_channels``, each image's channels
    also in a random order (one of the C! orders, uniformly): a colour cue such as the synthetic set's
    background palette then says nothing about the class, and only shape and contrast remain.

    The offsets and flips are drawn on the generator's device (3 draws per call, N values each; a 4th,
    N x C uniforms ranked per image, for the channel orders) and moved to x's device; the crop/flip/padding
    and the channel order are one gather of flat indices, so the output depends only on x and the generator
    state (a CPU generator gives the same augmentation for CPU and CUDA batches). Without
    ``shuffle_channels`` nothing more is drawn, so the generator's stream is that of a plain crop and flip.
    """
    _check_augment(x, pad, mode)
    n = x.shape[0]
    gdev = generator.device
    oy = torch.randint(0, 2 * pad + 1, (n,), generator=generator, device=gdev)
    ox = torch.randint(0, 2 * pad + 1, (n,), generator=generator, device=gdev)
    fl = torch.randint(0, 2, (n,), generator=generator, device=gdev).bool()
    channels = None
    if shuffle_channels:
        u = torch.rand((n, x.shape[1]), generator=generator, device=gdev)
        channels = torch.argsort(u, dim=1, stable=True)
    return crop_flip(x, oy, ox, fl if flip else torch.zeros_like(fl), pad=pad, mode=mode, channels=channels)


# splitmix64: golden-ratio increment and finaliser multipliers, as signed int64 (torch has no uint64
# arithmetic; int64 multiplication wraps mod 2**64 like uint64, and shifts are made logical by masking)
def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MUL1, _MUL2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * _MUL1
    z = (z ^ _shr(z, 27)) * _MUL2
    return z ^ _shr(z, 31)


def sample_draws(index: torch.Tensor, seed: int, epoch: int, *, pad: int = 4, flip: bool = True):
    """Crop offsets and flips keyed by each image's dataset index: (oy, ox, flip), each (N,) on index's
    device.

    A pure function of (seed, epoch, index): an image gets the same augmentation whichever batch, micro-
    batch, rank or world size it lands in. Counter-based (the splitmix64 finaliser of key ^ index * golden
    ratio), in integer arithmetic, so every device computes the same values and nothing depends on how
    many draws came before; no host round trip."""
    key = _signed(noise_key(seed, epoch))
    h = _mix64(index.to(torch.int64) * _GOLDEN ^ key)
    oy = (h & 0xFFFF) % (2 * pad + 1)
    ox = (_shr(h, 16) & 0xFFFF) % (2 * pad + 1)
    fl = (_shr(h, 32) & 1).bool() & flip
    return oy, ox, fl


def noise_key(seed: int, epoch: int) -> int:
    """A 64-bit key from (seed, epoch) (NumPy SeedSequence)."""
    return int(np.random.SeedSequence([int(seed), int(epoch)]).generate_state(1, np.uint64)[0])


def channel_orders(index: torch.Tensor, seed: int, epoch: int, channels: int) -> torch.Tensor:
    """Each image's channel order keyed by its dataset index: (N, channels) int64, row i a permutation of
    range(channels) (output channel j reads input channel row[j]). As :func:`sample_draws`, a pure
    function of (seed, epoch, index): one splitmix64 word per (image, channel) from a key distinct from the
    crop's, ranked per image (stable; a tie, probability ~2^-64, keeps channel order)."""
    key = _signed(noise_key(seed, epoch)) ^ _GOLDEN
    j = torch.arange(1, channels + 1, device=index.device, dtype=torch.int64)
    h = _mix64((index.to(torch.int64)[:, None] * _GOLDEN ^ key) + j[None, :] * _MUL2)
    return torch.argsort(h, dim=1, stable=True)


def augment_indexed(x: torch.Tensor, index: torch.Tensor, seed: int, epoch: int, *, pad: int = 4,
                    mode: str = "reflect", flip: bool = True, shuffle_channels: bool = False) -> torch.Tensor:
    """:func:`augment` with each image's crop, flip and (``shuffle_channels``) channel order keyed by its
    dataset index (:func:`sample_draws`, :func:`channel_orders`)."""
    _check_augment(x, pad, mode)
    if index.shape != (x.shape[0],):
        raise ValueError(f"augment_indexed: index must have shape ({x.shape[0]},), got {tuple(index.shape)}")
    channels = channel_orders(index, seed, epoch, x.shape[1]) if shuffle_channels else None
    return crop_flip(x, *sample_draws(index, seed, epoch, pad=pad, flip=flip), pad=pad, mode=mode, channels=channels)


def _check_augment(x: torch.Tensor, pad: int, mode: str) -> None:
    if x.ndim != 4:
        raise ValueError(f"augment: expected x of shape (N, C, H, W), got {tuple(x.shape)}")
    if mode not in ("reflect", "zero"):
        raise ValueError(f"augment: mode must be 'reflect' or 'zero', got {mode!r}")
    if not 0 <= pad < min(x.shape[2], x.shape[3]):
        raise ValueError(f"augment: pad must be in [0, {min(x.shape[2], x.shape[3])}), got {pad}")


def crop_flip(x: torch.Tensor, oy: torch.Tensor, ox: torch.Tensor, fl: torch.Tensor, *, pad: int,
              mode: str, channels: torch.Tensor | None = None) -> torch.Tensor:
    """Crop image i at offset (oy[i], ox[i]) of its padded copy, mirrored where fl[i], and with output
    channel j read from input channel channels[i, j] where ``channels`` (N, C) is given: one gather, per
    image independent of the others."""
    n, c, h, w = x.shape
    oy, ox, fl = oy.to(x.device), ox.to(x.device), fl.to(x.device)
    ar_h = torch.arange(h, device=x.device)
    ar_w = torch.arange(w, device=x.device)
    rows = oy[:, None] + ar_h[None, :] - pad  # (N, H) source row of each output row
    cols = ox[:, None] + torch.where(fl[:, None], w - 1 - ar_w[None, :], ar_w[None, :]) - pad
    if mode == "reflect":
        rows, cols = _reflect(rows, h), _reflect(cols, w)
    else:
        valid = ((rows >= 0) & (rows < h))[:, :, None] & ((cols >= 0) & (cols < w))[:, None, :]
        rows, cols = rows.clamp(0, h - 1), cols.clamp(0, w - 1)
    pix = (rows[:, :, None] * w + cols[:, None, :]).view(n, 1, h * w)
    if channels is None:
        out = x.reshape(n, c, h * w).gather(2, pix.expand(n, c, h * w)).view(n, c, h, w)
    else:
        src = channels.to(x.device)[:, :, None] * (h * w) + pix  # (N, C, H*W) flat indices into each image
        out = x.reshape(n, c * h * w).gather(1, src.view(n, c * h * w)).view(n, c, h, w)
    if mode == "zero":   # +0 (a product with the mask would give -0.0 for negative float pixels)
        out = out.masked_fill(~valid[:, None], 0)
    return out


def epoch_order(n: int, epoch: int, seed: int) -> torch.LongTensor:
    """The batch order of epoch ``epoch``: a permutation of range(n) from a CPU generator seeded by
    (seed, epoch) alone, so a run resumed at any epoch reproduces it."""
    g = torch.Generator(device="cpu")
    g.manual_seed(noise_key(seed, epoch))
    return torch.randperm(n, generator=g)


def channel_stats(x: torch.Tensor) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """Per-channel mean and standard deviation of x / 255, accumulated in float64."""
    v = x.to(torch.float64).div_(255.0).transpose(0, 1).reshape(x.shape[1], -1)
    mean = v.mean(dim=1)
    std = v.std(dim=1, unbiased=False)
    return tuple(float(m) for m in mean), tuple(float(s) for s in std)


# --------------------------------------------------------------------------------------------------
# Synthetic: hyper-parameters (pixels unless stated)

N_TRAIN, N_TEST = 10_000, 2_000
SYNTH_CLASSES = ["disc", "ring", "square", "frame", "triangle", "cross", "stripes", "bar", "pair",
                 "half_disc"]
SIZE = 32
MINORITY = {"train": 0.05, "test": 0.20}  # fraction whose background cue names another class
LABEL_NOISE = 0.03  # fraction of training labels flipped to a random other class
MORPH_P = 0.12  # fraction with a second shape blended in
MORPH_ALPHA = (0.2, 0.5)  # blend weight of the second shape
OCCLUDE_P = 0.15  # fraction with an opaque rectangle
OCCLUDE_SIDE = (5, 13)  # rectangle side, px (uniform integer, inclusive-exclusive)
OFFSET = 6.0  # shape centre within +-OFFSET px of the image centre
RADIUS = (6.0, 11.0)  # shape radius, px
ASPECT = (0.8, 1.25)  # u/v stretch
MIN_CONTRAST = 0.35  # Euclidean RGB distance (0..1 units) between foreground and background colours
BG_JITTER = 0.08  # per-channel background colour jitter, +- (0..1 units)
BG_GRADIENT = 0.12  # background gradient amplitude across the image (0..1 units)
CONTRAST = (0.75, 1.2)  # global contrast factor
BRIGHTNESS = 0.08  # global brightness shift, +-
NOISE_SIGMA = (0.02, 0.06)  # per-image Gaussian noise sigma (0..1 units)
CHUNK = 2048  # images rendered at once (bounds memory to ~50 MB)

PALETTE_SATURATION = 0.2  # HSV saturation of the background palette: the salience of the cue
PALETTE_VALUE = 0.72
# Background palette: ten evenly spaced hues. At this saturation, neighbouring hues overlap once jitter,
# contrast and noise are applied, so the cue is strong but not readable from the colour alone.
PALETTE = np.array([colorsys.hsv_to_rgb(i / 10, PALETTE_SATURATION, PALETTE_VALUE) for i in range(10)],
                   dtype=np.float32)


# --------------------------------------------------------------------------------------------------
# Synthetic: shapes as signed distance fields in unit coordinates (negative inside; radius 1 ~ RADIUS)


def _box(u, v, half):
    return np.maximum(np.abs(u), np.abs(v)) - half


def _sdf(cls: int, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    r = np.sqrt(u * u + v * v)
    if cls == 0:  # disc
        return r - 0.85
    if cls == 1:  # ring
        return np.abs(r - 0.72) - 0.26
    if cls == 2:  # square
        return _box(u, v, 0.75)
    if cls == 3:  # frame
        return np.abs(_box(u, v, 0.66)) - 0.2
    if cls == 4:  # equilateral triangle, circumradius 1: three half-planes at inradius 0.5
        d = v - 0.5
        for a in (np.pi * 7 / 6, np.pi * 11 / 6):
            d = np.maximum(d, np.cos(a) * u + np.sin(a) * v - 0.5)
        return d
    if cls == 5:  # cross
        return np.minimum(np.maximum(np.abs(u) - 0.95, np.abs(v) - 0.27),
                          np.maximum(np.abs(v) - 0.95, np.abs(u) - 0.27))
    if cls == 6:  # stripes: a disc cut by a grating of period 0.5
        period = 0.5
        grating = (np.abs(np.mod(u / period, 1.0) - 0.5) - 0.25) * period
        return np.maximum(r - 0.95, grating)
    if cls == 7:  # bar: ellipse 1 x 0.33 (distance scaled to the minor axis)
        return (np.sqrt(u * u + (v / 0.33) ** 2) - 1.0) * 0.33
    if cls == 8:  # pair of discs
        return np.minimum(np.sqrt((u - 0.55) ** 2 + v * v), np.sqrt((u + 0.55) ** 2 + v * v)) - 0.42
    if cls == 9:  # half disc, flat side at v = -0.35
        w = v + 0.35
        return np.maximum(np.sqrt(u * u + w * w) - 1.0, -w)
    raise ValueError(cls)


def _masks(cls: np.ndarray, u: np.ndarray, v: np.ndarray, radius: np.ndarray) -> np.ndarray:
    """Anti-aliased coverage in [0, 1] of shape cls[i] on image i: one pixel ramp across the edge."""
    m = np.empty_like(u)
    for c in range(len(SYNTH_CLASSES)):
        sel = cls == c
        if sel.any():
            m[sel] = np.clip(0.5 - _sdf(c, u[sel], v[sel]) * radius[sel, None, None], 0.0, 1.0)
    return m


def _render(rng: np.random.Generator, shape_cls: np.ndarray, bg_cls: np.ndarray):
    """uint8 images (k, 3, 32, 32) and their morph flags for the given shape and background classes."""
    k = len(shape_cls)
    f32 = np.float32
    grid = np.arange(SIZE, dtype=f32) + f32(0.5 - SIZE / 2)  # pixel centres, image centre at 0
    cy, cx = (rng.uniform(-OFFSET, OFFSET, (2, k))).astype(f32)
    radius = rng.uniform(*RADIUS, k).astype(f32)
    theta = rng.uniform(0, 2 * np.pi, k).astype(f32)
    aspect = np.exp(rng.uniform(np.log(ASPECT[0]), np.log(ASPECT[1]), k)).astype(f32)
    dx = grid[None, None, :] - cx[:, None, None]
    dy = grid[None, :, None] - cy[:, None, None]
    c, s = np.cos(theta)[:, None, None], np.sin(theta)[:, None, None]
    u = (c * dx + s * dy) / (radius * aspect)[:, None, None]
    v = (c * dy - s * dx) * (aspect / radius)[:, None, None]
    mask = _masks(shape_cls, u, v, radius)

    morph = rng.random(k) < MORPH_P
    other = (shape_cls + rng.integers(1, len(SYNTH_CLASSES), k)) % len(SYNTH_CLASSES)
    alpha = rng.uniform(*MORPH_ALPHA, k).astype(f32)
    if morph.any():
        m2 = _masks(other[morph], u[morph], v[morph], radius[morph])
        a = alpha[morph, None, None]
        mask[morph] = (1 - a) * mask[morph] + a * m2

    bg = PALETTE[bg_cls] + rng.uniform(-BG_JITTER, BG_JITTER, (k, 3)).astype(f32)
    gdir = rng.uniform(0, 2 * np.pi, k).astype(f32)
    gamp = rng.uniform(0, BG_GRADIENT, k).astype(f32)
    ramp = (np.cos(gdir)[:, None, None] * dx + np.sin(gdir)[:, None, None] * dy) / f32(SIZE)
    background = bg[:, :, None, None] + (gamp[:, None, None] * ramp)[:, None]

    fg = rng.random((k, 3), dtype=f32)
    for _ in range(4):  # redraw foregrounds too close to the background; the rare survivors stay hard
        close = np.linalg.norm(fg - bg, axis=1) < MIN_CONTRAST
        fg[close] = rng.random((int(close.sum()), 3), dtype=f32)
    img = background + (fg[:, :, None, None] - background) * mask[:, None]

    occ = rng.random(k) < OCCLUDE_P
    oh, ow = rng.integers(*OCCLUDE_SIDE, (2, k))
    oy, ox = rng.integers(0, SIZE, (2, k))
    ocol = rng.random((k, 3), dtype=f32)
    ar = np.arange(SIZE)[None, :]

    def span(centre, side):  # (k, SIZE): pixels within the rectangle's extent along one axis
        return (ar >= centre[:, None] - side[:, None] // 2) & (ar < centre[:, None] + (side[:, None] + 1) // 2)

    inside = span(oy, oh)[:, :, None] & span(ox, ow)[:, None, :] & occ[:, None, None]
    img = np.where(inside[:, None], ocol[:, :, None, None], img)

    contrast = rng.uniform(*CONTRAST, k).astype(f32)[:, None, None, None]
    bright = rng.uniform(-BRIGHTNESS, BRIGHTNESS, k).astype(f32)[:, None, None, None]
    sigma = rng.uniform(*NOISE_SIGMA, k).astype(f32)[:, None, None, None]
    img = (img - f32(0.5)) * contrast + f32(0.5) + bright
    img = img + sigma * rng.standard_normal(img.shape, dtype=f32)
    return np.rint(np.clip(img, 0.0, 1.0) * f32(255)).astype(np.uint8), morph


def _synthetic_split(seed: int, split: str, n: int):
    rng = np.random.default_rng([seed, 0 if split == "train" else 1])
    n_cls = len(SYNTH_CLASSES)
    shape_cls = rng.permutation(np.arange(n) % n_cls)  # balanced classes
    minority = rng.random(n) < MINORITY[split]
    bg_cls = np.where(minority, (shape_cls + rng.integers(1, n_cls, n)) % n_cls, shape_cls)
    x = np.empty((n, 3, SIZE, SIZE), dtype=np.uint8)
    morph = np.empty(n, dtype=bool)
    for i in range(0, n, CHUNK):
        x[i:i + CHUNK], morph[i:i + CHUNK] = _render(rng, shape_cls[i:i + CHUNK], bg_cls[i:i + CHUNK])
    y = shape_cls.copy()
    if split == "train":
        flipped = rng.random(n) < LABEL_NOISE
        y[flipped] = (y[flipped] + rng.integers(1, n_cls, int(flipped.sum()))) % n_cls
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(torch.int64)  # noqa: E731
    return torch.from_numpy(x), t(y), t(minority), t(shape_cls), t(bg_cls), torch.from_numpy(morph)


def synthetic(*, seed: int = 0, n_train: int = N_TRAIN, n_test: int = N_TEST) -> Dataset:
    train_x, train_y, train_g, train_true, train_cue, train_morph = _synthetic_split(seed, "train", n_train)
    test_x, test_y, test_g, _, test_cue, test_morph = _synthetic_split(seed, "test", n_test)
    mean, std = channel_stats(train_x)
    extra = {"train_true_y": train_true, "train_cue": train_cue, "train_morph": train_morph,
             "test_cue": test_cue, "test_morph": test_morph}
    return Dataset("synthetic", list(SYNTH_CLASSES), train_x, train_y, test_x, test_y, train_g, test_g,
                   mean, std, extra)


@functools.lru_cache(maxsize=2)
def _synthetic_memo(seed: int, n_train: int, n_test: int) -> Dataset:
    # A process that trains several members (a study worker) draws the set once: 10k + 10k images take
    # ~3 s. The tensors are shared between callers, which only ever read them.
    return synthetic(seed=seed, n_train=n_train, n_test=n_test)


# --------------------------------------------------------------------------------------------------
# CIFAR-10 / CIFAR-100 from the python-version archives

ARCHIVES = {"cifar10": "cifar-10-python.tar.gz", "cifar100": "cifar-100-python.tar.gz"}
MD5 = {"cifar10": "c58f30108f718f92721af3b95e74349a", "cifar100": "eb9058c3a382ffc7106e4002c42a8d85"}
BASE_URL = "https://www.cs.toronto.edu/~kriz/"
URL_ENV = "NNRAND_CIFAR_URL"  # a full archive URL (ending in .tar.gz) or a base URL to append the name to
DATA_DIR_ENV = "NNRAND_DATA_DIR"
DOWNLOAD_TIMEOUT = 60.0  # seconds without progress before a download is abandoned
# Members of each archive, matched by base name: (train files, test files, meta file, label key, names key)
_LAYOUT = {
    "cifar10": ([f"data_batch_{i}" for i in range(1, 6)], ["test_batch"], "batches.meta", "labels",
                "label_names"),
    "cifar100": (["train"], ["test"], "meta", "fine_labels", "fine_label_names"),
}


def default_data_dir() -> Path:
    return Path(os.environ.get(DATA_DIR_ENV) or Path.home() / ".cache" / "nnrand").expanduser()


def archive_url(name: str, url: str | None = None) -> str:
    url = url or os.environ.get(URL_ENV) or BASE_URL
    return url if url.endswith(".tar.gz") else url.rstrip("/") + "/" + ARCHIVES[name]


def md5sum(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download_archive(name: str, data_dir: str | os.PathLike | None = None, url: str | None = None) -> Path:
    """Fetch the archive of ``name`` into data_dir: streamed to a temporary file beside the target, md5
    checked, then renamed into place, so an interrupted or corrupt download never leaves a file under
    the archive's name. The URL is ``url``, else $NNRAND_CIFAR_URL, else the Toronto original."""
    data_dir = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    data_dir.mkdir(parents=True, exist_ok=True)
    target = data_dir / ARCHIVES[name]
    src = archive_url(name, url)
    fd, tmp = tempfile.mkstemp(prefix=f".{ARCHIVES[name]}.", suffix=".part", dir=data_dir)
    try:
        h = hashlib.md5()
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(src, timeout=DOWNLOAD_TIMEOUT) as resp:
            for block in iter(lambda: resp.read(1 << 20), b""):
                h.update(block)
                out.write(block)
        if h.hexdigest() != MD5[name]:
            raise DatasetError(f"download of {src} has md5 {h.hexdigest()}, expected {MD5[name]}; "
                               f"nothing was written to {target}")
        os.replace(tmp, target)
    except OSError as e:  # urllib's URLError/HTTPError are OSErrors
        raise DatasetError(f"could not download {src} to {target}: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _key(d: dict, key: str):
    # The original archives are Python 2 pickles: read with encoding="bytes", their keys are bytes.
    if key.encode() in d:
        return d[key.encode()]
    if key in d:
        return d[key]
    raise KeyError(key)


def _read_archive(name: str, path: Path):
    train_files, test_files, meta_file, label_key, names_key = _LAYOUT[name]
    wanted = set(train_files + test_files + [meta_file])
    found: dict[str, dict] = {}
    try:
        with tarfile.open(path, "r:gz") as tar:
            for member in tar.getmembers():
                base = member.name.rsplit("/", 1)[-1]
                if member.isfile() and base in wanted:
                    # Safe to unpickle: the archive's md5 matched the published one before we got here.
                    found[base] = pickle.load(io.BytesIO(tar.extractfile(member).read()), encoding="bytes")
    except (tarfile.TarError, OSError, EOFError, pickle.UnpicklingError) as e:
        raise DatasetError(f"{path} is not a readable {name} archive: {e}") from e
    missing = sorted(wanted - set(found))
    if missing:
        raise DatasetError(f"{path} lacks {', '.join(missing)}; is it the python version of {name}?")

    def stack(files):
        try:
            x = np.concatenate([np.asarray(_key(found[f], "data"), dtype=np.uint8) for f in files])
            y = np.concatenate([np.asarray(_key(found[f], label_key), dtype=np.int64) for f in files])
        except KeyError as e:
            raise DatasetError(f"{path}: a batch lacks the key {e}") from e
        if x.ndim != 2 or x.shape[1] != 3 * 32 * 32 or len(x) != len(y):
            raise DatasetError(f"{path}: expected (N, 3072) uint8 data with N labels, got data {x.shape} "
                               f"and {len(y)} labels")
        return torch.from_numpy(x.reshape(-1, 3, 32, 32).copy()), torch.from_numpy(y)

    train, test = stack(train_files), stack(test_files)
    classes = [c.decode() if isinstance(c, bytes) else str(c) for c in _key(found[meta_file], names_key)]
    for split, (_, y) in (("train", train), ("test", test)):
        if len(y) and (int(y.min()) < 0 or int(y.max()) >= len(classes)):
            raise DatasetError(f"{path}: {split} labels outside [0, {len(classes)})")
    return train, test, classes


def _subset(n_total: int, n: int | None, seed: int, split: int) -> torch.Tensor | None:
    if n is None or n >= n_total:
        return None
    g = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, split]).generate_state(1)[0]))
    return torch.randperm(n_total, generator=g)[:n].sort().values


def load_cifar(name: str, *, data_dir=None, seed: int = 0, n_train: int | None = None,
               n_test: int | None = None, download: bool = False, url: str | None = None) -> Dataset:
    data_dir = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    path = data_dir / ARCHIVES[name]
    if not path.is_file():
        if not download:
            raise DatasetError(
                f"{name}: {path} not found. Put {ARCHIVES[name]} (md5 {MD5[name]}, from "
                f"{archive_url(name)}) in {data_dir}, or download it (--download; download=True from Python) "
                f"(data_dir defaults to ${DATA_DIR_ENV} or ~/.cache/nnrand).")
        download_archive(name, data_dir, url)
    digest = md5sum(path)
    if digest != MD5[name]:
        raise DatasetError(f"{name}: {path} has md5 {digest}, expected {MD5[name]}: the file is corrupt "
                           f"or not the python version; delete it and download it again.")
    (train_x, train_y), (test_x, test_y), classes = _read_archive(name, path)
    for which, (n, split) in enumerate(((n_train, "train"), (n_test, "test"))):
        idx = _subset(len(train_y) if split == "train" else len(test_y), n, seed, which)
        if idx is not None and split == "train":
            train_x, train_y = train_x[idx], train_y[idx]
        elif idx is not None:
            test_x, test_y = test_x[idx], test_y[idx]
    mean, std = channel_stats(train_x)
    unknown = lambda y: torch.full_like(y, -1)  # noqa: E731
    return Dataset(name, classes, train_x, train_y, test_x, test_y, unknown(train_y), unknown(test_y),
                   mean, std)


# --------------------------------------------------------------------------------------------------
# scikit-learn's handwritten digits (optional extra nnrand[data])

DIGITS_TRAIN = 1437  # the first 1437 of the 1797 images train, the last 360 test (fixed; ~80/20)
DIGITS_SCALE = 4  # 8x8 -> 32x32
DIGITS_FAINT_QUANTILE = 0.25  # group 1: total ink below this quantile of the class's training images


class MissingExtraError(DatasetError):
    """A dataset needs a package of an optional extra that is not installed."""


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(images (1797, 8, 8) float64 in 0..16, labels (1797,) int64) from scikit-learn."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise MissingExtraError(f"--dataset digits needs scikit-learn, which is not importable here ({e}); "
                                "install the optional extra: pip install 'nnrand[data]'") from None
    bunch = load_digits()
    images, labels = np.asarray(bunch.images, dtype=np.float64), np.asarray(bunch.target, dtype=np.int64)
    if images.shape != (1797, 8, 8) or labels.shape != (1797,) or images.min() < 0 or images.max() > 16:
        raise DatasetError(f"scikit-learn's load_digits returned images {images.shape} in "
                           f"[{images.min()}, {images.max()}] and labels {labels.shape}; expected (1797, 8, 8) "
                           "in [0, 16] and (1797,)")
    return images, labels


def _upsample_matrix(n: int, scale: int) -> np.ndarray:
    """(n * scale, n) linear interpolation weights with half-pixel centres and clamped edges: output
    pixel o samples the input at (o + 0.5) / scale - 0.5 (align_corners=False)."""
    src = np.clip((np.arange(n * scale) + 0.5) / scale - 0.5, 0, n - 1)
    lo = np.floor(src).astype(np.int64)
    hi = np.minimum(lo + 1, n - 1)
    frac = src - lo
    m = np.zeros((n * scale, n))
    m[np.arange(n * scale), lo] += 1 - frac
    m[np.arange(n * scale), hi] += frac
    return m


def digits_to_rgb32(images: np.ndarray) -> torch.Tensor:
    """(N, 8, 8) values 0..16 -> (N, 3, 32, 32) uint8: scaled to 0..255, bilinear 4x upsampling in
    float64 (a convex combination, so the result stays in 0..255), rounded half to even, grey to RGB."""
    m = _upsample_matrix(images.shape[-1], DIGITS_SCALE)
    big = np.einsum("oh,nhw,pw->nop", m, images * (255.0 / 16.0), m)
    grey = np.clip(np.rint(big), 0, 255).astype(np.uint8)
    return torch.from_numpy(np.ascontiguousarray(np.repeat(grey[:, None], 3, axis=1)))


def load_digits_dataset(*, seed: int = 0, n_train: int | None = None, n_test: int | None = None) -> Dataset:
    """scikit-learn's digits as a :class:`Dataset` (see the module docstring: split, groups)."""
    images, labels = _digits_arrays()
    ink = images.sum(axis=(1, 2))
    train, test = np.arange(DIGITS_TRAIN), np.arange(DIGITS_TRAIN, len(labels))
    threshold = np.array([np.quantile(ink[train][labels[train] == c], DIGITS_FAINT_QUANTILE) for c in range(10)])
    faint = (ink < threshold[labels]).astype(np.int64)
    for which, n in enumerate((n_train, n_test)):
        split = train if which == 0 else test
        idx = _subset(len(split), n, seed, which)
        if idx is not None:
            split = split[idx.numpy()]
        if which == 0:
            train = split
        else:
            test = split
    x = digits_to_rgb32(images)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    train_x, test_x = x[t(train)], x[t(test)]
    mean, std = channel_stats(train_x)
    extra = {"train_ink": t(ink[train]), "test_ink": t(ink[test]), "ink_threshold": t(threshold)}
    return Dataset("digits", [str(c) for c in range(10)], train_x, t(labels[train]), test_x, t(labels[test]),
                   t(faint[train]), t(faint[test]), mean, std, extra)
