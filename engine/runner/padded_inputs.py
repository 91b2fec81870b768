"""The host side of a padded step (static_runner.py): every input of the step as one list of
values and the flat places in the runner's one input buffer that they go to, so that one copy
and one scatter write them all.

On a GPU each separate write is a launch the host pays for: a step's seven input copies were
about half of its launch calls once its head ran inside the graph (H100 profile, docs/gpu.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.core.scheduler import ScheduledRequest


@dataclass(frozen=True)
class InputRegions:
    """Where each input lives in the runner's one device buffer: `start[name]`, `size[name]`.
    `sampled` and `input_ids` come first and together: they are the token sources that `feed`
    indexes. `tables` is [max_seqs, max_blocks], row-major."""

    start: dict[str, int]
    size: dict[str, int]
    max_blocks: int

    @classmethod
    def for_sizes(cls, max_seqs: int, max_tokens: int, max_blocks: int) -> "InputRegions":
        size = {"sampled": max_seqs, "input_ids": max_tokens, "feed": max_tokens,
                "positions": max_tokens, "slots": max_tokens, "query_lens": max_seqs,
                "context_lens": max_seqs, "tables": max_seqs * max_blocks}
        start, at = {}, 0
        for name, n in size.items():
            start[name], at = at, at + n
        return cls(start, size, max_blocks)

    @property
    def total(self) -> int:
        return sum(self.size.values())


@dataclass
class PaddedInputs:
    values: list[int]
    places: list[int]  # where each value goes in the runner's buffer
    logits_rows: list[int]  # rows of the padded layout whose logits are wanted
    logits_owners: list[int]
    logits_row_starts: list[int]


def padded_inputs(scheduled: Sequence[ScheduledRequest], num_seqs: int, query_len: int,
                  regions: InputRegions, block_size: int, scratch_slot: int,
                  in_flight: dict[int, int] | None) -> PaddedInputs:
    """A step of `num_seqs` sequences (padding included) of `query_len` rows each. Padding rows
    feed token 0 at position 0 into the scratch slot; a padding sequence sees one key. Of each
    block table, only the blocks up to the sequence's context are sent (at 64 requests a
    full-width table is ~32k entries a step); what lies past them is the caller's to clear
    where an attention backend reads it. `in_flight`: see StaticStepRunner.prepare."""
    bs, n_tok, at = block_size, num_seqs * query_len, regions.start
    ids, positions, slots = [0] * n_tok, [0] * n_tok, [scratch_slot] * n_tok
    feed = list(range(at["input_ids"], at["input_ids"] + n_tok))
    query_lens, context_lens = [1] * num_seqs, [1] * num_seqs
    tables: list[int] = []
    table_places: list[int] = []
    logits_rows: list[int] = []
    owners: list[int] = []
    row_starts: list[int] = []
    for i, s in enumerate(scheduled):
        request, row, n = s.request, i * query_len, s.num_fed_tokens
        start = request.num_computed_tokens
        end = start + n
        table = request.block_table
        if n == query_len == 1:  # a decode row: scalars (the lists below cost ~1 us a request)
            ids[row] = request.all_token_ids[start]
            positions[row] = start
            slots[row] = table[start // bs] * bs + start % bs
        else:
            ids[row:row + n] = request.all_token_ids[start:start + 1] + request.draft_token_ids
            # Padding rows of a request repeat its last position (their keys are never read).
            positions[row:row + query_len] = [*range(start, end), *([end - 1] * (query_len - n))]
            slots[row:row + n] = [table[pos // bs] * bs + pos % bs for pos in range(start, end)]
        used = -(-end // bs)
        tables += table[:used]
        row_start = at["tables"] + i * regions.max_blocks
        table_places += range(row_start, row_start + used)
        query_lens[i], context_lens[i] = n, end
        if in_flight and id(request) in in_flight:
            feed[row] = in_flight[id(request)]
        if s.samples_token:
            owners.append(i)
            row_starts.append(len(logits_rows))
            logits_rows.extend(range(row, row + n))
    places = [place for name, n in (("input_ids", n_tok), ("feed", n_tok), ("positions", n_tok),
                                    ("slots", n_tok), ("query_lens", num_seqs),
                                    ("context_lens", num_seqs))
              for place in range(at[name], at[name] + n)] + table_places
    values = ids + feed + positions + slots + query_lens + context_lens + tables
    return PaddedInputs(values, places, logits_rows, owners, row_starts)
