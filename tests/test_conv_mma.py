"""The tensor-core conv launchers' host-side plans (kernels/conv_mma.py), on any machine."""
from __future__ import annotations

import pytest

from kernels import conv_mma
from kernels.runtime import cdiv

# (pixels, cin, q = kh * kw * cout) of ResNet-50 data-gradient GEMMs at batch 64 and 224 px, and edges
GEMMS = ((200704, 64, 576), (3136, 512, 2048), (3136, 512, 4608), (12544, 1024, 256), (784, 512, 4608),
         (100, 8, 8), (1, 8, 64 * 1000), (200704, 2048, 65536))


@pytest.mark.parametrize("gemm", GEMMS, ids=str)
def test_dgrad_split_covers_the_reduction_in_whole_k_steps(gemm):
    pixels, cin, q = gemm
    s, kc = conv_mma.dgrad_split(pixels, cin, q)
    assert kc % conv_mma.WG_BK == 0 and kc > 0
    assert s * kc >= q and (s - 1) * kc < q            # S chunks of Kc, none empty
    steps = cdiv(q, conv_mma.WG_BK)
    assert s == 1 or kc >= conv_mma.DGRAD_SPLIT_MIN_STEPS * conv_mma.WG_BK   # chunks of 4 K-steps at least
    tiles = cdiv(pixels, 128) * cdiv(cin, 128 if cin >= 128 else 64)
    if tiles >= conv_mma.DGRAD_SPLIT_BLOCKS:
        assert s == 1                                  # enough tiles: no split
    assert s <= max(1, steps // conv_mma.DGRAD_SPLIT_MIN_STEPS)


def test_dgrad_split_applies_to_the_few_tile_gemms():
    """The 7x7 ResNet-50 GEMMs have about 100 tiles, under a wave: they split; 56x56 ones do not."""
    assert conv_mma.dgrad_split(3136, 512, 2048)[0] > 1
    assert conv_mma.dgrad_split(200704, 64, 576)[0] == 1
