"""Data: synthetic generator semantics and determinism, CIFAR archives (format, md5, download), scikit-learn's
digits, tensor ops."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import http.server
import io
import pickle
import tarfile
import threading
import time

import numpy as np
import pytest
import torch

from nnrand import data
from nnrand.data import (
    DATASETS,
    Dataset,
    DatasetError,
    augment,
    epoch_order,
    load_dataset,
    normalize,
)
from tests.helpers import bitwise_equal

SMALL = dict(n_train=2000, n_test=1000)  # small synthetic sets: ~0.5 s each


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def dataset_digest(ds: Dataset) -> str:
    return digest(ds.train_x, ds.train_y, ds.test_x, ds.test_y, ds.train_group, ds.test_group,
                  *[ds.extra[k] for k in sorted(ds.extra)]) + repr((ds.mean, ds.std))


@pytest.fixture(scope="module")
def synth() -> Dataset:
    return load_dataset("synthetic", seed=0, **SMALL)


def binomial_ok(count: int, n: int, p: float, sigmas: float = 5.0) -> bool:
    return abs(count - n * p) <= sigmas * (n * p * (1 - p)) ** 0.5


# --------------------------------------------------------------------------------------------------
# Synthetic


def test_synthetic_layout(synth):
    ds = synth
    assert ds.name == "synthetic" and ds.classes == data.SYNTH_CLASSES and ds.num_classes == 10
    assert ds.train_x.shape == (2000, 3, 32, 32) and ds.test_x.shape == (1000, 3, 32, 32)
    for t in (ds.train_x, ds.test_x):
        assert t.dtype == torch.uint8 and t.is_contiguous()
    for t, n in ((ds.train_y, 2000), (ds.test_y, 1000), (ds.train_group, 2000), (ds.test_group, 1000)):
        assert t.shape == (n,) and t.dtype == torch.int64
    assert set(ds.train_group.unique().tolist()) == {0, 1} and set(ds.test_group.unique().tolist()) == {0, 1}
    # Shape classes are exactly balanced (labels differ from them only by the label noise).
    assert torch.bincount(ds.extra["train_true_y"], minlength=10).tolist() == [200] * 10
    assert torch.bincount(ds.test_y, minlength=10).tolist() == [100] * 10


def test_synthetic_fractions(synth):
    ds = synth
    assert binomial_ok(int(ds.train_group.sum()), 2000, data.MINORITY["train"])
    assert binomial_ok(int(ds.test_group.sum()), 1000, data.MINORITY["test"])
    flipped = int((ds.train_y != ds.extra["train_true_y"]).sum())
    assert flipped > 0 and binomial_ok(flipped, 2000, data.LABEL_NOISE)
    assert binomial_ok(int(ds.extra["train_morph"].sum()), 2000, data.MORPH_P)
    assert "test_true_y" not in ds.extra  # test labels are clean


def _border_palette_index(x: torch.Tensor) -> torch.Tensor:
    """Nearest palette colour to the median of each image's one-pixel border (the background cue)."""
    border = torch.cat([x[:, :, 0, :], x[:, :, -1, :], x[:, :, 1:-1, 0], x[:, :, 1:-1, -1]], dim=2)
    med = border.to(torch.float64).median(dim=2).values / 255  # (N, 3)
    pal = torch.from_numpy(data.PALETTE).to(torch.float64)
    return torch.cdist(med, pal).argmin(dim=1)


def test_synthetic_background_cue(synth):
    """Group 1 exactly where the background's palette colour names another class than the shape."""
    ds = synth
    assert bitwise_equal(ds.test_group, (ds.extra["test_cue"] != ds.test_y).long())
    assert bitwise_equal(ds.train_group, (ds.extra["train_cue"] != ds.extra["train_true_y"]).long())


def test_synthetic_background_cue_in_pixels(synth):
    """The cue is in the pixels: the border median's nearest palette colour is the drawn background's
    far more often than chance (0.1). The palette is pale (saturation 0.2, so that shapes, not the
    background, carry most of the signal) and jitter, gradient, contrast, noise and occluders blur
    neighbouring hues, so the read-back is imperfect: 0.46 measured on 2000 test images (seed 0), 0.48 in
    group 1. In group 1 it follows the cue, not the label (0.06 measured, chance 0.1)."""
    ds = synth
    read = _border_palette_index(ds.test_x)
    hit = (read == ds.extra["test_cue"]).double()
    assert hit.mean() > 0.3, hit.mean()
    g1 = ds.test_group == 1
    assert hit[g1].mean() > 0.3 and (read[g1] == ds.test_y[g1]).double().mean() < 0.1


def test_synthetic_images_vary(synth):
    """No constant images; every class has pixels beyond its background (a shape was drawn)."""
    x = synth.train_x.to(torch.int16)
    span = x.flatten(1).max(dim=1).values - x.flatten(1).min(dim=1).values
    assert (span > 60).all()
    # Pairwise distinct images.
    assert len({digest(img) for img in synth.test_x}) == len(synth.test_x)


def stats_rtol(n: int) -> float:
    """Two float64 computations (torch's and numpy's, in their own summation orders) of one channel's mean
    or population std over n values in [0, 1]: each within (n + 5) u relative of the exact value to first
    order (a sum of n terms n u; the centring, squaring, division and square root a few u more; u = 2^-53),
    so within twice that of each other."""
    return 2 * (n + 5) * 2.0**-53


def test_synthetic_stats(synth):
    x = synth.train_x.numpy().astype(np.float64) / 255
    mean = x.mean(axis=(0, 2, 3))
    std = x.std(axis=(0, 2, 3))
    np.testing.assert_allclose(synth.mean, mean, rtol=stats_rtol(x[:, 0].size))
    np.testing.assert_allclose(synth.std, std, rtol=stats_rtol(x[:, 0].size))
    assert all(isinstance(v, float) for v in synth.mean + synth.std)


def test_synthetic_deterministic(synth):
    again = data.synthetic(seed=0, **SMALL)  # drawn anew, not the per-process memo load_dataset keeps
    assert again is not synth and dataset_digest(again) == dataset_digest(synth)
    other = load_dataset("synthetic", seed=1, **SMALL)
    assert digest(other.train_x) != digest(synth.train_x) and digest(other.test_x) != digest(synth.test_x)
    # Train and test come from distinct streams: no test image is a training image.
    assert not set(map(digest, synth.test_x[:100])) & set(map(digest, synth.train_x))


def test_synthetic_memo_per_arguments():
    """load_dataset draws a synthetic set once per (seed, sizes) in a process; other arguments, another set."""
    a = load_dataset("synthetic", seed=4, n_train=30, n_test=20)
    assert load_dataset("synthetic", seed=4, n_train=30, n_test=20) is a
    assert load_dataset("synthetic", seed=4, n_train=31, n_test=20) is not a


def test_synthetic_test_independent_of_train_size():
    a = load_dataset("synthetic", seed=3, n_train=50, n_test=40)
    b = load_dataset("synthetic", seed=3, n_train=70, n_test=40)
    assert bitwise_equal(a.test_x, b.test_x) and bitwise_equal(a.test_y, b.test_y)


def test_global_rng_untouched():
    torch.manual_seed(5)
    np.random.seed(5)
    load_dataset("synthetic", n_train=20, n_test=20)
    t, n = torch.rand(3), np.random.rand(3)
    torch.manual_seed(5)
    np.random.seed(5)
    assert bitwise_equal(t, torch.rand(3)) and np.array_equal(n, np.random.rand(3))


@pytest.mark.slow
def test_synthetic_full_size():
    """The default size (10k + 2k images) builds; how long it takes is a benchmark's question."""
    ds = load_dataset("synthetic")
    assert ds.train_x.shape == (10_000, 3, 32, 32) and ds.test_x.shape == (2_000, 3, 32, 32)
    assert ds.train_y.shape == (10_000,) and int(ds.train_y.max()) == len(ds.classes) - 1


def test_bad_name():
    with pytest.raises(ValueError, match="synthetic, cifar10, cifar100, digits"):
        load_dataset("mnist")
    assert DATASETS == ("synthetic", "cifar10", "cifar100", "digits")


def test_bad_sizes():
    with pytest.raises(ValueError, match="n_train"):
        load_dataset("synthetic", n_train=0)


# --------------------------------------------------------------------------------------------------
# Tensor ops


def test_normalize(synth):
    x = synth.train_x[:256]
    out = normalize(x, synth)
    assert out.dtype == torch.float32 and out.shape == x.shape
    mean = torch.tensor(synth.mean, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(synth.std, dtype=torch.float64).view(1, 3, 1, 1)
    ref = (x.to(torch.float64) / 255 - mean) / std
    # Three float32 roundings (x/255, the subtraction, the division) of values |.| <= ~3 plus the
    # rounding of mean and std to float32: a few ulp at the largest magnitude.
    eps = torch.finfo(torch.float32).eps
    bound = 8 * eps * (ref.abs().max() + mean.abs().max() / std.min())
    assert (out.double() - ref).abs().max() <= bound
    # Over the whole set: each element is within the bound above of the exact normalisation (with the
    # largest |ref| any pixel value gives), whose mean is 0 and population std 1 up to float64 summation
    # error (n terms, n u relative, u = 2^-53); a mean, and a population std, move by at most the largest
    # elementwise difference.
    top = max(max(m, 1 - m) / s for m, s in zip(synth.mean, synth.std))
    n = synth.train_x.numel() // 3
    bound_full = 8 * eps * (top + mean.abs().max() / std.min()) + 2 * n * 2.0**-53 * top
    full = normalize(synth.train_x, synth).double()
    assert full.mean(dim=(0, 2, 3)).abs().max() <= bound_full
    assert (full.std(dim=(0, 2, 3), unbiased=False) - 1).abs().max() <= bound_full


def _augment_reference(x: torch.Tensor, seed: int, pad: int, mode: str) -> torch.Tensor:
    """np.pad + slice + flip, one image at a time, with the offsets drawn in augment's documented order
    (row offsets, column offsets, flips) from a fresh generator with the same seed."""
    g = torch.Generator().manual_seed(seed)
    n = len(x)
    oy = torch.randint(0, 2 * pad + 1, (n,), generator=g)
    ox = torch.randint(0, 2 * pad + 1, (n,), generator=g)
    fl = torch.randint(0, 2, (n,), generator=g)
    xs = x.numpy()
    npmode = "reflect" if mode == "reflect" else "constant"
    out = np.empty_like(xs)
    h, w = xs.shape[2:]
    for i in range(n):
        p = np.pad(xs[i], ((0, 0), (pad, pad), (pad, pad)), mode=npmode)
        crop = p[:, oy[i]:oy[i] + h, ox[i]:ox[i] + w]
        out[i] = crop[:, :, ::-1] if fl[i] else crop
    return torch.from_numpy(out)


@pytest.mark.parametrize("mode", ["reflect", "zero"])
@pytest.mark.parametrize("pad,shape", [(4, (64, 3, 32, 32)), (2, (9, 2, 7, 5)), (1, (3, 1, 2, 2))])
def test_augment_matches_reference(mode, pad, shape):
    x = torch.randint(1, 256, shape, generator=torch.Generator().manual_seed(7), dtype=torch.int64)
    x = x.to(torch.uint8)
    out = augment(x, torch.Generator().manual_seed(11), pad=pad, mode=mode)
    ref = _augment_reference(x, 11, pad, mode)
    bad = (out != ref).nonzero()
    assert out.dtype == x.dtype and out.shape == x.shape
    assert bad.numel() == 0, f"first mismatches at {bad[:5].tolist()}"


def test_augment_deterministic_and_varies(synth):
    x = synth.train_x[:128]
    outs = [augment(x, torch.Generator().manual_seed(3)) for _ in range(20)]
    assert all(bitwise_equal(outs[0], o) for o in outs[1:])
    other = augment(x, torch.Generator().manual_seed(4))
    assert not torch.equal(outs[0], other)
    # Consecutive calls advance the generator: two batches differ.
    g = torch.Generator().manual_seed(3)
    first, second = augment(x, g), augment(x, g)
    assert bitwise_equal(first, outs[0]) and not torch.equal(first, second)
    # Crops and flips really happen: most images change.
    assert (outs[0] != x).flatten(1).any(dim=1).double().mean() > 0.8


@pytest.mark.parametrize("shape", [(64, 3, 32, 32), (9, 4, 7, 5)])
def test_augment_shuffle_channels_permutes_each_image(shape):
    """With shuffle_channels: the crop and flip of the plain call (the same first three draws), then each
    image's channels in the order a 4th draw ranks, output channel j = input channel order[i, j]."""
    n, c = shape[:2]
    x = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(7), dtype=torch.int64).to(torch.uint8)
    out = augment(x, torch.Generator().manual_seed(11), shuffle_channels=True)
    plain = augment(x, torch.Generator().manual_seed(11))
    g = torch.Generator().manual_seed(11)
    for _ in range(3):
        torch.randint(0, 2, (n,), generator=g)  # the crop and flip draws (the ranges do not change the stream)
    order = torch.argsort(torch.rand((n, c), generator=g), dim=1, stable=True)
    want = torch.stack([plain[i, order[i]] for i in range(n)])
    assert bitwise_equal(out, want)
    assert all(sorted(row.tolist()) == list(range(c)) for row in order)
    assert (order != torch.arange(c)).any(dim=1).double().mean() > 0.5  # most images reordered


def test_augment_shuffle_channels_off_leaves_the_stream():
    """Without the option nothing more is drawn: the next call sees the same generator state."""
    x = torch.zeros(8, 3, 8, 8, dtype=torch.uint8)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    augment(x, g1)
    for _ in range(3):
        torch.randint(0, 2, (8,), generator=g2)
    assert bitwise_equal(g1.get_state(), g2.get_state())


def test_augment_float_and_identity():
    x = torch.randn(5, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    assert bitwise_equal(augment(x, torch.Generator().manual_seed(1), pad=0, flip=False), x)
    y = augment(x, torch.Generator().manual_seed(1), pad=2, mode="zero")
    assert y.dtype == torch.float32
    ref = _augment_reference(x, 1, 2, "zero")
    assert bitwise_equal(y, ref)
    with pytest.raises(ValueError, match="mode"):
        augment(x, torch.Generator(), mode="wrap")
    with pytest.raises(ValueError, match="pad"):
        augment(x, torch.Generator(), pad=8)


def test_epoch_order():
    a = epoch_order(1000, 3, 0)
    assert a.dtype == torch.int64 and bitwise_equal(a.sort().values, torch.arange(1000))
    torch.manual_seed(99)  # the global RNG has no say
    assert bitwise_equal(a, epoch_order(1000, 3, 0))
    assert not torch.equal(a, epoch_order(1000, 4, 0))
    assert not torch.equal(a, epoch_order(1000, 3, 1))
    # A resumed run asks for epoch k directly and gets what an uninterrupted run got.
    full = [epoch_order(50, e, 2) for e in range(5)]
    assert bitwise_equal(full[4], epoch_order(50, 4, 2))


def test_dataset_to(synth):
    moved = synth.to("meta")  # moves every tensor without needing a GPU
    for name in ("train_x", "train_y", "test_x", "test_y", "train_group", "test_group"):
        assert getattr(moved, name).device.type == "meta"
        assert getattr(moved, name).shape == getattr(synth, name).shape
    assert all(t.device.type == "meta" for t in moved.extra.values())
    assert moved.mean == synth.mean and moved.classes == synth.classes
    assert synth.train_x.device.type == "cpu"


@pytest.mark.gpu
def test_gpu_resident_ops_match_cpu(synth):
    ds = synth.to("cuda")
    assert ds.train_x.is_cuda and ds.test_group.is_cuda
    cpu = augment(synth.train_x[:256], torch.Generator().manual_seed(5))
    gpu = augment(ds.train_x[:256], torch.Generator().manual_seed(5))  # CPU generator, CUDA batch
    assert bitwise_equal(cpu, gpu.cpu())
    outs = [augment(ds.train_x[:256], torch.Generator(device="cuda").manual_seed(5)) for _ in range(20)]
    assert all(bitwise_equal(outs[0], o) for o in outs[1:])
    n_cpu = normalize(synth.train_x[:256], synth)
    n_gpu = normalize(ds.train_x[:256], ds)
    assert n_gpu.is_cuda and bitwise_equal(n_cpu, n_gpu.cpu())


# --------------------------------------------------------------------------------------------------
# CIFAR archives, built here in the exact layout of the published python-version tarballs

def _tar_add(tar: tarfile.TarFile, name: str, obj) -> None:
    blob = pickle.dumps(obj, protocol=2)
    info = tarfile.TarInfo(name)
    info.size = len(blob)
    info.mtime = 0
    tar.addfile(info, io.BytesIO(blob))


def make_cifar_archive(path, name: str, n_per_batch: int = 20, seed: int = 0, drop: str | None = None):
    """Write a small archive shaped like the original (bytes keys as Python 2 pickles read with
    encoding="bytes" have) and return the arrays it holds: ((train_x, train_y), (test_x, test_y), classes)."""
    rng = np.random.default_rng(seed)
    n_cls = 10 if name == "cifar10" else 100
    classes = [f"class_{i}" for i in range(n_cls)]

    def batch(k):
        return rng.integers(0, 256, (k, 3072), dtype=np.uint8), rng.integers(0, n_cls, k).tolist()

    with tarfile.open(path, "w:gz") as tar:
        if name == "cifar10":
            top, label_key = "cifar-10-batches-py/", b"labels"
            train = [batch(n_per_batch) for _ in range(5)]
            test = batch(n_per_batch)
            files = {f"data_batch_{i + 1}": b for i, b in enumerate(train)}
            files["test_batch"] = test
            meta = ("batches.meta", {b"label_names": [c.encode() for c in classes], b"num_vis": 3072})
        else:
            top, label_key = "cifar-100-python/", b"fine_labels"
            train = [batch(5 * n_per_batch)]
            test = batch(n_per_batch)
            files = {"train": train[0], "test": test}
            meta = ("meta", {b"fine_label_names": [c.encode() for c in classes],
                             b"coarse_label_names": [b"coarse"] * 20})
        for fname, (x, y) in files.items():
            if fname == drop:
                continue
            d = {b"batch_label": fname.encode(), b"data": x, label_key: y, b"filenames": [b"f.png"] * len(y)}
            if name == "cifar100":
                d[b"coarse_labels"] = [v // 5 for v in y]
            _tar_add(tar, top + fname, d)
        _tar_add(tar, top + meta[0], meta[1])
    train_x = np.concatenate([b[0] for b in train]).reshape(-1, 3, 32, 32)
    train_y = np.concatenate([b[1] for b in train])
    return (train_x, train_y), (test[0].reshape(-1, 3, 32, 32), np.array(test[1])), classes


@pytest.fixture
def archive(tmp_path, monkeypatch, request):
    name = getattr(request, "param", "cifar10")
    path = tmp_path / data.ARCHIVES[name]
    arrays = make_cifar_archive(path, name)
    monkeypatch.setitem(data.MD5, name, data.md5sum(path))
    return name, path, arrays


@pytest.mark.parametrize("archive", ["cifar10", "cifar100"], indirect=True)
def test_cifar_load(archive):
    name, path, ((tx, ty), (vx, vy), classes) = archive
    ds = load_dataset(name, data_dir=path.parent)
    assert ds.name == name and ds.classes == classes
    assert ds.train_x.dtype == torch.uint8 and ds.train_y.dtype == torch.int64
    assert np.array_equal(ds.train_x.numpy(), tx) and np.array_equal(ds.train_y.numpy(), ty)
    assert np.array_equal(ds.test_x.numpy(), vx) and np.array_equal(ds.test_y.numpy(), vy)
    assert (ds.train_group == -1).all() and (ds.test_group == -1).all()
    assert ds.train_group.shape == ds.train_y.shape and ds.test_group.shape == ds.test_y.shape
    np.testing.assert_allclose(ds.mean, (tx / 255).mean(axis=(0, 2, 3)), rtol=stats_rtol(tx[:, 0].size))
    np.testing.assert_allclose(ds.std, (tx / 255).std(axis=(0, 2, 3)), rtol=stats_rtol(tx[:, 0].size))
    assert dataset_digest(load_dataset(name, data_dir=path.parent)) == dataset_digest(ds)


def test_cifar_subset(archive):
    name, path, ((tx, ty), _, _) = archive
    a = load_dataset(name, data_dir=path.parent, n_train=30, n_test=7, seed=1)
    assert a.train_x.shape == (30, 3, 32, 32) and a.test_x.shape == (7, 3, 32, 32)
    # Each subset row is a source row with its own label, in archive order.
    src = {digest(torch.from_numpy(tx[i])): i for i in range(len(tx))}
    idx = [src[digest(img)] for img in a.train_x]
    assert idx == sorted(idx) and len(set(idx)) == 30
    assert a.train_y.tolist() == ty[idx].tolist()
    b = load_dataset(name, data_dir=path.parent, n_train=30, n_test=7, seed=1)
    c = load_dataset(name, data_dir=path.parent, n_train=30, n_test=7, seed=2)
    assert dataset_digest(a) == dataset_digest(b) and digest(a.train_x) != digest(c.train_x)
    assert load_dataset(name, data_dir=path.parent, n_train=10_000).train_x.shape[0] == len(tx)


def test_cifar_missing(tmp_path):
    with pytest.raises(DatasetError) as e:
        load_dataset("cifar10", data_dir=tmp_path)
    msg = str(e.value)
    assert str(tmp_path / "cifar-10-python.tar.gz") in msg and "--download" in msg and "download=True" in msg
    assert data.MD5["cifar10"] in msg and "cs.toronto.edu" in msg


def test_data_dir_expands_the_home_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(data.DATA_DIR_ENV, "~/datasets")
    assert data.default_data_dir() == tmp_path / "datasets"
    with pytest.raises(DatasetError, match=str(tmp_path / "elsewhere")):
        load_dataset("cifar10", data_dir="~/elsewhere")


def test_cifar_real_md5_table():
    assert data.MD5 == {"cifar10": "c58f30108f718f92721af3b95e74349a",
                        "cifar100": "eb9058c3a382ffc7106e4002c42a8d85"}


def test_cifar_corrupt(archive):
    name, path, _ = archive
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    path.write_bytes(bytes(blob))
    with pytest.raises(DatasetError, match="md5") as e:
        load_dataset(name, data_dir=path.parent)
    assert str(path) in str(e.value)


def test_cifar_unpatched_md5_rejects_fake(tmp_path):
    make_cifar_archive(tmp_path / data.ARCHIVES["cifar100"], "cifar100")
    with pytest.raises(DatasetError, match="expected eb9058c3a382ffc7106e4002c42a8d85"):
        load_dataset("cifar100", data_dir=tmp_path)


def test_cifar_incomplete_archive(tmp_path, monkeypatch):
    path = tmp_path / data.ARCHIVES["cifar10"]
    make_cifar_archive(path, "cifar10", drop="test_batch")
    monkeypatch.setitem(data.MD5, "cifar10", data.md5sum(path))
    with pytest.raises(DatasetError, match="test_batch"):
        load_dataset("cifar10", data_dir=tmp_path)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serve(directory, lifetime_s: float = 30.0):
    """Serve ``directory`` on 127.0.0.1 from a daemon thread that stops by itself after ``lifetime_s``
    (or when the block exits, whichever is first)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(_QuietHandler, directory=str(directory)))
    server.timeout = 0.1
    stop = threading.Event()
    deadline = time.monotonic() + lifetime_s

    def loop():
        while not stop.is_set() and time.monotonic() < deadline:
            server.handle_request()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        stop.set()
        thread.join(timeout=5)
        server.server_close()


@pytest.fixture
def no_proxy(monkeypatch):
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")


@pytest.mark.parametrize("archive", ["cifar10", "cifar100"], indirect=True)
def test_cifar_download(archive, tmp_path_factory, no_proxy):
    name, path, ((tx, _), _, _) = archive
    dest = tmp_path_factory.mktemp("dest")
    with serve(path.parent) as base:
        ds = load_dataset(name, data_dir=dest, download=True, url=base + "/")
    assert np.array_equal(ds.train_x.numpy(), tx)
    assert sorted(p.name for p in dest.iterdir()) == [data.ARCHIVES[name]]  # no temporary file left
    assert (dest / data.ARCHIVES[name]).read_bytes() == path.read_bytes()


def test_cifar_download_env_url(archive, tmp_path_factory, no_proxy, monkeypatch):
    name, path, _ = archive
    dest = tmp_path_factory.mktemp("dest")
    with serve(path.parent) as base:
        monkeypatch.setenv(data.URL_ENV, f"{base}/{path.name}")  # full archive URL
        ds = load_dataset(name, data_dir=dest, download=True)
    assert ds.train_x.shape[0] == 100


def test_cifar_download_bad_md5_leaves_nothing(archive, tmp_path_factory, no_proxy, monkeypatch):
    name, path, _ = archive
    monkeypatch.setitem(data.MD5, name, "0" * 32)
    dest = tmp_path_factory.mktemp("dest")
    with serve(path.parent) as base, pytest.raises(DatasetError, match="md5"):
        load_dataset(name, data_dir=dest, download=True, url=base)
    assert list(dest.iterdir()) == []


def test_cifar_download_404(tmp_path, no_proxy):
    with serve(tmp_path) as base, pytest.raises(DatasetError, match="could not download"):
        data.download_archive("cifar10", tmp_path / "dest", url=base)
    assert list((tmp_path / "dest").iterdir()) == []


# --------------------------------------------------------------------------------------------------
# scikit-learn's digits (extra nnrand[data])


@pytest.fixture(scope="module")
def digits() -> Dataset:
    pytest.importorskip("sklearn", reason="--dataset digits needs scikit-learn (extra nnrand[data])")
    return load_dataset("digits")


def test_digits_layout_and_fixed_split(digits):
    from sklearn.datasets import load_digits

    ds = digits
    assert "digits" in DATASETS and ds.name == "digits" and ds.classes == [str(c) for c in range(10)]
    assert ds.train_x.shape == (data.DIGITS_TRAIN, 3, 32, 32) and ds.test_x.shape == (1797 - data.DIGITS_TRAIN, 3, 32, 32)
    assert ds.train_x.dtype == torch.uint8 and ds.train_y.dtype == torch.int64
    ref = load_digits()
    # the documented split: the first DIGITS_TRAIN images in file order train, the rest test
    assert ds.train_y.tolist() == ref.target[:data.DIGITS_TRAIN].tolist()
    assert ds.test_y.tolist() == ref.target[data.DIGITS_TRAIN:].tolist()
    assert bitwise_equal(ds.train_x[:, 0], ds.train_x[:, 1]) and bitwise_equal(ds.train_x[:, 0], ds.train_x[:, 2])
    assert min(torch.bincount(ds.test_y, minlength=10).tolist()) >= 30
    assert ds.mean == data.channel_stats(ds.train_x)[0] and len(set(ds.mean)) == 1


def test_digits_pixels_are_torch_bilinear_upsampling(digits):
    """The float64 matrix form equals torch's bilinear interpolation (align_corners=False) of the 8x8
    images scaled to 0..255, after rounding: both compute the same convex combinations in float64 (the
    weights are multiples of 1/8, exact), so a rounding difference could only come from a tie; none here."""
    from sklearn.datasets import load_digits

    images = torch.from_numpy(load_digits().images * (255.0 / 16.0))[:, None]
    ref = torch.nn.functional.interpolate(images, size=(32, 32), mode="bilinear", align_corners=False)
    ref = ref.round().clamp(0, 255).to(torch.uint8)[:, 0]
    assert bitwise_equal(digits.train_x[:, 0], ref[:data.DIGITS_TRAIN])
    assert bitwise_equal(digits.test_x[:, 0], ref[data.DIGITS_TRAIN:])
    # the ink of an 8x8 image survives the upsampling: top-left block of 4x4 output pixels ~ one input pixel
    assert int(digits.train_x.max()) == 255 and int(digits.train_x.min()) == 0


def test_digits_groups_are_faint_images(digits):
    ds = digits
    thr = ds.extra["ink_threshold"]
    assert bitwise_equal(ds.train_group, (ds.extra["train_ink"] < thr[ds.train_y]).long())
    assert bitwise_equal(ds.test_group, (ds.extra["test_ink"] < thr[ds.test_y]).long())
    # below a linearly interpolated first quartile lie at most floor(0.25 * (n - 1)) + 1 of n values
    for c in range(10):
        g = ds.train_group[ds.train_y == c]
        assert 0 < int(g.sum()) <= int(0.25 * (len(g) - 1)) + 1
    assert 0.1 < float(ds.test_group.float().mean()) < 0.4


def test_digits_subset_is_seeded_and_deterministic(digits):
    a = load_dataset("digits", seed=3, n_train=100, n_test=50)
    b = load_dataset("digits", seed=3, n_train=100, n_test=50)
    c = load_dataset("digits", seed=4, n_train=100, n_test=50)
    assert dataset_digest(a) == dataset_digest(b) != dataset_digest(c)
    assert a.train_x.shape[0] == 100 and a.test_y.shape == (50,)
    assert dataset_digest(load_dataset("digits")) == dataset_digest(digits)
    # a subset's images are images of the full split, with their labels and groups
    full = {bytes(x.numpy().tobytes()): (int(y), int(g)) for x, y, g in zip(digits.train_x, digits.train_y,
                                                                             digits.train_group)}
    for x, y, g in zip(a.train_x, a.train_y, a.train_group):
        assert full[bytes(x.numpy().tobytes())] == (int(y), int(g))


def test_digits_without_scikit_learn_names_the_extra(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_sklearn(name, *a, **k):
        if name == "sklearn" or name.startswith("sklearn."):
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_sklearn)
    with pytest.raises(DatasetError, match=r"nnrand\[data\]"):
        load_dataset("digits")
