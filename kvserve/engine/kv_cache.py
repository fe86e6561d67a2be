"""Paged KV cache bookkeeping: block pool, block tables, prefix index and host tier.

Only :class:`KVCacheManager` touches free lists, reference counts, hashes and
block tables (one writer); the scheduler asks it for room and gets results
back. The KV tensors live in the model runner (the only code that touches
devices): block ``b`` holds cache rows ``b * block_size ... + block_size - 1``
in every layer.

Prefix cache (vLLM's block hashing, made token-granular):
- a full block is indexed by a hash chain: blake2b(parent key, its tokens);
  the root key carries the extra keys (``cache_salt``), so requests with
  different salts never share a block;
- every block that holds tokens is also listed under its parent key, so the
  block after the last matching full block is matched token by token; the
  matched rows are copied into a fresh block (copy on write), so reuse is
  token-granular, not only block-granular;
- a prompt never reuses its last token: the cache holds keys and values, not
  logits (llama-server's rule; at least one prompt token is evaluated).

Host tier (llama-server ``--cache-ram``): blocks that no sequence references
stay indexed and reusable, least recently used first out, up to a budget of
blocks; with budget 0 they are freed at once. The pool is allocated with
``torch.empty`` by the runner, so tier capacity costs memory only once used.

Slots: a finished sequence's blocks can be *parked* under a key (the slot
that ran it), which keeps them referenced like llama-server's idle slot; the
next request on that slot releases them after matching its own prefix.
Parked blocks are released (oldest first) when the pool runs out.

Layer groups (sliding-window models: gemma2, gemma3; vLLM's hybrid KV cache manager): with
``groups`` the manager keeps one more pool per sliding window (its own block ids, free list, host
tier and prefix index, a :class:`KVCacheManager` of its own in :attr:`KVCacheManager.groups`) for
the layers of that window; the manager's own pool serves the full-attention layers. Every sequence
then has a block table per group, of the same length, in which a sliding group's entries for
blocks that no future query can see are 0 (the null block): :meth:`KVCacheManager.slide` gives
them back (to the host tier while they are indexed, so a later prompt can still hit them). A
prefix hit is the longest prefix for which the full group's blocks are cached *and* every sliding
group holds the blocks of that prefix's last ``window - 1`` tokens (:meth:`match_prefix`); the
rest is recomputed. Every public method acts on all groups at once; the sub-pools are never
changed from outside.

KV shifting (llama-server ``--cache-reuse N``, :meth:`KVCacheManager.reuse_shifted`):
after the prefix match, runs of >= N of the slot's parked tokens that match the
prompt further on are moved to their new positions: the manager emits
``pending_shifts`` jobs (src row, dst row, position delta) that the runner
executes before the step's forward (K rows re-rotated by the delta, V copied).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class Block:
    """One fixed-size page of KV.

    Attributes:
        block_id: index in the pool.
        ref_count: sequences (and parked slots) holding it.
        token_ids: tokens whose K/V it holds, in position order (<= block_size).
        parent: key of the preceding block (root key for position 0), set when
            the first token is recorded; None while empty.
        hash: chain key once the block is full and indexed, else None.
    """

    block_id: int
    ref_count: int = 0
    token_ids: list[int] = field(default_factory=list)
    parent: bytes | None = None
    hash: bytes | None = None


@dataclass(slots=True)
class PrefixHit:
    """Result of a prefix lookup: shared full blocks, an optional copy-on-write
    source (block id, tokens to copy) and the number of cached tokens."""

    blocks: list[int] = field(default_factory=list)
    cow_src: int | None = None
    cow_tokens: int = 0
    #: per sliding-window group (KVCacheManager.groups order): its hit over the same tokens, whose
    #: ``blocks`` are 0 (the null block) for blocks wholly outside the window
    groups: list["PrefixHit"] = field(default_factory=list)


def root_key(salt: str | None) -> bytes:
    """Parent key of a sequence's first block; the salt separates caches.

    Any Python string hashes, lone surrogates included ("surrogatepass"): a salt
    the faces did not screen must never raise on the engine thread."""
    return hashlib.blake2b(b"kvserve-root\x00" + (salt or "").encode("utf-8", "surrogatepass"),
                           digest_size=16).digest()


def chain_key(parent: bytes, tokens: list[int]) -> bytes:
    """Key of a full block: hash of its parent key and its tokens."""
    return hashlib.blake2b(parent + array("i", tokens).tobytes(), digest_size=16).digest()


class KVCacheManager:
    """Allocates fixed-size KV blocks to sequences and indexes them for reuse.

    Args:
        num_blocks: blocks in the pool (each ``block_size`` tokens, all layers;
            with ``groups``, the full-attention layers).
        block_size: tokens per block (default 16, as vLLM).
        host_blocks: host-tier budget: unreferenced indexed blocks kept for
            reuse (0 = free at once; -1 = as many as the pool holds).
        groups: sliding-window layer groups, (window in tokens >= 2, blocks of its
            pool, its host-tier budget) each (see the module docstring).

    Block 0 is the null block: never allocated, its rows stay zero, and the
    runner points padded attention positions at it (uninitialized memory
    could hold NaN, and 0 * NaN is NaN even under a mask).

    Thread-safety: engine thread only.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, host_blocks: int = 0,
                 groups: "list[tuple[int, int, int]] | tuple" = ()):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        #: tokens a query of this pool's layers sees (0: full attention)
        self.window = 0
        #: the manager whose sub-pool this is (None: the manager itself)
        self._parent: KVCacheManager | None = None
        #: sliding-window groups' pools, one per (window, num_blocks, host_blocks) of ``groups``
        self.groups: list[KVCacheManager] = []
        for window, nb, hb in groups:
            if window < 2:
                raise ValueError(f"sliding window {window}: at least 2 tokens")
            g = KVCacheManager(nb, block_size, hb)
            g.window, g._parent = window, self
            self.groups.append(g)
        self.pending_group_copies: list[list[tuple[int, int, int]]] = [[] for _ in self.groups]
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.host_blocks = num_blocks if host_blocks < 0 else host_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))  # empty blocks; pop() gives low ids first
        self._lru: OrderedDict[int, None] = OrderedDict()  # ref 0 but still indexed (host tier)
        self._by_hash: dict[bytes, int] = {}
        self._children: dict[bytes, set[int]] = {}
        self._tables: dict[str, list[int]] = {}
        self._parked: OrderedDict[str, list[int]] = OrderedDict()
        self._parked_salt: dict[str, str | None] = {}
        self._parked_owner: dict[str, str | None] = {}
        #: bumped by every change of the parked tables (park, release, drop, eviction)
        self.parked_version = 0
        self.pending_copies: list[tuple[int, int, int]] = []  # (src block, dst block, rows) for the runner
        self.pending_shifts: list[tuple[int, int, int]] = []  # (src row, dst row, position delta) for the runner

    # -- queries -----------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now without preempting anyone (empty + host tier)."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the host tier (unreferenced but reusable)."""
        return len(self._lru)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by sequences or slots (0..1)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def block_table(self, request_id: str) -> list[int]:
        """The sequence's block ids in position order (empty if it has none)."""
        return self._tables.get(request_id, [])

    def group_table(self, group: int, request_id: str) -> list[int]:
        """The sequence's block table in sliding group ``group`` (0 entries: released blocks)."""
        return self.groups[group]._tables.get(request_id, [])

    def group_tables(self, request_id: str) -> dict[str, list[int]]:
        """Every group's table of the sequence, by name: "full" and "sliding N" (window N tokens)."""
        out = {"full": self.block_table(request_id)}
        for g in self.groups:
            out[f"sliding {g.window}"] = g._tables.get(request_id, [])
        return out

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def hit_tokens(self, hit: PrefixHit) -> int:
        return len(hit.blocks) * self.block_size + hit.cow_tokens

    # -- prefix lookup -----------------------------------------------------------

    def match_prefix(self, token_ids: list[int], salt: str | None, max_tokens: int) -> PrefixHit:
        """Longest cached prefix of ``token_ids`` (at most ``max_tokens`` tokens). Changes nothing.

        With sliding-window groups: the longest prefix whose full-attention blocks are cached and
        for which every group also holds the blocks of the prefix's last ``window - 1`` tokens
        (what the first recomputed query reads), vLLM's hybrid rule made token-granular."""
        if self.groups:
            return self._match_hybrid(token_ids, salt, max_tokens)
        bs = self.block_size
        hit = PrefixHit()
        parent = root_key(salt)
        n_full = max_tokens // bs
        i = 0
        while i < n_full:
            key = chain_key(parent, token_ids[i * bs:(i + 1) * bs])
            bid = self._by_hash.get(key)
            if bid is None:
                break
            hit.blocks.append(bid)
            parent = key
            i += 1
        # token-granular tail: the best child of the last matched key
        start = i * bs
        want = token_ids[start:min(start + bs, max_tokens)]
        best, best_n = None, 0
        for bid in self._children.get(parent, ()):
            toks = self.blocks[bid].token_ids
            n = 0
            for a, b in zip(toks, want):
                if a != b:
                    break
                n += 1
            if n > best_n:
                best, best_n = bid, n
        if best is not None and best_n > 0:
            hit.cow_src, hit.cow_tokens = best, best_n
        return hit

    def _best_child(self, parent: bytes, want: list[int]) -> tuple[int | None, int]:
        """The indexed block under ``parent`` whose tokens share the longest start with ``want``:
        (block id, tokens shared), (None, 0) when none shares a token."""
        best, best_n = None, 0
        for bid in self._children.get(parent, ()):
            n = 0
            for a, b in zip(self.blocks[bid].token_ids, want):
                if a != b:
                    break
                n += 1
            if n > best_n:
                best, best_n = bid, n
        return best, best_n

    def _match_hybrid(self, token_ids: list[int], salt: str | None, max_tokens: int) -> PrefixHit:
        bs = self.block_size
        root = root_key(salt)
        keys: list[bytes] = []
        blocks: list[int] = []
        parent = root
        for i in range(max_tokens // bs):
            key = chain_key(parent, token_ids[i * bs:(i + 1) * bs])
            bid = self._by_hash.get(key)
            if bid is None:
                break
            keys.append(key)
            blocks.append(bid)
            parent = key
        start = len(keys) * bs
        cow, cow_n = self._best_child(parent, token_ids[start:min(start + bs, max_tokens)])
        n = start + cow_n
        while True:  # each group's longest servable prefix <= n, until all agree
            m = min(g._window_reach(keys, token_ids, root, n) for g in self.groups)
            if m == n:
                break
            n = m
        k, t = divmod(n, bs)
        hit = PrefixHit(blocks[:k])
        if t:
            hit.cow_src, hit.cow_tokens = (blocks[k] if k < len(blocks) else cow), t
        hit.groups = [g._window_hit(keys, token_ids, root, n) for g in self.groups]
        return hit

    def _window_src(self, keys: list[bytes], token_ids: list[int], root: bytes, k: int,
                    t: int) -> tuple[int | None, int]:
        """A block of this (sliding) pool holding the first tokens of block ``k`` of the prompt:
        (block id, tokens of the first ``t`` it holds)."""
        if k < len(keys):
            bid = self._by_hash.get(keys[k])
            if bid is not None:
                return bid, t
        bs = self.block_size
        return self._best_child(keys[k - 1] if k else root, token_ids[k * bs:k * bs + t])

    def _window_reach(self, keys: list[bytes], token_ids: list[int], root: bytes, n: int) -> int:
        """The longest prefix <= ``n`` tokens this sliding pool can continue: it holds the blocks
        of the prefix's last ``window - 1`` tokens (0 always qualifies)."""
        bs, w = self.block_size, self.window
        k, t = divmod(n, bs)
        present = [key in self._by_hash for key in keys[:k]]

        def covered(end_block: int, end: int) -> bool:  # blocks [first needed, end_block) all here
            lo = max(0, end - w + 1) // bs
            return all(present[lo:end_block])

        if t:
            _, m = self._window_src(keys, token_ids, root, k, t)
            if m and covered(k, k * bs + m):
                return k * bs + m
        # aligned ends, longest first: a run of present blocks long enough for the window
        run = 0
        runs = []
        for p in present:
            run = run + 1 if p else 0
            runs.append(run)
        for kk in range(min(k, len(runs)), 0, -1):  # k is past the keys when the tail is a whole block
            lo = max(0, kk * bs - w + 1) // bs
            if runs[kk - 1] >= kk - lo:
                return kk * bs
        return 0

    def _window_hit(self, keys: list[bytes], token_ids: list[int], root: bytes, n: int) -> PrefixHit:
        """This sliding pool's hit for a prefix of ``n`` tokens that :meth:`_window_reach` allows:
        the blocks of the last ``window - 1`` tokens, 0 (null) before them."""
        bs, w = self.block_size, self.window
        k, t = divmod(n, bs)
        lo = max(0, n - w + 1) // bs
        hit = PrefixHit([0] * lo + [self._by_hash[key] for key in keys[lo:k]])
        if t:
            hit.cow_src, hit.cow_tokens = self._window_src(keys, token_ids, root, k, t)
            hit.cow_tokens = t
        return hit

    # -- updates -----------------------------------------------------------------

    def _take_block(self) -> Block | None:
        if self._free:
            b = self.blocks[self._free.pop()]
        elif self._lru:
            bid, _ = self._lru.popitem(last=False)
            b = self.blocks[bid]
            self._unindex(b)
        elif self._parked:
            (self._parent or self)._evict_parked(next(iter(self._parked)))
            return self._take_block()
        else:
            return None
        b.ref_count = 1
        b.token_ids = []
        return b

    def _evict_parked(self, key: str) -> None:
        """Release what ``key`` has parked in every group (a pool ran out of blocks)."""
        table = self._parked.pop(key, None)
        self._parked_salt.pop(key, None)
        self._parked_owner.pop(key, None)
        self.parked_version += 1
        if table:
            self._release_table(table)
        for g in self.groups:
            g.release_parked(key)

    def _unindex(self, b: Block) -> None:
        if b.hash is not None and self._by_hash.get(b.hash) == b.block_id:
            del self._by_hash[b.hash]
        if b.parent is not None:
            kids = self._children.get(b.parent)
            if kids is not None:
                kids.discard(b.block_id)
                if not kids:
                    del self._children[b.parent]
        b.hash = b.parent = None
        b.token_ids = []

    def allocate_prefix(self, request_id: str, hit: PrefixHit) -> bool:
        """Give a new sequence the blocks of ``hit``: shared full blocks (+1 ref)
        and, for a partial match, a fresh block whose first rows are copied from
        the source (queued in ``pending_copies``; a sliding group's in
        ``pending_group_copies``). False (nothing changed) when no block is free
        for a copy."""
        marks = self.job_marks()
        if not self._allocate_prefix_one(request_id, hit):
            return False
        for i, (g, gh) in enumerate(zip(self.groups, hit.groups)):
            if not g._allocate_prefix_one(request_id, gh):
                self.free(request_id)
                self.drop_jobs(marks)
                return False
            self.pending_group_copies[i].extend(g.take_copies())
        return True

    def _allocate_prefix_one(self, request_id: str, hit: PrefixHit) -> bool:
        table = self._tables.setdefault(request_id, [])
        assert not table, "allocate_prefix on a sequence that already has blocks"
        for bid in hit.blocks:
            if bid == 0:  # a sliding group's block outside the window
                table.append(0)
                continue
            b = self.blocks[bid]
            if b.ref_count == 0:
                self._lru.pop(bid, None)
            b.ref_count += 1
            table.append(bid)
        if hit.cow_src is not None:
            src = self.blocks[hit.cow_src]
            if src.ref_count == 0:  # keep the source alive while choosing a destination
                self._lru.pop(src.block_id, None)
            src.ref_count += 1
            dst = self._take_block()
            self._unref(src)
            if dst is None:
                self._release_table(self._tables.pop(request_id, []))
                return False
            dst.parent = src.parent
            dst.token_ids = src.token_ids[: hit.cow_tokens]
            self._children.setdefault(dst.parent, set()).add(dst.block_id)
            self.pending_copies.append((src.block_id, dst.block_id, hit.cow_tokens))
            table.append(dst.block_id)
        return True

    def allocate(self, request_id: str, num_tokens: int, evict: bool = True) -> bool:
        """Make the sequence's table cover ``num_tokens`` tokens.

        Evicts host-tier blocks (LRU) and parked slot blocks when the pool has
        no empty block (``evict`` False: takes empty blocks only, as for draft
        tokens, which must not cost anyone's cached prefix). Returns False (and
        changes nothing) when still short, in any group.
        """
        if not self.groups:
            return self._allocate_one(request_id, num_tokens, evict)
        managers = [self, *self.groups]
        before = [len(m._tables.get(request_id, ())) for m in managers]
        for i, m in enumerate(managers):
            if not m._allocate_one(request_id, num_tokens, evict):
                for m2, n in zip(managers[:i], before):
                    m2._shrink(request_id, n)
                return False
        return True

    def _shrink(self, request_id: str, n: int) -> None:
        """Undo an allocation: drop the (empty) blocks past the first ``n`` of the table."""
        table = self._tables.get(request_id)
        if table is None:
            return
        self._drop_table(table[n:])
        del table[n:]
        if not table:
            del self._tables[request_id]

    def _allocate_one(self, request_id: str, num_tokens: int, evict: bool) -> bool:
        table = self._tables.setdefault(request_id, [])
        need = self.blocks_needed(num_tokens) - len(table)
        if need <= 0:
            return True
        if not evict and need > len(self._free):
            if not table:
                del self._tables[request_id]
            return False
        parked = sum(1 for t in self._parked.values() for b in t if b)
        if need > len(self._free) + len(self._lru) + parked:
            if not table:
                del self._tables[request_id]
            return False
        new: list[Block] = []
        for _ in range(need):
            b = self._take_block()
            if b is None:  # parked blocks shared with running sequences freed nothing
                for nb in new:
                    table.remove(nb.block_id)
                    self._unref(nb)
                if not table:
                    del self._tables[request_id]
                return False
            new.append(b)
            table.append(b.block_id)
        return True

    def record_tokens(self, request_id: str, start: int, token_ids: list[int], salt: str | None = None) -> None:
        """Note that positions ``start..`` of the sequence now hold ``token_ids``;
        blocks that become full are indexed by their chain key (in every group)."""
        for g in self.groups:
            g.record_tokens(request_id, start, token_ids, salt)
        self._record(request_id, start, token_ids, salt)

    def _record(self, request_id: str, start: int, token_ids: list[int], salt: str | None,
                parent: bytes | None = None) -> None:
        """:meth:`record_tokens` in this pool only. ``parent``: the chain key before the first
        block, where the table has no block before it (a restored sliding group's table starts
        with released entries)."""
        table = self._tables[request_id]
        bs = self.block_size
        pos = start
        for t in token_ids:
            idx, off = divmod(pos, bs)
            blk = self.blocks[table[idx]]
            if off == 0 and blk.parent is None:
                prev = table[idx - 1] if idx else 0
                blk.parent = root_key(salt) if idx == 0 else self.blocks[prev].hash if prev else parent
                if blk.parent is not None:
                    self._children.setdefault(blk.parent, set()).add(blk.block_id)
            if off < len(blk.token_ids):
                del blk.token_ids[off:]
            blk.token_ids.append(t)
            if off == bs - 1 and blk.parent is not None and blk.hash is None:
                key = chain_key(blk.parent, blk.token_ids)
                blk.hash = key
                self._by_hash.setdefault(key, blk.block_id)
            pos += 1

    def restore(self, request_id: str, token_ids: list[int], group_firsts: list[int], salt: str | None = None) -> bool:
        """Blocks for a sequence restored from a slot file, its tokens recorded under ``salt`` (the
        cache key it was computed under): the full layers'
        blocks for every token, sliding group g's only from position ``group_firsts[g]`` (a multiple
        of the block size) on, the earlier entries 0 as :meth:`slide` leaves them. Every group's
        blocks are indexed under the full layers' chain keys, so prefix hits find them. Returns
        False (nothing changed) when a pool is short of blocks (parked blocks and the host tier
        are evicted first, as :meth:`allocate` does)."""
        n = len(token_ids)
        managers = [self, *self.groups]
        for i, m in enumerate(managers):
            if i:
                m._tables[request_id] = [0] * (group_firsts[i - 1] // m.block_size)
            if not m._allocate_one(request_id, n, True):
                for m2 in managers[:i + 1]:
                    m2._shrink(request_id, 0)
                return False
        self._record(request_id, 0, token_ids, salt)
        full = self._tables[request_id]
        for g, first in zip(self.groups, group_firsts):
            if first < n:
                k = first // g.block_size
                g._record(request_id, first, token_ids[first:], salt, self.blocks[full[k - 1]].hash if k else None)
        return True

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Shrink the sequence's table to the blocks covering its first ``num_tokens`` tokens
        (speculative decoding: the blocks past them hold only rejected draft positions).

        The released blocks must hold no recorded token (``record_tokens`` was never called
        for their positions): they are emptied and go back to the free list, never to the
        host tier or the prefix index. Tokens recorded in the kept blocks stay as they are.
        """
        for g in self.groups:
            g.truncate(request_id, num_tokens)
        table = self._tables.get(request_id)
        if not table:
            return
        keep = self.blocks_needed(num_tokens)
        while len(table) > keep:
            b = self.blocks[table.pop()]
            assert not b.token_ids and b.hash is None, "truncate would drop recorded tokens"
            self._drop_table([b.block_id])

    def _unref(self, b: Block) -> None:
        b.ref_count -= 1
        if b.ref_count > 0:
            return
        b.ref_count = 0
        indexed = b.hash is not None or (b.parent is not None and b.token_ids)
        if indexed and self.host_blocks > 0:
            self._lru[b.block_id] = None
            while len(self._lru) > self.host_blocks:
                bid, _ = self._lru.popitem(last=False)
                old = self.blocks[bid]
                self._unindex(old)
                self._free.append(bid)
        else:
            self._unindex(b)
            self._free.append(b.block_id)

    def _release_table(self, table: list[int]) -> None:
        for bid in reversed(table):  # tail first: it is the least reusable
            if bid:
                self._unref(self.blocks[bid])

    def free(self, request_id: str) -> None:
        """Drop the sequence's references; unreferenced blocks go to the host tier or the free list."""
        for g in self.groups:
            g.free(request_id)
        self._release_table(self._tables.pop(request_id, []))

    def slide(self, request_id: str, first_query: int) -> None:
        """Give back the sliding groups' blocks that no query at position >= ``first_query``
        (tokens) can see: those wholly before ``first_query - window + 1``. Their table entries
        become 0 (the null block); indexed blocks go to the host tier (reusable by a later
        prompt), the others to the free list. Nothing to do without sliding groups."""
        for g in self.groups:
            table = g._tables.get(request_id)
            if not table:
                continue
            j = min(max(0, first_query - g.window + 1) // g.block_size, len(table)) - 1
            while j >= 0 and table[j]:  # released entries are a prefix: stop at the first 0
                g._unref(g.blocks[table[j]])
                table[j] = 0
                j -= 1

    def discard(self, request_id: str) -> None:
        """Drop the sequence's references like :meth:`free`, but blocks left unreferenced are
        unindexed and emptied, never kept in the host tier (a failed step may have left their
        rows incomplete; an erased slot's text must not be reusable)."""
        for g in self.groups:
            g.discard(request_id)
        self._drop_table(self._tables.pop(request_id, []))

    def _drop_table(self, table: list[int]) -> None:
        for bid in reversed(table):
            if not bid:
                continue
            b = self.blocks[bid]
            b.ref_count -= 1
            if b.ref_count <= 0:
                b.ref_count = 0
                self._unindex(b)
                self._free.append(bid)

    def park(self, request_id: str, key: str, salt: str | None = None, owner: str | None = None) -> None:
        """Keep the sequence's blocks referenced under ``key`` (an idle slot); replaces what the key held.

        ``salt`` is the sequence's cache_salt (KV shifting only reuses parked rows of the same salt);
        ``owner`` the request's :attr:`~kvserve.engine.request.Request.owner` (see :meth:`parked_owner`)."""
        for g in self.groups:
            g.park(request_id, key, salt, owner)
        table = self._tables.pop(request_id, [])
        old = self._parked.pop(key, None)
        self._parked[key] = table
        self._parked_salt[key] = salt
        self._parked_owner[key] = owner
        self.parked_version += 1
        if old:
            self._release_table(old)

    def release_parked(self, key: str) -> None:
        """Drop the blocks parked under ``key`` (when its slot starts a new sequence)."""
        for g in self.groups:
            g.release_parked(key)
        table = self._parked.pop(key, None)
        self._parked_salt.pop(key, None)
        self._parked_owner.pop(key, None)
        self.parked_version += table is not None
        if table:
            self._release_table(table)

    def drop_parked(self, key: str) -> None:
        """Drop the blocks parked under ``key`` from the slot, the host tier and the prefix index
        (a slot ``erase``: llama-server's next request then reuses nothing). Blocks that another
        sequence or slot still references stay as they are."""
        for g in self.groups:
            g.drop_parked(key)
        table = self._parked.pop(key, None)
        self._parked_salt.pop(key, None)
        self._parked_owner.pop(key, None)
        self.parked_version += table is not None
        if table:
            self._drop_table(table)

    def parked_keys(self) -> list[str]:
        """Keys with parked blocks, oldest first."""
        return list(self._parked)

    def parked_table(self, key: str) -> list[int]:
        """Block ids parked under ``key`` in position order (empty if none)."""
        return list(self._parked.get(key, []))

    def parked_salt(self, key: str) -> str | None:
        """cache_salt of the sequence parked under ``key`` (None: unsalted or nothing parked)."""
        return self._parked_salt.get(key)

    def parked_owner(self, key: str) -> str | None:
        """Owner of the request whose sequence is parked under ``key`` (None: unknown, e.g. a slot
        restored from a file, or sent without an API key)."""
        return self._parked_owner.get(key)

    def row_of(self, table: list[int], pos: int) -> int:
        """KV cache row of position ``pos`` (tokens) of a block table."""
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def reuse_shifted(self, request_id: str, prompt: list[int], n_past: int, key: str, min_run: int,
                      limit: int, salt: str | None = None) -> int:
        """llama-server's cache-reuse loop over the tokens parked under ``key``.

        Starting at cached position ``n_past`` (the end of the common prefix),
        skip cached tokens until a run of at least ``min_run`` tokens matches
        ``prompt`` at the current prompt position ``head_p``; reuse that run at
        its new positions and continue after it. Only text removed from the
        prompt is handled (the walk only moves forward through the cache).

        The sequence's table is extended to cover the reused positions
        [n_past, head_p), shift jobs (src row, dst row, delta = new - old
        position) are queued in ``pending_shifts`` and the tokens are recorded
        (indexed) under ``salt``.

        Args:
            prompt: the request's prompt token ids.
            n_past: prompt tokens already reused by the prefix match (tokens).
            min_run: N of ``--cache-reuse N`` / ``n_cache_reuse`` (>= 1).
            limit: prompt positions >= limit are never reused (len(prompt) - 1:
                at least one prompt token is evaluated).

        Returns:
            the new n_past (tokens); ``n_past`` unchanged when nothing matched,
            the parked salt differs, or no block was free.
        """
        src_table = self._parked.get(key)
        if not src_table or min_run <= 0 or self._parked_salt.get(key) != salt or self.groups:
            return n_past  # sliding-window groups: see can_shift
        cached = self.parked_tokens(key)
        head_c = head_p = n_past
        runs: list[tuple[int, int, int]] = []  # (cached start, prompt start, length)
        while head_c < len(cached) and head_p < limit:
            n = 0
            while head_c + n < len(cached) and head_p + n < limit and cached[head_c + n] == prompt[head_p + n]:
                n += 1
            if n >= min_run:
                runs.append((head_c, head_p, n))
                head_c += n
                head_p += n
            else:
                head_c += 1
        if not runs:
            return n_past
        # pin the source blocks: allocating may release this very parked table
        pinned = list(src_table)
        for bid in pinned:
            b = self.blocks[bid]
            if b.ref_count == 0:
                self._lru.pop(bid, None)
            b.ref_count += 1
        try:
            if not self.allocate(request_id, head_p):
                return n_past
            table = self._tables[request_id]
            for c0, p0, n in runs:
                delta = p0 - c0
                for i in range(n):
                    self.pending_shifts.append((self.row_of(src_table, c0 + i), self.row_of(table, p0 + i), delta))
        finally:
            for bid in pinned:
                self._unref(self.blocks[bid])
        self.record_tokens(request_id, n_past, prompt[n_past:head_p], salt)
        return head_p

    def take_shifts(self) -> list[tuple[int, int, int]]:
        """KV shift jobs for the runner (emptied): (src row, dst row, position delta)."""
        c, self.pending_shifts = self.pending_shifts, []
        return c

    def parked_tokens(self, key: str) -> list[int]:
        """Tokens held by the blocks parked under ``key``."""
        out: list[int] = []
        for bid in self._parked.get(key, []):
            out.extend(self.blocks[bid].token_ids)
        return out

    def take_copies(self) -> list[tuple[int, int, int]]:
        """Copy-on-write jobs for the runner (emptied)."""
        c, self.pending_copies = self.pending_copies, []
        return c

    def take_group_copies(self) -> list[list[tuple[int, int, int]]]:
        """Per sliding group, its copy-on-write jobs (group block ids) for the runner (emptied)."""
        c, self.pending_group_copies = self.pending_group_copies, [[] for _ in self.groups]
        return c

    def job_marks(self) -> tuple:
        """Where the queued copy/shift jobs end now (see :meth:`drop_jobs`)."""
        return len(self.pending_copies), len(self.pending_shifts), [len(c) for c in self.pending_group_copies]

    def drop_jobs(self, marks: tuple) -> None:
        """Forget the copy/shift jobs queued since ``marks`` (a request whose admission failed)."""
        del self.pending_copies[marks[0]:], self.pending_shifts[marks[1]:]
        for c, n in zip(self.pending_group_copies, marks[2]):
            del c[n:]

    @property
    def can_shift(self) -> bool:
        """Whether KV shifting (``--cache-reuse``) applies: not with sliding-window groups (a
        shifted run's sliding-layer rows before the window are gone, and its window would
        hold other tokens than the prompt's at the new positions: not exact)."""
        return not self.groups
