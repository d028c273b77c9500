"""Which context-parallel rank owns which page of a prefix, on a server whose CP ranks
hold disjoint pages ("owner-sharded" CP).

Stock SGLang 0.5.12 replicates every page on every CP rank (`fingerprint.CP_REPLICATED`),
so it never needs this. A fork that shards pages over its CP ranks decides a page's
owner by a pure function of the page's logical index (its page index in the device pool,
slot // page_size), identical on every CP rank; a prefix's *owner pattern* is that
function over its pages, one CP rank per page in prefix order. Moving such pages rank to
rank needs both servers to use the same function: the source rank sends only the pages
it owns, and the target allocates pages with the same pattern (an owner-aware allocator)
so that each page lands on its owner's twin. The function travels in the fingerprint
(`LayoutFingerprint.cp_owner`) as a *name* from the short list below, never as code, and
a server whose function differs is refused naming that field.

Plain data, importable without torch or SGLang.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

# `round_robin:<pages_per_turn>`: pages are dealt to CP ranks 0, 1, .., C-1, 0, .. in
# turns of `pages_per_turn` pages each; `round_robin:1` deals them one at a time (page p
# is owned by rank p mod C), the kind of function a sharding fork uses.
ROUND_ROBIN = "round_robin"
KNOWN_OWNER_FUNCTIONS = (ROUND_ROBIN,)
# Bounds the one parameter so a hostile description cannot name an absurd function.
_MAX_PAGES_PER_TURN = 1 << 20


@dataclass(frozen=True)
class PageOwners:
    """A named owner function over `cp_size` CP ranks: logical page index -> CP rank."""

    cp_size: int
    pages_per_turn: int = 1

    def __post_init__(self) -> None:
        if not _is_int(self.cp_size) or self.cp_size < 2:
            raise ValueError(f"owner-sharded pages need attn_cp_size >= 2, got {self.cp_size!r}")
        if not _is_int(self.pages_per_turn) or not 1 <= self.pages_per_turn <= _MAX_PAGES_PER_TURN:
            raise ValueError(
                f"cp_owner {ROUND_ROBIN}: pages per turn must be 1..{_MAX_PAGES_PER_TURN}, "
                f"got {self.pages_per_turn!r}"
            )

    @classmethod
    def parse(cls, description: str, cp_size: int) -> PageOwners:
        """The function `description` names (`describe()`'s form) over `cp_size` ranks;
        ValueError naming the problem for anything not on the known list."""
        if not isinstance(description, str):
            raise ValueError(f"cp_owner must be a string, got {description!r}")
        name, sep, parameter = description.partition(":")
        if name not in KNOWN_OWNER_FUNCTIONS or not sep:
            raise ValueError(
                f"cp_owner {description!r} is not a known owner function "
                f"(known: {', '.join(f'{n}:<pages_per_turn>' for n in KNOWN_OWNER_FUNCTIONS)})"
            )
        if not parameter.isdigit() or parameter != str(int(parameter)):
            raise ValueError(f"cp_owner {description!r}: pages per turn must be a plain integer")
        return cls(cp_size=cp_size, pages_per_turn=int(parameter))

    def describe(self) -> str:
        """The name the fingerprint carries (`parse` reads it back)."""
        return f"{ROUND_ROBIN}:{self.pages_per_turn}"

    def owner_of(self, page: int) -> int:
        """The CP rank that owns logical page `page` (a page index of the device pool)."""
        if not _is_int(page) or page < 0:
            raise ValueError(f"logical page index must be an int >= 0, got {page!r}")
        return (page // self.pages_per_turn) % self.cp_size

    def owners(self, pages: Sequence[int]) -> list[int]:
        """The owner of each page of `pages` (a prefix's device pages, in prefix order):
        the pattern the source sends and the target allocates with."""
        return [self.owner_of(page) for page in pages]

    def check_pattern(self, pattern: Sequence[int]) -> None:
        """ValueError unless `pattern` (from a peer: hostile) is a list of CP ranks."""
        bad = next((o for o in pattern if not _is_int(o) or not 0 <= o < self.cp_size), None)
        if bad is not None:
            raise ValueError(f"page owner {bad!r} is not a CP rank in 0..{self.cp_size - 1}")

    def allocation_matches(self, pages: Sequence[int], pattern: Sequence[int]) -> bool:
        """Whether freshly allocated `pages` have exactly the owners `pattern` asks for
        (what an owner-aware allocator such as a fork's `alloc_pages_with_owners` must
        give the target before it takes any bytes)."""
        return len(pages) == len(pattern) and self.owners(pages) == list(pattern)


@dataclass(frozen=True)
class OwnerRun:
    """The owners of the pages one allocation reserves: the run after what the target
    already held, one CP rank per page, under `function` (the target's, equal to the
    source's: the fingerprints agree)."""

    function: PageOwners
    pattern: tuple[int, ...]


def owned_pages(pattern: Sequence[int], cp_rank: int, page_size: int, num_tokens: int) -> list[int]:
    """The token offsets (from the run's first token) of the pages of a run of
    `num_tokens` tokens that `cp_rank` owns under `pattern`: what that rank sends or
    writes. A run cut short (a partial send) keeps the owned pages inside it."""
    owned = owned_positions(pattern[: num_tokens // page_size], cp_rank)
    return [p * page_size + t for p in owned for t in range(page_size)]


def owned_positions(pattern: Sequence[int], cp_rank: int) -> list[int]:
    """The positions in `pattern` (one owner per page of a run) that CP rank `cp_rank`
    owns: the pages that rank sends as a source and writes as a target. A run that starts
    mid-pattern (a matched prefix ending inside a turn) simply starts with that turn's
    owner; the positions are always relative to the run's first page."""
    return [i for i, owner in enumerate(pattern) if owner == cp_rank]


def cp_rank_of(tp_rank: int, tp_size: int, cp_size: int) -> int:
    """The CP rank of TP rank `tp_rank`: SGLang numbers them
    ``tp_rank = cp_rank * attn_tp_size + attn_tp_rank`` with ``attn_tp_size = tp_size / C``."""
    return tp_rank // max(1, tp_size // cp_size)


def pattern_digest(pattern: Sequence[int]) -> str:
    """What a grant binds of the owner pattern it was allocated with (the source compares
    its own pattern of the run with it before it sends): sha256 of the owners in decimal,
    comma separated."""
    return hashlib.sha256(",".join(map(str, pattern)).encode()).hexdigest()[:32]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
