"""Index tracking (``index_replay.replay`` / ``Track``) on small captured graphs.

Each module computes ``P = linear(LayerNorm(x))`` and then moves ``P``'s elements around
(views, splits, GQA expansion, rotary embeddings ...). The tracked ``feat``/``tok`` index tensors
at the operand are compared with the same torch ops applied to plain index tensors shaped like
``P``, computed here independently of the pass.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import geoscale_fx
from geoscale_fx.analysis.fx.graph_ops import op_of
from geoscale_fx.analysis.index.index_replay import Track, Unsupported, replay
from geoscale_fx.analysis.index.replay_records import ReplayRecords
from tests.analysis_checks import Captured

B, L, D, H, DH = 2, 6, 32, 4, 8
KV = 2  # key/value heads of the GQA cases


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------

class Projected(nn.Module):
    """``movement(linear(LayerNorm(x)), module, x)``; returns a tuple of operands."""

    def __init__(self, movement, features: int = D, bias: bool = True):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.proj = nn.Linear(D, features, bias=bias)
        self.temperature = nn.Parameter(torch.full((1,), 0.7))
        self.head_bias = nn.Parameter(torch.randn(1, H, 1, DH))
        self.movement = movement

    def forward(self, x):
        out = self.movement(self.proj(self.norm(x)), self, x)
        return out if isinstance(out, tuple) else (out,)


def _capture(module: nn.Module) -> Captured:
    return Captured.of(module, torch.randn(B, L, D))


def _root_indices(features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``feat``/``tok`` of the projection output, built without ``Track.root``."""
    feat = torch.arange(features, dtype=torch.int32).repeat(B, L, 1)
    tok = torch.arange(B * L, dtype=torch.int32).reshape(B, L, 1).repeat(1, 1, features)
    return feat, tok


def _expected(movement, features: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The movement applied to the root index tensors: (feat, tok) per returned operand."""
    feat, tok = _root_indices(features)
    out_f, out_t = movement(feat, None, None), movement(tok, None, None)
    if not isinstance(out_f, tuple):
        out_f, out_t = (out_f,), (out_t,)
    return list(zip(out_f, out_t))


def _assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert tuple(actual.shape) == tuple(expected.shape)
    assert torch.equal(actual.long(), expected.long())


def _heads(p, n_heads=H):
    return p.view(B, L, n_heads, DH).transpose(1, 2)


def _rotate_half(t):
    return torch.cat((-t[..., DH // 2:], t[..., :DH // 2]), dim=-1)


def _rotate_every_two(t):
    return torch.stack((-t[..., 1::2], t[..., ::2]), dim=-1).flatten(-2)


def _frequencies():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, DH, 2).float() / DH))
    return torch.arange(L).float()[:, None] * inv_freq[None, :]          # (L, DH/2)


def _cat_angles():
    f = _frequencies()
    return torch.cat((f, f), dim=-1)


def _interleaved_angles():
    return _frequencies().repeat_interleave(2, dim=-1)


def _distinct_frequencies(positions: int):
    """(positions, DH) angles with DH different frequencies (no two columns equal)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 2 * DH, 2).float() / (2 * DH)))
    return torch.arange(positions).float()[:, None] * inv_freq[None, :]


def _rope(q, angles, turn=_rotate_half):
    return q * angles.cos() + turn(q) * angles.sin()


class Attention(nn.Module):
    """``sdpa(q, k, k)`` where ``(q, k) = operands(q, k, module, x)`` and q, k are
    ``linear(LayerNorm(x))`` viewed as heads; ``table`` is an optional angle buffer."""

    def __init__(self, operands, table=None):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.q, self.k = nn.Linear(D, D), nn.Linear(D, D)
        self.operands = operands
        if table is not None:
            self.register_buffer("table", table)

    def forward(self, x):
        h = self.norm(x)
        q, k = self.operands(_heads(self.q(h)), _heads(self.k(h)), self, x)
        return F.scaled_dot_product_attention(q, k, k)


def _site(module: nn.Module):
    (site,) = geoscale_fx.find_attention(module, torch.randn(B, L, D))
    return site


# --------------------------------------------------------------------------------------
# Data movement: feat / tok follow the ops exactly
# --------------------------------------------------------------------------------------

def _gqa_expand(p, *_):
    k = _heads(p, KV)
    return k[:, :, None].expand(B, KV, H // KV, L, DH).reshape(B, H, L, DH)


MOVEMENTS = {
    "view_transpose": (D, lambda p, *_: _heads(p)),
    "reshape_permute": (D, lambda p, *_: p.reshape(B, L, H, DH).permute(0, 2, 1, 3)),
    "unflatten_movedim": (D, lambda p, *_: p.unflatten(-1, (H, DH)).movedim(2, 1)),
    "split_fused": (3 * D, lambda p, *_: tuple(_heads(t) for t in p.split(D, dim=-1)[:2])),
    "chunk_fused": (3 * D, lambda p, *_: tuple(_heads(t) for t in torch.chunk(p, 3, -1)[:2])),
    "slice_fused": (3 * D, lambda p, *_: (_heads(p[..., :D]), _heads(p[..., D:2 * D]))),
    "interleaved_per_head": (3 * D, lambda p, *_: tuple(
        t.transpose(1, 2) for t in p.view(B, L, H, 3 * DH).split(DH, dim=-1)[:2])),
    "unbind_qkv": (3 * D, lambda p, *_: tuple(
        p.reshape(B, L, 3, H, DH).permute(2, 0, 3, 1, 4).unbind(0)[:2])),
    "gqa_expand_reshape": (KV * DH, _gqa_expand),
    "gqa_repeat_interleave": (KV * DH, lambda p, *_: _heads(p, KV).repeat_interleave(
        H // KV, dim=1)),
    "merged_heads_key_t": (D, lambda p, *_: _heads(p).reshape(B * H, L, DH).transpose(1, 2)),
    "narrow_select": (D, lambda p, *_: p.narrow(-1, DH, 2 * DH).contiguous()
                      .view(B, L, 2, DH).select(2, 1)),
    "cat_swapped_halves": (D, lambda p, *_: _heads(torch.cat((p[..., D // 2:],
                                                              p[..., :D // 2]), dim=-1))),
    "stack_heads": (D, lambda p, *_: torch.stack((p[..., :DH], p[..., 2 * DH:3 * DH]), dim=1)),
}


@pytest.mark.parametrize("name", sorted(MOVEMENTS))
def test_feature_and_token_indices_follow_the_data_movement(name):
    """feat/tok at each operand equal the same ops applied to arange(F) / arange(B·L) shaped
    like the projection; no gain or rotation is introduced by pure data movement."""
    features, movement = MOVEMENTS[name]
    captured = _capture(Projected(movement, features))
    expected = _expected(movement, features)
    assert len(captured.operands) == len(expected)
    for operand, (feat, tok) in zip(captured.operands, expected):
        trace = captured.trace(operand)
        assert op_of(trace.projection.root) == "linear"
        assert trace.projection.weight.name == "l_self_modules_proj_parameters_weight_"
        _assert_same(trace.track.feat, feat)
        _assert_same(trace.track.tok, tok)
        assert bool((trace.track.gain == 1).all())
        assert bool((trace.track.rot == 0).all())


def test_replay_keeps_split_parts_as_a_tuple_of_tracks():
    """``replay`` maps a split to one Track per part and each getitem to its part's columns."""
    captured = _capture(Projected(lambda p, *_: p.split(D, dim=-1), features=3 * D))
    root = captured.node(torch._C._nn.linear)
    nodes = list(captured.gm.graph.nodes)
    path = [n for n in nodes[nodes.index(root):] if n.op == "call_function"
            or n.op == "call_method"]
    env = replay(path, root, captured.records())
    split = next(n for n in path if op_of(n) == "split")
    assert isinstance(env[split], tuple) and len(env[split]) == 3
    assert all(isinstance(t, Track) for t in env[split])
    for i, part in enumerate(captured.operands):
        assert op_of(part) == "getitem"
        expected = torch.arange(i * D, (i + 1) * D, dtype=torch.int32).expand(B, L, D)
        _assert_same(env[part].feat, expected)
    assert env[root].shape == (B, L, 3 * D)


def test_replay_without_recorded_shape_is_unsupported():
    """A root without Dynamo's example value (plain symbolic_trace) names the projection."""
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(D, D)))
    root = next(n for n in gm.graph.nodes if n.op == "call_module")
    with pytest.raises(Unsupported, match=rf"projection `{root.name}` has no recorded shape"):
        replay([root], root, ReplayRecords(lambda node: None))


def test_track_root_indices():
    """``Track.root`` gives feature column, flat token row, unit gain and no rotation."""
    track = Track.root((B, L, 3 * D))
    feat, tok = _root_indices(3 * D)
    _assert_same(track.feat, feat)
    _assert_same(track.tok, tok)
    assert bool((track.gain == 1).all()) and bool((track.rot == 0).all())
    assert track.shape == (B, L, 3 * D)


# --------------------------------------------------------------------------------------
# Scalar factors and signs: tracked in gain
# --------------------------------------------------------------------------------------

GAINS = {
    "mul_const": (lambda q: q * 0.5, 0.5),
    "div_const": (lambda q: q / 4, 0.25),
    "neg_operator": (lambda q: -q, -1.0),
    "torch_neg_times_quarter_root": (lambda q: torch.neg(q) * DH ** -0.25, -(DH ** -0.25)),
    "const_first_and_methods": (lambda q: 2.0 * q.mul(3) / 8, 0.75),
    "div_method_then_neg": (lambda q: q.div(2).neg(), -0.5),
    "sqrt_scale_then_cast": (lambda q: (q / math.sqrt(DH)).float().contiguous(), DH ** -0.5),
}


@pytest.mark.parametrize("name", sorted(GAINS))
def test_scalar_factors_and_signs_are_tracked_in_gain(name):
    """Scalar mul/div/neg leave feat unchanged and multiply gain by the constant."""
    fn, expected_gain = GAINS[name]
    captured = _capture(Projected(lambda p, *_: fn(_heads(p))))
    (operand,) = captured.operands
    track = captured.trace(operand).track
    (feat, _tok), = _expected(lambda p, *_: _heads(p), D)
    _assert_same(track.feat, feat)
    torch.testing.assert_close(track.gain, torch.full(feat.shape, expected_gain))
    assert bool((track.rot == 0).all())


# --------------------------------------------------------------------------------------
# Rotary embeddings
# --------------------------------------------------------------------------------------

class Rotated(nn.Module):
    """RoPE on the projected heads: ``q·m·cos(E) + turn(q)·m·sin(E)``."""

    def __init__(self, turn, angles=None, buffer=None, factor=1.0, sin_turn=None):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.proj = nn.Linear(D, D, bias=False)
        self.turn, self.angles, self.factor = turn, angles, factor
        self.sin_turn = sin_turn
        if buffer is not None:
            self.register_buffer("table", buffer)

    def forward(self, x):
        q = _heads(self.proj(self.norm(x)))
        e = self.angles() if self.angles is not None else self.table
        cos, sin = e.cos(), e.sin()
        if self.factor != 1.0:
            cos, sin = cos * self.factor, sin * self.factor
        return (q * cos + self.turn(q) * sin,)


_HALF_PAIRING = tuple((j + DH // 2) % DH for j in range(DH))
_TWO_PAIRING = tuple(j ^ 1 for j in range(DH))
_HALF_SIGNS = (-1.0,) * (DH // 2) + (1.0,) * (DH // 2)
_TWO_SIGNS = (-1.0, 1.0) * (DH // 2)

ROTARIES = {
    # name: (module factory, style, pairing, signs, factor)
    "rotate_half_cat_angles": (lambda: Rotated(_rotate_half, _cat_angles), "rotate_half",
                               _HALF_PAIRING, _HALF_SIGNS, 1.0),
    "interleaved_repeat_angles": (lambda: Rotated(_rotate_every_two, _interleaved_angles),
                                  "interleaved", _TWO_PAIRING, _TWO_SIGNS, 1.0),
    "rotate_half_angle_buffer": (lambda: Rotated(_rotate_half, buffer=_cat_angles()),
                                 "rotate_half", _HALF_PAIRING, _HALF_SIGNS, 1.0),
    "scaled_tables": (lambda: Rotated(_rotate_half, _cat_angles, factor=0.5), "rotate_half",
                      _HALF_PAIRING, _HALF_SIGNS, 0.5),
}


@pytest.mark.parametrize("name", sorted(ROTARIES))
def test_rotary_embedding_is_recognised_and_verified(name):
    """x·cos + rot(x)·sin becomes one Track (the cos term's indices, rot = factor) and one
    verified Rotary record with the expected style, pairing and signs (structural proof for
    cat/repeat_interleave angles, numeric proof for an angle buffer)."""
    factory, style, pairing, signs, factor = ROTARIES[name]
    captured = _capture(factory())
    (operand,) = captured.operands
    records = captured.records()
    track = captured.trace(operand, records).track
    (feat, tok), = _expected(lambda p, *_: _heads(p), D)
    _assert_same(track.feat, feat)
    _assert_same(track.tok, tok)
    assert bool((track.gain == 1).all())
    torch.testing.assert_close(track.rot, torch.full(feat.shape, factor))
    (rotary,) = records.rotaries
    assert rotary.style == style
    assert rotary.pairing_verified is True
    assert rotary.factor == pytest.approx(factor)
    assert rotary.pairing == pairing
    assert rotary.signs == signs
    mul_cos, mul_sin = operand.args
    assert (rotary.cos_node, rotary.sin_node) == (mul_cos.args[1].name, mul_sin.args[1].name)


def test_rotary_with_unpaired_buffer_angles_has_its_gain_measured():
    """Tables that are not ``cos(E)``/``sin(E)`` of one angle per pair, but evaluable (a
    buffer): the gain is measured, and equals ``max_m ‖R_m‖₂`` of the dense per-position
    rotation matrices built here from the tables."""
    angles = torch.randn(L, DH) * 3
    captured = _capture(Rotated(_rotate_half, buffer=angles))
    (operand,) = captured.operands
    records = captured.records()
    track = captured.trace(operand, records).track
    (rotary,) = records.rotaries
    cos, sin = angles.double().cos(), angles.double().sin()
    dense = torch.diag_embed(cos)                                     # (L, DH, DH)
    rows = torch.arange(DH)
    dense[:, rows, torch.tensor(_HALF_PAIRING)] = sin * torch.tensor(_HALF_SIGNS).double()
    expected = float(torch.linalg.matrix_norm(dense, ord=2).max())
    assert 1.0 < expected < math.sqrt(2.0)
    assert rotary.style == "rotate_half" and rotary.pairing_verified is True
    assert rotary.factor == pytest.approx(expected, rel=1e-6)
    torch.testing.assert_close(track.rot, torch.full((B, H, L, DH), expected))


class InputRotated(nn.Module):
    """rotate_half with angles from positions passed in (not evaluable at compile time)
    whose paired entries differ."""

    def __init__(self):
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(D), nn.Linear(D, D, bias=False)
        self.register_buffer("freq", torch.rand(DH) + 0.1)

    def forward(self, x, positions):
        q = _heads(self.proj(self.norm(x)))
        e = positions[:, None] * self.freq
        return (q * e.cos() + _rotate_half(q) * e.sin(),)


def test_rotary_with_unpaired_angles_from_inputs_is_unverified_and_pays_sqrt2():
    """Angles whose pairing cannot be shown nor evaluated: factor √2, unverified."""
    captured = Captured.of(InputRotated(), torch.randn(B, L, D), torch.arange(L).float())
    (operand,) = captured.operands
    records = captured.records()
    track = captured.trace(operand, records).track
    (rotary,) = records.rotaries
    assert rotary.style == "rotate_half" and rotary.pairing_verified is False
    assert rotary.factor == pytest.approx(math.sqrt(2.0))
    torch.testing.assert_close(track.rot, torch.full((B, H, L, DH), math.sqrt(2.0)))


def _sliced_cat_rope(q):
    """rotate_half with tables sliced from ``cat((f, f))`` of width 2·DH: columns j and
    j + DH/2 of the slice hold different frequencies (f has DH of them)."""
    e = torch.cat((_distinct_frequencies(L),) * 2, dim=-1)
    return q * e.cos()[..., :DH] + _rotate_half(q) * e.sin()[..., :DH]


def _position_repeat_rope(q):
    """Interleaved RoPE whose angles repeat *positions* (dim 0), not channels."""
    e = _distinct_frequencies(L // 2).repeat_interleave(2, dim=0)
    return _rope(q, e, _rotate_every_two)


MISPAIRED = {
    "cat_angles_sliced_to_the_head": (_sliced_cat_rope, "rotate_half"),
    "repeat_interleave_over_positions": (_position_repeat_rope, "interleaved"),
}


def _max_gain(rope) -> float:
    """max over positions of ‖R‖₂ (R: the per-position map q ↦ rope(q) on one head)."""
    basis = torch.eye(DH)[:, None, None, :].expand(DH, 1, L, DH)
    columns = rope(basis)[:, 0]                                    # (DH in, L, DH out)
    return float(torch.linalg.matrix_norm(columns.permute(1, 2, 0), ord=2).max())


@pytest.mark.parametrize("name", sorted(MISPAIRED))
def test_rotary_structural_proof_checks_the_angle_width_and_dim(name):
    """A cat/repeat_interleave of angles only proves the pairing when it builds the head's last
    dim: a slice of a wider cat, or a repeat over positions, is no proof. The tables are
    constants here, so the gain is measured instead: it equals max ‖R‖₂ of the dense
    per-position map (computed independently), above 1 and below the √2 fallback."""
    rope, style = MISPAIRED[name]
    captured = _capture(Projected(lambda p, *_: rope(_heads(p))))
    (operand,) = captured.operands
    records = captured.records()
    track = captured.trace(operand, records).track
    (rotary,) = records.rotaries
    gain = _max_gain(rope)
    assert rotary.style == style and rotary.pairing_verified is True
    assert 1.3 < gain < math.sqrt(2.0)
    assert rotary.factor == pytest.approx(gain, rel=1e-5)
    torch.testing.assert_close(track.rot, torch.full((B, H, L, DH), rotary.factor))
    q = torch.randn(4096, 1, L, DH)
    ratio = rope(q).norm(dim=-1) / q.norm(dim=-1)
    assert 1.0 < float(ratio.max()) <= rotary.factor + 1e-6


def _from_input(table, x):
    """``table`` made to depend on the input (positions passed in): not evaluable."""
    return table + 0.0 * x.mean()


class TwiceRotated(Rotated):
    """RoPE with the angle buffer, then the standard (verified) RoPE on its output."""

    def forward(self, x):
        q = _heads(self.proj(self.norm(x)))
        return (_rope(_rope(q, _from_input(self.table, x)), _cat_angles()),)


def _twice_rotated(q, k, m, x):
    return _rope(_rope(q, _from_input(m.table, x)), _cat_angles()), _rope(k, _cat_angles())


def test_second_rotary_multiplies_the_factor_of_the_first():
    """An unverified RoPE (√2) followed by a verified one (1): ``rot`` is the product √2, not
    the last factor; both rotaries are recorded in order."""
    captured = _capture(TwiceRotated(_rotate_half, buffer=torch.randn(L, DH) * 3))
    (operand,) = captured.operands
    records = captured.records()
    track = captured.trace(operand, records).track
    first, second = records.rotaries
    assert (first.pairing_verified, second.pairing_verified) == (False, True)
    assert (first.factor, second.factor) == pytest.approx((math.sqrt(2.0), 1.0))
    torch.testing.assert_close(track.rot, torch.full((B, H, L, DH), math.sqrt(2.0)))


def test_site_rotary_factor_is_the_product_of_both_rotaries():
    """Through find_attention the query side's rotary factor is √2 (both rotations), the
    key's plain RoPE stays 1, and the term's rotation gain is √2."""
    site = _site(Attention(_twice_rotated, table=torch.randn(L, DH) * 3))
    assert site.supported, site.reason
    assert site.q.rotary.factor == pytest.approx(math.sqrt(2.0))
    assert site.k.rotary.factor == pytest.approx(1.0)
    assert site.terms[0].rotation_gain == pytest.approx(math.sqrt(2.0))
    # the site's rotary is verified only if every stacked rotation was
    assert not site.q.rotary.pairing_verified and site.k.rotary.pairing_verified


def _roll_by_one(t):
    return torch.cat((t[..., 1:], t[..., :1]), dim=-1)


def _swap_halves_no_sign(t):
    return torch.cat((t[..., DH // 2:], t[..., :DH // 2]), dim=-1)


class TwoCos(Rotated):
    def forward(self, x):
        q = _heads(self.proj(self.norm(x)))
        e = self.angles()
        return (q * e.cos() + self.turn(q) * e.cos(),)


FAKE_ROTARIES = {
    "cyclic_shift": (lambda: Rotated(_roll_by_one, _cat_angles), "is not a pairwise swap"),
    "swap_without_sign": (lambda: Rotated(_swap_halves_no_sign, _cat_angles),
                          "wrong signs for a rotation"),
    "two_cos_terms": (lambda: TwoCos(_rotate_half, _cat_angles), "one cos and one sin term"),
}


@pytest.mark.parametrize("name", sorted(FAKE_ROTARIES))
def test_fake_rotary_is_unsupported_naming_the_add(name):
    """cos/sin-shaped sums that are not rotations raise Unsupported naming the ``add`` node."""
    factory, reason = FAKE_ROTARIES[name]
    captured = _capture(factory())
    (operand,) = captured.operands
    assert op_of(operand) == "add"
    with pytest.raises(Unsupported, match=reason) as info:
        captured.trace(operand)
    assert f"`{operand.name}`" in str(info.value)


def test_half_of_a_rotary_is_unsupported():
    """``q·cos`` returned as an operand, or reshaped on its own, is refused."""
    def movement(p, m, x):
        q = _heads(p)
        half = q * _cat_angles().cos()
        return half, half.transpose(2, 3)

    captured = _capture(Projected(movement))
    half, transposed = captured.operands
    with pytest.raises(Unsupported, match=rf"the query `{half.name}` is half of a rotary"):
        captured.trace(half)
    with pytest.raises(Unsupported, match=rf"`{transposed.name}` \(transpose\) uses half of a "
                                          "rotary embedding on its own"):
        captured.trace(transposed)


# --------------------------------------------------------------------------------------
# Anything else on the path is refused, naming the node
# --------------------------------------------------------------------------------------

NON_MOVEMENT = {
    "relu": (lambda q: torch.relu(q), torch.relu),
    "exp_method": (lambda q: q.exp(), "exp"),
    "tanh": (lambda q: torch.tanh(q), torch.tanh),
    "sigmoid_then_view": (lambda q: q.sigmoid().transpose(2, 3), "sigmoid"),
}


@pytest.mark.parametrize("name", sorted(NON_MOVEMENT))
def test_non_data_movement_op_is_unsupported_and_named(name):
    """A value-changing op between projection and operand raises Unsupported naming it."""
    fn, target = NON_MOVEMENT[name]
    captured = _capture(Projected(lambda p, *_: fn(_heads(p))))
    (operand,) = captured.operands
    bad = captured.node(target)
    with pytest.raises(Unsupported, match="is not a reshape, slice, cast, scalar scale or "
                                          "rotary embedding") as info:
        captured.trace(operand)
    assert str(info.value).startswith(f"`{bad.name}` (")


BAD_PATHS = {
    "training_dropout": (lambda p, m, x: F.dropout(_heads(p), 0.1, training=True),
                         "dropout", r"dropout \(training\) applied to queries/keys"),
    "bias_after_reshape": (lambda p, m, x: _heads(p) + m.head_bias, "add",
                           "adds to the query/key something other than a rotary"),
    "learned_temperature": (lambda p, m, x: _heads(p) * m.temperature, "mul",
                            "neither a constant nor a rotary cos/sin table"),
    "divide_by_query": (lambda p, m, x: 1.0 / _heads(p), "div", "divides by the query/key"),
    "divide_by_zero": (lambda p, m, x: _heads(p) / 0.0, "div", "divides the query/key by zero"),
    "kv_cache_concat": (lambda p, m, x: torch.cat((_heads(x), _heads(p)), dim=-2), "cat",
                        r"does not come from the projection \(e\.g\. a KV cache\)"),
}


@pytest.mark.parametrize("name", sorted(BAD_PATHS))
def test_other_unsupported_paths_name_the_node(name):
    """Training dropout, a bias added after the head split, a non-constant factor, dividing by
    the operand, concatenating a non-projection (KV cache) and summing parts are refused; the
    message starts with the offending node."""
    movement, op, reason = BAD_PATHS[name]
    captured = _capture(Projected(movement))
    (operand,) = captured.operands
    (bad,) = [n for n in captured.gm.graph.nodes if op_of(n) == op]
    with pytest.raises(Unsupported, match=reason) as info:
        captured.trace(operand)
    assert f"`{bad.name}`" in str(info.value)


def test_eval_dropout_and_casts_are_transparent():
    """Dropout with training=False (or p=0) and dtype casts keep feat/tok/gain unchanged."""
    def movement(p, *_):
        q = _heads(p)
        return (F.dropout(q, 0.5, training=False), F.dropout(q.double().float(), 0.0),
                q.detach().clone())

    captured = _capture(Projected(movement))
    (feat, tok), = _expected(lambda p, *_: _heads(p), D)
    assert len(captured.operands) == 3
    for operand in captured.operands:
        track = captured.trace(operand).track
        _assert_same(track.feat, feat)
        _assert_same(track.tok, tok)
        assert bool((track.gain == 1).all())


def _key_cast_like_query(q, k, m, x):
    """The key is the raw input as heads; the query only supplies its dtype."""
    return q, _heads(x).type_as(q)


def test_cast_taking_the_query_only_as_dtype_reference_is_unsupported():
    """``x.type_as(q)`` has x's values, not q's: tracing it as the query's projection is
    refused, naming the cast."""
    captured = _capture(Projected(lambda p, m, x: _key_cast_like_query(_heads(p), None, m, x)))
    _query, key = captured.operands
    assert op_of(key) == "cast" and key.target == "type_as"
    with pytest.raises(Unsupported, match="takes the query/key only as a dtype reference"
                       ) as info:
        captured.trace(key)
    assert str(info.value).startswith(f"`{key.name}` (cast)")


def test_site_whose_key_is_cast_like_the_query_is_bounded_by_its_own_values():
    """find_attention does not take the query's projection for a key that only borrows the
    query's dtype: the key is the input itself, bounded by its actual norms (an observed
    side on the key operand), never by the query's weights."""
    site = _site(Attention(_key_cast_like_query))
    assert site.supported, site.reason
    assert site.k.observed and site.k.weight is None


def test_site_summing_two_parts_of_one_projection_is_unsupported():
    """Two halves of one projection added: not two maps of the same features (a LoRA
    adapter is), so the site is refused naming the attention."""
    site = _site(Attention(lambda q, k, m, x: (q[..., :DH // 2].repeat(1, 1, 1, 2)
                                               + q[..., DH // 2:].repeat(1, 1, 1, 2), k)))
    assert site.supported is False
    assert "a mix of two projections" in site.reason


def test_site_dividing_the_query_by_zero_is_unsupported():
    """``q / 0.0`` gives an unsupported site with the reason, not a ZeroDivisionError."""
    site = _site(Attention(lambda q, k, m, x: (q / 0.0, k)))
    assert site.supported is False
    assert "divides the query/key by zero" in site.reason


class _TwoAngleRope(torch.nn.Module):
    """cos of one angle table, sin of another: not a rotation, its 2×2 blocks reach norm 2."""

    def __init__(self, from_input: bool = False):
        super().__init__()
        self.from_input = from_input
        self.norm, self.qk = torch.nn.LayerNorm(32), torch.nn.Linear(32, 64)
        # block [[cos 0, −sin(−π/2)], [sin(π/2), cos 0]] = [[1, 1], [1, 1]]: norm 2
        self.register_buffer("a", torch.zeros(6, 8))
        self.register_buffer("b", torch.tensor([-math.pi / 2] * 4 + [math.pi / 2] * 4)
                             .expand(6, 8).clone())

    def forward(self, x):
        q, k = self.qk(self.norm(x)).view(2, 6, 2, 4, 8).transpose(2, 3).unbind(-2)
        q, k = q.transpose(1, 2), k.transpose(1, 2)                     # (B, H, L, 8)

        a, b = (_from_input(self.a, x), _from_input(self.b, x)) if self.from_input else \
            (self.a, self.b)

        def rotate(t):
            return t * a.cos() + torch.cat((-t[..., 4:], t[..., :4]), -1) * b.sin()
        return torch.nn.functional.scaled_dot_product_attention(rotate(q), rotate(k), k)


@pytest.mark.parametrize("from_input", [False, True])
def test_cos_and_sin_of_different_angles_pay_a_factor_two(from_input):
    """The old √2 assumed rows of norm ≤ 1, true only when cos and sin share each angle.
    Tables from the input pay the certified 2; constant tables have the gain measured, which
    here is the dense maps' own worst norm (2)."""
    import geoscale_fx

    site, = geoscale_fx.find_attention(_TwoAngleRope(from_input), torch.randn(2, 6, 32))
    # the map is not norm preserving: per token, max ‖R x‖/‖x‖ over x exceeds √2 here
    m = _TwoAngleRope()
    worst = 0.0
    for pos in range(6):
        c, s_ = m.a.cos()[pos], m.b.sin()[pos]
        rows = torch.zeros(8, 8)
        for j in range(8):
            rows[j, j] = c[j]
            partner = (j + 4) % 8
            rows[j, partner] = s_[j] * (-1.0 if j < 4 else 1.0)
        worst = max(worst, float(torch.linalg.matrix_norm(rows, ord=2)))
    assert math.sqrt(2.0) < worst <= 2.0 + 1e-6
    assert site.supported and site.q.rotary.pairing_verified is not from_input
    assert site.q.rotary.factor == pytest.approx(2.0 if from_input else worst, rel=1e-6)


class _SliceAfterRope(torch.nn.Module):
    """RoPE on 8-wide heads, then only the first 4 channels reach attention."""

    def __init__(self):
        super().__init__()
        self.norm, self.qk = torch.nn.LayerNorm(32), torch.nn.Linear(32, 64)
        angles = torch.arange(6)[:, None] * torch.linspace(0.3, 2.0, 4)
        self.register_buffer("e", torch.cat((angles, angles), -1))

    def forward(self, x):
        q, k = self.qk(self.norm(x)).view(2, 6, 2, 4, 8).transpose(2, 3).unbind(-2)
        q, k = q.transpose(1, 2), k.transpose(1, 2)                     # (B, H, L, 8)

        def rotate(t):
            return t * self.e.cos() + torch.cat((-t[..., 4:], t[..., :4]), -1) * self.e.sin()
        q, k = rotate(q)[..., :4], rotate(k)[..., :4]
        return torch.nn.functional.scaled_dot_product_attention(q, k, k)


def test_a_slice_after_rope_is_unsupported():
    """The kept channels mix in their dropped partners' weights: no bound from A[:, :4]."""
    import geoscale_fx

    site, = geoscale_fx.find_attention(_SliceAfterRope(), torch.randn(2, 6, 32))
    assert not site.supported and "half of a rotated pair" in site.reason
