"""The kinds of low-precision linear the analysis reads, and the one question it asks them.

``LINEAR_KINDS`` holds one recognizer per kind: a function of the ATen graph of an opaque
call (``opaque_calls.TracedCall``) returning ``float8_matmul.Found`` or None. A new kind is
one module with its recognizer and one entry here. ``low_precision_linear(node, kinds)``
traces ``node`` (once per call signature: the answer is cached by the call's target, its
tensors' shapes and dtypes, and its constant arguments' values) and returns the first
kind's answer whose input is an activation and whose weight is a function of parameters,
2-D. A call that casts to FP8 or multiplies matrices in a form no kind recognizes, or takes
a tensor subclass no trace can fake, is refused with a reason (``unrecognized_cast``): what
it outputs is not a function the bounds know.

Example (Llama's ``q_proj`` converted by ``convert_to_float8_training``)::

    found = low_precision_linear(output, kinds)
    found.x.name, found.weight.name, found.cast.input.groups   # ('hidden_states_2', 't', 'tensor')
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional, Union

from torch.fx import Node

from geoscale_fx.analysis.fx.graph_ops import ValueKinds, shape_of
from geoscale_fx.analysis.linears.aten_chains import A, FP8_STORAGE, is_op
from geoscale_fx.analysis.linears.float8_matmul import (
    Found, dequantized_mm_linear, scaled_mm_linear,
)
from geoscale_fx.analysis.linears.opaque_calls import (
    CallSignature, TracedCall, call_name, call_signature, traced_call, untraceable_tensor,
)

__all__ = ["LINEAR_KINDS", "low_precision_linear", "unrecognized_cast"]

#: one recognizer per kind of low-precision linear, tried in order
LINEAR_KINDS: tuple[Callable[[TracedCall], Optional[Found]], ...] = (
    scaled_mm_linear,        # torchao Float8Linear: _scaled_mm of FP8 operands
    dequantized_mm_linear,   # the same, emulated: mm of the dequantized operands
)

_CACHE_SIZE = 64
#: call signature key -> (index of x, index of the weight among the tensor args, LinearCast),
#: a refusal (str: the call casts to FP8 in no known form), or None (no low precision)
_answers: "OrderedDict[tuple, Union[tuple, str, None]]" = OrderedDict()


#: ATen products: a call computing one mixes features, which the index replay cannot follow
_PRODUCTS = frozenset({A.mm.default, A.bmm.default, A.addmm.default, A.baddbmm.default,
                       A._scaled_mm.default, A.convolution.default})


def _casts_to_fp8(traced: TracedCall) -> bool:
    return any(is_op(n, A._scaled_mm.default) or (
        is_op(n, A._to_copy.default) and n.kwargs.get("dtype") in FP8_STORAGE)
        for n in traced.graph.graph.nodes)


def _multiplies(traced: TracedCall) -> bool:
    return any(is_op(n, *_PRODUCTS) for n in traced.graph.graph.nodes)


def _recognize(signature: CallSignature) -> Union[tuple, str, None]:
    traced = traced_call(signature)
    if traced is None:
        return None
    for recognizer in LINEAR_KINDS:
        found = recognizer(traced)
        if found is not None:
            return (traced.tensor_args.index(found.x), traced.tensor_args.index(found.weight),
                    found.cast)
    call = f"`{signature.node.name}` ({call_name(signature.node.target)}), which"
    if _casts_to_fp8(traced):
        return (f"{call} computes with FP8 casts in a form no low-precision linear kind "
                "recognizes (geoscale_fx.analysis.linears: an FP8 matmul whose input is cast "
                "with scales from its own values and dequantized by them), so what it "
                "outputs is not bounded")
    if _multiplies(traced):
        return (f"{call} computes a matrix product that is no projection the analysis "
                "knows, so what it outputs is not bounded")
    return None


def _answer(node: Node, kinds: ValueKinds) -> tuple[Optional[CallSignature],
                                                    Union[tuple, str, None]]:
    signature = call_signature(node, kinds)
    if signature is None:
        return None, None
    key = signature.key
    if key is not None and key in _answers:
        _answers.move_to_end(key)
        return signature, _answers[key]
    answer = _recognize(signature)
    if key is not None:
        _answers[key] = answer
        while len(_answers) > _CACHE_SIZE:
            _answers.popitem(last=False)
    return signature, answer


def low_precision_linear(node: Node, kinds: ValueKinds) -> Optional[Found]:
    """``node`` as a low-precision linear of an activation by a parameter-only weight, or
    None (module docstring)."""
    signature, answer = _answer(node, kinds)
    if not isinstance(answer, tuple):
        return None
    x, weight = signature.tensors[answer[0]], signature.tensors[answer[1]]
    if not kinds.is_activation(x) or not kinds.is_param(weight) or \
            len(shape_of(weight) or ()) != 2:
        return None
    return Found(x, weight, answer[2])


def unrecognized_cast(node: Node, kinds: ValueKinds) -> Optional[str]:
    """Why ``node``, an opaque call that computes with FP8 casts or a matrix product in a
    form no kind recognizes, or that takes a tensor no trace can fake, bounds nothing it
    outputs (a walk must stop there); None for any other node (an opaque call that only
    moves or scales values elementwise is replayed as before)."""
    untraceable = untraceable_tensor(node)
    if untraceable is not None:
        return (f"`{node.name}` ({call_name(node.target)}), which takes a {untraceable} "
                "that the analysis cannot trace, so what it outputs is not bounded")
    _, answer = _answer(node, kinds)
    return answer if isinstance(answer, str) else None
