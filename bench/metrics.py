"""Run-to-run variance and accuracy metrics, computed on the results' own device.

Bitwise identity is the criterion: two results are the same only if every byte is the same (so -0.0 and
+0.0 differ, and a NaN equals a NaN with the same payload). For the magnitude of a difference:

* ``max_abs_diff``: max |a - b| over elements whose bits differ, in float64; an element that is NaN on
  one side only (or NaN with different payloads) counts as +inf.
* ``max_ulp``: max distance in units in the last place, counted on the float's ordered integer line
  (+0.0 and -0.0 are 0 ULP apart, the largest finite float and +inf 1 ULP); NaN on either side -> +inf.

With a single repeat there is nothing to compare: ``distinct_results`` is 1 and the comparison metrics
are NaN (unknown), never 0 (which would claim determinism).

A result is one tensor or a tuple of tensors (an op with several outputs, such as BatchNorm backward's
dx, dgamma, dbeta): a tuple is one result, the same only if every part is bitwise the same, and its error
against the reference is the worst over its parts.
"""
from __future__ import annotations

import hashlib
import math

import torch

_INT_OF = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
           torch.bfloat16: torch.int16}


def parts(out) -> tuple[torch.Tensor, ...]:
    """The tensors of a result: ``(out,)`` for a tensor, the tensors of a non-empty tuple or list."""
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (tuple, list)) and out and all(isinstance(t, torch.Tensor) for t in out):
        return tuple(out)
    raise TypeError(f"expected a torch.Tensor or a tuple of them, got {type(out).__name__}")


def joined(out) -> torch.Tensor:
    """A result as one tensor: a tensor itself; the parts of a tuple flattened and concatenated in order,
    so that comparing the joined bits compares every part. Parts of different floating dtypes of at most
    32 bits (a bf16 dx beside float32 dgamma, dbeta) are widened to float32 first: exact and one to one
    (NaN payloads aside), so distinct results stay distinct (VarianceTracker measures such a result's ULPs
    part by part, each in its own dtype)."""
    ps = parts(out)
    if isinstance(out, torch.Tensor):
        return out
    dtypes = {t.dtype for t in ps}
    if len(dtypes) > 1:
        if not dtypes <= {torch.float32, torch.bfloat16, torch.float16}:
            raise ValueError(f"a result's parts must share one dtype to be compared, got {sorted(map(str, dtypes))}")
        return torch.cat([t.detach().reshape(-1).float() for t in ps])
    return torch.cat([t.detach().reshape(-1) for t in ps])


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as signed integers of the same width (a flat contiguous view)."""
    t = t.detach().contiguous().reshape(-1)
    if t.dtype in _INT_OF:
        return t.view(_INT_OF[t.dtype])
    return t.view(torch.uint8) if t.dtype.is_floating_point or t.dtype.is_complex else t


def byte_hash(t: torch.Tensor) -> str:
    """blake2b of the tensor's bytes (moved to the host): a stable name for one exact result."""
    b = t.detach().contiguous().reshape(-1).cpu()
    return hashlib.blake2b(b.view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise ULP distance (float64) between two float tensors of one dtype; NaN involved -> inf."""
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"ulp_distance needs equal dtypes and shapes, got {a.dtype}{tuple(a.shape)} "
                         f"and {b.dtype}{tuple(b.shape)}")
    if a.dtype not in _INT_OF:
        raise ValueError(f"ulp_distance: unsupported dtype {a.dtype}")
    ia, ib = bits(a), bits(b)
    if a.dtype == torch.float64:
        # sign-magnitude -> two's-complement order. Same sign: the integer difference fits in int64;
        # opposite signs: the distance is the sum of both magnitudes, which may not, so add in float64.
        oa = torch.where(ia < 0, -(ia & 0x7FFFFFFFFFFFFFFF), ia)
        ob = torch.where(ib < 0, -(ib & 0x7FFFFFFFFFFFFFFF), ib)
        same = (oa >= 0) == (ob >= 0)
        d = torch.where(same, (oa - ob).abs().to(torch.float64),
                        oa.to(torch.float64).abs() + ob.to(torch.float64).abs())
    else:
        mask = (1 << (ia.element_size() * 8 - 1)) - 1
        la, lb = ia.to(torch.int64), ib.to(torch.int64)
        oa = torch.where(la < 0, -(la & mask), la)
        ob = torch.where(lb < 0, -(lb & mask), lb)
        d = (oa - ob).abs().to(torch.float64)
    nan = torch.isnan(a.reshape(-1)) | torch.isnan(b.reshape(-1))
    d = torch.where(nan & (ia != ib), torch.full_like(d, math.inf), d)
    return torch.where(ia == ib, torch.zeros_like(d), d)


def abs_difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise |a - b| in float64: 0 where the bits agree, inf where NaN-ness differs."""
    ia, ib = bits(a), bits(b)
    fa, fb = a.detach().reshape(-1).to(torch.float64), b.detach().reshape(-1).to(torch.float64)
    d = (fa - fb).abs()
    d = torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)
    return torch.where(ia == ib, torch.zeros_like(d), d)


class VarianceTracker:
    """Bitwise spread of repeated results of one computation on one input.

    Keeps the first result, a running "ever differed" mask, and one copy of each distinct result (on the
    results' device, compared with ``torch.equal`` on the bits) up to ``store_bytes``; past that, further
    distinct results are told apart by host byte hashes. Nothing is approximate.
    """

    def __init__(self, store_bytes: int = 4 << 30):
        self.store_bytes = store_bytes
        self.repeats = 0
        self.runs_differing = 0
        self.max_abs_diff = 0.0
        self.max_ulp = 0.0
        self._first: torch.Tensor | tuple[torch.Tensor, ...] | None = None
        self._first_joined: torch.Tensor | None = None
        self._signature: tuple | None = None
        self._first_bits: torch.Tensor | None = None
        self._ever: torch.Tensor | None = None
        self._stored: list[torch.Tensor] = []
        self._hashes: set[str] = set()
        self._float = False

    @property
    def first(self) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
        """The first result as it was added (a tensor, or a tuple of tensors)."""
        return self._first

    def add(self, out) -> None:
        """One result: a tensor, or a tuple of tensors compared as their joined bytes (see ``joined``)."""
        ps = parts(out)
        single = isinstance(out, torch.Tensor)
        signature = tuple((t.dtype, tuple(t.shape)) for t in ps)
        out = out.detach() if single else joined(ps)
        self.repeats += 1
        b = bits(out)
        if self._first is None:
            self._first_joined = out.clone() if single else out  # joined() already made a fresh tensor
            self._first = self._first_joined if single else tuple(t.detach().clone() for t in ps)
            self._signature = signature
            self._first_bits = bits(self._first_joined)
            self._ever = torch.zeros(b.shape, dtype=torch.bool, device=b.device)
            self._stored = [self._first_bits]
            self._float = out.dtype in _INT_OF
            return
        if signature != self._signature:
            first = self._signature if len(self._signature) > 1 else f"{self._signature[0][0]}{self._signature[0][1]}"
            now = signature if len(signature) > 1 else f"{signature[0][0]}{signature[0][1]}"
            raise ValueError(f"result changed shape or dtype between repeats: {first} -> {now}")
        if torch.equal(b, self._first_bits):
            return
        self.runs_differing += 1
        self._ever |= b != self._first_bits
        if self._float:
            self.max_abs_diff = max(self.max_abs_diff, float(abs_difference(out, self._first_joined).max()))
            if single or len({t.dtype for t in ps}) == 1:
                self.max_ulp = max(self.max_ulp, float(ulp_distance(out, self._first_joined).max()))
            else:   # parts of several dtypes: each part's ULPs in its own dtype (a bf16 ULP is not 65536)
                self.max_ulp = max(self.max_ulp, *(float(ulp_distance(t.detach(), f).max()) for t, f in
                                                   zip(ps, self._first) if t.numel()))
        else:
            self.max_abs_diff = self.max_ulp = math.nan
        if any(torch.equal(b, s) for s in self._stored[1:]):
            return
        if (len(self._stored) + 1) * b.numel() * b.element_size() <= self.store_bytes:
            self._stored.append(b.clone())
        else:
            self._hashes.add(byte_hash(b))

    @property
    def distinct(self) -> int:
        return len(self._stored) + len(self._hashes) if self._first is not None else 0

    def summary(self) -> dict[str, float]:
        if self.repeats == 0:
            raise ValueError("no results were added")
        compare = self.repeats > 1
        nan = math.nan
        return {
            "distinct_results": float(self.distinct),
            "frac_runs_differ": self.runs_differing / (self.repeats - 1) if compare else nan,
            "max_abs_diff": self.max_abs_diff if compare else nan,
            "max_ulp": self.max_ulp if compare else nan,
            "frac_elements_differ": float(self._ever.float().mean()) if compare and self._ever.numel() else nan,
        }


def variance(results) -> dict[str, float]:
    """:class:`VarianceTracker` summary of an iterable of results."""
    tracker = VarianceTracker()
    for r in results:
        tracker.add(r)
    return tracker.summary()


def reference_error(out, ref) -> dict[str, float]:
    """Error of one result against the float64 reference: max |out - ref| and ||out - ref|| / ||ref||
    (the absolute L2 error where the reference is all zeros). NaN/inf in the result propagate.

    A tuple result is compared part by part with a tuple reference, or with one tensor that holds the
    parts' values flattened and concatenated in order; each metric is the worst over the parts."""
    if not isinstance(out, torch.Tensor):
        outs = parts(out)
        if isinstance(ref, torch.Tensor):
            flat = ref.detach().reshape(-1)
            sizes = [t.numel() for t in outs]
            if sum(sizes) != flat.numel():
                raise ValueError(f"result has {sum(sizes)} elements in {len(outs)} parts, the reference {flat.numel()}")
            refs = torch.split(flat, sizes)
        else:
            refs = parts(ref)
            if len(refs) != len(outs):
                raise ValueError(f"result has {len(outs)} parts, the reference {len(refs)}")
        errs = [reference_error(o, r) for o, r in zip(outs, refs)]
        # max that propagates NaN (Python's max would depend on where the NaN sits)
        return {k: max((e[k] for e in errs), key=lambda v: math.inf if math.isnan(v) else v) for k in errs[0]}
    o = out.detach().to("cpu", torch.float64).reshape(-1)
    r = ref.detach().to("cpu", torch.float64).reshape(-1)
    if o.shape != r.shape:
        raise ValueError(f"result has {o.numel()} elements, the reference {r.numel()}")
    if o.numel() == 0:
        return {"err_max_abs": 0.0, "err_rel_l2": 0.0}
    d = o - r
    norm = float(torch.linalg.vector_norm(r))
    err = float(torch.linalg.vector_norm(d))
    return {"err_max_abs": float(d.abs().max()), "err_rel_l2": err / norm if norm > 0 else err}
