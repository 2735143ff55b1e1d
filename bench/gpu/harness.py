"""What every check of ``python -m bench.gpu`` runs in: its setting, its pieces, its time limit.

A check is a function ``check(ctx: CheckContext) -> None``. It runs its work as **pieces**
(``ctx.run(name, estimate_s, fn)``), each timed and recorded; a piece that raises is recorded
as failed (``"failed: <error>"``) and the check goes on with the next one, so one broken path
never hides the others' figures. The check's **time limit** is checked before every piece: once
it has passed, ``ctx.run`` raises ``TimeLimit`` and the row says "stopped at its time limit
after …" with the pieces that ran (a piece already running is never interrupted: CUDA work
cannot be cut safely; the estimates keep pieces short). Figures are numbers
(``ctx.figure``); what is not a number goes to the notes.

``run_check`` turns one check into a ``Row``: on a machine without CUDA its ``cuda`` verdict is
always "not run: no CUDA device" — the figures of such a run come from the CPU rehearsal at
tiny shapes and are never CUDA figures.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch

__all__ = ["Shapes", "LLAMA3_8B", "TINY", "Setting", "TimeLimit", "CheckContext", "Row",
           "Check", "run_check", "device_seconds", "peak_bytes", "NO_CUDA"]

NO_CUDA = "not run: no CUDA device"


@dataclass(frozen=True)
class Shapes:
    """The model and call shapes a run uses (one Llama layer's geometry and the grid)."""
    name: str
    d: int                  # model width
    n_q: int                # query heads
    n_kv: int               # key/value heads
    d_h: int                # head width
    mlp: int                # MLP width
    vocab: int
    layers: int
    batches: tuple          # batch sizes of the timing grids
    lengths: tuple          # sequence lengths of the timing grids
    new_tokens: int         # tokens generated per generate call
    step_tokens: int        # tokens of the training step the σ refresh is compared with


#: Llama-3-8B (config.json of Meta-Llama-3-8B); batches 1-8, sequences 2k-8k (issue 41)
LLAMA3_8B = Shapes("Llama-3-8B", d=4096, n_q=32, n_kv=8, d_h=128, mlp=14336, vocab=128256,
                   layers=32, batches=(1, 8), lengths=(2048, 8192), new_tokens=32,
                   step_tokens=4096)
#: the CPU rehearsal: the same code at the suite's tiny shapes (a 2-layer Llama, hidden 64),
#: one point per grid (every loop still runs its body)
TINY = Shapes("tiny (2-layer Llama, hidden 64)", d=64, n_q=4, n_kv=2, d_h=16, mlp=128,
              vocab=128, layers=2, batches=(2,), lengths=(32,), new_tokens=4, step_tokens=64)


@dataclass(frozen=True)
class Setting:
    """Where a run computes: the device, its shapes, the dtype of the attention inputs, the
    compiler of the compiled pieces (Inductor on CUDA; ``aot_eager`` on the CPU rehearsal, where
    an Inductor compile of flex_attention takes tens of seconds) and a scratch directory."""
    device: str
    shapes: Shapes
    compiler: str
    scratch: str
    dtype: torch.dtype = torch.bfloat16

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


class TimeLimit(Exception):
    """A check's time limit passed between two of its pieces."""


@dataclass
class Row:
    """One check's line of the report (``results.json`` holds ``asdict(row)``)."""
    check: str
    title: str
    proves: str
    device: str
    cuda: str = NO_CUDA
    status: str = ""
    figures: dict = field(default_factory=dict)
    pieces: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    seconds: float = 0.0
    cpu_s: float = 0.0          # this process's CPU time (a subprocess's is not counted)
    limit_s: float = 0.0
    estimate_s: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Check:
    """A check: its key, the title of its row, what its figures prove, its function, its time
    limit and the estimate of its time on one H200 (the sum of its pieces' estimates)."""
    key: str
    title: str
    proves: str
    fn: Callable[["CheckContext"], None]
    limit_s: float
    estimate_s: float


class CheckContext:
    """The pieces, figures and notes of one check while it runs (module docstring)."""

    def __init__(self, setting: Setting, limit_s: float, clock: Callable[[], float] = None):
        self.setting = setting
        self.limit_s = limit_s
        self.clock = clock or time.perf_counter
        self.start = self.clock()
        self.pieces: list[dict] = []
        self.figures: dict[str, float] = {}
        self.notes: list[str] = []

    def elapsed(self) -> float:
        return self.clock() - self.start

    def run(self, name: str, estimate_s: float, fn: Callable[[], Any]) -> Any:
        """``fn()`` as the piece ``name`` (its result, or None when it failed); raises
        ``TimeLimit`` when the check's limit has passed before it starts."""
        if self.elapsed() >= self.limit_s:
            raise TimeLimit(name)
        began = self.clock()
        try:
            result = fn()
            status = "ran"
        except TimeLimit:
            raise
        except Exception as exc:     # the piece's failure is its record; the check goes on
            result, status = None, f"failed: {_one_line(exc)}"
            self.notes.append(f"{name}: {traceback.format_exc(limit=-3).strip()}")
        self.pieces.append({"piece": name, "status": status,
                            "seconds": round(self.clock() - began, 3),
                            "estimate_s": estimate_s})
        return result

    def skip(self, name: str, reason: str) -> None:
        """A piece that does not run here, and why (``reason`` starts with "not run")."""
        self.pieces.append({"piece": name, "status": reason, "seconds": 0.0, "estimate_s": 0.0})

    def figure(self, name: str, value) -> None:
        """A measured number (a tensor of one element is read on the host)."""
        self.figures[name] = float(value)

    def note(self, text: str) -> None:
        self.notes.append(text)


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text if len(text) <= 300 else text[:297] + "..."


def _status(pieces: list[dict]) -> str:
    bad = [p for p in pieces if p["status"] != "ran"]
    if not bad:
        return "ran"
    return (f"ran {len(pieces) - len(bad)} of {len(pieces)} pieces; "
            + "; ".join(f"{p['piece']}: {p['status']}" for p in bad))


def run_check(check: Check, setting: Setting, limit_s: float,
              clock: Callable[[], float] = None) -> Row:
    """Run ``check`` under ``limit_s`` and return its row (never raises)."""
    ctx = CheckContext(setting, limit_s, clock)
    cpu_start = time.process_time()
    row = Row(check.key, check.title, check.proves,
              device=f"{setting.device}, {setting.shapes.name}",
              limit_s=limit_s, estimate_s=check.estimate_s)
    try:
        check.fn(ctx)
        row.status = _status(ctx.pieces)
    except TimeLimit as stop:
        ran = [p["piece"] for p in ctx.pieces]
        row.status = (f"stopped at its time limit ({limit_s:g} s) after {ctx.elapsed():.1f} s,"
                      f" before '{stop}'; pieces done: {', '.join(ran) or 'none'}")
    except Exception as exc:
        row.status = f"failed: {_one_line(exc)}"
        row.notes.append(traceback.format_exc(limit=-3).strip())
    row.seconds = round(ctx.elapsed(), 2)
    row.cpu_s = round(time.process_time() - cpu_start, 2)
    row.pieces, row.notes = ctx.pieces, ctx.notes + row.notes
    row.figures = {k: v for k, v in ctx.figures.items()}
    if setting.cuda:
        row.cuda = row.status
    return row


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def device_seconds(fn: Callable[[], Any], device: str, repeats: int = 5,
                   warmup: int = 1) -> float:
    """Median wall time of ``fn()`` with the device synchronized around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        began = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2]


def peak_bytes(fn: Callable[[], Any], device: str) -> Optional[float]:
    """CUDA memory allocated at the peak of ``fn()`` above what was allocated before it (None
    off CUDA: the CPU allocator keeps no such statistic)."""
    if device != "cuda":
        fn()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return float(torch.cuda.max_memory_allocated() - base)
