"""The request table's step on GPU through Pallas' Mosaic GPU backend (Hopper and newer):
release, extend and decode (each optional, in that order) in one launch that writes the
table, two with extend (the slots by many programs).

Reference: jax_kvalloc.request_table's jnp path (SPEC 11), bit for bit, and the same
contract as triton_table.table_step_triton: `release_rows` (free_page_ids of each row's
owned pages, in row order, then the rows cleared), `extend_rows` (alloc_extend with
prefix_lens = lens and last_loc read from the table, the new pages appended, lens += n),
`decode_rows` (alloc_decode likewise). need_sort, debug mode and the token allocator stay
with the caller's jnp composition.

One program of T warpgroups (mosaic_gpu_common: 4 T warps, each a stream of scalar code).
Each phase's rows are cut into 4 T contiguous blocks, one per warp, so a prefix over rows
is a prefix over warps (counts in shared memory, a barrier, then each warp adds the counts
of the warps before it). A phase reads the pool and the table as the previous one left
them; barriers order the steps::

  marks      every real row inside the table stores its batch index at scratch[row]
             (one region per phase); the release rows' pages are counted.
  checks     each row reads its mark back: a row given twice finds another index there;
             rows outside the table are bad too. A phase with a bad row does nothing.
  release    the valid owned pages (ids 1..n) go in front of the free list in row order
             (the count cut to the room left), then the rows are cleared.
  extend     counts (tokens, new pages, row capacity), then per row its span of the
             slots and the constants of triton_extend._slot (a plan line), its new pages
             appended to the table (ring[head + k] for its pages k), lens += n.
  decode     counts (pages needed, full rows), then per row the slot (ring[head + k] * ps
             for a row starting a page, else last_loc + 1), the new page appended, lens.

The ring, the free list's head and length, the table's pages (flattened), lens and
owned_from are in-place operands (`jax.new_ref`): under donation or a loop carry the
kernel writes them where they are.
The extend slots are a second launch (`_slots_kernel`): C programs of 4 warps per extend
row, each warp writing blocks of SLOT_BLOCK consecutive slots of its row (from the row's
plan line), then its share of the zero tail.

Ownership (SPEC 14; `record=`, jax_kvalloc.guard the reference, bit for bit): held
i32[n + 1] and status i32[3] are in-place operands, and the record fits the same steps.
The release is guard.free(distinct=True) of the owned pages (0: padding), entry k = b W +
j for released row b's column j::

  marks      each entry naming a page 1..n also stores k at pmark[page] (scratch, n + 1
             after the row marks): for a page named twice, one of them is left there.
  checks     each entry reads held[page] and pmark[page] back: OUT_OF_RANGE (outside
             1..n), NOT_HELD (held != 1), REPEATED (another entry's k there: that entry
             names the page too). An offending entry proposes its k, a REPEATED one the
             smaller of its k and the one it found, so every offending entry is proposed
             by someone; each warp keeps its smallest proposal (k, why, page).
  release    the smallest proposal of all warps is the first offence (argument order):
             with one (and valid rows), the release is refused whole (nothing freed, rows
             kept, release_ok False) and warp 0 records (op, why, page) if the status was
             empty; else held[page] = 0 for every entry as its page goes back.

The extend and decode steps store held[page] = 1 for the pages they take (guard.take).
No sort, no atomics: scalar loads and stores, no launch more.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp

from pallas_kernels import _util
from pallas_kernels import capacity
from pallas_kernels import mosaic_gpu_common as mg
from pallas_kernels._util import cdiv, floordiv, mod

Array = jax.Array

MAX_ROWS = 2048             # rows per phase (as the Triton table kernel's decode)
MAX_EXTEND_ROWS = 256
MAX_EXTEND_TOKENS = 2**16
MAX_WARPGROUPS = 8
SLOT_BLOCK = 32             # extend slots a warp writes per block (unrolled)
CHUNK = 8                   # rows (or pages) a warp loads before it stores any of them

# Shared-memory counts, one region of 4 T per kind.
(_REL_BAD, _REL_PAGES, _EXT_BAD, _EXT_CAP, _EXT_TOK, _EXT_PAGES, _DEC_BAD, _DEC_FULL,
 _DEC_NEEDS, _DEC_SEQ, _REL_KEY, _REL_WHY, _REL_PAGE) = range(13)
_KINDS = 13
_NONE = _util.INT32_MAX     # no offence (entry keys are b W + j < INT32_MAX)
# The extend plan: per row a line of _LINE ints, then one line (head, length, limit).
_TS, _TE, _A, _E, _C, _BP = range(6)
_HEAD, _FLEN, _LIMIT = range(3)
_LINE = 8


@dataclasses.dataclass(frozen=True)
class _Params:
  page_size: int
  num_pages: int      # n, the ring's length
  max_reqs: int       # R
  width: int          # W
  rel_rows: int       # rows given per phase (0: the phase is not run)
  ext_rows: int
  dec_rows: int
  max_tokens: int     # extend slots (static)
  warpgroups: int     # T
  guard: bool = False  # the ownership record (held, status) in place
  op: int = 0          # the operation a refused release names in the status

  @property
  def streams(self) -> int:
    return mg.WARPS * self.warpgroups

  def per_stream(self, rows: int) -> int:
    return -(-rows // self.streams)


def warpgroups_for(rows: int) -> int:
  """Warpgroups of the table program for its largest phase: about 32 rows per warp, at
  most MAX_WARPGROUPS."""
  return max(1, min(MAX_WARPGROUPS, _util.next_pow2(-(-rows // (mg.WARPS * 32)))))


def supported(*, max_reqs: int, width: int, num_pages: int, page_size: int,
              release: int = 0, extend: int = 0, max_tokens: int = 0,
              decode: int = 0) -> bool:
  """Whether `table_step_mosaic_gpu` takes these static sizes (rows per phase, 0: none)."""
  if not mg.available():
    return False
  if not (max_reqs >= 1 and width >= 1 and num_pages >= 1 and page_size >= 1):
    return False
  if width * page_size > _util.INT32_MAX or max_reqs * width > _util.INT32_MAX:
    return False
  if 3 * max_reqs > _util.INT32_MAX or release > MAX_ROWS or decode > MAX_ROWS:
    return False
  if release * width >= _util.INT32_MAX or 3 * max_reqs + num_pages >= _util.INT32_MAX:
    return False  # the record's entry keys and page marks
  if extend and (extend > MAX_EXTEND_ROWS or max_tokens < 1
                 or max_tokens > MAX_EXTEND_TOKENS
                 or capacity.sums_may_wrap(extend, max_tokens)
                 or capacity.sums_may_wrap(extend, num_pages)):
    return False
  return bool(release or extend or decode)


# ---------------------------------------------------------------------------------------
# Kernel body.
# ---------------------------------------------------------------------------------------

class _Rows:
  """A phase's rows as one stream sees them: batch indices b = stream * Q + i (i < Q)."""

  def __init__(self, p: _Params, rows_ref, num_ref, num: int, stream):
    self.p, self.rows_ref, self.num, self.q = p, rows_ref, num, p.per_stream(num)
    self.count = jnp.clip(num_ref[0], 0, num)
    self.stream = stream

  def __iter__(self):
    for i in range(self.q):
      yield self.at(self.stream * self.q + i)

  def chunks(self):
    """The stream's rows in chunks of CHUNK: within one, every load is issued before any
    store (a store may alias the next row's loads, so the compiler keeps them in order;
    loads first keeps a chunk's loads in flight together)."""
    for i in range(0, self.q, CHUNK):
      yield [self.at(self.stream * self.q + j) for j in range(i, min(i + CHUNK, self.q))]

  def at(self, b):
    """(b, row clipped into the table, real: b < count, inside: the row given is)."""
    raw = self.rows_ref[jnp.minimum(b, self.num - 1)]
    real = b < self.count
    inside = (raw >= 0) & (raw < self.p.max_reqs)
    return b, jnp.clip(raw, 0, self.p.max_reqs - 1), real, inside


def _store_counts(cnt, stream, nstreams, values: Dict[int, Array]) -> None:
  for kind, v in values.items():
    cnt[kind * nstreams + stream] = v


def _sums(cnt, kind: int, stream, nstreams: int):
  """(before, total) of one kind of count over the streams."""
  return mg.before_and_total(cnt, kind * nstreams, stream, nstreams)


def _last_loc(p: _Params, pages_ref, row, pre):
  """request_table._last_loc: pages[row, (pre-1)//ps] * ps + (pre-1) % ps, -1 at 0."""
  ps = p.page_size
  prev = jnp.maximum(pre - 1, 0)
  col = jnp.minimum(floordiv(prev, ps), p.width - 1)
  slot = pages_ref[row * p.width + col] * ps + mod(prev, ps)
  return jnp.where(pre > 0, slot, -1)


def _kernel(*refs, p: _Params, names: Tuple[str, ...]):
  r = dict(zip(names, refs))
  ps, n, w, nt = p.page_size, p.num_pages, p.width, p.warpgroups
  ns = p.streams
  ring, pages, lens, owned, scr, cnt = (r["ring"], r["pages"], r["lens"], r["owned"],
                                        r["scr"], r["cnt"])
  bar = r.get("bar")
  base = {"rel": 0, "ext": p.max_reqs, "dec": 2 * p.max_reqs}
  phases = {k: (r[f"{k}_rows"], r[f"{k}_num"], num)
            for k, num in (("rel", p.rel_rows), ("ext", p.ext_rows), ("dec", p.dec_rows))
            if num}

  def rows(name, s):
    rows_ref, num_ref, num = phases[name]
    return _Rows(p, rows_ref, num_ref, num, s)

  def step(fn):
    mg.streams(nt, fn)
    mg.sync(bar, nt)

  # --- marks, and the release rows' valid pages --------------------------------------
  pmark = 3 * p.max_reqs     # the record's page marks in scr

  def marks(s):
    if "rel" in phases:  # loads only: before the marks' stores
      total = jnp.zeros((), jnp.int32)
      for b, row, real, _ in rows("rel", s):
        start, end = _owned_span(p, lens, owned, row)
        end = jnp.where(real, end, start)
        key = (scr, pmark, b * w) if p.guard else None
        total = total + _count_valid(p, pages, row, start, end, key)
    for name in phases:
      for chunk in rows(name, s).chunks():
        for b, row, real, inside in chunk:
          mg.store(scr, base[name] + row, b, real & inside)
    if "rel" in phases:
      _store_counts(cnt, s, ns, {_REL_PAGES: total})

  step(marks)

  # --- checks: distinct rows inside the table -------------------------------------------
  def checks(s):
    for name, kind in (("rel", _REL_BAD), ("ext", _EXT_BAD), ("dec", _DEC_BAD)):
      if name not in phases:
        continue
      bad = jnp.zeros((), jnp.int32)
      for b, row, real, inside in rows(name, s):
        back = scr[base[name] + row]
        bad = bad + jnp.where(real & (~inside | (back != b)), 1, 0)
      _store_counts(cnt, s, ns, {kind: bad})
    if p.guard and "rel" in phases:
      first = (jnp.full((), _NONE, jnp.int32), jnp.zeros((), jnp.int32),
               jnp.zeros((), jnp.int32))
      for b, row, real, _ in rows("rel", s):
        start, end = _owned_span(p, lens, owned, row)
        end = jnp.where(real, end, start)
        first = _offences(p, pages, r["held"], scr, pmark, row, b * w, start, end, first)
      _store_counts(cnt, s, ns, dict(zip((_REL_KEY, _REL_WHY, _REL_PAGE), first)))

  step(checks)
  head, flen, rlen = r["head"][0], r["flen"][0], r["rlen"][0]
  state = {"head": head, "flen": flen}

  # --- release -------------------------------------------------------------------------
  if "rel" in phases:
    def release_counts(s):
      _, bad = _sums(cnt, _REL_BAD, s, ns)
      before, total = _sums(cnt, _REL_PAGES, s, ns)
      go = bad == 0
      offence = None
      if p.guard:  # the first offence: a refusal (only of valid rows)
        found, why, page = _first_offence(cnt, ns)
        offence = (go & found, why, page)
        go = go & ~found
      count = jnp.where(go, jnp.minimum(total, n - flen - rlen), 0)
      return go, count, before, offence

    def release(s):
      go, count, before, offence = release_counts(s)
      new_head = jnp.where(head - count < 0, head - count + n, head - count)
      rank = before
      held = r["held"] if p.guard else None
      for b, row, real, _ in rows("rel", s):
        live = real & go
        start, end = _owned_span(p, lens, owned, row)
        end = jnp.where(live, end, start)
        rank = _give_back(p, pages, ring, row, start, end, new_head, rank, count, held)
        mg.when(live, lambda row=row: _clear_row(p, pages, lens, owned, row))
      if p.guard:
        _record_status(r["status"], s == 0, p.op, *offence)

    step(release)
    go_rel, count, _, _ = release_counts(0)
    state["head"] = jnp.where(head - count < 0, head - count + n, head - count)
    state["flen"] = flen + count
  head, flen = state["head"], state["flen"]
  oks = [jnp.ones((), bool)] * 3
  if "rel" in phases:
    oks[0] = go_rel

  # --- extend --------------------------------------------------------------------------
  if "ext" in phases:
    def ext_row(b, row, real, go=True):
      """(pre, n) of an extend row (0, 0 for padding, n 0 when not go)."""
      n_tok = jnp.where(real, r["ext_n"][jnp.minimum(b, p.ext_rows - 1)], 0)
      pre = jnp.where(real, lens[row], 0)
      return pre, jnp.where(go, n_tok, 0)

    def ext_counts(s):
      cap = tok = new = jnp.zeros((), jnp.int32)
      for b, row, real, _ in rows("ext", s):
        pre, n_tok = ext_row(b, row, real)
        cap = cap + jnp.where(real & ((n_tok < 0) | (n_tok > w * ps - pre) | (pre < 0)), 1, 0)
        ext, new_pages = _extend_counts(p, pre, pre + n_tok)
        tok, new = tok + ext, new + new_pages
      _store_counts(cnt, s, ns, {_EXT_CAP: cap, _EXT_TOK: tok, _EXT_PAGES: new})

    step(ext_counts)

    def ext_verdict(s):
      _, bad = _sums(cnt, _EXT_BAD, s, ns)
      _, cap = _sums(cnt, _EXT_CAP, s, ns)
      tok_before, tok_total = _sums(cnt, _EXT_TOK, s, ns)
      page_before, page_total = _sums(cnt, _EXT_PAGES, s, ns)
      go = (bad == 0) & (cap == 0)
      tok_before, tok_total = (jnp.where(go, x, 0) for x in (tok_before, tok_total))
      page_before, page_total = (jnp.where(go, x, 0) for x in (page_before, page_total))
      ok = (tok_total <= p.max_tokens) & (page_total <= flen)
      return go, ok, tok_before, tok_total, page_before, page_total

    def extend(s):
      go, ok, ts, tok_total, ps_before, page_total = ext_verdict(s)
      plan = r["plan"]
      for chunk in rows("ext", s).chunks():
        lines = []
        for b, row, real, _ in chunk:  # loads
          pre, n_tok = ext_row(b, row, real & go, go)
          live = real & go
          pre, seq = jnp.where(live, pre, 0), jnp.where(live, pre + n_tok, 0)
          ext, new_pages = _extend_counts(p, pre, seq)
          fnp = cdiv(pre, ps)
          a = pre - ts
          last = _last_loc(p, pages, row, pre)
          consts = (ts, jnp.where(ok, ts + ext, ts), a, fnp * ps - a, last + 1 - ts,
                    ps_before - fnp)
          lines.append((b, row, live, seq, fnp, ps_before, new_pages, consts))
          ts, ps_before = ts + ext, ps_before + new_pages
        for b, row, live, seq, fnp, k0, new_pages, consts in lines:  # stores
          for v, value in enumerate(consts):
            mg.store(plan, b * _LINE + v, value, b < p.ext_rows)
          # The row's new pages, appended: page k of the batch is ring[head + k].
          _copy_run(n, ring, mg.wrap, head + k0, pages, row * w + fnp,
                    jnp.where(ok & live, new_pages, 0), r["held"] if p.guard else None)
          mg.store(lens, row, seq, ok & live)

      def tail():
        g = p.ext_rows * _LINE
        plan[g + _HEAD] = head
        plan[g + _FLEN] = flen
        plan[g + _LIMIT] = jnp.where(ok, tok_total, 0)
      mg.when(s == 0, tail)

    step(extend)
    go_ext, ok_ext, _, _, _, taken = ext_verdict(0)
    taken = jnp.where(ok_ext, taken, 0)
    oks[1] = go_ext & ok_ext
    new_head = head + taken
    head, flen = jnp.where(new_head >= n, new_head - n, new_head), flen - taken

  # --- decode --------------------------------------------------------------------------
  if "dec" in phases:
    def dec_row(row, real):
      pre = jnp.where(real, lens[row], 0)
      return pre, pre + 1

    def dec_counts(s):
      full = needs = seqbad = jnp.zeros((), jnp.int32)
      for _, row, real, _ in rows("dec", s):
        pre, seq = dec_row(row, real)
        full = full + jnp.where(real & (pre >= w * ps), 1, 0)
        needs = needs + jnp.where(real & _needs_page(seq, ps), 1, 0)
        seqbad = seqbad + jnp.where(real & (seq < 1), 1, 0)
      _store_counts(cnt, s, ns, {_DEC_FULL: full, _DEC_NEEDS: needs, _DEC_SEQ: seqbad})

    step(dec_counts)

    def dec_verdict(s):
      _, bad = _sums(cnt, _DEC_BAD, s, ns)
      _, full = _sums(cnt, _DEC_FULL, s, ns)
      before, total = _sums(cnt, _DEC_NEEDS, s, ns)
      _, seqbad = _sums(cnt, _DEC_SEQ, s, ns)
      go = (bad == 0) & (full == 0)
      before, total, seqbad = (jnp.where(go, x, 0) for x in (before, total, seqbad))
      ok = (seqbad == 0) & (total <= flen)
      return go, ok, before, total

    def decode(s):
      go, ok, k, _ = dec_verdict(s)
      for chunk in rows("dec", s).chunks():
        out = []
        for b, row, real, _ in chunk:  # loads
          pre, seq = dec_row(row, real)
          live = real & go
          needs = jnp.where(live & _needs_page(seq, ps), 1, 0)
          last = _last_loc(p, pages, row, pre)
          page = ring[mg.wrap(head + k, n)]
          slot = jnp.where(needs > 0, page * ps, last + 1)
          out.append((b, row, pre, seq, live, needs, page, jnp.where(ok & live, slot, 0)))
          k = k + needs
        for b, row, pre, seq, live, needs, page, slot in out:  # stores
          mg.store(r["dec_out"], b, slot, b < p.dec_rows)
          col = jnp.minimum(floordiv(pre, ps), w - 1)
          mg.store(pages, row * w + col, page, ok & live & (needs > 0))
          if p.guard:  # guard.take
            mg.mark_held(r["held"], page, ok & live & (needs > 0), n)
          mg.store(lens, row, seq, ok & live)

    step(decode)
    go_dec, ok_dec, _, total = dec_verdict(0)
    oks[2] = go_dec & ok_dec
    taken = jnp.where(ok_dec, total, 0)
    new_head = head + taken
    head, flen = jnp.where(new_head >= n, new_head - n, new_head), flen - taken

  def finish(s):
    def put():  # head and flen are in place: every read of them came before
      r["head"][0] = head
      r["flen"][0] = flen
      for i, ok in enumerate(oks):
        r["ok_o"][i] = ok.astype(jnp.int32)
    mg.when(s == 0, put)

  mg.streams(nt, finish)


def _needs_page(seq, ps: int):
  return cdiv(seq, ps) > cdiv(seq - 1, ps)


def _extend_counts(p: _Params, pre, seq):
  """(tokens, new pages) of one extend row, each clipped as capacity.clip_counts."""
  fnp = cdiv(pre, p.page_size)
  ext = capacity.clip_counts(seq - pre, p.max_tokens)
  new_pages = capacity.clip_counts(cdiv(seq, p.page_size) - fnp, p.num_pages)
  return ext, new_pages


def _owned_span(p: _Params, lens, owned, row):
  """(first, end) columns of the pages a row owns, inside [0, W]."""
  end = jnp.minimum(cdiv(lens[row], p.page_size), p.width)
  start = jnp.clip(owned[row], 0, p.width)
  return start, jnp.maximum(end, start)


def _blocks(start, end, fn, carry):
  """carry = fn(j, inside, carry) for j in [start, end), CHUNK at a time: a loop over
  blocks whose CHUNK columns are unrolled (inside: j < end; j past it is clamped by the
  caller's index)."""
  def block(i, carry):
    for u in range(CHUNK):
      j = start + i * CHUNK + u
      carry = fn(j, j < end, carry)
    return carry
  return jax.lax.fori_loop(0, cdiv(jnp.maximum(end - start, 0), CHUNK), block, carry)


def _owned_blocks(p: _Params, pages, row, start, end, visit, carry):
  """carry = visit(cols, carry) for each block of CHUNK columns of a row from `start`,
  cols = [(j, page, j < end)] with the block's page loads issued first (a visit then
  loads more or stores; columns past the row's last are clamped to it)."""
  def block(i, carry):
    cols = []
    for u in range(CHUNK):
      j = start + i * CHUNK + u
      cols.append((j, pages[row * p.width + jnp.minimum(j, p.width - 1)], j < end))
    return visit(cols, carry)
  return jax.lax.fori_loop(0, cdiv(jnp.maximum(end - start, 0), CHUNK), block, carry)


def _count_valid(p: _Params, pages, row, start, end, key=None):
  """Owned pages of a row (columns [start, end)) that name a page of the pool (1..n).
  key (the record): (scr, pmark, k0): each such column j also stores its entry key
  k0 + j at scr[pmark + page]."""
  n = p.num_pages

  def visit(cols, acc):
    for j, page, inside in cols:
      valid = inside & (page >= 1) & (page <= n)
      acc = acc + jnp.where(valid, 1, 0)
      if key is not None:
        scr, pmark, k0 = key
        mg.store(scr, pmark + jnp.clip(page, 0, n), k0 + j, valid)
    return acc
  return _owned_blocks(p, pages, row, start, end, visit, jnp.zeros((), jnp.int32))


def _offences(p: _Params, pages, held, scr, pmark, row, k0, start, end, first):
  """guard.reasons of a released row's owned columns [start, end) (entry keys k0 + j),
  folded into first = (key, why, page), the smallest proposal so far (module docstring:
  an offending entry proposes its key; a REPEATED one the smaller of its key and the key
  it found at its page's mark)."""
  n = p.num_pages

  def visit(cols, first):
    got = []
    for j, page, inside in cols:  # the held values and marks: loads, all first
      at = jnp.clip(page, 0, n)
      got.append((k0 + j, page, inside & (page != 0), held[at], scr[pmark + at]))
    for key, page, given, h0, mark in got:
      pool = (page >= 1) & (page <= n)
      twice = pool & (mark != key)
      why = jnp.where(~pool, mg.OUT_OF_RANGE, jnp.where(
          h0 != 1, mg.NOT_HELD, jnp.where(twice, mg.REPEATED, 0)))
      cand = jnp.where(given & (why != 0),
                       jnp.where(twice, jnp.minimum(key, mark), key), _NONE)
      better = cand < first[0]
      first = tuple(jnp.where(better, v, f) for v, f in zip((cand, why, page), first))
    return first
  return _owned_blocks(p, pages, row, start, end, visit, first)


def _first_offence(cnt, ns: int):
  """(found, why, page) of the smallest proposal of all streams (shared memory)."""
  best = jnp.full((), _NONE, jnp.int32)
  at = jnp.zeros((), jnp.int32)
  for t in range(ns):
    k = cnt[_REL_KEY * ns + t]
    at = jnp.where(k < best, t, at)
    best = jnp.minimum(k, best)
  return best < _NONE, cnt[_REL_WHY * ns + at], cnt[_REL_PAGE * ns + at]


def _record_status(status, mine, op: int, found, why, page) -> None:
  """The sticky status (guard.record_status), written by one stream (mine): stores only
  where a refusal finds it empty (each lane stores the same values or nothing)."""
  def put():
    new = found & (status[0] == 0)
    for i, v in enumerate((jnp.int32(op), why, page)):
      mg.store(status, i, v, new)
  mg.when(mine, put)


def _give_back(p: _Params, pages, ring, row, start, end, head, rank, count, held=None):
  """The row's valid owned pages, in column order, to ring[head + rank ...] while rank <
  count (held: the record, held[page] = 0 for each). Returns the rank after them."""
  n = p.num_pages

  def visit(cols, rank):
    for _, page, inside in cols:
      valid = inside & (page >= 1) & (page <= n)
      mg.store(ring, mg.wrap(head + rank, n), page, valid & (rank < count))
      if held is not None:
        mg.store(held, jnp.clip(page, 0, n), jnp.zeros((), jnp.int32), valid)
      rank = rank + jnp.where(valid, 1, 0)
    return rank
  return _owned_blocks(p, pages, row, start, end, visit, rank)


def _copy_run(n: int, src, wrap, src_start, dst, dst_start, count, held=None) -> None:
  """dst[dst_start + g] = src[wrap(src_start + g, n)] for g < count (held: the record,
  each value marked held); per block of CHUNK the loads, then the stores."""
  def block(i, carry):
    got = [(i * CHUNK + u, src[wrap(src_start + i * CHUNK + u, n)]) for u in range(CHUNK)]
    for g, value in got:
      mg.store(dst, dst_start + g, value, g < count)
      if held is not None:
        mg.mark_held(held, value, g < count, n)
    return carry
  jax.lax.fori_loop(0, cdiv(count, CHUNK), block, 0)


def _clear_row(p: _Params, pages, lens, owned, row) -> None:
  def fn(j, inside, carry):
    del inside  # columns past the row's last are clamped to it: cleared again
    pages[row * p.width + jnp.minimum(j, p.width - 1)] = jnp.zeros((), jnp.int32)
    return carry
  _blocks(jnp.zeros((), jnp.int32), jnp.full((), p.width, jnp.int32), fn, 0)
  lens[row] = 0
  owned[row] = 0


# ---------------------------------------------------------------------------------------
# The extend slots: a second launch.
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _SlotParams:
  page_size: int
  num_pages: int
  rows: int          # extend rows given
  max_tokens: int
  chunks: int        # C programs per row; grid = rows * C, 4 warps each


def slot_chunks(rows: int, max_tokens: int) -> int:
  """Programs per extend row of the slots launch: its 4 warps write SLOT_BLOCK slots a
  block, and C programs cover twice the mean row (max_tokens / rows) in one round."""
  span = min(2 * -(-max_tokens // rows), max_tokens)
  return max(1, -(-span // (mg.WARPS * SLOT_BLOCK)))


def _slots_kernel(ring_ref, plan_ref, out_ref, *, p: _SlotParams):
  """Program (row, chunk), warp w: stream u = chunk * 4 + w of the row's U = 4 C streams
  writes the row's blocks u, u + U, ... of SLOT_BLOCK slots of [tok_start, tok_end)
  (triton_extend._slot from the row's plan line), then, as stream s of all S = 4 G, the
  blocks s, s + S, ... of the zero tail [limit, max_tokens). ring_ref i32[n] as the
  table program left it; plan_ref i32[(rows + 1) * 8]; out_ref i32[max_tokens]."""
  ps, n, sb = p.page_size, p.num_pages, SLOT_BLOCK
  g = p.rows * _LINE
  grid = p.rows * p.chunks
  prog = mg.program_id()
  row = prog // p.chunks if p.chunks > 1 else prog
  chunk = prog % p.chunks if p.chunks > 1 else 0

  def stream(warp):
    head, limit = plan_ref[g + _HEAD], plan_ref[g + _LIMIT]
    ts, te, a, e, c, bp = (plan_ref[row * _LINE + v] for v in (_TS, _TE, _A, _E, _C, _BP))
    u, nu = chunk * mg.WARPS + warp, p.chunks * mg.WARPS

    def row_block(i, carry):
      t0 = ts + (u + i * nu) * sb
      slots = []
      for j in range(sb):  # the block's loads, then its stores
        t = t0 + j
        pos = t + a
        page = ring_ref[mg.wrap(head + bp + floordiv(pos, ps), n)]
        slots.append((t, jnp.where(t < e, t + c, page * ps + mod(pos, ps))))
      for t, slot in slots:
        mg.store(out_ref, jnp.minimum(t, p.max_tokens - 1), slot, t < te)
      return carry

    blocks = cdiv(te - ts, sb)    # 0 for padding rows and failed batches
    jax.lax.fori_loop(0, cdiv(jnp.maximum(blocks - u, 0), nu), row_block, 0)

    s, ns = prog * mg.WARPS + warp, grid * mg.WARPS

    def tail_block(i, carry):
      t0 = limit + (s + i * ns) * sb
      for j in range(sb):
        t = t0 + j
        mg.store(out_ref, jnp.minimum(t, p.max_tokens - 1), jnp.zeros((), jnp.int32),
                 t < p.max_tokens)
      return carry

    blocks = cdiv(p.max_tokens - limit, sb)
    jax.lax.fori_loop(0, cdiv(jnp.maximum(blocks - s, 0), ns), tail_block, 0)

  mg.streams(1, stream)


# ---------------------------------------------------------------------------------------
# Wrapper.
# ---------------------------------------------------------------------------------------

def table_step_mosaic_gpu(free_ring: Array, free_head: Array, free_len: Array,
                          release_len: Array, pages: Array, lens: Array, owned_from: Array,
                          *, page_size: int, release: Optional[Tuple[Array, Array]] = None,
                          extend: Optional[Tuple[Array, Array, Array]] = None,
                          max_tokens: int = 0,
                          decode: Optional[Tuple[Array, Array]] = None,
                          interpret=False,
                          warpgroups: Optional[int] = None,
                          record: Optional[Tuple[Array, Array]] = None,
                          op: int = 0) -> Dict[str, Array]:
  """The request table's release, extend and decode (each optional, in that order) in one
  Mosaic GPU launch, two with extend (SPEC 11; need_sort off, no debug, paged pool).

  Args and returns as triton_table.table_step_triton (the same dict, the bits of the jnp
  path's release_rows, extend_rows, decode_rows applied in turn; with `record`, (held
  i32[n + 1], status i32[3]) written in place, "held" and "status" too, `op` named in
  the status of a refused release). interpret: run in jax's Mosaic GPU interpreter
  (True, or its parameters). warpgroups: of the table program (default `warpgroups_for`
  the largest phase).

  Raises TypeError naming the argument for a non-integer dtype, ValueError for sizes
  `supported` refuses.
  """
  (free_ring, free_head, free_len, release_len, pages, lens, owned_from), sizes = (
      _util.table_step_args("table_step_mosaic_gpu", supported, page_size, max_tokens,
                            release, extend, decode, note=f"; jax {jax.__version__}",
                            free_ring=free_ring, free_head=free_head, free_len=free_len,
                            release_len=release_len, pages=pages, lens=lens,
                            owned_from=owned_from))
  max_reqs, width = pages.shape
  n = free_ring.shape[0]
  nt = warpgroups or warpgroups_for(max(sizes.values()))
  p = _Params(page_size=page_size, num_pages=n, max_reqs=max_reqs, width=width,
              rel_rows=sizes["release"], ext_rows=sizes["extend"],
              dec_rows=sizes["decode"], max_tokens=max_tokens if extend is not None else 0,
              warpgroups=nt, guard=record is not None, op=op)
  one = lambda x: jnp.reshape(jnp.asarray(x, jnp.int32), (1,))
  # In place, the free list's head and length too: an output that is not aliased to its
  # input cannot take a loop carry's buffer, and XLA would copy it into the carry.
  ring_ref, head_ref, flen_ref, pages_ref, lens_ref, owned_ref = mg.as_i32_refs(
      free_ring, one(free_head), one(free_len), pages.reshape(-1), lens, owned_from)
  names = ["ring", "head", "flen", "rlen", "pages", "lens", "owned"]
  args = [ring_ref, head_ref, flen_ref, one(release_len), pages_ref, lens_ref, owned_ref]
  for key, phase, fields in (("rel", release, ("rows", "num")),
                             ("ext", extend, ("rows", "n", "num")),
                             ("dec", decode, ("rows", "num"))):
    if phase is None:
      continue
    checked = _util.check_ints(**{f"{key}_{f}": v for f, v in zip(fields, phase)})
    names += [f"{key}_{f}" for f in fields]
    args += [x if f != "num" else one(x) for f, x in zip(fields, checked)]
  held_status = ()
  if record is not None:
    (status,) = _util.check_ints(status=record[1])
    held_status = mg.as_i32_refs(mg.check_held(record[0], n), status.reshape(3))
    names += ["held", "status"]
    args += list(held_status)
  i32 = lambda k: jax.ShapeDtypeStruct((max(k, 1),), jnp.int32)
  # scr: the row marks of the three phases, then (record, release) the page marks.
  pmarks = n + 1 if p.guard and release is not None else 0
  outs = {"ok_o": i32(3), "scr": i32(3 * max_reqs + pmarks)}
  if extend is not None:
    outs["plan"] = i32((p.ext_rows + 1) * _LINE)
  if decode is not None:
    outs["dec_out"] = i32(p.dec_rows)
  names += list(outs) + ["cnt"] + (["bar"] if nt > 1 else [])
  body = _bind(p, tuple(names))
  kernel = mg.call(body, tuple(outs.values()), name="jax_kvalloc_table_step_mosaic_gpu",
                   num_threads=nt,
                   scratch=(mg.smem(_KINDS * p.streams),) + mg.barrier_scratch(nt),
                   interpret=interpret)
  res = dict(zip(outs, kernel(*args)))
  ok = res["ok_o"] > 0
  result = dict(ring=ring_ref[...], head=head_ref[...].reshape(()),
                length=flen_ref[...].reshape(()),
                pages=pages_ref[...].reshape(max_reqs, width), lens=lens_ref[...],
                owned_from=owned_ref[...])
  if record is not None:
    result["held"], result["status"] = (ref[...] for ref in held_status)
  if release is not None:
    result["release_ok"] = ok[0]
  if extend is not None:
    sp = _SlotParams(page_size=page_size, num_pages=n, rows=p.ext_rows,
                     max_tokens=max_tokens, chunks=slot_chunks(p.ext_rows, max_tokens))
    slots = mg.call(_bind_slots(sp), i32(max_tokens),
                    name="jax_kvalloc_table_extend_slots_mosaic_gpu",
                    grid=p.ext_rows * sp.chunks,
                    interpret=interpret)(result["ring"], res["plan"])
    result["extend_slots"], result["extend_ok"] = slots, ok[1]
  if decode is not None:
    result["decode_slots"], result["decode_ok"] = res["dec_out"], ok[2]
  return result


def _bind(p: _Params, names: Tuple[str, ...]):
  def body(*refs):
    _kernel(*refs, p=p, names=names)
  return body


def _bind_slots(p: _SlotParams):
  def body(*refs):
    _slots_kernel(*refs, p=p)
  return body
