"""What only this worker holds, through a checkpoint: its inner optimizer's moments, its place in its shard, the error
feedback residual, and (with fragments) θ's tensors trained on past the anchor.

Inputs:  the Worker this mixes into (engine.py): its inner optimizer, batches taken, residual, fragments, model θ,
         outer state and any exchange in flight (overlap.py).
Output:  ``local_state()`` (a dict of tensors and ints for checkpoint.py's ``worker_state``);
         ``restore_local_state(saved)`` puts one back into a worker built with the same config and model.
State:   none of its own.
Failure: ``restore_local_state`` raises ValueError naming what differs when ``saved`` does not fit this model and
         optimizer (shapes, missing keys), before it changes anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from p2p_diloco.engine import Worker

__all__ = ["LocalStateMixin"]


class LocalStateMixin:
    """Worker's checkpointed local state (the module docstring); mixed into engine.Worker."""

    def local_state(self: Worker) -> dict[str, Any]:
        """What only this worker holds: inner optimizer state and how far into its shard it has read; the error
        feedback residual; with fragments, θ (the tensors not exchanged yet trained on past the anchor) and the round
        it belongs to."""
        out = {"inner_optimizer": self.inner.optimizer.state_dict(), "batches_taken": self.batches_taken}
        if self.residual is not None:
            out["residual"] = [r.clone() for r in self.residual]
        if self.fragments.count > 1:
            params = [p.detach().to("cpu", torch.float32).clone() for p in self.model.parameters()]
            if self.pending is not None and self.start is not None:
                # what an exchange in flight leaves as a lost one (``drain``): the tensors it puts back on the anchor
                # with the carried steps, which a resumed peer exchanges again
                only, carry = self._carried(self.pending), self.cfg.swarm.overlap_carry
                params = [
                    a.add(p.sub(s), alpha=carry) if only is None or only[k] else p
                    for k, (p, s, a) in enumerate(zip(params, self.start, self.state.anchor, strict=True))
                ]
            out["params"] = params
            out["params_round"] = self.state.round
        return out

    def restore_local_state(self: Worker, saved: dict[str, Any]) -> None:
        """Continue from ``local_state()`` of an earlier run of this worker: same moments, next batches.

        ValueError (naming what differs) when the saved optimizer does not fit this model.
        """
        try:
            params = [p for group in self.inner.optimizer.param_groups for p in group["params"]]
            for index, entry in saved["inner_optimizer"]["state"].items():
                for name, value in entry.items():
                    if torch.is_tensor(value) and value.dim() and value.shape != params[index].shape:
                        raise ValueError(
                            f"{name} of parameter {index} is {list(value.shape)}, the model's is "
                            f"{list(params[index].shape)}"
                        )
            residual = saved.get("residual")  # absent: saved without error feedback (or before it existed)
            if residual is not None:
                shapes = [list(a.shape) for a in self.state.anchor]
                if [list(r.shape) for r in residual] != shapes:
                    raise ValueError(f"the error feedback residual's shapes are not the model's {shapes}")
                residual = [r.to("cpu", torch.float32).clone() for r in residual]
            params = saved.get("params") if saved.get("params_round") == self.state.round else None
            if params is not None and [list(p.shape) for p in params] != [list(a.shape) for a in self.state.anchor]:
                raise ValueError("the saved parameters' shapes are not the model's")
            self.inner.optimizer.load_state_dict(saved["inner_optimizer"])
            skip = int(saved["batches_taken"]) - self.batches_taken
            self.residual = residual
            if params is not None and self.fragments.count > 1:  # saved at this state: the fragments' progress too
                with torch.no_grad():
                    for p, x in zip(self.model.parameters(), params, strict=True):
                        p.copy_(x)
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"saved worker state does not fit this model and optimizer: {exc}") from None
        for _ in range(skip):
            next(self.batches)
