"""``ReplayRecords``: what a replay records besides its tracks (norm units, multipliers)."""
import pytest
import torch

from geoscale_fx.analysis.index.index_track import Track
from geoscale_fx.analysis.index.replay_records import ReplayRecords
from geoscale_fx.sites.terms import Rotary


def _records(values: dict, constant: bool = True) -> ReplayRecords:
    return ReplayRecords(lambda node: values.get(node), is_constant=lambda node: constant)


def test_a_constant_per_position_table_is_a_multiplier_with_its_max_modulus():
    track = Track.root((2, 3, 4), offset=8)                    # features 8..11
    records = _records({"t": torch.tensor([[0.5], [-3.0], [2.0]])})
    assert records.multiplier("t", track) == pytest.approx(3.0)
    ((bound, features),) = records.multipliers
    assert bound == pytest.approx(3.0)
    assert features.tolist() == [8, 9, 10, 11]


@pytest.mark.parametrize("values, constant", [
    (torch.tensor([[1.0, 2.0]]), True),            # varies along the last dim: not a scalar
    (torch.tensor([[2.0]]), False),                # depends on an input
    (torch.tensor(2.0), True),                     # a 0-d value is a scalar constant, not a table
])
def test_anything_else_is_no_multiplier_and_nothing_is_recorded(values, constant):
    records = _records({"t": values}, constant)
    assert records.multiplier("t", Track.root((3, 2))) is None
    assert records.multipliers == []


def test_evaluate_hides_meta_and_non_tensor_values():
    records = _records({"meta": torch.empty(2, device="meta"), "int": 3,
                        "real": torch.ones(2)})
    assert records.evaluate("meta") is None and records.evaluate("int") is None
    assert torch.equal(records.evaluate("real"), torch.ones(2))


def test_norm_units_and_rotaries_are_kept_as_recorded():
    records = ReplayRecords(lambda node: None)
    rotary = Rotary("rotate_half", 1.0, True, (1, 0), "cos", "sin")
    records.record(rotary)
    records.record_norm(3, 16, {5: 0, 6: 1})
    assert records.rotaries == [rotary]
    assert records.norms == {3: (16, {5: 0, 6: 1})}
    assert records.sums == [] and records.partners == []
