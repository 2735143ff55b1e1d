"""Names in the user's model, found by object identity, for everything a captured graph reads.

Every site, state key, scale tensor, cache row and report row is named by its module's path
in the user's model (``model.layers.0.self_attn``), however the compiled frame reached the
model: ``model(...)``, a bound method's ``__self__`` (TRL's forward wrappers), a
``functools.partial``, accelerate's mixed-precision wrappers, a ``*args`` wrapper, a global, a
per-block compile. Dynamo's sources say *how* the frame reached a tensor; they are never
parsed for names. Instead:

* **tensors**: a graph's inputs are the live parameters and buffers; ``ModelNames`` maps each
  to its names in the model by identity (``named_parameters``/``named_buffers``, a tied
  tensor to all of its names);
* **modules**: Dynamo records for every node the stack of module calls that made it
  (``nn_module_stack``: a key per call and the module's class, outermost first). A node that
  reads a parameter directly ties its stack to the parameter's owner: walking up from the
  owner, each entry of the stack is the nearest ancestor of its class. An entry that no
  parameter reaches (a module without parameters of its own) is found below the nearest
  named entry as the only submodule of its class there.

The model is the one geoscale was given (``apply_``, ``wrap``, ``compile_blocks``,
``capture_graphs(module, ...)``), recorded on the graph (``attach_model``); for
``torch.compile(model, backend="geoscale")`` it is the outermost module on the paths by which
the frame reached the graph's parameters, evaluated by Dynamo itself while it compiles
(``OutputGraph.resolve_source_value``). A graph with no model names nothing: its sites are
named by their graph node.

    names = graph_names(gm, example_inputs)       # once per graph (and per bound weights)
    names.module(sdpa_node)                      # "model.layers.0.self_attn"
    names.parameter(placeholder)                 # "model.layers.0.self_attn.q_proj.weight"
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torch._dynamo.symbolic_convert import InstructionTranslator
from torch.fx import GraphModule, Node
from torch.utils.weak import WeakIdKeyDictionary

from geoscale_fx.core import compat

__all__ = ["ModelNames", "GraphNames", "attach_model", "graph_names", "graph_tensor_names",
           "model_names",
           "frame_root", "NAME_META", "MODULE_META"]

log = logging.getLogger("geoscale_fx")

#: ``gm.meta`` key: a weak reference to the model the graph was captured from
_MODEL_META = "geoscale_model"
#: ``node.meta`` key of a placeholder: its name in the model (``parameter_name`` reads it)
NAME_META = "geoscale_name"
#: ``node.meta`` key of a call: the path of the module that made it, when it was annotated
MODULE_META = "geoscale_module"


class ModelNames:
    """A model's names of its tensors (by identity), and its modules by path.

    The model is held weakly. Names are read again when a parameter is not found: FSDP2
    registers the unsharded parameters on the module while it runs, and ``load_state_dict(
    assign=True)`` or a new ``nn.Parameter`` replaces tensors.
    """

    def __init__(self, model: nn.Module):
        self._model = weakref.ref(model)
        self._tensors = WeakIdKeyDictionary()      # tensor -> tuple of its names

    @property
    def model(self) -> nn.Module | None:
        return self._model()

    def tensor_names(self, tensor: Any) -> tuple[str, ...]:
        """Every name of ``tensor`` in the model (tied tensors have several), or ``()``."""
        if not isinstance(tensor, torch.Tensor):
            return ()
        names = self._tensors.get(tensor)
        if names is None and isinstance(tensor, nn.Parameter):
            self.read()
            names = self._tensors.get(tensor)
        return names or ()

    def tensor(self, tensor: Any) -> str | None:
        """The first name of ``tensor`` in the model, or None."""
        names = self.tensor_names(tensor)
        return names[0] if names else None

    def read(self) -> None:
        """(Re)read the model's parameters and buffers."""
        model = self._model()
        if model is None:
            return
        found: dict[int, tuple[torch.Tensor, list[str]]] = {}
        for name, t in [*model.named_parameters(remove_duplicate=False),
                        *model.named_buffers(remove_duplicate=False)]:
            found.setdefault(id(t), (t, []))[1].append(name)
        self._tensors = WeakIdKeyDictionary()
        for t, names in found.values():
            self._tensors[t] = tuple(names)

    def module(self, path: str) -> nn.Module | None:
        model = self._model()
        if model is None:
            return None
        try:
            return model.get_submodule(path)
        except AttributeError:
            return None


#: one ``ModelNames`` per live model (its identity maps are reused by every graph of it)
_NAMES: "weakref.WeakKeyDictionary[nn.Module, ModelNames]" = weakref.WeakKeyDictionary()


def model_names(model: nn.Module) -> ModelNames:
    """The shared ``ModelNames`` of ``model``."""
    names = _NAMES.get(model)
    if names is None:
        names = _NAMES[model] = ModelNames(model)
    return names


def attach_model(gm: GraphModule, model: nn.Module | None) -> None:
    """Record (weakly) which model ``gm`` was captured from: its sites are named in it."""
    if isinstance(model, nn.Module):
        gm.meta[_MODEL_META] = weakref.ref(model)


def graph_tensor_names(gm: GraphModule) -> Callable[[Any], str | None]:
    """``name_of(tensor)``: the name of a tensor in the model ``gm`` was captured from (None
    for a tensor it does not hold, or once the model is gone)."""
    ref = gm.meta.get(_MODEL_META)

    def name_of(tensor: Any) -> str | None:
        model = ref() if isinstance(ref, weakref.ref) else None
        return model_names(model).tensor(tensor) if model is not None else None

    return name_of


def graph_names(gm: GraphModule, example_inputs: Sequence[Any] | Mapping[str, Any],
                model: nn.Module | None = None) -> "GraphNames":
    """The names of ``gm``'s inputs and modules in ``model``: given, recorded on the graph
    (``attach_model``), or the frame's outermost module while Dynamo compiles ``gm``."""
    if model is None:
        ref = gm.meta.get(_MODEL_META)
        model = ref() if isinstance(ref, weakref.ref) else None
    if model is None:
        model = frame_root(gm)
        attach_model(gm, model)
    values = example_inputs if isinstance(example_inputs, Mapping) else \
        _placeholder_values(gm, example_inputs)
    return GraphNames(gm, values, model_names(model) if model is not None else None)


def _placeholder_values(gm: GraphModule, example_inputs: Sequence[Any]) -> dict[str, Any]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return {n.name: example_inputs[i] for i, n in enumerate(placeholders)
            if i < len(example_inputs)}


class GraphNames:
    """Names of one graph's parameter inputs and module calls in a model (see the module
    docstring); ``values`` maps placeholder names to the tensors bound to them."""

    def __init__(self, gm: GraphModule, values: Mapping[str, Any], names: ModelNames | None):
        self._names = names
        self._parameters: dict[Node, tuple[str, ...]] = {}
        self._calls: dict[str, str] = {}           # nn_module_stack key -> module path
        if names is None:
            return
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        tensors = [values.get(n.name) for n in placeholders]
        if any(isinstance(t, nn.Parameter) and not names.tensor_names(t) for t in tensors):
            names.read()
        for node, tensor in zip(placeholders, tensors):
            found = names.tensor_names(tensor)
            if found:
                self._parameters[node] = found
        for node in gm.graph.nodes:
            stack = node.meta.get("nn_module_stack")
            if not stack or node.op == "placeholder":
                continue
            for source in node.all_input_nodes:
                for name in self._parameters.get(source, ()):
                    self._tie(list(stack.items()), name.rpartition(".")[0])

    @property
    def model(self) -> nn.Module | None:
        return self._names.model if self._names is not None else None

    def parameter(self, node: Node) -> str | None:
        """The model's (first) name of the tensor behind placeholder ``node``, or None."""
        names = self._parameters.get(node)
        return names[0] if names else None

    def module(self, node: Node) -> str | None:
        """Path in the model of the module whose forward made ``node`` (the innermost entry
        of its module stack), or None where nothing ties the stack to the model (without a
        model: the path ``annotate`` wrote while it was alive)."""
        if self._names is None:
            return node.meta.get(MODULE_META)
        stack = list((node.meta.get("nn_module_stack") or {}).items())
        for depth in range(len(stack) - 1, -1, -1):
            path = self._calls.get(stack[depth][0])
            if path is not None:
                return self._below(path, [cls for _, (_, cls) in stack[depth + 1:]])
        return None

    def annotate(self, gm: GraphModule) -> None:
        """Write into each node's ``meta`` its name in the model: a parameter placeholder's
        (``parameter_name``), a module call's path (``MODULE_META``, read where the model is
        no longer alive: a graph captured from a temporary model)."""
        if self._names is None:
            return
        for node in gm.graph.nodes:
            name = self.parameter(node) if node.op == "placeholder" else self.module(node)
            key = NAME_META if node.op == "placeholder" else MODULE_META
            if name is None:
                node.meta.pop(key, None)
            else:
                node.meta[key] = name

    # ---- module calls -----------------------------------------------------------------
    def _tie(self, stack: list, owner: str) -> None:
        """Tie the entries of one node's module stack to ancestors of ``owner`` (the module
        holding a tensor the node reads): innermost entry first, each the nearest ancestor
        of its class not above the previous one."""
        ancestors = [owner]
        while ancestors[-1]:
            ancestors.append(ancestors[-1].rpartition(".")[0])
        position = 0
        for key, (_, cls) in reversed(stack):
            for j in range(position, len(ancestors)):
                if type(self._names.module(ancestors[j])) is cls:
                    self._calls.setdefault(key, ancestors[j])
                    position = j + 1
                    break

    def _below(self, path: str, classes: list[type]) -> str:
        """Descend from ``path`` through modules of ``classes`` (stack entries no parameter
        tied), each the only submodule of its class below the last one found."""
        for cls in classes:
            module = self._names.module(path)
            found = [name for name, m in module.named_modules() if name and type(m) is cls] \
                if module is not None else []
            if len(found) != 1:
                break
            path = f"{path}.{found[0]}" if path else found[0]
        return path


def frame_root(gm: GraphModule) -> nn.Module | None:
    """While Dynamo compiles ``gm``: the outermost ``nn.Module`` on the paths by which the
    frame reached the graph's parameter inputs (the one holding most of them), evaluated
    against the frame by Dynamo (``OutputGraph.resolve_source_value``); None outside a
    compile or for a graph without module inputs."""
    output = _compiling_output()
    if output is None:
        return None
    roots: dict[int, list] = {}
    resolved: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        chain = []
        source = getattr(node, "_dynamo_source", None)
        while source is not None:
            chain.append(source)
            source = getattr(source, "base", None)
        for source in reversed(chain):       # outermost first
            key = source.name
            if key not in resolved:
                try:
                    resolved[key] = compat.resolve_source_value(output, source)
                except Exception:       # a source kind Dynamo cannot evaluate: look deeper
                    resolved[key] = None
            value = resolved[key]
            if isinstance(value, nn.Module):
                roots.setdefault(id(value), [value, 0])[1] += 1
                break
    if not roots:
        return None
    return max(roots.values(), key=lambda entry: entry[1])[0]


def _compiling_output():
    """Dynamo's ``OutputGraph`` of the frame being compiled now, or None."""
    try:
        tx = InstructionTranslator.current_tx()
    except AttributeError:     # this thread never compiled
        return None
    return getattr(tx, "output", None) if tx is not None else None
