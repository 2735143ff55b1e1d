"""Activation checkpointing, opened up: the attention inside a checkpointed region is analysed
and rewritten like any other.

``torch.utils.checkpoint`` under Dynamo (Hugging Face's gradient checkpointing, TRL's default)
becomes a higher-order op, ``tag_activation_checkpoint(body, *args)``, whose body is a graph
of its own: an attention inside it is invisible to a pass that reads the outer graph, and the
model would train without FP8. ``inline_activation_checkpoints`` copies every body into the
outer graph in place of its call and tags each copied node as AOTAutograd's own lowering of
the op does (``meta["recompute"] = PREFER_RECOMPUTE`` and one ``meta["ac_graph_id"]`` per
region): AOTAutograd copies the tags onto the ATen operators it traces and its partitioner
recomputes them in the backward, so the checkpoint still trades compute for memory.

A region with its own selective policy (``context_fn``) is recomputed whole instead
(logged); nested regions are opened from the outside in.

    gm = inline_activation_checkpoints(gm)     # a new GraphModule, or gm if it has none
"""
from __future__ import annotations

import copy
import itertools
import logging
import operator

import torch
from torch.fx import GraphModule, Node
from torch.utils.checkpoint import CheckpointPolicy

__all__ = ["inline_activation_checkpoints", "RECOMPUTE_TAGS"]

log = logging.getLogger("geoscale_fx")

_CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint
#: node meta keys AOTAutograd reads to recompute a node in the backward
RECOMPUTE_TAGS = ("recompute", "ac_graph_id")
_REGION_IDS = itertools.count(1_000_000)     # apart from the ids AOTAutograd hands out


def _checkpoint_calls(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _CHECKPOINT]


def inline_activation_checkpoints(gm: GraphModule) -> GraphModule:
    """``gm`` with every checkpointed region's body in the graph, its nodes tagged for
    recomputation (module docstring); ``gm`` itself when there is none."""
    if not _checkpoint_calls(gm):
        return gm
    gm = copy.deepcopy(gm)
    kept: set[Node] = set()
    while calls := [c for c in _checkpoint_calls(gm) if c not in kept]:
        for call in calls:
            if all(u.op == "call_function" and u.target is operator.getitem
                   for u in call.users):
                _inline(gm, call)
            else:      # its output tuple used as a whole: left as it is, and said
                kept.add(call)
                log.warning("geoscale: a checkpointed region (%s) is used as a whole tuple "
                            "and left closed: attention inside it is not analysed",
                            call.name)
    gm.graph.lint()
    gm.recompile()
    return gm


def _inline(gm: GraphModule, call: Node) -> None:
    graph = gm.graph
    body_attr, *operands = call.args
    body: GraphModule = getattr(gm, body_attr.target)
    if "_checkpoint_context_fn" in body.meta:
        log.info("geoscale: a checkpointed region with its own policy (context_fn) is "
                 "recomputed whole (its attention is rewritten inside it)")
    region = next(_REGION_IDS)
    env: dict[Node, object] = {}
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    env.update(zip(placeholders, operands))
    outputs = None
    with graph.inserting_before(call):
        for node in body.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                outputs = torch.fx.map_arg(node.args[0], lambda n: env[n])
                break
            if node.op == "get_attr":       # a nested body or a constant of the body's own
                name = f"{body_attr.target}_{node.target}"
                setattr(gm, name, getattr(body, node.target))
                new = graph.get_attr(name)
            else:
                new = graph.node_copy(node, lambda n: env[n])
                new.meta.setdefault("recompute", CheckpointPolicy.PREFER_RECOMPUTE)
                new.meta.setdefault("ac_graph_id", region)
            new.meta.update({k: v for k, v in node.meta.items() if k not in RECOMPUTE_TAGS
                             and k not in new.meta})
            env[node] = new
    for user in list(call.users):
        user.replace_all_uses_with(outputs[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(call)
    if not body_attr.users:
        graph.erase_node(body_attr)
