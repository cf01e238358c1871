"""Noise control: which sources of run-to-run variation are on, each with its own seed.

Sources (Zhuang et al. 2021, "Randomness in neural network training"):
    init     weight initialisation (torch's global RNG, seeded just before the model is built)
    order    the batch order of each epoch (``data.epoch_order(n, epoch, seed)``)
    aug      augmentation: each image's crop, flip (and channel order) keyed by its dataset index, the aug
             seed and the epoch (``data.augment_indexed``), so no other source moves it
    kernel   the backward reductions: ``atomic`` variants add in the order partials arrive. On a GPU that
             order is the hardware's and no seed reaches it; the CPU order models draw it from the
             kernel seed ("fresh": new entropy every call, as a GPU behaves)
    perturb  optionally one weight moved by one ULP (nextafter) before step 0

A seed spec is ``"fixed"`` (the run's base seed), ``"member"`` (a different seed per member, derived from
the base seed, the source and the member index, so a study is reproducible), ``"fresh"`` (kernel only)
or an integer. Presets:

    control    all seeds fixed, deterministic kernels (tree)
    algo       init, order and aug per member, deterministic kernels
    impl       all seeds fixed, atomic kernels
    algo+impl  both

Everything else is pinned by ``pinned_flags`` and recorded: TF32 off unless asked, cuDNN benchmark off
(unless asked, for routings that claim no determinism: ``--cudnn-benchmark``),
cuDNN deterministic when the routing is deterministic (so ops left native add in a fixed order too).
With cuDNN benchmark off, cuDNN's heuristic picks each conv's algorithm; ``set_cudnn_heuristic`` chooses
which heuristic (``--cudnn-heuristic``), a choice without timing, so runs repeat under either.
On the CPU the bits also depend on torch's thread count: CPU BLAS splits a matmul's sums by thread (the
linear layer's weight gradient; conv_wgrad's CPU models on 1x1 spatial inputs), so runs compared bit for
bit must use the same count (recorded as ``cpu_threads`` in the fingerprint). Measured: `small`, batch
32, tree routing, 1 vs 2 threads: every gradient equal except fc.weight.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass
from typing import Iterator

import numpy as np
import torch

SOURCES = ("init", "order", "aug", "kernel")

PRESETS: dict[str, dict] = {
    "control": {"family": "tree", "init": "fixed", "order": "fixed", "aug": "fixed"},
    "algo": {"family": "tree", "init": "member", "order": "member", "aug": "member"},
    "impl": {"family": "atomic", "init": "fixed", "order": "fixed", "aug": "fixed"},
    "algo+impl": {"family": "atomic", "init": "member", "order": "member", "aug": "member"},
}
DEFAULT_PRESET = "control"
DEFAULT_KERNEL_SEED = "fresh"

_ROLE_KEYS = {"init": 1, "order": 2, "aug": 3, "kernel": 4, "perturb": 5}


def derive(base: int, *keys: int) -> int:
    """A 62-bit seed from a base seed and integer keys (NumPy SeedSequence: well mixed, stable)."""
    words = np.random.SeedSequence([int(base), *keys]).generate_state(2, np.uint32)
    return (int(words[0]) << 30) ^ int(words[1])


def check_spec(source: str, spec: object) -> str | int:
    """Normalise a seed spec; raise ValueError naming the valid forms."""
    allowed = ("fixed", "member", "fresh") if source == "kernel" else ("fixed", "member")
    if isinstance(spec, (int, np.integer)) and not isinstance(spec, bool):
        if spec < 0 or spec >= 2**63:   # torch.manual_seed takes up to 2**64 - 1; derive's keys are int64
            raise ValueError(f"--{source}-seed must be >= 0 and < 2**63, got {spec}")
        return int(spec)
    if isinstance(spec, str):
        if spec in allowed:
            return spec
        try:
            return check_spec(source, int(spec))
        except ValueError:
            pass
    raise ValueError(f"--{source}-seed must be a non-negative integer or one of {', '.join(allowed)}; "
                     f"got {spec!r}")


def seed_for(source: str, spec: str | int, base: int, member: int) -> int | None:
    """The concrete seed of one source for one member (None: fresh entropy, kernel only)."""
    spec = check_spec(source, spec)
    if isinstance(spec, int):
        return spec
    if spec == "fresh":
        return None
    if spec == "fixed":
        return derive(base, _ROLE_KEYS[source])
    return derive(base, _ROLE_KEYS[source], member + 1)


@dataclass(frozen=True)
class MemberSeeds:
    init: int
    order: int
    aug: int
    kernel: int | None  # None: CPU atomic models draw fresh entropy every call

    def as_dict(self) -> dict:
        return asdict(self)


def member_seeds(specs: dict, base: int, member: int) -> MemberSeeds:
    return MemberSeeds(*(seed_for(s, specs[s], base, member) for s in SOURCES))


def kernel_rng(seed: int | None) -> np.random.Generator | None:
    """The random source handed to CPU order models of atomic variants (None: fresh per call)."""
    return None if seed is None else np.random.default_rng(seed)


def seed_torch(seed: int) -> None:
    """Seed torch's global RNGs (CPU and every CUDA device); used right before building the model."""
    torch.manual_seed(seed)


# --------------------------------------------------------------------------------------------------
# One-ULP perturbation


class PerturbIndexError(ValueError):
    """``--perturb-index`` past the model's parameters."""


def perturb_one_ulp(model: torch.nn.Module, index: int, direction: float = np.inf) -> dict:
    """Move element ``index`` of the flat parameter vector (parameters in ``model.parameters()`` order,
    each flattened) to the next float32 toward ``direction``. Returns what changed, for the config."""
    offset = 0
    for name, p in model.named_parameters():
        n = p.numel()
        if index < offset + n:
            with torch.no_grad():
                i = index - offset
                at = tuple(int(k) for k in np.unravel_index(i, tuple(p.shape)))  # logical order, any memory layout
                old = p[at].detach().clone()
                new = torch.nextafter(old, torch.tensor(direction, dtype=old.dtype, device=old.device))
                p[at] = new
            return {"param": name, "element": i, "flat_index": index,
                    "old": float(old), "new": float(new),
                    "old_bits": f"{int(old.cpu().view(torch.int32)) & 0xFFFFFFFF:08x}",
                    "new_bits": f"{int(new.cpu().view(torch.int32)) & 0xFFFFFFFF:08x}"}
        offset += n
    raise PerturbIndexError(f"--perturb-index {index} is past the model's {offset} parameters")


# --------------------------------------------------------------------------------------------------
# Pinned global flags


def tf32_new_api() -> bool:
    """Whether this torch sets TF32 through ``fp32_precision`` (matmul and cuDNN conv); then the old
    ``allow_tf32`` switches must not be touched (torch refuses a mix of the two)."""
    return hasattr(torch.backends.cuda.matmul, "fp32_precision") and hasattr(torch.backends.cudnn, "conv") \
        and hasattr(torch.backends.cudnn.conv, "fp32_precision")


def set_deterministic_algorithms(on: bool, warn_only: bool) -> None:
    """``torch.use_deterministic_algorithms(on, warn_only=warn_only)``, called only for a change: its first
    call imports torch._inductor (seconds)."""
    if (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) \
            != (on, warn_only):
        torch.use_deterministic_algorithms(on, warn_only=warn_only)


def _tf32_flags() -> dict[str, object]:
    b = torch.backends
    if hasattr(b.cuda.matmul, "fp32_precision"):
        return {"matmul": b.cuda.matmul.fp32_precision, "conv": b.cudnn.conv.fp32_precision,
                "rnn": b.cudnn.rnn.fp32_precision}
    return {"matmul": b.cuda.matmul.allow_tf32, "cudnn": b.cudnn.allow_tf32}


def _set_tf32(flags: dict[str, object]) -> None:
    b = torch.backends
    if "conv" in flags:  # the fp32_precision API; mixing it with allow_tf32 is an error in torch
        b.cuda.matmul.fp32_precision = flags["matmul"]
        b.cudnn.conv.fp32_precision = flags["conv"]
        b.cudnn.rnn.fp32_precision = flags["rnn"]
    else:
        b.cuda.matmul.allow_tf32 = flags["matmul"]
        b.cudnn.allow_tf32 = flags["cudnn"]


# cuDNN's heuristic for the algorithms of torch's convs with cudnn.benchmark off (PyTorch's deterministic mode,
# and so every routing that claims determinism, for the convs it leaves to torch): ``instant``, PyTorch's
# default, or cuDNN's mode B (torch reads HEURISTIC_ENV once, at the process's first cuDNN convolution).
# Neither times anything, so the choice repeats run to run; they pick different algorithms, so different
# bits. H100, fp32, graph replays of a training step (bench/dev/step_profile.py --graph, mode b with the
# variable set in its environment): ResNet-18 (CIFAR) at batch
# 64, where the instant heuristic gives 3x3 64->64 32x32 forward convs an FFT algorithm, `tree` 10.92 ms
# (instant) against 9.31 ms (b), PyTorch's deterministic mode 15.17 against 11.18; batch 128 and
# torchvision resnet50 (224 px, batch 64) within 0.5%.
CUDNN_HEURISTICS = ("instant", "b")
HEURISTIC_ENV = "TORCH_CUDNN_USE_HEURISTIC_MODE_B"
_ENV_VALUES = {None: "instant", "": "instant", "0": "instant", "1": "b"}   # torch reads "0" or "1", nothing else


def _heuristic_of(value: str | None) -> str:
    if value not in _ENV_VALUES:
        raise ValueError(f"{HEURISTIC_ENV}={value!r}: torch reads 0 or 1 there and ignores anything else")
    return _ENV_VALUES[value]


# what the process was started with: the default of a run that names no heuristic (never what an earlier
# run in this process asked for, see set_cudnn_heuristic)
_AT_START = os.environ.get(HEURISTIC_ENV)


def default_cudnn_heuristic() -> str:
    """The heuristic of the environment this process started in (``instant`` unless HEURISTIC_ENV=1)."""
    return _heuristic_of(_AT_START)


def cudnn_heuristic_now() -> str:
    """The heuristic the environment asks torch for now (what its first cuDNN convolution reads)."""
    return _heuristic_of(os.environ.get(HEURISTIC_ENV))


def set_cudnn_heuristic(mode: str) -> None:
    """Make torch's cuDNN convs in this process use heuristic ``mode`` (CUDNN_HEURISTICS). Torch reads the
    variable once, at its first cuDNN convolution, so a change is only made before CUDA is in use; a
    process that already uses CUDA and runs another mode is refused (ValueError), never half-switched."""
    if mode not in CUDNN_HEURISTICS:
        raise ValueError(f"--cudnn-heuristic must be one of {', '.join(CUDNN_HEURISTICS)}, got {mode!r}")
    now = cudnn_heuristic_now()
    if now == mode:
        return
    if torch.cuda.is_initialized():
        raise ValueError(f"--cudnn-heuristic {mode}: this process already uses CUDA under cuDNN heuristic {now} "
                         f"(torch reads {HEURISTIC_ENV} once, at its first convolution); start it with "
                         f"{HEURISTIC_ENV}={'1' if mode == 'b' else '0'}")
    os.environ[HEURISTIC_ENV] = "1" if mode == "b" else "0"


@contextlib.contextmanager
def pinned_flags(*, tf32: bool, cudnn_deterministic: bool, cudnn_benchmark: bool = False) -> Iterator[dict]:
    """Set TF32, cuDNN benchmark (off unless asked: it picks convolution algorithms by timing, per
    process) and cuDNN deterministic for the duration; yield the flags set, for the config; put the
    previous values back on exit."""
    if cudnn_benchmark and cudnn_deterministic:
        raise ValueError("cudnn_benchmark chooses algorithms by timing, run to run: not with cudnn_deterministic")
    b = torch.backends
    before = (_tf32_flags(), b.cudnn.benchmark, b.cudnn.deterministic)
    # the CPU's oneDNN float32 precision: torch.set_float32_matmul_precision("medium") makes its matmuls
    # bf16 ("none" follows that global setting); float32 products stay float32 here
    onednn = [getattr(b.mkldnn, k, None) for k in ("matmul", "conv", "rnn")]
    onednn = [o for o in onednn if o is not None and hasattr(o, "fp32_precision")]
    onednn_before = [o.fp32_precision for o in onednn]
    want = "tf32" if tf32 else "ieee"
    try:
        for o in onednn:
            o.fp32_precision = "ieee"
        if "conv" in before[0]:
            _set_tf32({"matmul": want, "conv": want, "rnn": want})
        else:
            _set_tf32({"matmul": tf32, "cudnn": tf32})
        b.cudnn.benchmark = cudnn_benchmark
        b.cudnn.deterministic = cudnn_deterministic
        yield {"tf32": tf32, "tf32_flags": {k: str(v) for k, v in _tf32_flags().items()},
               "cudnn_benchmark": cudnn_benchmark, "cudnn_deterministic": cudnn_deterministic,
               "cudnn_enabled": bool(b.cudnn.enabled)}
    finally:
        _set_tf32(before[0])
        b.cudnn.benchmark, b.cudnn.deterministic = before[1], before[2]
        for o, v in zip(onednn, onednn_before):
            o.fp32_precision = v
