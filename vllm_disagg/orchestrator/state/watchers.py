"""Who hears of a registry's changes: the callbacks ``Registry.watch`` keeps, and calling them."""

from __future__ import annotations

from collections.abc import Callable

Unwatch = Callable[[], None]  # stops what ``Registry.watch`` started


class Watchers:
    """Callbacks told of every change a snapshot shows (``changes``), and those also told as in-flight
    counts move (``flight``). Tuples, so that a callback that stops watching while the others are
    called does not disturb the loop; the hot path (a request sent or over) checks ``flight`` alone."""

    def __init__(self) -> None:
        self.changes: tuple[Callable[[], None], ...] = ()
        self.flight: tuple[Callable[[], None], ...] = ()

    def add(self, callback: Callable[[], None], in_flight: bool) -> Unwatch:
        """Watch; returns the call that stops this one registration."""
        if in_flight:
            self.flight += (callback,)
        else:
            self.changes += (callback,)

        def unwatch() -> None:
            if in_flight:
                self.flight = _without(self.flight, callback)
            else:
                self.changes = _without(self.changes, callback)

        return unwatch

    def notify(self) -> None:
        """A change a snapshot shows: tell every watcher."""
        for callback in self.changes:
            callback()
        for callback in self.flight:
            callback()

    def notify_in_flight(self) -> None:
        """In-flight counts moved: tell those who asked for it."""
        for callback in self.flight:
            callback()


def _without(
    callbacks: tuple[Callable[[], None], ...], callback: Callable[[], None]
) -> tuple[Callable[[], None], ...]:
    """``callbacks`` less one registration of ``callback`` (a watcher may watch twice, and stop once)."""
    for i, c in enumerate(callbacks):
        if c == callback:
            return callbacks[:i] + callbacks[i + 1 :]
    return callbacks
