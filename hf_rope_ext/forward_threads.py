"""One forward at a time per patched model, across threads.

A patch keeps the state of the forward under way on itself: the frequencies a length-dependent
method chose for it, the prefix it recomputes, an attention-level method's cache geometry, key
tables and position memos. A forward that another thread starts meanwhile would read or overwrite
that state (wrong logits, not an error), so it is refused. A forward run inside another on the
same thread (a hook that calls the model) is allowed: the hooks handle nesting themselves.

Some calls span several forwards and keep state between them: ``generate`` (its planned length
and the raised ``config.max_position_embeddings``), a ``planned_length`` block, and an unpatch or
re-patch, which swaps the modules a forward runs. Such a call holds the model for its thread
(:meth:`ForwardThreads.held`): another thread's forward or held call is refused meanwhile, and it
is refused itself while another thread runs one.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Iterator
from types import CodeType, FrameType
from typing import Any

_LOCK = threading.Lock()

CONCURRENT_FORWARD_MESSAGE = (
    "this patched model is running a forward on another thread (or a generate call or planned_length block, between "
    "its forwards), and its per-forward state (the chosen frequencies, cache geometry, key tables, position memos) "
    "belongs to that call: give each thread its own copy (copy.deepcopy(model) patches the copy), or wait for it to end "
    "(a generate ends when it returns, not when its streamer does: join its thread; a planned_length block holds the "
    "model for the thread that entered it, so a loop resumed on other threads enters one per step)."
)


class ForwardThreads:
    """The forwards of one patched model under way, counted per thread.

    The hooks that count a forward out run even when it raised, but not when it was interrupted
    (``KeyboardInterrupt`` skips PyTorch's always-call hooks), so a count can outlive its forward.
    Before a count refuses a forward, or makes one nested, it is checked against what really runs:
    the calls of the patched module on that thread's stack. A ``copy.deepcopy`` starts with none.
    """

    def __init__(self) -> None:
        self.depths: dict[int, int] = {}
        # the module each counted thread runs: nn.DataParallel's replicas share one patch's hooks
        self._modules: dict[int, weakref.ref] = {}
        # the code of the frame that runs the module's hooks (torch.nn.Module's call), learnt from
        # the first forward: a frame with this code and ``self`` the module is one of its forwards
        self._call_code: CodeType | None = None
        # calls that hold the model for a thread across forwards (see held), counted per thread
        self.holds: dict[int, int] = {}
        # holds ended but not yet counted out (see _release)
        self._released: list[int] = []

    def __deepcopy__(self, memo: dict) -> ForwardThreads:
        return type(self)()

    def enter(self, module: Any) -> int:
        """Count a forward of ``module`` on this thread in (called from a forward pre-hook), and
        return how many this thread now runs (2 or more: nested); refuse it while another thread
        runs one."""
        me = threading.get_ident()
        here = sys._getframe(1)
        with _LOCK:
            if self._call_code is None:
                self._call_code = _calling_code(here, module)
            self._refuse_other_threads(me, here, module, CONCURRENT_FORWARD_MESSAGE)
            self.depths[me] = depth = self.depths.get(me, 0) + 1
            if depth == 1:
                self._modules[me] = weakref.ref(module)
        return depth

    @contextlib.contextmanager
    def held(self, refusal: str = CONCURRENT_FORWARD_MESSAGE) -> Iterator[None]:
        """Hold the model for this thread during the block: another thread's forward or held
        call is refused meanwhile, and the block is refused (``RuntimeError(refusal)``) while
        another thread runs one. Forwards and held calls of this thread nest freely. Released
        on every exit, ``KeyboardInterrupt`` included (it is a ``finally``, not a hook)."""
        me = threading.get_ident()
        with _LOCK:
            self._refuse_other_threads(me, sys._getframe(), None, refusal)
            self.holds[me] = self.holds.get(me, 0) + 1
        try:
            yield
        finally:
            self._release(me)

    def _release(self, thread: int) -> None:
        """Count a hold of ``thread`` out without waiting for ``_LOCK``: a generator paused inside a
        held block (``planned_length``) runs this when it is collected, which may happen while the
        collecting thread holds the lock itself. The count is then taken out at the next check."""
        self._released.append(thread)  # atomic; read under the lock only
        if _LOCK.acquire(blocking=False):
            try:
                self._count_out_released()
            finally:
                _LOCK.release()

    def _count_out_released(self) -> None:
        """Take out the holds that ended (called under the lock)."""
        while self._released:
            thread = self._released.pop()
            if self.holds.get(thread, 0) > 1:
                self.holds[thread] -= 1
            else:
                self.holds.pop(thread, None)

    def under_way_here(self) -> bool:
        """Whether this thread runs a forward of the model now, or holds it (inside generate)."""
        me = threading.get_ident()
        with _LOCK:
            self._count_out_released()
            if me in self.depths:
                self._forget_ended(me, sys._getframe(), None)
            return me in self.depths or me in self.holds

    def leave(self) -> int:
        """Count a forward of this thread out, and return how many it ran before (0: none, its
        start was refused)."""
        me = threading.get_ident()
        with _LOCK:
            depth = self.depths.get(me, 0)
            if depth > 1:
                self.depths[me] = depth - 1
            elif depth == 1:
                self._forget(me)
        return depth

    def clear(self) -> None:
        with _LOCK:
            self.depths.clear()
            self._modules.clear()
            self.holds.clear()
            self._released.clear()

    def _refuse_other_threads(self, me: int, here: FrameType, starting_module: Any, refusal: str) -> None:
        """Raise ``RuntimeError(refusal)`` if a thread other than this one runs a forward or holds
        the model (called under the lock)."""
        self._count_out_released()
        if self.depths:
            self._forget_ended(me, here, starting_module)
        if any(thread != me for thread in self.holds):
            # released by a finally: left over only by a thread that ended inside a block entered by hand
            alive = sys._current_frames()
            for thread in [thread for thread in self.holds if thread not in alive]:
                del self.holds[thread]
        if any(thread != me for thread in self.depths) or any(thread != me for thread in self.holds):
            raise RuntimeError(refusal)

    def _forget(self, thread: int) -> None:
        del self.depths[thread]
        self._modules.pop(thread, None)

    def _forget_ended(self, me: int, here: FrameType, starting_module: Any) -> None:
        """Lower each thread's count to the forwards its stack still runs (the rest were
        interrupted; a thread that ended runs none)."""
        if self._call_code is None:  # the hooks' caller is unknown: keep the counts (refuse, never mix)
            return
        stacks = sys._current_frames()
        for thread in list(self.depths):
            module = self._modules[thread]()
            top = here if thread == me else stacks.get(thread)
            running = 0 if module is None else _calls_of(module, self._call_code, top)
            if thread == me and module is starting_module:
                running -= 1  # the forward starting now is on this stack as well
            if running <= 0:
                self._forget(thread)
            elif running < self.depths[thread]:
                self.depths[thread] = running


def _calling_code(frame: FrameType | None, module: Any) -> CodeType | None:
    """The code of the nearest frame at or above ``frame`` whose ``self`` is ``module``."""
    while frame is not None:
        if frame.f_locals.get("self") is module:
            return frame.f_code
        frame = frame.f_back
    return None


def _calls_of(module: Any, code: CodeType, frame: FrameType | None) -> int:
    """How many frames at or above ``frame`` run ``code`` with ``self`` the module."""
    count = 0
    while frame is not None:
        if frame.f_code is code and frame.f_locals.get("self") is module:
            count += 1
        frame = frame.f_back
    return count
