"""Where this machine cannot run Inductor's CPU flex_attention template (torch's own check:
AVX2 with vectorized ATen kernels, not macOS, no XPU), geoscale plans the explicit lowering
instead of the fused one; the tests that compile the fused lowering are skipped there, saying
why."""
from __future__ import annotations

import pytest

from geoscale_fx.kernels.logit_attention import inductor_cpu_fused_unsupported


def skip_where_the_cpu_cannot_fuse() -> None:
    """Skip the calling test where Inductor's CPU flex_attention template does not run."""
    reason = inductor_cpu_fused_unsupported()
    if reason:
        pytest.skip(f"{reason}: geoscale plans the explicit lowering here "
                    "(tests/planning/test_plan.py)")
