"""One forward at a time per patched model, across threads.

A patch keeps the state of the forward under way on itself: the frequencies a length-dependent
method chose for it, the prefix it recomputes, an attention-level method's cache geometry, key
tables and position memos. A forward that another thread starts meanwhile would read or overwrite
that state (wrong logits, not an error), so it is refused. A forward run inside another on the
same thread (a hook that calls the model) is allowed: the hooks handle nesting themselves.
"""

from __future__ import annotations

import threading

_LOCK = threading.Lock()

CONCURRENT_FORWARD_MESSAGE = (
    "this patched model is running a forward on another thread, and its per-forward state (the chosen frequencies, "
    "cache geometry, key tables, position memos) belongs to one forward: give each thread its own copy "
    "(copy.deepcopy(model) patches the copy), or, if no other forward runs (one was interrupted), unpatch_model and "
    "patch_model again."
)


class ForwardThreads:
    """The forwards of one patched model under way, counted per thread.

    A forward interrupted by ``KeyboardInterrupt`` skips PyTorch's always-call hooks, so its
    thread stays counted (README: Known limits); a ``copy.deepcopy`` starts with none under way.
    """

    def __init__(self) -> None:
        self.depths: dict[int, int] = {}

    def __deepcopy__(self, memo: dict) -> ForwardThreads:
        return type(self)()

    def enter(self) -> int:
        """Count a forward of this thread in, and return how many it now runs (2 or more: nested);
        refuse it while another thread runs one."""
        me = threading.get_ident()
        with _LOCK:
            if any(depth and thread != me for thread, depth in self.depths.items()):
                raise RuntimeError(CONCURRENT_FORWARD_MESSAGE)
            self.depths[me] = depth = self.depths.get(me, 0) + 1
        return depth

    def leave(self) -> int:
        """Count a forward of this thread out, and return how many it ran before (0: none, its
        start was refused)."""
        me = threading.get_ident()
        with _LOCK:
            depth = self.depths.get(me, 0)
            if depth > 1:
                self.depths[me] = depth - 1
            elif depth == 1:
                del self.depths[me]
        return depth

    def clear(self) -> None:
        with _LOCK:
            self.depths.clear()
