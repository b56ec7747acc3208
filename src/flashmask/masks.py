"""One builder per FlashMask mask type (semantics §2.3), each drawn in its docstring.

Every builder returns a :class:`~flashmask.mask.FlashMask` whose ``startend_row_indices`` are int32
and contiguous, shaped ``[B, 1, S, C]`` (``[B, H, S, 1]`` for :func:`random_eviction`, the one
per-head mask). Pictures show one sample: rows are queries, columns keys, ``#`` = may attend,
``.`` = masked. Every mask records the query length it was built for (``mask.seqlen_q``: the
``seqlen_q`` argument where a builder has one, else ``S``); using it with another query length
raises ``ValueError`` (:meth:`~flashmask.FlashMask.with_seqlen_q` says why and how to opt out).

Builders of packed sequences (``doc_lens``, ``docs``, ``bucket_ids``) take one sample (a flat
list) or a batch (a list of samples, possibly of different totals). ``seqlen`` defaults to the
longest total; shorter samples get a fully masked padding tail: no query sees a padding key and
padding queries see nothing, so their attention output is 0 (:func:`causal_blockwise` is the one
exception, see there).

:func:`example` builds every type with the parameters of the paper's benchmark (semantics §5.1);
``flashmask show`` and ``flashmask bench`` use it.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence

import torch

from flashmask._builder_args import (
    _at,
    _Device,
    _doc_lens,
    _doc_starts_ends,
    _int,
    _is_int,
    _is_int_list,
    _is_pair,
    _is_seq,
    _listify,
    _mask,
    _per_doc,
    _repeat,
    _samples,
    _seqlen,
    _window,
)
from flashmask.mask import FlashMask

__all__ = [
    "MASK_TYPES",
    "causal",
    "causal_blockwise",
    "causal_document",
    "document",
    "example",
    "full",
    "global_sliding_window",
    "hash_sparse",
    "prefix_lm_causal",
    "prefix_lm_document",
    "qk_sparse",
    "random_eviction",
    "share_question",
    "sliding_window",
]

MASK_TYPES: tuple[str, ...] = (
    "full",
    "causal",
    "sliding_window",
    "causal_document",
    "document",
    "share_question",
    "global_sliding_window",
    "causal_blockwise",
    "prefix_lm_document",
    "prefix_lm_causal",
    "qk_sparse",
    "random_eviction",
)
"""The 12 mask types of the paper's benchmark (semantics §5.1), in the paper's order."""


# ---------------------------------------------------------------------- builders
def full(
    seqlen: int, *, batch_size: int = 1, seqlen_q: int | None = None, device: _Device = None
) -> FlashMask:
    """No mask: every query sees every key (non-causal, C=2, ``LTS = Sq``, ``UTE = 0``).

    Args:
        seqlen: number of keys ``Sk``.
        batch_size: ``B``.
        seqlen_q: number of queries ``Sq`` (default ``seqlen``).

    >>> print(full(4).to_string())
    ####
    ####
    ####
    ####
    """
    sk = _int("seqlen", seqlen, minimum=1)
    batch_size = _int("batch_size", batch_size, minimum=1)
    sq = sk if seqlen_q is None else _int("seqlen_q", seqlen_q, minimum=1)
    lts = torch.full((batch_size, sk), sq, dtype=torch.int64)
    return _mask([lts, torch.zeros_like(lts)], False, device, sq)


def causal(
    seqlen: int, *, batch_size: int = 1, seqlen_q: int | None = None, device: _Device = None
) -> FlashMask:
    """Causal attention: query ``i`` sees keys ``j <= i`` (causal, C=1, ``LTS = Sq``).

    With ``seqlen_q < seqlen`` the triangle is aligned bottom-right (the last query sees every key).

    Args:
        seqlen: number of keys ``Sk``.
        batch_size: ``B``.
        seqlen_q: number of queries ``Sq`` (default ``seqlen``).

    >>> print(causal(4).to_string())
    #...
    ##..
    ###.
    ####
    >>> print(causal(5, seqlen_q=3).to_string(3))
    ###..
    ####.
    #####
    """
    sk = _int("seqlen", seqlen, minimum=1)
    batch_size = _int("batch_size", batch_size, minimum=1)
    sq = sk if seqlen_q is None else _int("seqlen_q", seqlen_q, minimum=1)
    return _mask([torch.full((batch_size, sk), sq, dtype=torch.int64)], True, device, sq)


def sliding_window(
    seqlen: int,
    window: int,
    *,
    sink_tokens: int = 0,
    seqlen_q: int | None = None,
    batch_size: int = 1,
    device: _Device = None,
) -> FlashMask:
    """Causal local attention: query ``i`` sees keys ``[i - window, i]`` (and the first
    ``sink_tokens`` keys, which stay visible to every later query: streaming "attention sinks").

    Causal, C=1, ``LTS_j = min(j + window + 1, S)``: Paddle's ``window_size`` convention, the
    query plus ``window`` keys before it. The test generator's ``min(j + w, S)`` (``w`` keys in
    all, the query included) is ``window = w - 1`` here. With ``seqlen_q < seqlen`` (new queries
    over a longer key cache) everything is aligned bottom-right: query ``i`` stands at key
    position ``i + seqlen - seqlen_q``.

    >>> print(sliding_window(6, 2).to_string())
    #.....
    ##....
    ###...
    .###..
    ..###.
    ...###
    >>> print(sliding_window(7, 2, sink_tokens=1).to_string())
    #......
    ##.....
    ###....
    ####...
    #.###..
    #..###.
    #...###
    """
    seqlen = _int("seqlen", seqlen, minimum=1)
    window = _int("window", window, minimum=0)
    sink_tokens = _int("sink_tokens", sink_tokens, minimum=0)
    batch_size = _int("batch_size", batch_size, minimum=1)
    sq = seqlen if seqlen_q is None else _int("seqlen_q", seqlen_q, minimum=1)
    cols = torch.arange(seqlen, dtype=torch.int64)
    # Column j leaves the window of query i once i + (Sk - Sq) > j + window.
    lts = (cols + window + 1 - (seqlen - sq)).clamp(0, sq)
    lts = torch.where(cols < sink_tokens, sq, lts)
    return _mask([_repeat(lts, batch_size)], True, device, sq)


def causal_document(
    doc_lens: Sequence[int] | Sequence[Sequence[int]],
    seqlen: int | None = None,
    *,
    device: _Device = None,
) -> FlashMask:
    """Packed documents, causal inside each: query ``i`` sees keys ``j <= i`` of its document.

    Causal, C=1, ``LTS_j = end of j's document``; padding columns ``LTS = sum(doc_lens)``.

    Args:
        doc_lens: document lengths of one sample, or a list of them (one per sample).
        seqlen: ``S`` (default: the longest total); shorter samples get a fully masked tail.

    >>> print(causal_document([3, 2]).to_string())
    #....
    ##...
    ###..
    ...#.
    ...##
    >>> print(causal_document([[2, 2], [3]], seqlen=4).to_string(batch=1))
    #...
    ##..
    ###.
    ....
    """
    samples, batched = _doc_lens("doc_lens", doc_lens)
    totals = [sum(lens) for lens in samples]
    seqlen = _seqlen(seqlen, "doc_lens", totals, batched)
    lts = [
        _per_doc(_doc_starts_ends(lens)[1], lens, seqlen, total)
        for lens, total in zip(samples, totals, strict=True)
    ]
    return _mask([torch.stack(lts)], True, device, seqlen)


def document(
    doc_lens: Sequence[int] | Sequence[Sequence[int]],
    seqlen: int | None = None,
    *,
    device: _Device = None,
) -> FlashMask:
    """Packed documents, bidirectional inside each: query ``i`` sees every key of its document.

    Non-causal, C=2: ``LTS_j = end`` and ``UTE_j = start`` of ``j``'s document (the true start:
    Paddle's generator accumulates the next document's length there); padding columns
    ``LTS = UTE = sum(doc_lens)``.

    Args:
        doc_lens: document lengths of one sample, or a list of them (one per sample).
        seqlen: ``S`` (default: the longest total); shorter samples get a fully masked tail.

    >>> print(document([3, 2], seqlen=6).to_string())
    ###...
    ###...
    ###...
    ...##.
    ...##.
    ......
    """
    samples, batched = _doc_lens("doc_lens", doc_lens)
    totals = [sum(lens) for lens in samples]
    seqlen = _seqlen(seqlen, "doc_lens", totals, batched)
    lts, ute = [], []
    for lens, total in zip(samples, totals, strict=True):
        starts, ends = _doc_starts_ends(lens)
        lts.append(_per_doc(ends, lens, seqlen, total))
        ute.append(_per_doc(starts, lens, seqlen, total))
    return _mask([torch.stack(lts), torch.stack(ute)], False, device, seqlen)


def share_question(
    docs: Sequence[Sequence[int]] | Sequence[Sequence[Sequence[int]]],
    seqlen: int | None = None,
    *,
    device: _Device = None,
) -> FlashMask:
    """Packed documents of one question and several answers that share it (DPO, reward models).

    Inside a document, causal attention, except that an answer does not see the other answers:
    question keys are seen by the whole document, answer keys only by that answer. Causal, C=1:
    question columns ``LTS = end of the document``, answer columns ``LTS = end of that answer``,
    padding columns ``LTS = total``.

    Args:
        docs: the documents of one sample, each ``[question_len, answer1_len, ...]``, or a list
            of such samples.
        seqlen: ``S`` (default: the longest total); shorter samples get a fully masked tail.

    >>> print(share_question([[2, 2, 1], [1, 1, 1]]).to_string())
    #.......
    ##......
    ###.....
    ####....
    ##..#...
    .....#..
    .....##.
    .....#.#
    """
    samples, batched = _samples(
        "docs", docs, _is_int_list, "documents ([question_len, answer_len, ...])"
    )
    part_lens, part_ends, totals = [], [], []
    for b, sample in enumerate(samples):
        lens, ends, total = [], [], 0
        for d, doc in enumerate(sample):
            if len(doc) == 0:
                raise ValueError(f"{_at('docs', batched, b, d)} must start with a question length")
            parts = [_int(_at("docs", batched, b, d, k), n, minimum=0) for k, n in enumerate(doc)]
            lens += parts
            end = total + parts[0]
            ends.append(total + sum(parts))  # the question is seen until the document's end
            for n in parts[1:]:
                end += n
                ends.append(end)  # an answer is seen until its own end
            total = end
        part_lens.append(lens)
        part_ends.append(ends)
        totals.append(total)
    seqlen = _seqlen(seqlen, "docs", totals, batched)
    lts = [
        _per_doc(ends, lens, seqlen, total)
        for ends, lens, total in zip(part_ends, part_lens, totals, strict=True)
    ]
    return _mask([torch.stack(lts)], True, device, seqlen)


def global_sliding_window(
    seqlen: int,
    global_tokens: int,
    window: int | tuple[int, int],
    *,
    batch_size: int = 1,
    device: _Device = None,
) -> FlashMask:
    """A bidirectional local window plus global tokens (Longformer / BigBird style).

    Query ``i`` sees keys ``[i - left, i + right]``; the first ``global_tokens`` queries see every
    key and the first ``global_tokens`` keys are seen by every query. Non-causal, C=4 (semantics
    §2.3 item 7): for ``j >= g`` ``LTS_j = min(j + left + 1, S)``, ``LTE_j = S``, and the rows
    ``[g, j - right)`` above the window are masked by ``UTS_j = g``, ``UTE_j = j - right``.

    Args:
        seqlen: ``S``.
        global_tokens: ``g``, the number of leading global tokens.
        window: ``w`` for ``(w, w)``, or ``(left, right)``.
        batch_size: ``B``.

    >>> print(global_sliding_window(8, 1, 1).to_string())
    ########
    ###.....
    ####....
    #.###...
    #..###..
    #...###.
    #....###
    #.....##
    """
    seqlen = _int("seqlen", seqlen, minimum=1)
    g = _int("global_tokens", global_tokens, minimum=0)
    if g > seqlen:
        raise ValueError(f"global_tokens={g} must not exceed seqlen={seqlen}")
    left, right = _window(window)
    batch_size = _int("batch_size", batch_size, minimum=1)
    j = torch.arange(seqlen, dtype=torch.int64)
    lts = torch.where(j < g, seqlen, (j + left + 1).clamp(max=seqlen))
    lte = torch.full_like(j, seqlen)
    above = j - right > g  # rows [g, j - right) lie above the window
    uts = torch.where(above, g, 0)
    ute = torch.where(above, j - right, 0)
    return _mask([_repeat(v, batch_size) for v in (lts, lte, uts, ute)], False, device, seqlen)


def causal_blockwise(
    doc_lens: Sequence[int] | Sequence[Sequence[int]],
    seqlen: int | None = None,
    *,
    device: _Device = None,
) -> FlashMask:
    """In-context examples: every document is causal on its own; the last one sees them all.

    Causal, C=2 (semantics §2.3 item 8): ``LTS_j = end of j's document``; ``LTE_j`` = the start of
    the last document for columns of the other documents, ``S`` for the last document and padding.

    Padding: no query sees a padding key or the last document, but padding queries do see the
    other documents. Hiding those too would need a second masked interval per column (rows
    ``[end, last start)`` and ``[total, S)``), which no FlashMask form has.

    Args:
        doc_lens: document lengths of one sample, or a list of them (one per sample).
        seqlen: ``S`` (default: the longest total).

    >>> print(causal_blockwise([2, 2, 3]).to_string())
    #......
    ##.....
    ..#....
    ..##...
    #####..
    ######.
    #######
    """
    samples, batched = _doc_lens("doc_lens", doc_lens)
    totals = [sum(lens) for lens in samples]
    seqlen = _seqlen(seqlen, "doc_lens", totals, batched)
    lts, lte = [], []
    for lens, total in zip(samples, totals, strict=True):
        _, ends = _doc_starts_ends(lens)
        last_start = total - (lens[-1] if lens else 0)
        lts.append(_per_doc(ends, lens, seqlen, total))
        lte.append(_per_doc([last_start] * (len(lens) - 1) + [seqlen], lens, seqlen, seqlen))
    return _mask([torch.stack(lts), torch.stack(lte)], True, device, seqlen)


def prefix_lm_document(
    docs: Sequence[Sequence[int]] | Sequence[Sequence[Sequence[int]]],
    seqlen: int | None = None,
    *,
    device: _Device = None,
) -> FlashMask:
    """Packed prefix-LM documents: a bidirectional prefix, then causal tokens, per document.

    Query ``i`` sees the prefix of its document and its document's keys ``j <= i``. Non-causal,
    C=2 (semantics §2.3 item 9): ``LTS_j = end of j's document``; ``UTE_j`` = the document start
    for prefix columns and ``j`` otherwise; padding columns ``LTS = UTE = total``.

    Args:
        docs: ``(prefix_len, doc_len)`` pairs of one sample (``0 <= prefix_len <= doc_len``), or
            a list of such samples.
        seqlen: ``S`` (default: the longest total); shorter samples get a fully masked tail.

    >>> print(prefix_lm_document([(2, 3), (1, 2)], seqlen=6).to_string())
    ##....
    ##....
    ###...
    ...#..
    ...##.
    ......
    """
    samples, batched = _samples("docs", docs, _is_pair, "(prefix_len, doc_len) pairs")
    parsed, totals = [], []
    for b, sample in enumerate(samples):
        prefixes, lens = [], []
        for d, (prefix, n) in enumerate(sample):
            n = _int(_at("docs", batched, b, d, 1) + " (doc_len)", n, minimum=0)
            prefix = _int(_at("docs", batched, b, d, 0) + " (prefix_len)", prefix, minimum=0)
            if prefix > n:
                where = _at("docs", batched, b, d)
                raise ValueError(f"{where}: prefix_len={prefix} exceeds doc_len={n}")
            prefixes.append(prefix)
            lens.append(n)
        parsed.append((prefixes, lens))
        totals.append(sum(lens))
    seqlen = _seqlen(seqlen, "docs", totals, batched)
    j = torch.arange(seqlen, dtype=torch.int64)
    lts, ute = [], []
    for (prefixes, lens), total in zip(parsed, totals, strict=True):
        starts, ends = _doc_starts_ends(lens)
        lts.append(_per_doc(ends, lens, seqlen, total))
        # Prefix columns are seen from the document start, the others from their own row.
        start = _per_doc(starts, lens, seqlen, total)
        prefix_ends = [s + p for s, p in zip(starts, prefixes, strict=True)]
        in_prefix = j < _per_doc(prefix_ends, lens, seqlen, 0)
        ute.append(torch.where(in_prefix, start, j.clamp(max=total)))
    return _mask([torch.stack(lts), torch.stack(ute)], False, device, seqlen)


def prefix_lm_causal(
    seqlen: int, prefix_len: int, *, batch_size: int = 1, device: _Device = None
) -> FlashMask:
    """One bidirectional prefix, then causal tokens: query ``i`` sees the prefix and ``j <= i``.

    Non-causal, C=2 (semantics §2.3 item 10): ``LTS_j = S``; ``UTE_j = 0`` for ``j < prefix_len``,
    else ``j``.

    >>> print(prefix_lm_causal(6, 3).to_string())
    ###...
    ###...
    ###...
    ####..
    #####.
    ######
    """
    seqlen = _int("seqlen", seqlen, minimum=1)
    prefix_len = _int("prefix_len", prefix_len, minimum=0)
    if prefix_len > seqlen:
        raise ValueError(f"prefix_len={prefix_len} must not exceed seqlen={seqlen}")
    batch_size = _int("batch_size", batch_size, minimum=1)
    j = torch.arange(seqlen, dtype=torch.int64)
    ute = torch.where(j < prefix_len, 0, j)
    return _mask(
        [_repeat(torch.full_like(j, seqlen), batch_size), _repeat(ute, batch_size)],
        False,
        device,
        seqlen,
    )


def qk_sparse(
    seqlen: int,
    maskout: Sequence[Sequence[int]] | Sequence[Sequence[Sequence[int]]],
    *,
    batch_size: int = 1,
    device: _Device = None,
) -> FlashMask:
    """Causal attention with spans whose queries and keys do not interact (QK-sparse).

    For each ``(offset, length)`` span, no query inside the span sees a key inside it (not even
    its own); queries after the span see it normally. A query inside a span therefore sees only
    the keys before the span (none when ``offset = 0``: its output is 0). Causal, C=2
    (semantics §2.3 item 11): span columns ``LTS_j = j``, ``LTE_j = offset + length``; other
    columns have the empty interval ``LTS = LTE = S``.

    Args:
        seqlen: ``S``.
        maskout: non-overlapping ``(offset, length)`` spans shared by the batch, or one list of
            spans per sample (then ``B`` is the number of lists).
        batch_size: ``B`` when ``maskout`` is shared (1, or the number of lists, otherwise).

    >>> print(qk_sparse(6, [(2, 2)]).to_string())
    #.....
    ##....
    ##....
    ##....
    #####.
    ######
    """
    seqlen = _int("seqlen", seqlen, minimum=1)
    batch_size = _int("batch_size", batch_size, minimum=1)
    maskout = _listify(maskout)
    if _is_seq(maskout) and len(maskout) == 0:
        samples, batched = [[]], False
    else:
        samples, batched = _samples("maskout", maskout, _is_pair, "(offset, length) pairs")
    if batched and batch_size not in (1, len(samples)):
        raise ValueError(
            f"batch_size={batch_size} does not match the {len(samples)} lists of maskout"
        )
    lts, lte = [], []
    for b, spans in enumerate(samples):
        lo = torch.full((seqlen,), seqlen, dtype=torch.int64)
        hi = lo.clone()
        taken = []
        for k, (offset, length) in enumerate(spans):
            where = _at("maskout", batched, b, k)
            offset = _int(where + " (offset)", offset, minimum=0)
            length = _int(where + " (length)", length, minimum=0)
            if offset + length > seqlen:
                raise ValueError(f"{where} = ({offset}, {length}) ends past seqlen={seqlen}")
            if length:
                taken.append((offset, offset + length, where))
            lo[offset : offset + length] = torch.arange(offset, offset + length)
            hi[offset : offset + length] = offset + length
        taken.sort()
        for (_, end, first), (start, _, second) in itertools.pairwise(taken):
            if start < end:
                raise ValueError(f"maskout spans {first} and {second} overlap")
        lts.append(lo)
        lte.append(hi)
    lts, lte = torch.stack(lts), torch.stack(lte)
    if not batched:
        lts, lte = lts.expand(batch_size, -1), lte.expand(batch_size, -1)
    return _mask([lts, lte], True, device, seqlen)


def hash_sparse(
    bucket_ids: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor,
    *,
    device: _Device = None,
) -> FlashMask:
    """Hash-bucketed attention (Reformer LSH): causal attention inside each bucket.

    The tokens must already be sorted by bucket, so that each bucket is one contiguous run of
    equal ids (which id a run has does not matter). Query ``i`` sees key ``j`` iff both are in the
    same bucket and ``j <= i``. Causal, C=1, ``LTS_j = end of j's run``.

    Args:
        bucket_ids: the bucket id of every token of one sample, or a list of them (one per
            sample; a ``[B, S]`` tensor also works). Shorter samples get a fully masked tail.

    Raises:
        ValueError: a bucket id appears in two runs.

    >>> print(hash_sparse([7, 7, 2, 2, 2, 5]).to_string())
    #.....
    ##....
    ..#...
    ..##..
    ..###.
    .....#
    """
    if isinstance(bucket_ids, torch.Tensor):
        if bucket_ids.dtype.is_floating_point or bucket_ids.dtype.is_complex:
            raise TypeError(f"bucket_ids must hold integers, got {bucket_ids.dtype}")
        if bucket_ids.dim() not in (1, 2) or bucket_ids.numel() == 0:
            raise ValueError(
                "bucket_ids must be a non-empty [S] or [B, S] tensor, "
                f"got shape {tuple(bucket_ids.shape)}"
            )
        batched = bucket_ids.dim() == 2
        rows = list(bucket_ids.to("cpu", torch.int64).reshape(-1, bucket_ids.shape[-1]))
    else:
        samples, batched = _samples("bucket_ids", bucket_ids, _is_int, "bucket ids (ints)")
        rows = [
            torch.tensor([operator.index(v) for v in ids], dtype=torch.int64) for ids in samples
        ]
    lengths = [row.numel() for row in rows]
    seqlen = _seqlen(None, "bucket_ids", lengths, batched)
    lts = []
    for b, ids in enumerate(rows):
        n = ids.numel()
        if n == 0:
            lts.append(torch.zeros(seqlen, dtype=torch.int64))
            continue
        new_run = torch.ones(n, dtype=torch.bool)
        new_run[1:] = ids[1:] != ids[:-1]
        run_starts = new_run.nonzero().flatten()
        run_ends = torch.cat([run_starts[1:], torch.tensor([n])])
        run_ids = ids[run_starts]
        order = torch.argsort(run_ids, stable=True)
        repeated = run_ids[order[1:]] == run_ids[order[:-1]]  # a later run of an earlier id
        if bool(repeated.any()):
            run = int(order[1:][repeated].min())
            pos = int(run_starts[run])
            raise ValueError(
                f"{_at('bucket_ids', batched, b)}: bucket {int(run_ids[run])} starts again at "
                f"position {pos} after an earlier run; sort the tokens so that each bucket is "
                "one contiguous run"
            )
        vec = torch.repeat_interleave(run_ends, run_ends - run_starts)
        lts.append(torch.cat([vec, vec.new_full((seqlen - n,), n)]))
    return _mask([torch.stack(lts)], True, device, seqlen)


def random_eviction(
    seqlen: int,
    start_row: int,
    *,
    num_heads: int = 1,
    batch_size: int = 1,
    generator: torch.Generator | None = None,
    device: _Device = None,
) -> FlashMask:
    """Causal attention with KV-cache eviction: from query ``start_row`` on, each query evicts
    one more past key, drawn at random per (batch, head).

    A per-head mask ``[B, num_heads, S, 1]`` (causal, C=1, semantics §2.3 item 12): an evicted
    key ``j`` gets ``LTS_j`` = the query that evicted it; the others keep ``LTS = S``. The draw
    is a random-replacement cache of ``start_row`` past keys: query ``r >= start_row`` evicts
    one key uniformly among the keys before ``r`` not yet evicted, so every query from
    ``start_row`` on sees exactly ``start_row`` keys, itself included (a key is never evicted
    before its own query, so the diagonal stays visible). Paddle draws the ``S - start_row``
    evicted keys with ``randperm`` and orders them with a heuristic; this draw evicts as many.

    Args:
        seqlen: ``S``.
        start_row: the first query that evicts (``1 <= start_row <= S``; ``S`` = plain causal).
        num_heads: mask heads ``Hm`` (1, the number of key/value heads or of query heads), each
            its own draw.
        batch_size: ``B``, each sample its own draw.
        generator: a ``torch.Generator`` for reproducible draws.

    >>> g = torch.Generator().manual_seed(0)
    >>> print(random_eviction(6, 2, generator=g).to_string())
    #.....
    ##....
    .##...
    ..##..
    ..#.#.
    ....##
    """
    seqlen = _int("seqlen", seqlen, minimum=1)
    start_row = _int("start_row", start_row, minimum=1)
    if start_row > seqlen:
        raise ValueError(f"start_row={start_row} must not exceed seqlen={seqlen}")
    num_heads = _int("num_heads", num_heads, minimum=1)
    batch_size = _int("batch_size", batch_size, minimum=1)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    n, steps = batch_size * num_heads, seqlen - start_row
    lts = torch.full((n, seqlen), seqlen, dtype=torch.int64)
    if steps:
        # The cache has start_row slots, holding keys 0 .. start_row - 1 at first. Query
        # r = start_row + k empties a random slot (evicting its key, which gets LTS = r) and
        # refills it with key r, which later queries may evict.
        gen_device = generator.device if generator is not None else "cpu"
        slot = torch.randint(start_row, (n, steps), generator=generator, device=gen_device).cpu()
        step = torch.arange(steps).expand(n, -1)
        # Group the steps by slot, in time order: the key a step evicts is the one written by
        # the slot's previous step, or the slot's initial key.
        order = torch.argsort(slot * steps + step, dim=1)
        slot_sorted = slot.gather(1, order)
        same_slot = slot_sorted[:, 1:] == slot_sorted[:, :-1]
        written = start_row + order[:, :-1]
        evicted_sorted = torch.cat(
            [slot_sorted[:, :1], torch.where(same_slot, written, slot_sorted[:, 1:])], dim=1
        )
        evicted = torch.empty_like(evicted_sorted).scatter_(1, order, evicted_sorted)
        lts.scatter_(1, evicted, start_row + step)
    return _mask([lts.view(batch_size, num_heads, seqlen)], True, device, seqlen)


# ---------------------------------------------------------------------- paper examples
def _randint(low: int, high: int, generator: torch.Generator) -> int:
    """A uniform int in ``[low, high]``."""
    return int(torch.randint(low, high + 1, (1,), generator=generator))


def _split(total: int, parts: int, generator: torch.Generator) -> list[int]:
    """``total`` split into ``parts`` positive lengths, uniform over all such splits."""
    parts = max(1, min(parts, total))
    cuts = torch.randperm(total - 1, generator=generator)[: parts - 1] + 1
    bounds = [0, *sorted(cuts.tolist()), total]
    return [b - a for a, b in itertools.pairwise(bounds)]


def _doc_count(seqlen: int, generator: torch.Generator) -> int:
    """Documents per sample: [3, 7] up to 8K, [10, 14] up to 32K, [11, 15] beyond (paper
    appendix), at most one per 4 tokens for short sequences."""
    low, high = (3, 7) if seqlen <= 8192 else (10, 14) if seqlen <= 32768 else (11, 15)
    return min(_randint(low, high, generator), max(1, seqlen // 4))


def _random_docs(seqlen: int, generator: torch.Generator) -> list[int]:
    return _split(seqlen, _doc_count(seqlen, generator), generator)


def example(
    name: str,
    seqlen: int,
    *,
    batch_size: int = 1,
    num_heads: int = 1,
    generator: torch.Generator | None = None,
    device: _Device = None,
) -> FlashMask:
    """The mask ``name`` with the parameters of the paper's benchmark (semantics §5.1).

    Sliding window ``w = S/16``; global + sliding window: 16 global tokens (fewer below
    ``S = 256``) and windows ``S/16`` each side; prefix-LM causal prefix ``S/2``; random eviction
    from row ``S/2`` (per head when ``num_heads > 1``). Document masks pack random documents that
    fill the sequence exactly: 3-7 per sample up to 8K tokens, 10-14 up to 32K, 11-15 beyond (at
    most ``S/4``); share-question documents hold a question and 2-6 answers; prefix-LM documents
    a random prefix of 1 to all of their tokens; QK-sparse masks out each document but the first
    with probability 1/2; hash-sparse uses ``S/8`` buckets (at most ``max(64, S/128)``) in
    random order. Every sample of a batch is its own draw.

    Args:
        name: one of :data:`MASK_TYPES` or ``"hash_sparse"``.
        seqlen: ``S``.
        batch_size: ``B``.
        num_heads: mask heads of ``random_eviction`` (the other masks have one head).
        generator: the random draws' source (default: a generator seeded with 0, so the result
            is the same on every call).

    >>> print(example("causal_document", 8).to_string())
    #.......
    ##......
    ###.....
    ####....
    ....#...
    ....##..
    ....###.
    ....####
    """
    if not isinstance(name, str) or name not in (*MASK_TYPES, "hash_sparse"):
        raise ValueError(
            f"name must be one of {', '.join((*MASK_TYPES, 'hash_sparse'))}; got {name!r}"
        )
    s = _int("seqlen", seqlen, minimum=1)
    b = _int("batch_size", batch_size, minimum=1)
    num_heads = _int("num_heads", num_heads, minimum=1)
    if generator is None:
        generator = torch.Generator().manual_seed(0)
    elif not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if generator.device.type != "cpu":
        raise ValueError(f"generator must be a CPU generator, got one on {generator.device}")

    window = s // 16
    if name == "full":
        return full(s, batch_size=b, device=device)
    if name == "causal":
        return causal(s, batch_size=b, device=device)
    if name == "sliding_window":
        return sliding_window(s, window, batch_size=b, device=device)
    if name == "global_sliding_window":
        g = min(16, max(1, s // 16))
        return global_sliding_window(s, g, window, batch_size=b, device=device)
    if name == "prefix_lm_causal":
        return prefix_lm_causal(s, s // 2, batch_size=b, device=device)
    if name == "random_eviction":
        return random_eviction(
            s, max(1, s // 2), num_heads=num_heads, batch_size=b, generator=generator, device=device
        )
    if name == "hash_sparse":
        buckets = min(s, max(1, s // 8), max(64, s // 128))
        ids = []
        for _ in range(b):
            lens = _split(s, buckets, generator)
            run_ids = torch.randperm(len(lens), generator=generator)
            ids.append(torch.repeat_interleave(run_ids, torch.tensor(lens)))
        return hash_sparse(torch.stack(ids), device=device)

    docs = [_random_docs(s, generator) for _ in range(b)]
    if name == "causal_document":
        return causal_document(docs, s, device=device)
    if name == "document":
        return document(docs, s, device=device)
    if name == "causal_blockwise":
        return causal_blockwise(docs, s, device=device)
    if name == "share_question":
        questions = [
            [_split(n, 1 + _randint(2, 6, generator), generator) for n in lens] for lens in docs
        ]
        return share_question(questions, s, device=device)
    if name == "prefix_lm_document":
        pairs = [[(_randint(1, n, generator), n) for n in lens] for lens in docs]
        return prefix_lm_document(pairs, s, device=device)
    # qk_sparse: flagged documents (never the first, so every query sees key 0) are masked out.
    spans = []
    for lens in docs:
        starts, _ = _doc_starts_ends(lens)
        flags = torch.rand(len(lens), generator=generator) < 0.5
        spans.append(
            [(st, n) for st, n, f in zip(starts, lens, flags.tolist(), strict=True) if f and st > 0]
        )
    return qk_sparse(s, spans, device=device)
