"""How an APB prefill is cut over instances: pure logic, no I/O.

The home cuts a request's document into H contiguous chunks at block boundaries (every chunk's
KV becomes one segment of the request, and a segment starts on a block), one per host. The
home takes the last chunk, so that its segment is the request's tail and the query (and the
output) go on writing into it; the peers take the chunks before it, in order, rank 0 first.
Host 0's chunk begins with the anchor block's document tokens, which every later host puts
before its own rows (``engine/seq_parallel.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

PREFILL_MODES = ("exact", "apb")
SCORERS = ("attention", "random")
# With no figure given: the anchor is this part of a chunk, and each host passes this part of
# a chunk's keys per KV head to the hosts after it.
DEFAULT_ANCHOR_FRACTION = 0.25
DEFAULT_PASSING_FRACTION = 0.125
# ... but never fewer tokens than these (the anchor cut to chunk 0). Short chunks lost the most
# accuracy at the fractions alone (bench/apb_accuracy.py, SmolLM2-135M: H=4 8.0 points under
# exact, 1.7 with these floors); long chunks, where APB saves the most, are above them anyway.
DEFAULT_ANCHOR_MIN_TOKENS = 1024
DEFAULT_PASSING_MIN_TOKENS = 512


@dataclass(frozen=True)
class PrefillOptions:
    """A request's choice of prefill, as the APIs take it (validated here).

    mode: "exact" (the default) or "apb".
    query: for a completion, the question after the document (the prompt); text or token ids.
        For a chat, the last user turn is the query and this stays None.
    hosts: instances to prefill over, the home included (None: every live instance).
    anchor_tokens, passing_tokens: APB's anchor length and passing-block length per KV head
        (None: a quarter and an eighth of a chunk); passing_tokens 0 passes nothing.
    scorer: "attention" (APB's own) or "random" (an ablation).
    """

    mode: str = "exact"
    query: str | tuple[int, ...] | None = None
    hosts: int | None = None
    anchor_tokens: int | None = None
    passing_tokens: int | None = None
    scorer: str = "attention"

    def __post_init__(self) -> None:
        if self.mode not in PREFILL_MODES:
            raise ValueError(f"prefill must be one of {', '.join(PREFILL_MODES)}, got {self.mode!r}")
        if self.scorer not in SCORERS:
            raise ValueError(f"apb_scorer must be one of {', '.join(SCORERS)}, got {self.scorer!r}")
        for name, value, low in (("apb_hosts", self.hosts, 1), ("apb_anchor_tokens", self.anchor_tokens, 0),
                                 ("apb_passing_tokens", self.passing_tokens, 0)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.query is not None and not (isinstance(self.query, str) or (
                isinstance(self.query, tuple)
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.query))):
            raise ValueError("query must be a string or a list of token ids")

    @property
    def apb(self) -> bool:
        return self.mode == "apb"


@dataclass(frozen=True)
class APBPlan:
    """The chunks of one APB prefill.

    bounds: ``H + 1`` token positions, ``bounds[r] .. bounds[r + 1]`` being rank r's chunk;
        every inner bound a multiple of the block size.
    anchor_len: the document's first tokens, before every chunk but rank 0's.
    passing_len: keys per KV head each host passes on, per layer.
    """

    bounds: tuple[int, ...]
    anchor_len: int
    passing_len: int

    @property
    def num_hosts(self) -> int:
        return len(self.bounds) - 1

    @property
    def doc_len(self) -> int:
        return self.bounds[-1]

    def chunk(self, rank: int) -> tuple[int, int]:
        """Rank ``rank``'s chunk as ``(start, end)`` positions."""
        return self.bounds[rank], self.bounds[rank + 1]

    def chunk_len(self, rank: int) -> int:
        start, end = self.chunk(rank)
        return end - start


def plan_apb(doc_len: int, num_hosts: int, block_size: int, *, min_chunk_tokens: int,
             anchor_tokens: int | None = None, passing_tokens: int | None = None) -> APBPlan | str:
    """Cut a document of ``doc_len`` tokens over ``num_hosts`` hosts.

    Returns the plan, or why the document is too short for it (the request is then prefilled
    exactly): a chunk shorter than ``min_chunk_tokens`` (at least one block) is not worth a
    host. An anchor longer than rank 0's chunk is cut to it.

    Raises ValueError for arguments no request can make (a non-positive host count or block).
    """
    if num_hosts < 1 or block_size < 1 or min_chunk_tokens < 1:
        raise ValueError(f"num_hosts, block_size and min_chunk_tokens must be positive, got "
                         f"{num_hosts}, {block_size}, {min_chunk_tokens}")
    if num_hosts == 1:
        return "one host: an APB prefill over one instance is an exact prefill"
    # A multiple of the block: the cuts are rounded down to blocks, and none may then fall short.
    min_chunk = -(-max(min_chunk_tokens, block_size) // block_size) * block_size
    if doc_len < num_hosts * min_chunk:
        return (f"the document has {doc_len} tokens, too few for {num_hosts} chunks of at least {min_chunk} "
                f"tokens (apb_min_chunk_tokens)")
    inner = [(rank * doc_len // num_hosts) // block_size * block_size for rank in range(1, num_hosts)]
    bounds = (0, *inner, doc_len)
    if any(b <= a for a, b in zip(bounds, bounds[1:])):  # not reached while min_chunk >= block_size
        return f"the document has {doc_len} tokens, too few to cut into {num_hosts} block-aligned chunks"
    first = bounds[1]
    chunk = doc_len // num_hosts
    anchor = max(int(chunk * DEFAULT_ANCHOR_FRACTION), DEFAULT_ANCHOR_MIN_TOKENS) if anchor_tokens is None \
        else anchor_tokens
    passing = max(int(chunk * DEFAULT_PASSING_FRACTION), DEFAULT_PASSING_MIN_TOKENS) if passing_tokens is None \
        else passing_tokens
    return APBPlan(bounds, min(anchor, first), passing)
