"""Shape tables shared by tests, benchmarks and the harness: ResNet-18's real layers and hostile cases.

ResNet-18 here is the CIFAR variant (3x3 stem, 32x32 input) plus the ImageNet stem (7x7 stride-2 conv
and 3x3 stride-2 max-pool) applied to the same 32x32 input, as the harness builds them. Batch 128 is the
benchmark batch; tests also use batch 1.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


def conv_out(size: int, k: int, stride: int, pad: int, dilation: int = 1) -> int:
    return (size + 2 * pad - dilation * (k - 1) - 1) // stride + 1


def check_dgrad_output(op: str, dy_shape: tuple, cout: int, h: int, wd: int, kh: int, kw: int, sh: int, sw: int,
                       ph: int, pw: int, dh: int, dw: int) -> tuple[int, int, int]:
    """A data gradient's dy against the conv it belongs to: Cout channels and the conv output size of
    input (h, wd). Returns (N, OH, OW); raises KernelArgumentError naming ``op`` and the argument."""
    from .runtime import KernelArgumentError

    n, dcout, oh, ow = dy_shape
    if dcout != cout:
        raise KernelArgumentError(op, "dy", f"expected {cout} channels (w.shape[0]), got shape {tuple(dy_shape)}")
    eh, ew = conv_out(h, kh, sh, ph, dh), conv_out(wd, kw, sw, pw, dw)
    if eh < 1 or ew < 1:
        raise KernelArgumentError(op, "input_size", f"{(h, wd)} with padding {(ph, pw)} is smaller than the "
                                  f"dilated kernel {(dh * (kh - 1) + 1, dw * (kw - 1) + 1)}")
    if (oh, ow) != (eh, ew):
        raise KernelArgumentError(op, "dy", f"expected spatial size {(eh, ew)} (the conv output of input_size "
                                  f"{(h, wd)}, kernel {(kh, kw)}, stride {(sh, sw)}, padding {(ph, pw)}, "
                                  f"dilation {(dh, dw)}), got {(oh, ow)}")
    return n, oh, ow


@dataclass(frozen=True)
class ConvGeometry:
    """Validated sizes of one convolution gradient call (hashable: launch plans are cached per geometry):
    batch n, channels cin and cout, input h x w, output oh x ow, kernel kh x kw, per-axis stride s*,
    padding p* and dilation d*. Each op's Geometry adds its derived sizes (and the layout, where it has
    one)."""

    n: int
    cin: int
    h: int
    w: int
    cout: int
    oh: int
    ow: int
    kh: int
    kw: int
    sh: int
    sw: int
    ph: int
    pw: int
    dh: int
    dw: int


@dataclass(frozen=True)
class GroupedGeometry(ConvGeometry):
    """A ConvGeometry of ``groups`` channel groups (cin and cout both divisible by it)."""

    groups: int

    @property
    def cin_g(self) -> int:
        return self.cin // self.groups

    @property
    def cout_g(self) -> int:
        return self.cout // self.groups


@dataclass(frozen=True)
class ConvShape:
    name: str
    n: int
    cin: int
    cout: int
    k: int
    stride: int
    pad: int
    h: int
    w: int
    dilation: int = 1

    @property
    def x_shape(self) -> tuple[int, int, int, int]:
        return (self.n, self.cin, self.h, self.w)

    @property
    def w_shape(self) -> tuple[int, int, int, int]:
        return (self.cout, self.cin, self.k, self.k)

    @property
    def y_shape(self) -> tuple[int, int, int, int]:
        return (self.n, self.cout, conv_out(self.h, self.k, self.stride, self.pad, self.dilation),
                conv_out(self.w, self.k, self.stride, self.pad, self.dilation))

    @property
    def flops(self) -> int:
        """Multiply-adds x 2 of one forward (= one wgrad = one dgrad) pass."""
        _, _, oh, ow = self.y_shape
        return 2 * self.n * self.cout * oh * ow * self.cin * self.k * self.k

    def with_batch(self, n: int) -> "ConvShape":
        return replace(self, n=n)


@dataclass(frozen=True)
class PoolShape:
    name: str
    n: int
    c: int
    h: int
    w: int
    k: int
    stride: int
    pad: int
    dilation: int = 1

    @property
    def x_shape(self) -> tuple[int, int, int, int]:
        return (self.n, self.c, self.h, self.w)

    @property
    def y_shape(self) -> tuple[int, int, int, int]:
        return (self.n, self.c, conv_out(self.h, self.k, self.stride, self.pad, self.dilation),
                conv_out(self.w, self.k, self.stride, self.pad, self.dilation))

    def with_batch(self, n: int) -> "PoolShape":
        return replace(self, n=n)


BATCH = 128

# Every distinct conv of ResNet-18 (CIFAR variant) plus the ImageNet stem, batch 128.
RESNET18_CONV: tuple[ConvShape, ...] = (
    ConvShape("stem3x3_3-64_32", BATCH, 3, 64, 3, 1, 1, 32, 32),
    ConvShape("conv3x3_64-64_32", BATCH, 64, 64, 3, 1, 1, 32, 32),
    ConvShape("conv3x3s2_64-128_32", BATCH, 64, 128, 3, 2, 1, 32, 32),
    ConvShape("conv1x1s2_64-128_32", BATCH, 64, 128, 1, 2, 0, 32, 32),
    ConvShape("conv3x3_128-128_16", BATCH, 128, 128, 3, 1, 1, 16, 16),
    ConvShape("conv3x3s2_128-256_16", BATCH, 128, 256, 3, 2, 1, 16, 16),
    ConvShape("conv1x1s2_128-256_16", BATCH, 128, 256, 1, 2, 0, 16, 16),
    ConvShape("conv3x3_256-256_8", BATCH, 256, 256, 3, 1, 1, 8, 8),
    ConvShape("conv3x3s2_256-512_8", BATCH, 256, 512, 3, 2, 1, 8, 8),
    ConvShape("conv1x1s2_256-512_8", BATCH, 256, 512, 1, 2, 0, 8, 8),
    ConvShape("conv3x3_512-512_4", BATCH, 512, 512, 3, 1, 1, 4, 4),
    ConvShape("stem7x7s2_3-64_32", BATCH, 3, 64, 7, 2, 3, 32, 32),
)

# Hostile conv cases for tests (small, each exercising one edge).
HOSTILE_CONV: tuple[ConvShape, ...] = (
    ConvShape("odd_s2", 2, 5, 7, 3, 2, 1, 15, 13),
    ConvShape("c3_k7_s2_p3", 2, 3, 8, 7, 2, 3, 17, 17),
    ConvShape("spatial1x1", 3, 16, 8, 1, 1, 0, 1, 1),
    ConvShape("k3_on_1x1_p1", 2, 8, 4, 3, 1, 1, 1, 1),
    ConvShape("pad_gt_half", 1, 4, 6, 3, 1, 3, 6, 5),
    ConvShape("dilation2", 2, 6, 5, 3, 1, 2, 9, 11, 2),
    ConvShape("k1_s2_odd", 2, 8, 16, 1, 2, 0, 7, 7),
)

# Max-pool: the ImageNet stem's 3x3 stride-2 pad-1 pool on the stem output (64 x 16 x 16).
RESNET18_POOL: tuple[PoolShape, ...] = (
    PoolShape("stem_pool3x3s2p1_16", BATCH, 64, 16, 16, 3, 2, 1),
)

HOSTILE_POOL: tuple[PoolShape, ...] = (
    PoolShape("overlap_odd", 2, 3, 15, 13, 3, 2, 1),
    PoolShape("k2s2", 2, 4, 8, 8, 2, 2, 0),
    PoolShape("k3s1_heavy_overlap", 1, 2, 9, 9, 3, 1, 1),
    PoolShape("dilation2", 2, 3, 11, 10, 3, 2, 1, 2),
    PoolShape("tiny_1x1", 3, 2, 1, 1, 1, 1, 0),
)


def bias_grad_shapes() -> tuple[tuple[str, tuple[int, ...]], ...]:
    """dY shapes whose channel sums ResNet-18 takes (BatchNorm beta/gamma, bias), batch 128, plus the
    classifier's (N, 10) bias gradient."""
    seen: dict[tuple[int, ...], str] = {}
    for s in RESNET18_CONV:
        seen.setdefault(s.y_shape, f"dy_{s.y_shape[1]}x{s.y_shape[2]}x{s.y_shape[3]}")
    rows = [(name, shape) for shape, name in seen.items()]
    rows.append(("fc_10", (BATCH, 10)))
    return tuple(rows)
