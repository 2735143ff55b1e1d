"""``python -m bench.gpu``: one command that runs every CUDA path of geoscale-fx in minutes.

Written for a GPU machine that is lent rarely and briefly, with no network (one H200, torch
2.11+cu130, Triton, transformers and accelerate; nothing else installed, the repository
copied in): ≤ 8 minutes, no install, every check under its own time limit. It prints the
versions it found, then one line per check as it completes, and writes
``<out>/gpu-<timestamp>/report.md`` and ``results.json`` (rewritten after every check, so a
run cut short keeps what it measured)::

    PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 python -m bench.gpu --out "$OUT"   # GPU machine
    python -m bench.gpu                          # no CUDA: the rehearsal, CPU, tiny shapes
    python -m bench.gpu --checks fp8_qkv flex    # some checks only
    python -m bench.gpu --tiny                   # on CUDA, at the rehearsal's shapes

The checks (``bench.gpu.checks.CHECKS``, one module each): ``suite`` (the suite's CUDA tests),
``fp8_qkv`` (FlashAttention-3's FP8 kernel), ``flex`` (the fused FP8-logit lowering under
Inductor), ``kv_cache`` (``generate`` with the FP8 cache), ``sigma`` (the certified refresh
against a training step), ``export`` (``export_kv_scales`` / ``attention_scales``).

Without a CUDA device the same code runs at tiny shapes on the CPU paths, and every row's
CUDA verdict is "not run: no CUDA device"; its figures are the rehearsal's, never CUDA's.
``tests/test_bench_gpu.py`` runs the rehearsal, so the command cannot rot unseen.
"""
