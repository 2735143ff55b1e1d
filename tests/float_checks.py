"""How the suite compares floats that were computed along different paths.

Floats are equal bit for bit only where the same operations run in the same order on the same
inputs: a copy, a save and load, a cast, the same function twice in one process, or nothing
but correctly rounded elementwise operations (+ − × ÷ √, casts, max) on both sides. Anything
else — a float64 reference against a float32 path, eager against compiled, a refresh on the
host against the one inside the graph, batched against per head — goes through reductions
(``sum``, norms, ``matmul``, ``einsum``) or transcendental functions (``exp``, ``tanh``,
``sin``) whose last bits depend on the machine: AVX-512, AVX2 or scalar kernels
(``ATEN_CPU_CAPABILITY``), MKL's code path for the CPU (``MKL_CBWR``), the thread count. Such
values are compared by what is guaranteed:

* ``assert_certified(actual, reference, ulps=K)`` — a certified bound or scale: never below
  the reference (a float64 recomputation of the exact value), and at most ``K`` ulps of
  ``actual``'s dtype (or ``rtol`` relative) above it;
* ``assert_close_ulps(a, b, ulps=K)`` — two computations of one value with no direction
  guaranteed between them: within ``K`` ulps of each other; ``assert_tensors_close_ulps``
  for two ``{name: tensor}`` maps (the same names and dtypes, each pair within ``K`` ulps).

"Never below" allows the reference's own float64 rounding, ``F64_SLACK = 2⁻³⁶`` relative: a
float64 sum over d terms is within ~d·2⁻⁵³ of the exact one (≈ 2⁻⁴⁰ at d = 8192), and one
float32 ulp (2⁻²³ relative at most) is 8 000 times larger, so a scale one float32 ulp under
its bound still fails.

The number of ulps is what the computation can lose, stated where it is used; the constants
here are the common cases:

* ``SCALE_ULPS = 1``: a float32 scale rounded *up* from a float64 bound
  (``bounds.round_up_f32``). Against the exact value it lies in ``[B, B + 1 ulp)``; between two
  paths computing the same float64 bound (their float64 sums differ by ~d·2⁻⁵³) the two
  round-ups land on the same float32 or on neighbours.
* ``f32_sum_ulps(n)``: a float32 sum of ``n`` terms (a squared norm, a matmul row, a
  ``LayerNorm`` mean), in any order, is within ``(n − 1)·2⁻²⁴·Σ|terms|`` of the exact sum
  (Higham, *Accuracy and Stability of Numerical Algorithms*, §4.2). For terms of one sign
  ``Σ|terms|`` is the sum itself and a float32 ulp is at least ``2⁻²⁴`` of it, so each order
  is within ``n − 1`` ulps and two orders within ``2n`` (a square root halves it).
"""
from __future__ import annotations

import torch

__all__ = ["F64_SLACK", "SCALE_ULPS", "f32_sum_ulps", "ulp", "assert_certified",
           "assert_close_ulps", "assert_tensors_close_ulps"]

#: the relative float64 rounding a reference may carry: "never below" means ``≥ r·(1 − 2⁻³⁶)``
F64_SLACK = 2.0 ** -36
#: a float32 scale rounded up from a float64 bound is at most one float32 ulp above it
SCALE_ULPS = 1


def f32_sum_ulps(n: int) -> int:
    """Float32 ulps by which two evaluation orders of a sum of ``n`` same-signed terms can
    differ: each is within ``n − 1`` ulps of the exact sum (module docstring)."""
    return max(1, 2 * int(n))


def ulp(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Spacing of ``dtype``'s values at ``|x|`` (float64 tensor, ``x``'s shape): ``eps·2^⌊log₂|x|⌋``
    for normal magnitudes, the subnormal spacing below ``finfo(dtype).tiny`` and at 0."""
    info = torch.finfo(dtype)
    x = x.detach().double().abs()
    _, exponent = torch.frexp(x)                           # |x| = m·2^e, m ∈ [0.5, 1)
    spacing = torch.ldexp(torch.full_like(x, info.eps), exponent - 1)
    return torch.where(x < info.tiny, torch.full_like(x, info.tiny * info.eps), spacing)


def _tensor(x) -> torch.Tensor:
    """A tensor as it is; a Python number as float64 (``as_tensor`` would round it to float32)."""
    return x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.float64)


def _pair(actual, reference) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    actual, reference = _tensor(actual), _tensor(reference)
    if actual.shape != reference.shape:
        raise AssertionError(f"shapes differ: {tuple(actual.shape)} and {tuple(reference.shape)}")
    if not (actual.is_floating_point() and reference.is_floating_point()):
        raise AssertionError(f"floats expected, got {actual.dtype} and {reference.dtype}")
    for name, t in (("actual", actual), ("reference", reference)):
        if torch.isnan(t).any():
            raise AssertionError(f"{name} holds NaN: {t}")
    return actual.detach().cpu().double(), reference.detach().cpu().double(), actual.dtype


def _where(msg: str) -> str:
    return f"{msg}: " if msg else ""


def _listing(mask, a, r, dtype, limit: int = 5) -> str:
    where = mask.nonzero().tolist()
    gap = (a - r) / ulp(r, dtype)
    rows = [f"  at {tuple(i)}: {a[tuple(i)].item()!r} vs {r[tuple(i)].item()!r} "
            f"({gap[tuple(i)].item():+.3g} {dtype} ulps)" for i in where[:limit]]
    more = f"\n  ... {len(where) - limit} more" if len(where) > limit else ""
    return "\n".join(rows) + more


def assert_certified(actual, reference, *, ulps: int = SCALE_ULPS, rtol: float = 0.0,
                     msg: str = "") -> None:
    """``actual`` (a certified bound or scale) is never below ``reference`` (the exact value,
    recomputed in float64; up to ``F64_SLACK``) and at most ``max(ulps ulps of actual's
    dtype, rtol·|reference|)`` above it. Shapes must be equal; NaN fails; an infinite
    reference needs an equal ``actual``."""
    a, r, dtype = _pair(actual, reference)
    finite = torch.isfinite(r)
    if not torch.equal(a[~finite], r[~finite]):
        raise AssertionError(f"{_where(msg)}infinite reference, actual differs\n"
                             f"{_listing(~finite & (a != r), a, r, dtype)}")
    a, r = a.where(finite, 0.0), r.where(finite, 0.0)
    below = a < r - F64_SLACK * r.abs()
    if below.any():
        raise AssertionError(f"{_where(msg)}below its certified reference at "
                             f"{int(below.sum())} of {a.numel()} entries\n"
                             f"{_listing(below, a, r, dtype)}")
    room = torch.maximum(ulps * ulp(r, dtype), rtol * r.abs())
    above = a > r + room
    if above.any():
        raise AssertionError(f"{_where(msg)}more than {ulps} ulps / rtol {rtol} above its "
                             f"reference at {int(above.sum())} of {a.numel()} entries\n"
                             f"{_listing(above, a, r, dtype)}")


def assert_close_ulps(a, b, *, ulps: int, dtype: torch.dtype | None = None,
                      msg: str = "") -> None:
    """``|a − b| ≤ ulps`` ulps of ``dtype`` (default: the less precise of the two dtypes) at
    the larger magnitude, entry by entry: one value computed along two paths. Shapes must be
    equal; NaN fails; infinities must match."""
    a, b = _tensor(a), _tensor(b)
    x, y, _ = _pair(a, b)
    dtype = dtype or max((a.dtype, b.dtype), key=lambda t: torch.finfo(t).eps)
    finite = torch.isfinite(x) & torch.isfinite(y)
    if not torch.equal(x[~finite], y[~finite]):
        raise AssertionError(f"{_where(msg)}infinities differ\n"
                             f"{_listing(~finite & (x != y), x, y, dtype)}")
    x, y = x.where(finite, 0.0), y.where(finite, 0.0)
    far = (x - y).abs() > ulps * ulp(torch.maximum(x.abs(), y.abs()), dtype)
    if far.any():
        raise AssertionError(f"{_where(msg)}more than {ulps} {dtype} ulps apart at "
                             f"{int(far.sum())} of {x.numel()} entries\n"
                             f"{_listing(far, x, y, dtype)}")


def assert_tensors_close_ulps(got: dict, ref: dict, *, ulps: int, msg: str = "") -> None:
    """Two ``{name: tensor}`` maps (exported scales, say): the same names, each pair of the same
    dtype and shape and within ``ulps`` ulps (``assert_close_ulps``)."""
    if got.keys() != ref.keys():
        raise AssertionError(f"{_where(msg)}names differ: {sorted(got.keys() ^ ref.keys())}")
    for name, t in ref.items():
        if got[name].dtype != t.dtype:
            raise AssertionError(f"{_where(msg)}{name}: dtype {got[name].dtype}, "
                                 f"expected {t.dtype}")
        assert_close_ulps(got[name], t, ulps=ulps, msg=f"{msg} {name}".strip())
