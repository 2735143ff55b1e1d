"""The scenarios of ``python -m bench``, in order."""
from bench.runner import Scenario
from bench.scenarios.calibration import quality, utilization
from bench.scenarios.decoding import inference
from bench.scenarios.distributed import scale_out
from bench.scenarios.kv_cache import fp8_kv_cache
from bench.scenarios.performance import overhead, seq_len_sweep
from bench.scenarios.rl import rl_rollouts
from bench.scenarios.tables import alpha_table, spectral_norms
from bench.scenarios.transients import first_forward, lr_spike, resume, weight_spike

SCENARIOS = [
    Scenario("pretrained", "1. First forward after loading a pretrained checkpoint",
             first_forward),
    Scenario("resume", "2. Resume with a fresh scaling state", resume),
    Scenario("lr-spike", "3. 100x learning-rate spike", lr_spike),
    Scenario("weight-spike", "4. 4x attention-weight spike", weight_spike),
    Scenario("overhead", "5. Overhead against plain Inductor", overhead, timed=True),
    Scenario("seq-len", "6. Sequence-length sweep: fused vs materialized", seq_len_sweep,
             timed=True),
    Scenario("utilization", "7. FP8 utilization: delayed, theory-alpha, auto-alpha", utilization),
    Scenario("alpha-table", "8. alpha_min / gamma table", alpha_table),
    Scenario("spectral-norms", "9. Spectral norms of the pretrained models", spectral_norms),
    Scenario("quality", "10. Fine-tuning quality", quality),
    Scenario("inference", "11. Inference: greedy decoding with a KV cache", inference,
             timed=True),
    Scenario("fp8-kv-cache", "12. FP8 KV cache: scales from the weights, 1.0, first batch, "
             "ideal", fp8_kv_cache),
    Scenario("distributed", "13. Scale-out: 2 CPU processes, TP and FSDP2", scale_out,
             default=False, timed=True),
    Scenario("rl", "14. RL rollouts with an FP8 KV cache: rollout-trainer log-ratios per "
             "source of k/v scales", rl_rollouts, default=False, timed=True),
]

__all__ = ["SCENARIOS"]
