"""GPU time of conv_dgrad's ``tree`` kernel (the data gradient, and the forward form a stride-1 forward conv
runs as) per network shape and layout, with a checksum of each result, so that two checkouts of the kernel
can be compared in one session: same shapes, same seeded tensors, bit-identical results expected where a
change keeps the accumulation order.

    python bench/dev/conv_tree_gemm.py --model torchvision:resnet50 --batch 64 --size 224 --classes 1000
    python bench/dev/conv_tree_gemm.py --model resnet18 --batch 128 --size 32 --json out.json
    python bench/dev/conv_tree_gemm.py --model torchvision:resnet18 --batch 128 --size 224 --deep on,off
    python bench/dev/conv_tree_gemm.py --model torchvision:resnet18 --batch 128 --size 224 --split-waves off,on
    python bench/dev/conv_tree_gemm.py --model torchvision:resnet18 --batch 128 --size 224 --t128 off,on

--deep on,off times each call under each DEEP_SLICES setting (stages of 16 output channels in unsplit
launches, or of 8) and checks that the settings give the same bits. --split-waves off,on does the same for
SPLIT_WAVES (the split that fills the last wave): a shape it splits gets other bits (another order), which
is not counted as a mismatch. --wide-deep off,on: WIDE_DEEP (deep stages on the wide tile), same bits.
--t128 off,on: T128 (128-thread blocks on NCHW narrow tiles), same bits.

GPU time per call: median of CUDA-graph replays (bench.timing.graph_replay_us), fp32, TF32 off.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from bench.conv_shapes import conv_shapes, network_arguments, shape_name  # noqa: E402
from bench.metrics import byte_hash  # noqa: E402
from bench.timing import graph_replay_us  # noqa: E402
from kernels import conv_dgrad  # noqa: E402
from nnrand import noise  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    network_arguments(p, batch=128, calls=5, replays=10)
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--deep", default="", help="comma-separated DEEP_SLICES settings to time (on, off)")
    p.add_argument("--split-waves", default="", help="comma-separated SPLIT_WAVES settings to time (on, off)")
    p.add_argument("--wide-deep", default="", help="comma-separated WIDE_DEEP settings to time (on, off)")
    p.add_argument("--t128", default="", help="comma-separated T128 settings to time (on, off)")
    p.add_argument("--layouts", default="nchw,channels_last", help="comma-separated layouts (nchw, channels_last)")
    args = p.parse_args()
    layouts = [x for x in args.layouts.split(",") if x]
    if not layouts or not set(layouts) <= {"nchw", "channels_last"}:
        p.error(f"--layouts: expected a comma-separated list of nchw and channels_last, got {args.layouts!r}")
    for opt, value in (("--deep", args.deep), ("--split-waves", args.split_waves), ("--wide-deep", args.wide_deep),
                       ("--t128", args.t128)):
        if not set(value.split(",")) <= {"", "on", "off"}:
            p.error(f"{opt}: expected a comma-separated list of on and off, got {value!r}")
    deeps = [d == "on" for d in args.deep.split(",") if d] or [conv_dgrad.DEEP_SLICES]
    waves = [d == "on" for d in args.split_waves.split(",") if d] or [conv_dgrad.SPLIT_WAVES]
    wdeeps = [d == "on" for d in args.wide_deep.split(",") if d] or [conv_dgrad.WIDE_DEEP]
    t128s = [d == "on" for d in args.t128.split(",") if d] or [conv_dgrad.T128]
    settings = [(deep, wave, wd, t) for deep in deeps for wave in waves for wd in wdeeps for t in t128s]
    mismatches = 0
    rows = []
    totals: dict[str, float] = {}
    with noise.pinned_flags(tf32=False, cudnn_deterministic=False):
        for s in conv_shapes(args.model, args.batch, args.size, args.classes):
            if s["groups"] != 1 or s["dilation"] != [1, 1]:
                continue
            for layout in layouts:
                fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
                g = torch.Generator(device="cuda").manual_seed(0)
                x = torch.randn(*s["x"], device="cuda", generator=g).contiguous(memory_format=fmt)
                w = torch.randn(*s["w"], device="cuda", generator=g).contiguous(memory_format=fmt)
                y = torch.nn.functional.conv2d(x, w, None, s["stride"], s["padding"])
                dy = torch.randn(y.shape, device="cuda", generator=g).contiguous(memory_format=fmt)
                geom = dict(input_size=tuple(s["x"][-2:]), stride=tuple(s["stride"]), padding=tuple(s["padding"]))
                calls = {"dgrad": lambda: conv_dgrad.conv_dgrad_tree_cuda(w, dy, **geom)}
                k = s["w"][-2:]
                if s["stride"] == [1, 1] and all(q <= kk - 1 for q, kk in zip(s["padding"], k)):
                    calls["fwd"] = lambda: conv_dgrad.conv_forward_tree_cuda(x, w, padding=tuple(s["padding"]))
                row = {"shape": shape_name(s), "count": s["count"], "layout": layout}
                names, hashes = [], {}
                for deep, wave, wd, t128 in settings:
                    saved = conv_dgrad.DEEP_SLICES, conv_dgrad.SPLIT_WAVES, conv_dgrad.WIDE_DEEP, conv_dgrad.T128
                    conv_dgrad.DEEP_SLICES, conv_dgrad.SPLIT_WAVES, conv_dgrad.WIDE_DEEP, conv_dgrad.T128 = \
                        deep, wave, wd, t128
                    try:
                        for call, fn in calls.items():
                            tags = ([("deep" if deep else "k8")] if len(deeps) > 1 else []) + \
                                   ([("waves" if wave else "nowaves")] if len(waves) > 1 else []) + \
                                   ([("wdeep" if wd else "wk8")] if len(wdeeps) > 1 else []) + \
                                   ([("t128" if t128 else "t256")] if len(t128s) > 1 else [])
                            name = "_".join([call, *tags])
                            names.append(name)
                            row[f"{name}_us"] = graph_replay_us(fn, calls=args.calls, replays=args.replays)
                            row[f"{name}_sha"] = byte_hash(fn())[:12]
                            hashes.setdefault((call, wave), set()).add(row[f"{name}_sha"])
                            totals[f"{layout} {name}"] = totals.get(f"{layout} {name}", 0.0) + \
                                row[f"{name}_us"] * s["count"]
                    finally:
                        conv_dgrad.DEEP_SLICES, conv_dgrad.SPLIT_WAVES, conv_dgrad.WIDE_DEEP, conv_dgrad.T128 = saved
                mismatches += sum(len(h) > 1 for h in hashes.values())
                rows.append(row)
                print(f"{row['shape']:<24} x{s['count']:<2} {layout:<13} " +
                      "  ".join(f"{n} {row[f'{n}_us']:8.1f} us {row[f'{n}_sha']}" for n in names), flush=True)
    print("totals (us, count-weighted): " + ", ".join(f"{k} {v:.0f}" for k, v in totals.items()))
    if len(deeps) > 1 or len(wdeeps) > 1 or len(t128s) > 1:
        print(f"{mismatches} call(s) whose bits differ between the DEEP_SLICES / WIDE_DEEP / T128 settings "
              "(same SPLIT_WAVES)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "totals": totals}, indent=1))


if __name__ == "__main__":
    main()
