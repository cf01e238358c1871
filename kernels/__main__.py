"""``python -m kernels``: print the registry of kernel variants."""
from __future__ import annotations

import argparse

from . import cuda_available, ops, table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kernels",
        description="List every registered kernel variant (op, variant, determinism, order independence, "
                    "whether the CPU model is bit-exact, note).",
        epilog="example: python -m kernels --op sum",
    )
    parser.add_argument("--op", choices=ops(), metavar="OP", help=f"only this op (one of: {', '.join(ops())})")
    args = parser.parse_args(argv)
    rows = [r for r in table() if args.op is None or r["op"] == args.op]
    yes = {True: "yes", False: "no"}
    header = ("op", "variant", "deterministic", "order-independent", "CPU model bit-exact", "note")
    body = [(r["op"], r["variant"], yes[r["deterministic"]], yes[r["order_independent"]],
             yes[r["cpu_bitexact"]], r["note"]) for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths[:-1]) + "  {}"
    print(fmt.format(*header))
    print(fmt.format(*("-" * w for w in widths)))
    for row in body:
        print(fmt.format(*row))
    backend = "CUDA kernels available" if cuda_available() else "no CUDA device/CuPy: CPU order models run"
    print(f"\n{len(rows)} variants; {backend}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
