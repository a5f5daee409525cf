"""The agent's copy of the blocks its engine caches, so that the orchestrator's index can be rebuilt.

The orchestrator's KV index of an instance is fed by the events the agent forwards, and it is lost
whenever the instance starts a new session: the orchestrator restarted, or it expired the agent (a
starved host) and dropped its entries at the re-Hello. The engine still holds those blocks, and it
never announces them again. So the forwarder applies every event it reads to a ``KvMirror`` and,
after each ``Welcome``, sends ``snapshot()``: a ``cleared`` followed by the stored blocks, parents
before children, which turns an empty (or stale) index into exactly what the live events had built.

What the mirror keeps follows the orchestrator's ``PrefixIndex`` rule for rule, so that a snapshot
applied to an empty index gives the same entries as every event applied one by one:

- a ``stored`` block is kept only when its parent is held (or it is a prompt's first block) and its
  tokens fill a whole block; the rest of that event is skipped after the first block that is not;
- a ``removed`` block whose descendants are still cached stays as a *ghost*: not held, but its
  tokens are needed to chain the descendants (the index keys a block by its whole prefix). The
  snapshot stores a ghost to chain its children and removes it at the end. A ghost goes as soon as
  its last descendant goes;
- a ``cleared`` empties it, and so does a block size other than the one in use (a new engine).

Memory is bounded: token ids are stored as arrays of the smallest integer width that holds them (one
byte for the simulated engine's, four for a real vocabulary), and the mirror's estimated size
(``BLOCK_BYTES`` per block plus its token ids: measured, 500,000 blocks of 16 tokens take about
140 MB) stays under ``max_bytes``, 128 MiB by default; a real engine's prefix cache usually needs far
less (the CPU test engine's 1 GiB cache: 8,192 blocks of 128 tokens, about 4 MB). A block that would go
beyond is not kept and is counted in ``skipped``: a snapshot then misses it (and its descendants), so
the rebuilt index may miss blocks but never holds one the engine does not.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from vllm_disagg.protocol.messages import KvEvent

MAX_BYTES = 128 << 20
BLOCK_BYTES = 240  # a block's cost besides its token ids (dict entries, record, array header): 224 measured
_TYPECODES = ("B", "H", "I", "Q")  # the narrowest array that holds a block's token ids


def _cost(tokens: array[int]) -> int:
    return BLOCK_BYTES + tokens.itemsize * len(tokens)


@dataclass(slots=True)
class _Block:
    parent: int | None
    tokens: array[int]
    held: bool = True


class KvMirror:
    """The blocks an engine holds, from the KV events it published; ``snapshot()`` re-sends them."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self._max_bytes = max_bytes
        self._bytes = 0
        self._width = 0  # index in _TYPECODES of the narrowest width every block so far fits
        # Insertion-ordered: a block usually comes after its parent, so a snapshot rarely waits.
        self._blocks: dict[int, _Block] = {}
        self._children: dict[int, int] = {}  # engine hash -> blocks kept whose parent it is
        self._tokens = 0  # token ids stored, ghosts included
        self.block_size: int | None = None
        self.held = 0  # blocks the engine holds (ghosts excluded)
        self.skipped = 0  # stored blocks not kept because the mirror was full, over its life

    def __len__(self) -> int:
        """Blocks the engine holds, as far as the mirror knows."""
        return self.held

    @property
    def tokens(self) -> int:
        """Token ids stored, ghosts included."""
        return self._tokens

    @property
    def size_bytes(self) -> int:
        """The estimated memory the mirror holds (what ``max_bytes`` bounds)."""
        return self._bytes

    @property
    def ghosts(self) -> int:
        """Removed blocks kept only to chain descendants that are still cached."""
        return len(self._blocks) - self.held

    def apply(self, events: Iterable[KvEvent]) -> None:
        """Apply protocol events in order, as the orchestrator's index would."""
        for event in events:
            if event.kind == "stored":
                self._stored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size)
            elif event.kind == "removed":
                for engine_hash in event.block_hashes:
                    self._removed(engine_hash)
            else:
                self.clear()

    def clear(self) -> None:
        """The engine's cache was emptied (or the engine replaced)."""
        self._blocks.clear()
        self._children.clear()
        self._tokens = 0
        self._bytes = 0
        self.held = 0

    def _stored(self, hashes: Sequence[int], parent: int | None, tokens: Sequence[int], size: int) -> None:
        if size < 1:
            return  # the index ignores such an event too
        if size != self.block_size:
            self.clear()  # the index drops an instance whose block size changes
            self.block_size = size
        if parent is not None and not self._is_held(parent):
            return  # the index cannot chain it either
        for i, engine_hash in enumerate(hashes):
            block = tokens[i * size : (i + 1) * size]
            if len(block) < size:
                return
            if not self._put(engine_hash, parent, block):
                return  # its descendants in this event would have no parent here
            parent = engine_hash

    def _is_held(self, engine_hash: int) -> bool:
        block = self._blocks.get(engine_hash)
        return block is not None and block.held

    def _put(self, engine_hash: int, parent: int | None, tokens: Sequence[int]) -> bool:
        old = self._blocks.pop(engine_hash, None)
        if old is not None:  # stored again (it was a ghost, or an event was repeated)
            self._forget(old)
            self.held -= old.held
            self._unlink(old.parent)
        packed = self._pack(tokens)
        if packed is None or self._bytes + _cost(packed) > self._max_bytes:
            self.skipped += 1
            return False
        self._blocks[engine_hash] = _Block(parent, packed)
        self._tokens += len(packed)
        self._bytes += _cost(packed)
        self.held += 1
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1
        return True

    def _pack(self, tokens: Sequence[int]) -> array[int] | None:
        # One engine's ids share a vocabulary: start from the width the last block needed.
        for width in range(self._width, len(_TYPECODES)):
            try:
                packed = array(_TYPECODES[width], tokens)
            except OverflowError:
                continue
            self._width = width
            return packed
        return None  # a negative or oversized id: not a token any engine sends

    def _forget(self, block: _Block) -> None:
        self._tokens -= len(block.tokens)
        self._bytes -= _cost(block.tokens)

    def _removed(self, engine_hash: int) -> None:
        block = self._blocks.get(engine_hash)
        if block is None or not block.held:
            return
        block.held = False
        self.held -= 1
        self._collect(engine_hash)

    def _unlink(self, parent: int | None) -> None:
        """One block fewer has ``parent`` as its parent: ghosts nobody needs any more go, up the chain."""
        while parent is not None:  # a loop, not recursion: a chain may be thousands of blocks long
            left = self._children.get(parent, 0) - 1
            if left > 0:
                self._children[parent] = left
                return
            self._children.pop(parent, None)
            block = self._blocks.get(parent)
            if block is None or block.held:
                return
            del self._blocks[parent]
            self._forget(block)
            parent = block.parent

    def _collect(self, engine_hash: int) -> None:
        """Forget a block that is neither held nor needed by a descendant, then its ghost ancestors."""
        block = self._blocks.get(engine_hash)
        if block is None or block.held or self._children.get(engine_hash):
            return
        del self._blocks[engine_hash]
        self._forget(block)
        self._unlink(block.parent)

    def snapshot(self, max_items: int) -> list[KvEvent]:
        """Events that rebuild the engine's blocks in an index: ``cleared``, ``stored`` parents first,
        then ``removed`` for the ghosts; no event holds more than ``max_items`` token ids plus hashes
        (plus one), chains of blocks share an event.
        """
        events = [KvEvent("cleared")]
        size = self.block_size or 1
        per_event = max(1, (max_items - 1) // (size + 1))
        waiting: dict[int, list[int]] = {}  # parent -> blocks met before it
        emitted: set[int] = set()
        run: list[int] = []  # the stored event being built: a chain of blocks
        run_tokens: list[int] = []
        run_parent: int | None = None

        def close_run() -> None:
            if run:
                events.append(KvEvent("stored", run.copy(), run_parent, run_tokens.copy(), size))
                run.clear()
                run_tokens.clear()

        def emit(engine_hash: int) -> None:
            nonlocal run_parent
            stack = [engine_hash]
            while stack:
                current = stack.pop()
                block = self._blocks[current]
                if not run or run[-1] != block.parent or len(run) >= per_event:
                    close_run()
                    run_parent = block.parent
                run.append(current)
                run_tokens.extend(block.tokens)
                emitted.add(current)
                stack.extend(reversed(waiting.pop(current, ())))

        for engine_hash, block in self._blocks.items():
            if block.parent is None or block.parent in emitted:
                emit(engine_hash)
            else:
                waiting.setdefault(block.parent, []).append(engine_hash)
        close_run()
        ghosts = [h for h, b in self._blocks.items() if not b.held and h in emitted]
        per_removal = max(1, max_items - 1)
        for start in range(0, len(ghosts), per_removal):
            events.append(KvEvent("removed", ghosts[start : start + per_removal]))
        return events
