"""What recording a training step costs, alone (without the rest of ``nnrand.trace report``): the median
step time without recording, recording the routed ops only, and recording every op, the modes taking turns
(``nnrand.trace.recording_cost``; the ratio is paired per round). Options after ``--`` go to nnrand.train's
parser (model, batch, kernel, ...; default: its ResNet-18, batch 128, ``--kernel tree``).

    python bench/dev/trace_recording_cost.py --steps 10 --rounds 20 [-- --kernel tree --cuda-graph]
    NNRAND_REPLAY=0 python bench/dev/trace_recording_cost.py        # every routed call through Python

With the C++ replay layer on (the default on CUDA), every mode replays its routed ops in C++; a routed-ops
recording hands each replayed call's outputs to its observer in Python (``routing.observe``).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nnrand import replay, trace, train  # noqa: E402


def main() -> None:
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="steps per mode and round (default %(default)s)")
    p.add_argument("--rounds", type=int, default=20, help="rounds over the three modes (default %(default)s)")
    args = p.parse_args(own)
    cfg = train.resolve(train.config_from_args(train.parser().parse_args(["--kernel", "tree", *rest])))
    with tempfile.TemporaryDirectory() as tmp:
        cost = trace.recording_cost(cfg, args.steps, tmp, args.rounds)
    print(f"model {cfg.model}, batch {cfg.batch_size}, kernel {cfg.kernel}, cuda graph {cfg.cuda_graph}, "
          f"replay layer {'requested' if replay.requested() else 'off'}; {args.rounds} rounds of {args.steps} steps")
    for mode in ("none", "routed", "all"):
        c = cost[mode]
        print(f"  {mode:<7} {c['ms_per_step']:8.2f} ms/step   x{c['ratio']:.3f} paired")


if __name__ == "__main__":
    main()
