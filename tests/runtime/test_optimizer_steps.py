"""``runtime.optimizer_steps``: fused optimizer steps become visible to version counters.

``torch.optim``'s fused kernels write the parameters without bumping their in-place version
counters; once geoscale keeps a ``VersionRecord`` every optimizer step bumps them. Checked
with the records themselves (``holds`` after a step) for each fused optimizer of torch,
and end to end against independent references: ``attention_scales`` after fused AdamW steps
equals the scales a fresh trace of a model holding the same weights gives (the runtime's
refresh is checked the same way in ``test_graph_runtime``)."""
from __future__ import annotations

import pytest
import torch

import geoscale_fx
from geoscale_fx.runtime.version_record import VersionRecord
from tests.hf_models import build_hf

FUSED = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True),
    "Adam": lambda ps: torch.optim.Adam(ps, lr=0.1, fused=True),
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, fused=True),
}


@pytest.mark.parametrize("name", sorted(FUSED))
def test_a_fused_step_breaks_the_record_of_the_weights_it_wrote(name):
    weights = [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(3))]
    frozen = torch.nn.Parameter(torch.randn(2))          # in no optimizer
    optimizer = FUSED[name](weights)
    record = VersionRecord()
    record.update(weights + [frozen])
    sum(w.sum() for w in weights).backward()
    before = [w.detach().clone() for w in weights]
    optimizer.step()
    assert not any(torch.equal(b, w) for b, w in zip(before, weights))   # it did write
    assert not record.holds(weights, [0, 1])
    assert record.holds([frozen], [2])


def test_an_optimizer_created_before_the_first_record_is_followed():
    """The hook is global: it sees optimizers whatever their age."""
    weight = torch.nn.Parameter(torch.randn(4))
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=True)
    record = VersionRecord()
    record.update([weight])
    weight.sum().backward()
    optimizer.step()
    assert not record.holds([weight], [0])


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 128, (2, 10), generator=torch.Generator().manual_seed(seed))


@pytest.mark.slow
@pytest.mark.zoo
def test_attention_scales_follow_fused_adamw_steps():
    """transformers' default optimizer (``adamw_torch_fused``) between two calls: the scales
    are those of the weights it wrote, as a fresh trace of a copy finds them."""
    model = build_hf("llama-sdpa")
    first = geoscale_fx.attention_scales(model, _ids())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    for step in range(3):
        ids = _ids(step)
        (10.0 * model(input_ids=ids, labels=ids).loss).backward()
        optimizer.step()
        optimizer.zero_grad()
    after = geoscale_fx.attention_scales(model)
    copy = build_hf("llama-sdpa")
    copy.load_state_dict(model.state_dict())
    fresh = geoscale_fx.attention_scales(copy, _ids())
    assert sorted(after) == sorted(fresh)
    for name in fresh:
        assert torch.equal(after[name], fresh[name]), name     # same operations, same order
    assert any(not torch.equal(first[n], fresh[n]) for n in fresh)   # the steps moved them
