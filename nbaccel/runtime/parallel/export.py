"""``model.save_pretrained(...)`` on a sharded model writes the full weights, once.

A transformers (or any Hugging Face-style) model prepared under FSDP2 or tensor parallel
holds DTensor shards; its own ``save_pretrained`` takes ``model.state_dict()`` -- DTensors
-- and safetensors dies on them ("Attempted to access the data pointer on an invalid python
storage"), on every rank at once. Accelerate's ``nd_parallel.py`` ends with exactly that
call. :func:`route_save_pretrained` gives the prepared instance a ``save_pretrained`` that
gathers the full state dict through the strategy (torch's ``get_model_state_dict``: a
collective, so every rank calls it, as the script does), lets the main process alone write
it with the model's own method, and tells the others its outcome (a broadcast): on return
the files exist on every rank, and a failure there is raised on every rank, the main
process's own exception there, :class:`SavePretrainedError` naming it elsewhere.
A ``state_dict=`` the caller passes (Accelerate's ``get_state_dict`` pattern) is used as it is.

Example:
    >>> import torch
    >>> route_save_pretrained(torch.nn.Linear(2, 2), strategy=None)  # no save_pretrained: untouched
    False
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from ...errors import SavePretrainedError


def route_save_pretrained(model: torch.nn.Module, *, strategy: Any) -> bool:
    """Replace ``model.save_pretrained`` (on this instance) by a gathering one; returns
    whether it did (only models whose method takes ``state_dict=``)."""
    original = getattr(model, "save_pretrained", None)
    if not callable(original) or getattr(original, "_nbaccel_gathers", False):
        return False
    try:
        takes_state = "state_dict" in inspect.signature(original).parameters
    except (TypeError, ValueError):
        return False
    if not takes_state:
        return False

    @functools.wraps(original)
    def save_pretrained(save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        import torch.distributed as dist

        state = kwargs.pop("state_dict", None)
        if state is None:  # a collective: every rank gathers, the main process gets it all
            state = strategy.model_state_dict(model)
        result, failure = None, None
        if strategy.state.is_main_process:
            try:
                result = original(save_directory, *args, state_dict=state, **kwargs)
            except Exception as error:  # told to every rank below, then raised here
                failure = error
        if dist.is_available() and dist.is_initialized():
            # the outcome, not a bare barrier: a barrier would hold the other ranks until the
            # process group timed out when the main process's write failed
            _share_outcome(failure, is_main=strategy.state.is_main_process)
        if failure is not None:
            raise failure
        return result

    save_pretrained._nbaccel_gathers = True  # type: ignore[attr-defined]
    model.save_pretrained = save_pretrained  # type: ignore[assignment]
    return True


def _share_outcome(failure: BaseException | None, *, is_main: bool) -> None:
    """Broadcast the main process's outcome (global rank 0: the one that writes) to every
    rank; the others raise :class:`SavePretrainedError` naming the main process's error.
    A collective: every rank calls it, so on return the files exist on every rank."""
    import torch.distributed as dist

    # the error as text: its type may not unpickle elsewhere, its message always does
    said = [None if failure is None else f"{type(failure).__name__}: {failure}"]
    dist.broadcast_object_list(said, src=0)
    if said[0] is not None and not is_main:
        raise SavePretrainedError(
            f"save_pretrained failed on the main process (rank 0), which writes the files: "
            f"{said[0]} (its traceback is rank 0's); fix it and save again."
        )


__all__ = ["SavePretrainedError", "route_save_pretrained"]
