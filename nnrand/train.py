"""Train a ResNet with chosen kernel variants in its backward pass, under controlled noise.

    python -m nnrand.train --kernel tree                 # CPU: small model, synthetic data, under a minute
    python -m nnrand.train --preset impl --members 4     # four members that differ only by atomics
    torchrun --nproc_per_node 2 -m nnrand.train --kernel tree --world-invariant   # same bits on 1, 2, 4 GPUs

``main(config) -> metrics`` runs every member of a run (a study calls it many times); ``cli()`` is the
only place that parses arguments. Sections: hyper-parameters, data, network, training, evaluation, run.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import socket
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import kernels
from nnrand import autotune, data, distributed, models, noise, routing, runio
from nnrand.fingerprint import fingerprint

# --------------------------------------------------------------------------------------------------
# Hyper-parameters (one place; units in comments). ``None`` means "the device default below".


@dataclass
class Config:
    # data and network
    model: str | None = None            # models.MODELS or torchvision:NAME / timm:NAME; CPU "small", CUDA "resnet18"
    image_size: int | None = None       # resize every batch to this square size (ImageNet-style models); None: 32
    dataset: str = "synthetic"          # data.DATASETS; "synthetic" needs no files and no network
    data_dir: str | None = None         # CIFAR archives (default ~/.cache/nnrand)
    download: bool = False              # fetch a missing CIFAR archive
    data_seed: int = 0                  # draws the synthetic images / the CIFAR subset (same for every member)
    n_train: int | None = None          # training images (None: device default; 0 < n)
    n_test: int | None = None           # test images
    # optimisation: SGD with momentum, linear warm-up then linear decay to 0, per step
    epochs: int | None = None           # passes over the training images
    batch_size: int | None = None       # images per step; the last partial batch of an epoch is dropped
    lr: float | None = None             # peak learning rate (per step, loss is the batch mean); 0.2 on both
    momentum: float = 0.9               # SGD momentum (nesterov)
    weight_decay: float = 5e-4          # L2 on every parameter, through SGD
    warmup_epochs: float = 0.5          # linear warm-up length, epochs (capped at half the run)
    # augmentation: random crop and flip always; each image's channels in a random order (colour says
    # nothing about the class) when on. None: the device default (CPU on, CUDA off)
    shuffle_channels: bool | None = None
    # kernel routing and noise
    preset: str = noise.DEFAULT_PRESET  # noise.PRESETS: control / algo / impl / algo+impl
    kernel: str | None = None           # routing family (tree / atomic / native / fastest-deterministic)
    kernel_ops: dict = field(default_factory=dict)  # per-op overrides {op: variant}
    autotune_plan: str | None = None    # a run's config.json whose per-shape conv choices to reuse (auto ops)
    seed: int = 0                       # base seed: "fixed" and "member" seeds derive from it
    init_seed: str | int | None = None  # "fixed" | "member" | int; None: the preset's
    order_seed: str | int | None = None
    aug_seed: str | int | None = None
    kernel_seed: str | int = noise.DEFAULT_KERNEL_SEED  # CPU atomic models only: "fresh" | "fixed" | "member" | int
    strict: bool = True                 # deterministic routing: an uncovered nondeterministic op is an error
    perturb_ulp: bool = False           # nextafter one weight before step 0
    perturb_index: int = 0              # which element of the flat parameter vector
    # run
    out: str = "runs"                   # run directory root
    name: str | None = None             # run directory name; None: from preset and routing
    members: int = 1                    # members of the run, member_000 ...
    first_member: int = 0               # index of the first member (a study can extend a run)
    device: str | None = None           # "cuda" when available, else "cpu"
    channels_last: bool = False         # model and activations in channels_last
    cuda_graph: bool = False            # capture forward + backward once, replay it every step (CUDA only)
    tf32: bool = False                  # TF32 for matmul and cuDNN conv (off: fp32 arithmetic)
    cudnn_benchmark: bool = False       # native/atomic only: cuDNN picks conv algorithms by timing (fastest native)
    cudnn_heuristic: str | None = None  # CUDA: "instant" | "b", cuDNN's heuristic, benchmark off (None: as started)
    amp: str | None = None              # "bf16" | "fp16": forward under torch.autocast (fp16 with a GradScaler)
    resume: bool = True                 # continue an unfinished member from its checkpoint
    save_epoch_weights: bool = False    # weights_epoch_XXX.pt per epoch
    eval_every: int = 1                 # test-set evaluation every this many epochs (and after the last)
    progress: bool = True               # tqdm bars
    report: bool = True                 # render report.md when the run's members are done
    interrupt_at_step: int | None = None  # behave as if Ctrl-C arrived after this global step (tests)
    # several processes (torchrun): plain DDP, or the world-size invariant step (nnrand.distributed)
    world_invariant: bool = False       # same bits on any power-of-two world size dividing batch/micro_batch
    micro_batch: int | None = None      # world-invariant: images per micro-batch (= BatchNorm's virtual batch)
    dist_timeout: float = 300.0         # seconds a collective waits for the other ranks before failing


DEVICE_DEFAULTS = {
    # 2 CPU cores, `time python3 -m nnrand.train --kernel tree --no-resume` (CPU order models in every
    # backward): 640 steps of batch 64 over 8192 images with channel shuffling at lr 0.2. The former
    # defaults (4096 images, no shuffling, lr 0.1) ended at 65% test top-1 in ~32 s: with colour a class
    # cue, the model takes that shortcut, and 80% needed about four times the steps. Shuffling each image's
    # channels takes the cue away; with BatchNorm's order model compiled (kernels/bn_bwd.py), 640 steps fit
    # in the minute and learn the shapes (README.md has the figures).
    "cpu": {"model": "small", "epochs": 5, "batch_size": 64, "lr": 0.2, "n_train": 8192, "n_test": 512,
            "shuffle_channels": True},
    # H200: ResNet-18 on the whole synthetic set (10k/2k).
    "cuda": {"model": "resnet18", "epochs": 10, "batch_size": 128, "lr": 0.2, "n_train": None, "n_test": None,
             "shuffle_channels": False},
}
EVAL_BATCH = 500      # images per evaluation forward
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
NESTEROV = True
# Config fields that may differ between a run and its resumption.
RESUMABLE_CHANGES = ("out", "resume", "progress", "report", "interrupt_at_step", "members", "first_member",
                     "data_dir", "download", "dist_timeout", "eval_every", "name", "save_epoch_weights")
# Micro-batches per global batch when --world-invariant has no --micro-batch: runs on 1, 2 and 4
# processes then give the same bits.
DEFAULT_MICRO_BATCHES = 4


class ConfigError(ValueError):
    """A bad option value, detected before anything trains."""


def resolve(cfg: Config) -> Config:
    """Fill device defaults and the preset; validate names and values. Raises ConfigError."""
    cfg = dataclasses.replace(cfg, kernel_ops=dict(cfg.kernel_ops))
    if cfg.device is None:
        cfg.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(cfg.device)
    except RuntimeError as e:
        raise ConfigError(f"--device: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available here")
    if dev.type not in DEVICE_DEFAULTS:
        raise ConfigError(f"--device must be cpu or cuda, got {cfg.device!r}")
    for key, value in DEVICE_DEFAULTS[dev.type].items():
        if getattr(cfg, key) is None:
            setattr(cfg, key, value)
    if cfg.preset not in noise.PRESETS:
        raise ConfigError(f"unknown preset {cfg.preset!r}; valid: {', '.join(noise.PRESETS)}")
    preset = noise.PRESETS[cfg.preset]
    cfg.kernel = cfg.kernel or preset["family"]
    for src in ("init", "order", "aug"):
        attr = f"{src}_seed"
        setattr(cfg, attr, preset[src] if getattr(cfg, attr) is None else getattr(cfg, attr))
    try:
        for src in noise.SOURCES:
            setattr(cfg, f"{src}_seed", noise.check_spec(src, getattr(cfg, f"{src}_seed")))
        routing.resolve(cfg.kernel, cfg.kernel_ops)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not models.is_known(cfg.model):
        raise ConfigError(f"unknown model {cfg.model!r}; valid: {', '.join(models.MODELS)}, or torchvision:NAME / "
                          "timm:NAME (extra nnrand[vision])")
    if cfg.image_size is not None and cfg.image_size < 8:
        raise ConfigError(f"--image-size must be >= 8, got {cfg.image_size}")
    if cfg.amp is not None and cfg.amp not in AMP_DTYPES:
        raise ConfigError(f"--amp must be one of {', '.join(AMP_DTYPES)}, got {cfg.amp!r}")
    if cfg.amp is not None and cfg.world_invariant:
        raise ConfigError("--amp is not supported with --world-invariant (its micro-batch step runs float32)")
    if cfg.cuda_graph and dev.type != "cuda":
        raise ConfigError("--cuda-graph needs --device cuda (CUDA graphs capture GPU work only)")
    claims = routing.resolve(cfg.kernel, cfg.kernel_ops).claims_determinism
    if cfg.cudnn_benchmark and (cfg.world_invariant or claims):
        what = "--world-invariant" if cfg.world_invariant else "the deterministic routing --kernel " + cfg.kernel + \
            "".join(f" --kernel-op {op}={v}" for op, v in sorted(cfg.kernel_ops.items()))
        raise ConfigError(f"--cudnn-benchmark picks cuDNN's convolution algorithms by timing, per process, so two "
                          f"runs can differ: it applies to runs that claim no determinism (--kernel native or "
                          f"atomic), not to {what}")
    if cfg.dataset not in data.DATASETS:
        raise ConfigError(f"unknown dataset {cfg.dataset!r}; valid: {', '.join(data.DATASETS)}")
    for key, low in (("epochs", 1), ("batch_size", 2), ("members", 1), ("n_train", 2), ("n_test", 1),
                     ("eval_every", 1)):
        v = getattr(cfg, key)
        if v is not None and v < low:
            raise ConfigError(f"--{key.replace('_', '-')} must be >= {low}, got {v}")
    # a dataset smaller than asked serves all it has, and the config records what is used: a run asking for
    # more than the dataset holds is the same run as one asking for exactly that (it matches and resumes it)
    for key, have in zip(("n_train", "n_test"), data.SPLIT_SIZES.get(cfg.dataset, (None, None))):
        if have is not None and getattr(cfg, key) is not None and getattr(cfg, key) > have:
            logging.getLogger("nnrand.train").warning("--%s %d: --dataset %s has %d; using %d", key.replace("_", "-"),
                                                      getattr(cfg, key), cfg.dataset, have, have)
            setattr(cfg, key, have)
    for key in ("lr", "momentum", "weight_decay", "warmup_epochs"):
        if not math.isfinite(getattr(cfg, key)) or getattr(cfg, key) < 0:
            raise ConfigError(f"--{key.replace('_', '-')} must be a finite number >= 0")
    if cfg.first_member < 0 or cfg.perturb_index < 0:
        raise ConfigError("--first-member and --perturb-index must be >= 0")
    for key in ("seed", "data_seed"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"--{key.replace('_', '-')} must be >= 0, got {getattr(cfg, key)}")
    if cfg.momentum >= 1:
        raise ConfigError(f"--momentum must be below 1, got {cfg.momentum}")
    if cfg.name is not None and (not cfg.name or cfg.name in (".", "..") or "/" in cfg.name or "\\" in cfg.name):
        raise ConfigError(f"--name must be a plain directory name (no '/', not '.' or '..'), got {cfg.name!r}")
    if cfg.cudnn_heuristic not in (None, *noise.CUDNN_HEURISTICS):
        raise ConfigError(f"--cudnn-heuristic must be one of {', '.join(noise.CUDNN_HEURISTICS)}, "
                          f"got {cfg.cudnn_heuristic!r}")
    if dev.type != "cuda" and cfg.cudnn_heuristic not in (None, "instant"):
        raise ConfigError(f"--cudnn-heuristic {cfg.cudnn_heuristic} picks cuDNN's convolution algorithms: it applies "
                          "to --device cuda")
    if cfg.cudnn_heuristic is None:
        try:
            cfg.cudnn_heuristic = noise.default_cudnn_heuristic() if dev.type == "cuda" else "instant"
        except ValueError as e:
            raise ConfigError(str(e)) from None
    _resolve_world(cfg, dev)
    _resolve_autotune(cfg)
    if cfg.name is None:
        ops = "".join(f"_{op}={v}" for op, v in sorted(cfg.kernel_ops.items()))
        cfg.name = f"{cfg.preset}_{cfg.kernel}{ops}_{cfg.model}" + (f"_{cfg.amp}" if cfg.amp else "")
    return cfg


def _resolve_autotune(cfg: Config) -> None:
    tuned = routing.resolve(cfg.kernel, cfg.kernel_ops).tuned
    if cfg.autotune_plan is not None:
        if not tuned:
            raise ConfigError("--autotune-plan applies to runs whose conv ops are tuned per shape: --kernel "
                              "fastest-deterministic or --kernel-op OP=auto")
        try:
            autotune.read_record(cfg.autotune_plan)
        except autotune.AutotuneError as e:
            raise ConfigError(str(e)) from None
        if torch.device(cfg.device).type == "cuda":
            check_plan_heuristic(cfg.autotune_plan, cfg.cudnn_heuristic)
    elif tuned and distributed.world_from_env().distributed:
        raise ConfigError("per-shape conv choices (--kernel fastest-deterministic or OP=auto) with several "
                          "processes need --autotune-plan: ranks "
                          "timing on their own could choose differently; run one process first and pass its "
                          "member's config.json")


def check_plan_heuristic(plan: str, mode: str) -> None:
    """A plan's torch_det choices ran the algorithms of its process's cuDNN heuristic (CUDA runs): following it
    under the other one would run other algorithms, other bits, than the run that made it. A plan written
    before runs recorded the heuristic is taken as it is."""
    made = (runio.read_json(plan).get("flags") or {}).get("cudnn_heuristic")
    if made is not None and made != mode:
        raise ConfigError(f"--autotune-plan {plan} was made under --cudnn-heuristic {made}; this run has {mode}: "
                          f"pass --cudnn-heuristic {made} to follow it")


def _resolve_world(cfg: Config, dev: torch.device) -> None:
    try:
        world = distributed.world_from_env()
    except distributed.LaunchError as e:
        raise ConfigError(str(e)) from None
    if not math.isfinite(cfg.dist_timeout) or cfg.dist_timeout <= 0:
        raise ConfigError(f"--dist-timeout must be a number of seconds > 0, got {cfg.dist_timeout}")
    if dev.type == "cuda" and world.distributed and world.local_rank >= torch.cuda.device_count():
        raise ConfigError(f"rank {world.rank}: LOCAL_RANK {world.local_rank} but only "
                          f"{torch.cuda.device_count()} CUDA devices are visible")
    if not cfg.world_invariant:
        if cfg.micro_batch is not None:
            raise ConfigError("--micro-batch applies to --world-invariant runs only")
        if cfg.batch_size % world.size:
            raise ConfigError(f"--batch-size {cfg.batch_size} (the global batch) is not divisible by the world "
                              f"size {world.size}")
        return
    if cfg.micro_batch is None:   # the most micro-batches of 2 images or more, up to DEFAULT_MICRO_BATCHES
        cfg.micro_batch = next((cfg.batch_size // k for k in (DEFAULT_MICRO_BATCHES, 2, 1)
                                if cfg.batch_size % k == 0 and cfg.batch_size // k >= 2), cfg.batch_size)
    if cfg.micro_batch < 2:
        raise ConfigError(f"--micro-batch must be >= 2 (BatchNorm needs two images), got {cfg.micro_batch}")
    try:
        distributed.check_invariant_layout(cfg.batch_size, cfg.micro_batch, world.size)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def lr_at(step: int, total: int, warmup: int, peak: float) -> float:
    """Linear warm-up from peak/warmup to peak over ``warmup`` steps, then linear decay to 0 at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * max(0.0, (total - step) / max(1, total - warmup))


# --------------------------------------------------------------------------------------------------
# Data: the whole dataset is one tensor on the device; batches are index gathers (no workers, no races)


def load_data(cfg: Config):
    try:
        ds = data.load_dataset(cfg.dataset, data_dir=cfg.data_dir, seed=cfg.data_seed, n_train=cfg.n_train,
                               n_test=cfg.n_test, download=cfg.download)
    except ValueError as e:  # a size or name the dataset cannot serve; DatasetError passes through
        raise ConfigError(f"--dataset {cfg.dataset}: {e}") from None
    if len(ds.train_y) < cfg.batch_size:
        raise ConfigError(f"--batch-size {cfg.batch_size} exceeds the {len(ds.train_y)} training images")
    return ds.to(cfg.device)


def resize(x: torch.Tensor, size: int | None) -> torch.Tensor:
    """Bilinear resize of a batch to size x size (no gradient flows into the data)."""
    if size is None or x.shape[-1] == size and x.shape[-2] == size:
        return x
    return F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=False)


def train_batch(ds, order: torch.Tensor, i: int, batch: int, aug_seed: int, epoch: int, fmt, size: int | None = None,
                shuffle_channels: bool = False):
    """Batch ``i`` of an epoch's ``order``."""
    return indexed_batch(ds, order[i * batch:(i + 1) * batch], aug_seed, epoch, fmt, size, shuffle_channels)


def indexed_batch(ds, idx: torch.Tensor, aug_seed: int, epoch: int, fmt, size: int | None = None,
                  shuffle_channels: bool = False):
    """The images at dataset indices ``idx``, each augmented by its own index, the augmentation seed and the
    epoch (data.augment_indexed): an image's augmentation does not depend on the batch order, the batch
    size, the rank or the number of processes, so the order seed varies the order alone."""
    x = data.augment_indexed(ds.train_x[idx.to(ds.train_x.device)], idx, aug_seed, epoch,
                             shuffle_channels=shuffle_channels)
    x = resize(data.normalize(x, ds), size).contiguous(memory_format=fmt)
    return x, ds.train_y[idx.to(ds.train_y.device)]


# --------------------------------------------------------------------------------------------------
# Network and weight checksums


def build(cfg: Config, seeds: noise.MemberSeeds, num_classes: int, fmt):
    noise.seed_torch(seeds.init)
    try:
        model = models.build_model(cfg.model, num_classes)
    except models.ModelSourceError as e:
        raise ConfigError(str(e)) from None
    model = model.to(cfg.device, memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, nesterov=NESTEROV,
                          weight_decay=cfg.weight_decay)
    return model, opt


def autocast_for(device_type: str, amp: str | None, cache: bool = True):
    """The forward's precision: ``torch.autocast`` in the ``--amp`` dtype (``AMP_DTYPES``), or float32 (a
    disabled context) for None. ``cache=False`` inside a CUDA-graph capture (autocast's cast cache must not
    outlive the capture)."""
    dtype = AMP_DTYPES.get(amp)
    return torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None, cache_enabled=cache)


def autocast(cfg: Config, *, cache: bool = True):
    """``autocast_for`` the run's device and ``--amp``."""
    return autocast_for(torch.device(cfg.device).type, cfg.amp, cache)


def float32_forward(cache: bool = True):
    """The precision context of a float32 forward: none (the default of ``GraphStep`` and ``evaluate``)."""
    return contextlib.nullcontext()


def scaler_for(device_type: str, amp: str | None):
    """fp16 only: loss scaling against gradient underflow (None otherwise). Its steps are deterministic
    given the gradients: the unscale and the Inf/NaN check are elementwise, the skip-or-step decision and
    the scale update depend only on whether any gradient is non-finite."""
    return torch.amp.GradScaler(device_type) if amp == "fp16" else None


def grad_scaler(cfg: Config):
    """``scaler_for`` the run's device and ``--amp``."""
    return scaler_for(torch.device(cfg.device).type, cfg.amp)


def backward(loss: torch.Tensor, scaler) -> None:
    (loss if scaler is None else scaler.scale(loss)).backward()


def forward_backward(model, opt, x: torch.Tensor, y: torch.Tensor, precision=None, scaler=None):
    """One eager step but the optimizer's: the forward and the cross-entropy loss in ``precision`` (a context
    factory; float32 by default), the gradients zeroed, the backward (loss-scaled for fp16). Returns
    (logits, loss); ``optimizer_step`` follows."""
    with (precision or float32_forward)():
        logits = model(x)
        loss = F.cross_entropy(logits, y)
    opt.zero_grad(set_to_none=True)
    backward(loss, scaler)
    return logits, loss


def optimizer_step(opt, scaler) -> None:
    if scaler is None:
        opt.step()
    else:
        scaler.step(opt)   # skipped when a gradient is Inf/NaN
        scaler.update()


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


class Checksum:
    """Exact checksum of every parameter's float32 bits: sum_i (i+1) * bits_i over the flat parameter
    vector, in wrapping int64 arithmetic. Integer addition is associative, so the reduction order of
    the sum cannot change it; position weights make a swap of two values show. Stays on the device."""

    def __init__(self, model: torch.nn.Module):
        n = sum(p.numel() for p in model.parameters())
        self.weights = torch.arange(1, n + 1, dtype=torch.int64, device=next(model.parameters()).device)

    def __call__(self, model: torch.nn.Module) -> torch.Tensor:
        bits = flat_params(model).contiguous().view(torch.int32).to(torch.int64)
        return (bits * self.weights).sum()


# --------------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def evaluate(model, ds, fmt, size: int | None = None, precision=float32_forward) -> tuple[dict, torch.Tensor]:
    """Test-set metrics and logits (float32); ``precision``: a context factory the forwards run in (autocast)."""
    model.eval()
    logits = []
    for s in range(0, len(ds.test_y), EVAL_BATCH):
        x = resize(data.normalize(ds.test_x[s:s + EVAL_BATCH], ds), size).contiguous(memory_format=fmt)
        with precision():
            logits.append(model(x).float())
    model.train()
    logits = torch.cat(logits)
    y = ds.test_y
    k = min(5, logits.shape[1])
    top = logits.topk(k, dim=1).indices
    return {
        "test_loss": F.cross_entropy(logits, y).item(),
        "test_top1": (top[:, 0] == y).float().mean().item(),
        "test_top5": (top == y[:, None]).any(dim=1).float().mean().item(),
    }, logits


# --------------------------------------------------------------------------------------------------
# Training: one member


class _StepTimer:
    """Per-step times: CUDA events on a GPU (read once per epoch, no sync per step), wall clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list = []

    def start(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def stop(self, start) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.pending.append((start, e))
        else:
            self.pending.append((time.perf_counter() - start) * 1e3)

    def collect(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            out = [a.elapsed_time(b) for a, b in self.pending]
        else:
            out = list(self.pending)
        self.pending = []
        return out


class _Interrupt:
    """Ctrl-C sets a flag that the loop reads between steps, so the checkpoint is taken at a step
    boundary; a second Ctrl-C interrupts at once. Under torchrun SIGTERM (what its agent sends the
    workers when it is stopped) does the same, and the ranks agree on the step to stop at."""

    def __init__(self, distributed: bool = False):
        self.requested = False
        self._signals = (signal.SIGINT, signal.SIGTERM) if distributed else (signal.SIGINT,)
        self._previous: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self._signals}
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        return False


# eager DistributedDataParallel steps before a capture (PyTorch's CUDA-graph notes ask for at least 11)
DDP_WARMUP = 11


class GraphStep:
    """Forward, loss and backward captured once in a CUDA graph and replayed every step.

    Inputs are copied into static buffers; the gradients land in the same buffers every replay (they
    were allocated during capture, and nothing sets them to None afterwards). The optimizer step stays
    eager: SGD reads its per-step learning rate as a host float. The kernels are the ones eager runs,
    in the same order, so a replay gives eager's bits (tested for tree on the GPU). Lazy work (kernel
    compilation, cuDNN plans) is done first by a forward and backward of a copy of the model on a side
    stream, so the model's own state (weights, BatchNorm statistics) only changes on replay.

    Under DistributedDataParallel (``ddp``) the capture holds the gradient all-reduces too, and every rank
    replays its own graph. DDP's reducer settles during its first iterations (its buckets are rebuilt after
    the first), so the warm-up runs :data:`DDP_WARMUP` steps of ``ddp`` itself and puts the model's buffers
    back afterwards; warm-up and capture run on ``stream``, the stream DDP was built on (the gradient
    accumulators DDP holds belong to it)."""

    def __init__(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, precision=float32_forward,
                 scaler=None, ddp=None, stream: torch.cuda.Stream | None = None, capture=None):
        """``precision(cache=...)``: the forward's autocast context; ``scaler``: fp16's GradScaler (its scale is
        a device tensor the replay reads, so its updates between steps reach the captured backward);
        ``ddp``: ``model`` wrapped in DistributedDataParallel, built on ``stream``;
        ``capture(stream)``: called before the capture starts, a context entered inside it, around the captured
        ops only (``nnrand.trace.Recorder.capturing``); what it yields is kept as ``captured``."""
        import copy

        if ddp is not None and stream is None:
            raise ValueError("GraphStep: a DistributedDataParallel step needs the stream DDP was built on")
        self.captured = None
        self.x, self.y = x.clone(), y.clone()
        if scaler is not None:   # its scale tensor exists before the capture, outside the graph's pool
            scaler.scale(torch.ones((), device=x.device))
        saved = [b.detach().clone() for b in model.buffers()] if ddp is not None else None
        # the warm-up's random draws (dropout, stochastic depth) do not move the run's generators
        with distributed.warm_up_stream(x.device, stream):
            warm = copy.deepcopy(model) if ddp is None else ddp
            for _ in range(2 if ddp is None else DDP_WARMUP):
                with precision(cache=False):
                    loss = F.cross_entropy(warm(self.x), self.y)
                backward(loss, scaler)
            del warm, loss
            if saved is not None:   # BatchNorm statistics as they were (rank 0's, which DDP broadcasts)
                for b, v in zip(model.buffers(), saved):
                    b.copy_(v)
        for p in model.parameters():
            p.grad = None
        self.graph = torch.cuda.CUDAGraph()
        capturing = torch.cuda.graph(self.graph, stream=stream)   # (its stream: ``stream`` or torch's side stream)
        inside = capture(capturing.capture_stream) if capture is not None else contextlib.nullcontext()
        with capturing, inside as self.captured:
            with precision(cache=False):
                self.logits = (ddp or model)(self.x)
                self.loss = F.cross_entropy(self.logits, self.y)
            backward(self.loss, scaler)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.x.copy_(x)
        self.y.copy_(y)
        self.graph.replay()
        return self.logits, self.loss


def _rng_states(kernel_rng) -> dict:
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "numpy_kernel": None if kernel_rng is None else kernel_rng.bit_generator.state}


def _set_rng_states(states: dict, kernel_rng) -> None:
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and torch.cuda.is_available():
        # one state per GPU the writing process saw; a resume that sees fewer GPUs (a 2-GPU run resumed under
        # CUDA_VISIBLE_DEVICES=0) restores those it has
        for i, state in enumerate(list(states["cuda"])[:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, i)
    if kernel_rng is not None and states["numpy_kernel"] is not None:
        kernel_rng.bit_generator.state = states["numpy_kernel"]


def member_config(cfg: Config, member: int, seeds: noise.MemberSeeds, route: routing.Routing,
                  flags: dict, world: distributed.World | None = None) -> dict:
    world = world or distributed.World()
    return {"member": member, "config": config_record(cfg, world), "seeds": seeds.as_dict(),
            "routing": route.describe(),
            "flags": dict(flags, channels_last=cfg.channels_last, nesterov=NESTEROV, world_size=world.size,
                          cudnn_heuristic=cfg.cudnn_heuristic,
                          world_invariant=cfg.world_invariant, micro_batch=cfg.micro_batch),
            "fingerprint": fingerprint(cfg.device)}


def config_record(cfg: Config, world: distributed.World | None = None) -> dict:
    """The config fields a member's results depend on (``config.json``'s "config"; a resume, or a finished
    member taken as this run's, must match them)."""
    world = world or distributed.World()
    hp = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in RESUMABLE_CHANGES}
    if hp.get("amp") is None:
        hp.pop("amp", None)   # float32 runs' configs read as before --amp existed (their checkpoints resume)
    for key in ("shuffle_channels", "cudnn_benchmark"):
        if not hp.get(key):
            hp.pop(key, None)   # off: as before the option existed (such runs' checkpoints resume)
    if hp.get("cudnn_heuristic") == "instant":
        hp.pop("cudnn_heuristic")   # PyTorch's default: as before the option existed
    if world.distributed and not cfg.world_invariant:
        hp["world_size"] = world.size   # plain DDP: another world size is another run
    if not cfg.world_invariant:
        # every image's augmentation keyed by its index (world-invariant runs always were): a run or
        # checkpoint of the positional draws that came before differs in this field and is not resumed
        hp["augmentation"] = "indexed"
    return hp


def finished_config_diff(directory: Path, cfg: Config, world: distributed.World | None = None) -> list[str]:
    """The fields in which the finished member in ``directory`` ran under another config than ``cfg``
    (empty: the same, or no record to tell)."""
    path = Path(directory) / "config.json"
    done = runio.read_json(path).get("config") if path.exists() else None
    return _config_diff(done, config_record(cfg, world)) if done is not None else []


# Fingerprint fields under which the same code may give other bits (a resume across them is recorded)
BIT_AFFECTING = ("torch", "numpy", "numba", "cuda", "cudnn", "cupy", "cupy_cuda", "nvrtc", "device", "gpu",
                 "cpu_threads", "cpu_capability")


def _config_diff(a: dict, b: dict) -> list[str]:
    """The fields where two member configs differ, compared as their JSON forms (a config read back from
    config.json has lists where the running one has tuples)."""
    a, b = (json.loads(json.dumps(c, default=runio._json_default)) for c in (a, b))
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def merge_coverage(*parts: dict) -> dict[str, dict[str, int]]:
    """Coverage counts (``Coverage.as_dict()`` form) of several processes of one run, added up."""
    out: dict[str, dict[str, int]] = {}
    for part in parts:
        for op, counts in part.items():
            into = out.setdefault(op, {})
            for where, n in counts.items():
                into[where] = into.get(where, 0) + n
    return {op: dict(sorted(c.items())) for op, c in sorted(out.items())}


def logits_hash(logits: torch.Tensor) -> str:
    return hashlib.sha256(logits.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def train_member(cfg: Config, member: int, ds, route: routing.Routing, flags: dict,
                 group: distributed.Group | None = None, log: logging.Logger | None = None) -> dict:
    group = group or distributed.Group(distributed.World(), torch.device(cfg.device))
    world = group.world
    main_rank = world.is_main
    log = log or logging.getLogger("nnrand.train")
    d = runio.member_dir(cfg.out, cfg.name, member)
    specs = {s: getattr(cfg, f"{s}_seed") for s in noise.SOURCES}
    seeds = noise.member_seeds(specs, cfg.seed, member)
    meta = member_config(cfg, member, seeds, route, flags, world)
    if cfg.resume and runio.is_finished(d):
        # a finished member is this run's only if its config is (a changed --epochs or --lr under the same
        # --name would otherwise return the old result as the new one's)
        differ = finished_config_diff(d, cfg, world)
        if differ:
            raise ConfigError(f"{d} holds a finished run with a different config (differs in: {', '.join(differ)}); "
                              "use another --name or --no-resume")
        return runio.read_json(d / "result.json")
    if not cfg.resume and main_rank:   # the old run's files go (its epoch weights and predictions too)
        runio.clear_member(d)
    group.barrier()
    device = torch.device(cfg.device)
    fmt = torch.channels_last if cfg.channels_last else torch.contiguous_format
    model, opt = build(cfg, seeds, ds.num_classes, fmt)
    precision = functools.partial(autocast, cfg)
    scaler = grad_scaler(cfg)
    kernel_rng = noise.kernel_rng(seeds.kernel)
    checksum = Checksum(model)
    n = len(ds.train_y)
    steps = n // cfg.batch_size
    total = steps * cfg.epochs
    warmup = max(1, min(int(cfg.warmup_epochs * steps), total // 2))
    local = cfg.batch_size // world.size

    ckpt = runio.load_checkpoint(d) if cfg.resume else None
    if ckpt is None:
        meta["perturb"] = noise.perturb_one_ulp(model, cfg.perturb_index) if cfg.perturb_ulp else None
        state = {"epoch": 0, "i": 0, "step": 0, "metrics": [], "checksums": [], "acc": None,
                 "aug_state": None, "perturb": meta["perturb"], "fingerprint": meta["fingerprint"],
                 "coverage": {}}
        state["checksums"].append({"step": 0, "epoch": 0, "checksum": int(checksum(model))})
    else:
        if ckpt["config"] != meta["config"]:
            diff = _config_diff(ckpt["config"], meta["config"])
            raise ConfigError(f"{d} holds a run with a different config (differs in: {', '.join(diff)}); "
                              "use another --name or --no-resume")
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        if scaler is not None:
            scaler.load_state_dict(ckpt["scaler"])  # written by the same config (fp16), checked above
        _set_rng_states(ckpt["rng"], kernel_rng)
        state = ckpt["state"]
        meta["perturb"] = state["perturb"]
        meta["resumed_from"] = {"epoch": state["epoch"], "i": state["i"], "step": state["step"]}
        first = state.setdefault("fingerprint", None)   # None: a checkpoint written before it was kept
        # fields the run's first fingerprint lacks (recorded by a later version) are not changes
        changed = {k: [first.get(k), meta["fingerprint"].get(k)] for k in BIT_AFFECTING
                   if first is not None and k in first and first.get(k) != meta["fingerprint"].get(k)}
        if changed:   # the run goes on, recorded: these change the bits from the resume on
            meta["resumed_from"]["fingerprint_changes"] = changed
            log.warning("member %d resumes where %s differ%s from the start of the run (old, new: %s): the bits "
                        "from here on may differ from an uninterrupted run's", member, ", ".join(changed),
                        "s" if len(changed) == 1 else "", changed)
    tuner = None
    if route.tuned:   # per-shape conv choices: the checkpoint's on resume, else the plan's, else timed
        pinned = (ckpt or {}).get("autotune") or (autotune.read_record(cfg.autotune_plan) if cfg.autotune_plan
                                                 else None)
        # a record given is the whole plan: a backward shape outside it is an error, never a silent new
        # timing (a forward shape outside it runs torch's forward, as in every process that follows it)
        tuner = autotune.Tuner(pinned=pinned, pinned_only=bool(pinned and pinned.get("choices")) or world.distributed)
        meta["autotune"] = tuner.record()
    if main_rank:
        runio.write_json(d / "config.json", meta)

    ddp = None
    step_fn = None
    capture_stream = None   # a captured DDP step: DDP is built, warmed up and captured on this one stream
    if cfg.world_invariant:
        step_fn = distributed.InvariantStep(model, group, batch=cfg.batch_size, micro=cfg.micro_batch,
                                            seed=seeds.aug, graph=cfg.cuda_graph)
        # before the routing is on: the check's forward is neither counted in the coverage nor draws from
        # the kernels' generator (any micro-batch of images serves to count BatchNorm calls)
        if step_fn.bns:
            probe, _ = indexed_batch(ds, torch.arange(cfg.micro_batch), seeds.aug, 0, fmt, cfg.image_size,
                                     cfg.shuffle_channels)
            step_fn.check_batchnorm_calls(probe)
    elif world.distributed:
        from torch.nn.parallel import DistributedDataParallel

        if cfg.cuda_graph:
            capture_stream = torch.cuda.Stream()
            capture_stream.wait_stream(torch.cuda.current_stream())
        with group.guard("DistributedDataParallel start-up"), torch.cuda.stream(capture_stream):
            ddp = DistributedDataParallel(model, device_ids=[world.local_rank] if device.type == "cuda" else None)
        if capture_stream is not None:
            torch.cuda.current_stream().wait_stream(capture_stream)

    def save_checkpoint():
        state["coverage"] = coverage_so_far()
        if main_rank:
            record = None
            if tuner is not None:   # the choices made so far, in the checkpoint and the run's config.json
                record = meta["autotune"] = tuner.record()
                runio.write_json(d / "config.json", meta)
            runio.torch_save(d / "checkpoint.pt", {
                "config": meta["config"], "model": model.state_dict(), "optimizer": opt.state_dict(),
                "rng": _rng_states(kernel_rng), "state": state, "autotune": record,
                "scaler": None if scaler is None else scaler.state_dict()})

    before = state.setdefault("coverage", {})   # the routing's counts of the processes before this one

    def coverage_so_far() -> dict:
        """The counts of the processes before this one and of every rank now (a collective: every rank calls
        it, where each saves a checkpoint and once at the end)."""
        return merge_coverage(before, *group.gather_objects(routed.coverage.as_dict()))

    def step_metrics(loss_sum, correct):
        if ddp is not None:   # every rank's share of the global batch
            group.all_reduce_sum(loss_sum)
            group.all_reduce_sum(correct)

    log.info("member %d: %s, %d steps of %d images (%d per rank%s)", member,
             "resumed at step %d" % state["step"] if ckpt is not None else "starting", total, cfg.batch_size,
             local, f", micro-batches of {cfg.micro_batch}" if cfg.world_invariant else "")
    show = cfg.progress and main_rank
    timer = _StepTimer(device)
    epochs = tqdm(range(state["epoch"], cfg.epochs), desc=f"member {member}", disable=not show,
                  initial=state["epoch"], total=cfg.epochs, leave=False)
    model.train()
    graph = None
    last_eval = None   # (metrics, logits) of the last epoch, when its evaluation ran in this call
    with routing.use_kernels(route, rng=kernel_rng, strict=cfg.strict, model=model, tuner=tuner) as routed, \
            _Interrupt(distributed=world.distributed) as interrupt:
        for epoch in epochs:
            order = data.epoch_order(n, epoch, seeds.order).to(device)  # batches slice it on the device
            acc = state["acc"] or {"loss": 0.0, "correct": 0, "seen": 0, "time_s": 0.0, "step_ms": []}
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss_sum = torch.zeros((), device=device, dtype=torch.float64)
            correct = torch.zeros((), device=device, dtype=torch.int64)
            pending_sums: list[tuple[int, torch.Tensor]] = []
            for i in tqdm(range(state["i"], steps), desc=f"epoch {epoch}", disable=not show,
                          initial=state["i"], total=steps, leave=False):
                group.step = state["step"]
                for pgroup in opt.param_groups:
                    pgroup["lr"] = lr_at(state["step"], total, warmup, cfg.lr)
                batch_idx = order[i * cfg.batch_size:(i + 1) * cfg.batch_size]
                if step_fn is not None:
                    m, first = cfg.micro_batch, step_fn.first_micro()
                    batches = [indexed_batch(ds, batch_idx[j * m:(j + 1) * m], seeds.aug, epoch, fmt, cfg.image_size,
                                             cfg.shuffle_channels) for j in range(first, first + step_fn.local)]
                    start = timer.start()
                    out = step_fn(batches, state["step"])
                    opt.step()
                    timer.stop(start)
                    loss_sum += out[0]
                    correct += out[1].to(torch.int64)
                else:
                    x, y = indexed_batch(ds, batch_idx[world.rank * local:(world.rank + 1) * local], seeds.aug, epoch,
                                         fmt, cfg.image_size, cfg.shuffle_channels)
                    if cfg.cuda_graph and graph is None:
                        with group.guard("DistributedDataParallel capture", only_collectives=True):
                            graph = GraphStep(model, x, y, precision, scaler, ddp=ddp, stream=capture_stream)
                    start = timer.start()
                    with group.guard("DistributedDataParallel step", only_collectives=True):
                        if graph is not None:
                            logits, loss = graph(x, y)
                        else:
                            logits, loss = forward_backward(ddp or model, opt, x, y, precision, scaler)
                    optimizer_step(opt, scaler)
                    timer.stop(start)
                    loss_sum += loss.detach().double() * len(y)
                    correct += (logits.detach().argmax(1) == y).sum()
                acc["seen"] += cfg.batch_size
                state["step"] += 1
                state["i"] = i + 1
                if epoch == 0:
                    pending_sums.append((state["step"], checksum(model)))
                stop = group.any(interrupt.requested or state["step"] == cfg.interrupt_at_step)
                if stop and state["i"] < steps:
                    _flush(acc, loss_sum, correct, timer, t0, device, state, pending_sums, epoch, step_metrics)
                    state["acc"] = acc
                    save_checkpoint()
                    raise KeyboardInterrupt(f"interrupted at step {state['step']}; checkpoint saved in {d}")
            _flush(acc, loss_sum, correct, timer, t0, device, state, pending_sums, epoch, step_metrics)
            ev = {}
            if main_rank and ((epoch + 1) % cfg.eval_every == 0 or epoch + 1 == cfg.epochs):
                ev, logits = evaluate(model, ds, fmt, cfg.image_size, precision)
                if epoch + 1 == cfg.epochs:
                    last_eval = ev, logits   # the final evaluation below (same model, same bits)
            state["metrics"].append({
                "epoch": epoch, "step": state["step"], "train_loss": acc["loss"] / max(1, acc["seen"]),
                "train_top1": acc["correct"] / max(1, acc["seen"]), **ev, "epoch_time_s": acc["time_s"],
                "step_time_ms": statistics.median(acc["step_ms"]) if acc["step_ms"] else float("nan")})
            if epoch > 0:
                state["checksums"].append({"step": state["step"], "epoch": epoch, "checksum": int(checksum(model))})
            log.info("member %d epoch %d: step %d, train loss %.4f, train top-1 %.4f%s, median step %.2f ms",
                     member, epoch, state["step"], state["metrics"][-1]["train_loss"],
                     state["metrics"][-1]["train_top1"],
                     f", test top-1 {ev['test_top1']:.4f}" if ev else "", state["metrics"][-1]["step_time_ms"])
            if cfg.save_epoch_weights and main_rank:
                runio.torch_save(d / f"weights_epoch_{epoch:03d}.pt", flat_params(model).float().cpu())
            state.update(epoch=epoch + 1, i=0, acc=None, aug_state=None)
            if main_rank:
                runio.write_csv(d / "metrics.csv", runio.METRICS_COLUMNS, state["metrics"])
                runio.write_csv(d / "checksums.csv", runio.CHECKSUM_COLUMNS, state["checksums"])
            save_checkpoint()
            if ev:
                epochs.set_postfix(top1=f"{ev['test_top1']:.3f}")
            stop = group.any(interrupt.requested or state["step"] == cfg.interrupt_at_step)
            if stop and epoch + 1 < cfg.epochs:
                raise KeyboardInterrupt(f"interrupted at step {state['step']}; checkpoint saved in {d}")

    if state["epoch"] < cfg.epochs or not state["metrics"]:
        raise RuntimeError(f"{d}: training ended at epoch {state['epoch']} of {cfg.epochs}")
    final = int(state["checksums"][-1]["checksum"])
    cov = coverage_so_far()
    if not main_rank:
        group.barrier()   # rank 0 evaluates and writes the member's files
        log.info("member %d done: final checksum %d", member, final)
        return {"member": member, "rank": world.rank, "final_checksum": final, "steps": state["step"]}
    ev, logits = last_eval or evaluate(model, ds, fmt, cfg.image_size, precision)
    runio.npz_save(d / "predictions.npz", logits=logits.float().cpu().numpy(),
                   labels=runio.small_ints(ds.test_y.cpu().numpy()),
                   group=runio.small_ints(ds.test_group.cpu().numpy()))
    last = state["metrics"][-1]
    result = {"member": member, "epochs": cfg.epochs, "steps": state["step"], **ev,
              "train_loss": last["train_loss"], "train_top1": last["train_top1"],
              "final_checksum": final, "logits_hash": logits_hash(logits),
              "step_time_ms": statistics.median(m["step_time_ms"] for m in state["metrics"]),
              "train_time_s": sum(m["epoch_time_s"] for m in state["metrics"]),
              "coverage": cov, "uncovered": sorted(op for op, c in cov.items()
                                                                          if c.get(routing.UNCOVERED)),
              "replay": routed.replay,   # the C++ replay layer's statistics (None: not used)
              "world_size": world.size, "world_invariant": cfg.world_invariant,
              "fingerprint": meta["fingerprint"]}
    if tuner is not None:
        result["autotune"] = tuner.counts()
        meta["autotune"] = tuner.record()
        runio.write_json(d / "config.json", meta)
    runio.write_json(d / "result.json", result)
    log.info("member %d done: test top-1 %.4f, final checksum %d, logits %s", member, ev["test_top1"], final,
             result["logits_hash"])
    group.barrier()
    return result


def _flush(acc, loss_sum, correct, timer, t0, device, state, pending_sums, epoch, reduce=None) -> None:
    """Move the epoch's device-side accumulators to the host (one sync per epoch, or at an interrupt)."""
    if reduce is not None:
        reduce(loss_sum, correct)
    if device.type == "cuda":
        torch.cuda.synchronize()
    acc["time_s"] += time.perf_counter() - t0
    acc["loss"] += float(loss_sum)
    acc["correct"] += int(correct)
    acc["step_ms"] += timer.collect()
    state["checksums"] += [{"step": s, "epoch": epoch, "checksum": int(c)} for s, c in pending_sums]
    loss_sum.zero_()
    correct.zero_()
    pending_sums.clear()


# --------------------------------------------------------------------------------------------------
# Run: every member, then the report


def rank_logger(run_dir: Path, world: distributed.World) -> logging.Logger:
    """``<run>/logs/rank<R>.log``: this rank's start, epochs, end or error (appended across resumes)."""
    log = logging.getLogger(f"nnrand.train.rank{world.rank}")
    log.setLevel(logging.INFO)
    log.propagate = False
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()
    path = run_dir / "logs" / f"rank{world.rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    log.addHandler(handler)
    log.info("rank %d of %d (local %d), host %s, pid %d", world.rank, world.size, world.local_rank,
             socket.gethostname(), os.getpid())
    return log


def preflight(cfg: Config, ds, route: routing.Routing) -> None:
    """Everything that can fail before training: kernels runnable on the device, disk space."""
    if torch.device(cfg.device).type == "cuda" and not route.is_native and not kernels.cuda_available():
        raise ConfigError("routing to kernel variants on CUDA needs CuPy (pip install 'nnrand[cuda13]' or "
                          "'nnrand[cuda12]'), or use --kernel native")
    try:
        probe = models.build_model(cfg.model, ds.num_classes)
    except models.ModelSourceError as e:
        raise ConfigError(str(e)) from None
    need = runio.estimate_member_bytes(
        sum(p.numel() for p in probe.parameters()), sum(b.numel() for b in probe.buffers()),
        epochs=cfg.epochs, steps_first_epoch=len(ds.train_y) // cfg.batch_size, n_test=len(ds.test_y),
        classes=ds.num_classes, save_epoch_weights=cfg.save_epoch_weights)
    runio.check_free_space(Path(cfg.out) / cfg.name, need * cfg.members)


def apply_cudnn_heuristic(cfg: Config) -> None:
    """A resolved config's ``--cudnn-heuristic`` for this process (CUDA runs): set before its first convolution,
    or a ConfigError where CUDA is already in use under the other one (nnrand.noise.set_cudnn_heuristic)."""
    if torch.device(cfg.device).type == "cuda":
        try:
            noise.set_cudnn_heuristic(cfg.cudnn_heuristic)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def main(config: Config | dict) -> dict:
    """Train members ``first_member .. first_member + members - 1`` of the run; returns
    ``{"run_dir", "members": [result per member], "report"}``. Finished members are read, not rerun."""
    cfg = resolve(Config(**config) if isinstance(config, dict) else config)
    apply_cudnn_heuristic(cfg)
    route = routing.resolve(cfg.kernel, cfg.kernel_ops)
    world = dataclasses.replace(distributed.world_from_env(), timeout_s=cfg.dist_timeout)
    if world.is_main:
        for op, note in route.notes.items():
            print(f"note: {note}", file=sys.stderr)
    if world.distributed and torch.device(cfg.device).type == "cuda":
        torch.cuda.set_device(world.local_rank)   # "cuda" is this rank's GPU from here on
    ds = load_data(cfg)
    preflight(cfg, ds, route)
    run_dir = Path(cfg.out) / cfg.name
    results = []
    deterministic = route.deterministic and not route.is_native
    log = rank_logger(run_dir, world)
    threads = torch.get_num_threads()
    if cfg.world_invariant and torch.device(cfg.device).type == "cpu":
        # CPU BLAS blocks a matrix product by thread count (a linear layer's weight gradient over 8 images
        # changed bits between 1 and 2 threads), so every process uses one: the processes are the parallelism.
        torch.set_num_threads(1)
    group = distributed.Group(world, torch.device(cfg.device))
    finished = False
    try:
        with noise.pinned_flags(tf32=cfg.tf32, cudnn_deterministic=deterministic,
                                cudnn_benchmark=cfg.cudnn_benchmark) as flags:
            for member in range(cfg.first_member, cfg.first_member + cfg.members):
                results.append(train_member(cfg, member, ds, route, flags, group, log))
        finished = True
    except BaseException as e:
        log.error("stopped: %s: %s", type(e).__name__, e)
        raise
    finally:
        try:
            group.close(wait=finished)   # a peer lost at the final barrier raises here, after the rest below
        finally:
            torch.set_num_threads(threads)
            for h in list(log.handlers):
                log.removeHandler(h)
                h.close()
    report_path = None
    if cfg.report and world.is_main:
        from nnrand import report

        report_path = report.render(run_dir)
    return {"run_dir": str(run_dir), "members": results, "report": None if report_path is None else str(report_path)}


# --------------------------------------------------------------------------------------------------
# Command line


EPILOG = """examples:
  python -m nnrand.train --kernel tree                      deterministic backward (CPU: small model, under a minute)
  python -m nnrand.train --kernel atomic --members 3        three members that differ by atomic order only
  python -m nnrand.train --kernel tree --kernel-op conv_wgrad=atomic   one op's noise switched on alone
  python -m nnrand.train --preset algo --members 5 --epochs 20          init/order/aug noise, tree kernels
  python -m nnrand.train --kernel tree --perturb-ulp --perturb-index 123   one weight moved by one ULP
  python -m nnrand.train --dataset cifar10 --data-dir ~/data --model resnet18 --device cuda
  python -m nnrand.train --model torchvision:resnet50 --image-size 224 --channels-last --kernel tree
  python -m nnrand.train --model timm:resnet18 --image-size 64 --kernel tree --no-strict
  python -m nnrand.train --kernel tree --cuda-graph                  whole forward/backward as one graph replay
  python -m nnrand.train --model torchvision:resnet50 --image-size 224 --channels-last --amp bf16 --kernel fastest-deterministic
                                    bf16 autocast, deterministic backward (add --cuda-graph: bf16 steps are host-bound eager)
  python -m nnrand.train --kernel fastest-deterministic   per conv shape, the fastest deterministic backward
                                    and stride-1 forward (timed once, cached on disk, recorded in
                                    <member>/config.json)
  python -m nnrand.train --kernel fastest-deterministic --autotune-plan runs/X/member_000/config.json
                                    the same per-shape choices as run X, without timing
  torchrun --nproc_per_node 2 -m nnrand.train --kernel tree          DistributedDataParallel over 2 GPUs
  torchrun --nproc_per_node 2 -m nnrand.train --kernel tree --cuda-graph   the DDP step (all-reduces too) as one replay
  torchrun --nproc_per_node 4 -m nnrand.train --kernel tree --world-invariant --micro-batch 32
                                    the same bits as 1 or 2 processes with the same --batch-size and --micro-batch
  torchrun --nproc_per_node 2 -m nnrand.train --kernel tree --world-invariant --cuda-graph
                                    every micro-batch one graph replay: the same bits, less host time per step
presets: control (fixed seeds, tree), algo (per-member init/order/aug, tree), impl (fixed seeds,
atomic), algo+impl (both). Explicit flags override the preset.
outputs: <out>/<name>/member_XXX/{config.json,metrics.csv,checksums.csv,predictions.npz,result.json},
<out>/<name>/logs/rank<R>.log and <out>/<name>/report.md (rank 0 writes all but its own rank's log). An unfinished member resumes from its checkpoint; finished ones are skipped."""


def parser() -> argparse.ArgumentParser:
    ops = ", ".join(routing.ROUTED_OPS)
    p = argparse.ArgumentParser(prog="python -m nnrand.train", description=__doc__.splitlines()[0],
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("data and network")
    g.add_argument("--model", metavar="NAME", help=f"{', '.join(models.MODELS)}, torchvision:NAME or timm:NAME "
                   "(extra nnrand[vision]); default: small on CPU, resnet18 on CUDA")
    g.add_argument("--image-size", type=int, metavar="PX", help="resize every batch to PX x PX (default: the "
                   "data's 32); e.g. 224 for ImageNet-style models")
    g.add_argument("--dataset", choices=data.DATASETS, default="synthetic")
    g.add_argument("--data-dir", help="where CIFAR archives are (or go, with --download)")
    g.add_argument("--download", action="store_true", help="download a missing CIFAR archive")
    g.add_argument("--data-seed", type=int, default=0, help="draws the synthetic set / CIFAR subset")
    g.add_argument("--n-train", type=int, help="training images (CPU default 8192; CUDA: all)")
    g.add_argument("--n-test", type=int, help="test images (CPU default 512; CUDA: all)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=int, help="CPU default 5, CUDA default 10")
    g.add_argument("--batch-size", type=int, help="CPU default 64, CUDA default 128")
    g.add_argument("--lr", type=float, help="peak learning rate (default 0.2)")
    g.add_argument("--momentum", type=float, default=Config.momentum)
    g.add_argument("--weight-decay", type=float, default=Config.weight_decay)
    g.add_argument("--shuffle-channels", action=argparse.BooleanOptionalAction,
                   help="augmentation: each image's channels in a random order as well as the random crop and flip, "
                   "so colour is no cue to the class (default: on for CPU runs, off on CUDA)")
    g = p.add_argument_group("kernels and noise")
    g.add_argument("--preset", choices=list(noise.PRESETS), default=noise.DEFAULT_PRESET)
    g.add_argument("--kernel", choices=routing.FAMILIES, help="every backward reduction to this family "
                   "(default: the preset's; native = stock PyTorch/cuDNN)")
    g.add_argument("--kernel-op", action="append", metavar="OP=VARIANT",
                   help=f"per-op override, repeatable; ops: {ops}; variants from the registry, native, or "
                   "auto (conv ops: the fastest deterministic candidate per shape; conv_dgrad=auto also tunes "
                   "the training step's stride-1 forward convs)")
    g.add_argument("--autotune-plan", metavar="CONFIG_JSON",
                   help="fastest-deterministic: reuse the per-shape choices recorded in a run's "
                   "<member>/config.json instead of timing (needed with several processes)")
    g.add_argument("--seed", type=int, default=0, help="base seed the fixed/member seeds derive from")
    for src in ("init", "order", "aug"):
        g.add_argument(f"--{src}-seed", metavar="fixed|member|N", help=f"{src} seed (default: the preset's)")
    g.add_argument("--kernel-seed", default=noise.DEFAULT_KERNEL_SEED, metavar="fresh|fixed|member|N",
                   help="arrival order of atomic CPU models (GPU atomics cannot be seeded); default fresh")
    g.add_argument("--strict", action=argparse.BooleanOptionalAction, default=True,
                   help="deterministic kernels: an op nnrand cannot make deterministic is an error (default); "
                   "--no-strict warns once per op and records it as uncovered")
    g.add_argument("--perturb-ulp", action="store_true", help="move one weight by one ULP before step 0")
    g.add_argument("--perturb-index", type=int, default=0, help="flat parameter index to perturb")
    g = p.add_argument_group("run")
    g.add_argument("--out", default="runs", help="run directory root (default %(default)s)")
    g.add_argument("--name", help="run name (default from preset, routing and model)")
    g.add_argument("--members", type=int, default=1, help="members to train (member_000 ...)")
    g.add_argument("--first-member", type=int, default=0)
    g.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    g.add_argument("--channels-last", action="store_true")
    g.add_argument("--cuda-graph", action="store_true",
                   help="capture forward + backward once and replay it each step (CUDA; eager's bits in one process; "
                   "under torchrun the capture holds DDP's all-reduces; with --world-invariant one micro-batch is "
                   "captured and replayed for each, eager's bits on every world size; see README)")
    g.add_argument("--tf32", action="store_true", help="allow TF32 in matmul/conv (default off)")
    g.add_argument("--cudnn-benchmark", action="store_true", help="--kernel native or atomic: cuDNN times its "
                   "convolution algorithms and keeps the fastest (the fastest native configuration; not repeatable "
                   "run to run). Default off")
    g.add_argument("--cudnn-heuristic", choices=list(noise.CUDNN_HEURISTICS),
                   help="CUDA: which cuDNN heuristic picks the algorithms of torch's convs where cudnn.benchmark is "
                   "off (deterministic routings, for the convs they leave to torch): instant (PyTorch's default) or b "
                   "(cuDNN's mode B, " + noise.HEURISTIC_ENV + "). Neither times anything, so runs repeat under "
                   "either, with different bits; on an H100 b took ResNet-18's 3x3 64->64 forward at batch 64 off "
                   "an FFT algorithm. Read once per process, before CUDA is in use. Default: the environment the "
                   "process started in (instant unless that variable is 1)")
    g.add_argument("--amp", choices=list(AMP_DTYPES), help="forward under torch.autocast in this dtype, its backward "
                   "ops routed in it (half inputs accumulate in float32); fp16 adds a GradScaler. Default: float32")
    g.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="resume an unfinished run directory (default on)")
    g.add_argument("--save-epoch-weights", action="store_true")
    g.add_argument("--eval-every", type=int, default=1, metavar="N",
                   help="evaluate on the test set every N epochs and after the last (default 1)")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--report", action=argparse.BooleanOptionalAction, default=True,
                   help="render report.md at the end (default on)")
    g = p.add_argument_group("several processes (torchrun --nproc_per_node N -m nnrand.train ...)")
    g.add_argument("--world-invariant", action="store_true",
                   help="the same bits on any power-of-two number of processes that divides the micro-batches: "
                   "fixed-size micro-batches, ghost BatchNorm, per-image augmentation, one fixed summation tree")
    g.add_argument("--micro-batch", type=int, metavar="M", help="--world-invariant: images per micro-batch, also "
                   f"BatchNorm's virtual batch size (default: --batch-size / {DEFAULT_MICRO_BATCHES}, else / 2, "
                   "whichever divides it into micro-batches of 2 images or more)")
    g.add_argument("--dist-timeout", type=float, default=Config.dist_timeout, metavar="S",
                   help="seconds a rank waits in a collective before failing (default %(default)s)")
    return p


def config_from_args(args: argparse.Namespace) -> Config:
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(Config) if hasattr(args, f.name)}
    kw["kernel_ops"] = routing.parse_overrides(args.kernel_op)
    return Config(**kw)


def cli(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        world = distributed.world_from_env()
    except distributed.LaunchError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    who = f" (rank {world.rank} of {world.size})" if world.distributed else ""
    try:
        cfg = resolve(config_from_args(args))
        out = main(cfg)
    except (ConfigError, routing.RoutingError, runio.DiskSpaceError, runio.CheckpointError, data.DatasetError,
            autotune.AutotuneError, noise.PerturbIndexError, distributed.InvariantModelError) as e:
        p.exit(2, f"{p.prog}: error{who}: {e}\n")
    except routing.NondeterministicOpError as e:
        p.exit(3, f"{p.prog}: error{who}: {e}\n")
    except distributed.RankFailure as e:
        p.exit(4, f"{p.prog}: error: {e}\n")
    except KeyboardInterrupt as e:
        how = "rerun the same command to resume" if args.resume else "rerun it without --no-resume to resume"
        print(f"\n{e or 'interrupted'}{who}; {how}", file=sys.stderr)
        return 130
    if not world.is_main:
        return 0
    for r in out["members"]:
        print(f"member {r['member']}: test top-1 {r['test_top1']:.4f}, top-5 {r['test_top5']:.4f}, "
              f"final checksum {r['final_checksum']}")
    print(f"outputs: {out['run_dir']}")
    if out["report"]:
        print(f"report: {out['report']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
