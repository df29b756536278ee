"""The outer state's tag (round, checksum), hashed once per state and, when asked ahead, in a background thread.

Inputs:  the worker's current OuterState, passed to every call (the worker replaces the object on a download and
         moves its ``round`` on an outer step: the only two ways a state changes).
Output:  ``tag(state)`` (hashed here unless a hashing of this state already runs, whose end it waits for),
         ``soon(state)`` (a Future -> RoundTag: hashlib lets go of the GIL on large buffers, so the hashing runs
         beside the next inner steps), ``cached(state)`` (the tag if it was hashed, else None; hashes nothing).
State:   the last state hashed (the object and its round) with its Future; one hashing thread, made on first use.
Failure: a hashing's exception is raised by whoever reads its Future. ``settled()`` must be called before the
         state is changed in place (an outer step), so that no hashing still reads it.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from p2p_diloco.outer import OuterState
from p2p_diloco.protocol import RoundTag

__all__ = ["StateTags"]


class StateTags:
    """One worker's tags of its outer state (the module docstring)."""

    def __init__(self) -> None:
        self._last: tuple[OuterState, int, Future] | None = None
        self._hasher: ThreadPoolExecutor | None = None

    def tag(self, state: OuterState) -> RoundTag:
        hashing = self._of(state)
        if hashing is None:
            hashing = Future()
            hashing.set_result(RoundTag(state.round, state.checksum()))
            self._remember(state, hashing)
        return hashing.result()

    def soon(self, state: OuterState) -> Future:
        hashing = self._of(state)
        if hashing is None:
            if self._hasher is None:
                self._hasher = ThreadPoolExecutor(1, thread_name_prefix="hashing")
            round = state.round
            hashing = self._hasher.submit(lambda: RoundTag(round, state.checksum()))
            self._remember(state, hashing)
        return hashing

    def cached(self, state: OuterState) -> RoundTag | None:
        hashing = self._of(state)
        return hashing.result() if hashing is not None and hashing.done() else None

    def settled(self) -> None:
        """Wait for a hashing in the background, if one runs, and forget it (its result stays with its future)."""
        last, self._last = self._last, None
        if last is not None:
            last[2].exception()

    def close(self) -> None:
        if self._hasher is not None:
            self._hasher.shutdown(wait=True)
            self._hasher = None

    def _of(self, state: OuterState) -> Future | None:
        """The tag (future) of ``state`` as it is now, if one was hashed or is being hashed."""
        last = self._last
        if last is not None and last[0] is state and last[1] == state.round:
            return last[2]
        return None

    def _remember(self, state: OuterState, hashing: Future) -> None:
        self.settled()
        self._last = (state, state.round, hashing)
