"""The scaling state beside the weights: ``geoscale_state.safetensors``.

    geoscale_fx.save_state(model, "ckpt/")        # ckpt/geoscale_state.safetensors
    geoscale_fx.load_state(model, "ckpt/")        # True when restored (warm), else cold

A Hugging Face checkpoint keeps the weights in ``model.safetensors`` and the scaling state in
this separate file, so a plain ``from_pretrained`` (no geoscale installed) sees exactly the
model's own keys. ``apply_`` makes this automatic: the converted model's ``save_pretrained``
(hence every ``Trainer`` checkpoint) writes the file, ``apply_`` restores it from the
directory ``from_pretrained`` loaded the model from, and ``Trainer(...).train(
resume_from_checkpoint=...)`` restores it from the checkpoint (``hook_trainer_resume``).

The file records a fingerprint of the weights it was saved with, ``‖W‖²`` per parameter
(float64). A state restored onto other weights would start the power iteration from vectors
of another matrix and scale with another σ: when the fingerprint does not match the model's
weights (same dtype: relative 1e-9; a dtype change such as loading in bf16: 1e-2), the file
is ignored with a warning and every site starts cold, from the weights (certified).
"""
from __future__ import annotations

import functools
import json
import logging
import os
import sys
import types

import torch
from torch import nn

from geoscale_fx.compile.attach import STATE_ATTR, attach_state
from geoscale_fx.sites.state import GeoscaleState

__all__ = ["STATE_FILE", "save_state", "load_state", "install_save_pretrained",
           "hook_trainer_resume"]

log = logging.getLogger("geoscale_fx")

STATE_FILE = "geoscale_state.safetensors"
_RTOL_SAME_DTYPE, _RTOL_OTHER_DTYPE = 1e-9, 1e-2


def _fingerprint(model: nn.Module) -> dict[str, list]:
    """``{parameter: [dtype, ‖W‖²]}`` in float64 (shared parameters once)."""
    return {name: [str(p.dtype), float(torch.linalg.vector_norm(p.detach(),
                                                                  dtype=torch.float64) ** 2)]
            for name, p in model.named_parameters()}


def _mismatch(saved: dict, current: dict) -> str | None:
    """Why the saved fingerprint does not describe ``current`` (None when it does)."""
    if set(saved) != set(current):
        extra = sorted(set(saved) ^ set(current))[:3]
        return f"the parameters differ ({', '.join(extra)} ...)"
    for name, (dtype, value) in saved.items():
        now_dtype, now = current[name]
        rtol = _RTOL_SAME_DTYPE if dtype == now_dtype else _RTOL_OTHER_DTYPE
        if abs(now - value) > rtol * max(abs(value), 1e-30):
            return f"parameter {name} changed (‖W‖² {value:.9g} saved, {now:.9g} now)"
    return None


def save_state(model: nn.Module, directory: str | os.PathLike) -> str:
    """Write ``model``'s scaling state to ``directory/geoscale_state.safetensors``; its path."""
    from safetensors.torch import save_file

    state = getattr(model, STATE_ATTR, None)
    if not isinstance(state, GeoscaleState):
        raise ValueError(f"geoscale_fx.save_state: {type(model).__name__} has no geoscale "
                         "state (convert it with geoscale_fx.apply_ or geoscale_fx.wrap)")
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.state_dict().items()}
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, STATE_FILE)
    save_file(tensors, path, metadata={"format": "pt", "producer": "geoscale_fx",
                                       "weights": json.dumps(_fingerprint(model))})
    log.info("geoscale: %d scaling-state tensors saved to %s", len(tensors), path)
    return path


def load_state(model: nn.Module, directory: str | os.PathLike) -> bool:
    """Restore ``directory/geoscale_state.safetensors`` into ``model`` (warm sites).

    Sites that exist already are restored in place; the others pick their entries up when
    the next compile creates them. Returns False (sites start cold) when there is no file, or
    when it was saved with other weights (a warning says which parameter differs).
    """
    from safetensors import safe_open

    path = os.path.join(directory, STATE_FILE)
    if not os.path.isfile(path):
        return False
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    reason = _mismatch(json.loads(metadata.get("weights", "{}")), _fingerprint(model))
    if reason is not None:
        log.warning("geoscale: %s was saved with other weights than %s's: %s; ignored, every "
                    "site starts cold from the current weights", path, type(model).__name__,
                    reason)
        return False
    state = attach_state(model)
    state.load_state_dict(tensors, strict=False)
    log.info("geoscale: %d scaling-state tensors restored from %s", len(tensors), path)
    return True


# ---- Hugging Face: save_pretrained and Trainer -------------------------------------------

def install_save_pretrained(model: nn.Module) -> None:
    """Make ``model.save_pretrained(d)`` write the state to ``d/geoscale_state.safetensors``
    and keep it out of ``model.safetensors`` (an instance attribute: other models unchanged)."""
    original = getattr(type(model), "save_pretrained", None)
    if not callable(original) or "save_pretrained" in model.__dict__:
        return

    @functools.wraps(original)
    def save_pretrained(self, save_directory, *args, **kwargs):
        return _save_pretrained(self, original, save_directory, *args, **kwargs)

    model.save_pretrained = types.MethodType(save_pretrained, model)


def _save_pretrained(self, original, save_directory, *args, **kwargs):
    ignore = self.__dict__.get("_keys_to_ignore_on_save")   # PreTrainedModel: an exact-key set
    state = getattr(self, STATE_ATTR, None)
    added = set()
    if isinstance(ignore, set) and isinstance(state, GeoscaleState):
        added = {f"{STATE_ATTR}.{k}" for k in state.state_dict()} - ignore
        ignore |= added
    try:
        out = original(self, save_directory, *args, **kwargs)
    finally:
        if added:
            ignore -= added
    if kwargs.get("is_main_process", True) and isinstance(state, GeoscaleState):
        save_state(self, save_directory)
        if kwargs.get("push_to_hub"):
            log.warning("geoscale: push_to_hub uploaded the weights only; upload %s from %s "
                        "yourself to share the scaling state", STATE_FILE, save_directory)
    return out


def hook_trainer_resume() -> bool:
    """Make ``transformers.Trainer`` restore the state when it resumes from a checkpoint.

    ``Trainer._load_from_checkpoint`` loads ``model.safetensors`` with ``load_state_dict``,
    which never sees the directory: without this, a resume would start every site cold. The
    wrapper calls the original, then ``load_state`` on models that carry geoscale state, and
    changes nothing for the others. Returns whether the hook is in place.
    """
    if "transformers" not in sys.modules:
        return False
    try:
        from transformers import Trainer
    except Exception as exc:   # transformers without torch/accelerate: no Trainer to hook
        log.debug("geoscale: transformers.Trainer unavailable (%s)", exc)
        return False
    original = Trainer.__dict__.get("_load_from_checkpoint")
    if original is None:
        log.warning("geoscale: this transformers version has no Trainer._load_from_checkpoint; "
                    "Trainer resumes start cold unless you call geoscale_fx.load_state(model, "
                    "checkpoint_dir) after train() loads the weights")
        return False
    if getattr(original, "_geoscale", False):
        return True

    @functools.wraps(original)
    def _load_from_checkpoint(trainer, resume_from_checkpoint, model=None):
        result = original(trainer, resume_from_checkpoint, model)
        target = trainer.model if model is None else model
        target = getattr(target, "module", target)        # DDP / DataParallel
        if isinstance(getattr(target, STATE_ATTR, None), GeoscaleState):
            load_state(target, resume_from_checkpoint)
        return result

    _load_from_checkpoint._geoscale = True
    Trainer._load_from_checkpoint = _load_from_checkpoint
    return True
