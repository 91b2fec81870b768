"""What a target step and a proposal cost, in seconds: the controller's price list.

A step is priced in row units: u = shape(rows) + row_key_units x (keys its rows attend, summed
over rows) + request_key_units x (keys in the caches of its requests, once per request), and
t(u) = fixed + per_unit x u. Rows alone, each at one price, were not enough on CPU:
- a verified row's attention grows with its context (a row at 512 keys cost 1.6x one at 16 on
  the Xeon), and 16 concurrent agent loops, which re-send long histories, lost to no
  speculation with drafts priced at the start-up's short context;
- the integer kernels run rows in chunks, so rows do not cost alike: on the Xeon the 2nd row of a
  step cost 0.2 ms, the 17th (16 requests and one draft) 1.7 ms, the 18th to 32nd 0.7-1.2 each.
`RowShape` is that measured curve, in rows (1 row is 1, 16 rows are 16). The curve and the key
prices are measured at start-up (cost_probe.py); scale and intercept are then fitted online, by
exponentially forgetting least squares, from every decode step.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

COST_DECAY = 0.98  # per observation for the step-time fit
# How precisely the online data must pin the slope (its standard error, as a share of the slope)
# before the fit takes it; less precise, the fit keeps its slope and moves only its intercept. At
# a steady 16 requests nearly every step feeds 16 rows, and a slope fitted on them and a rare
# 17-row probe was noise, once 1.7 ms a row with no fixed part, and then no draft paid. At batch 1
# the same probes against 1-row steps pin it well (steps vary far less than a row's cost).
MAX_SLOPE_ERROR = 0.25
# A step this many times slower than the line predicts is not learned from, unless such steps
# keep coming (then the line was wrong). On a GPU a kernel's or a shape's first use compiles it
# (a second, against 1.5 ms steps), and one such step, decayed by COST_DECAY a step, still read
# as 10 ms of fixed cost 60 steps later (test_online_cost_fit.py), which mispriced every draft
# against a step. (On an H200 the spec_matrix engine that met the verify shapes first drafted
# 3 to 8 tokens in 256 while its twins drafted 180-320: suspected first-use costs, not shown.)
OUTLIER_FACTOR = 10.0
MAX_OUTLIERS_IN_A_ROW = 8


def attended_keys(first_position: int, num_rows: int) -> int:
    """Keys that `num_rows` consecutive rows from `first_position` attend, all rows together (row
    j, at position first_position + j, sees first_position + j + 1 keys)."""
    return num_rows * first_position + num_rows * (num_rows + 1) // 2


def step_keys(first_positions: Sequence[int], num_rows: Sequence[int]) -> tuple[int, int]:
    """(keys the step's rows attend, keys in its requests' caches) for requests feeding
    num_rows[i] rows from first_positions[i]."""
    return (sum(attended_keys(p, n) for p, n in zip(first_positions, num_rows)),
            sum(p + n for p, n in zip(first_positions, num_rows)))


class RowShape:
    """Effective rows of a step of n rows: the step's measured time over row counts, scaled so
    that 1 row is 1 and 16 rows are 16, linear between the row counts measured and past the
    last one. Without measurements, n itself."""

    def __init__(self, seconds_by_rows: dict[int, float] | None = None):
        self.rows: list[int] = []
        self.effective: list[float] = []
        if not seconds_by_rows or 1 not in seconds_by_rows or 16 not in seconds_by_rows:
            return
        one, sixteen = seconds_by_rows[1], seconds_by_rows[16]
        if sixteen <= one:
            return
        slowest = 0.0  # noise must not make a row count cheaper than a smaller one
        for rows in sorted(seconds_by_rows):
            slowest = max(slowest, 1 + 15 * (seconds_by_rows[rows] - one) / (sixteen - one))
            self.rows.append(rows)
            self.effective.append(slowest)

    def __call__(self, n: float) -> float:
        rows, effective = self.rows, self.effective
        if len(rows) < 2 or n <= 0:
            return float(n)
        if n <= rows[0]:
            return effective[0] * n / rows[0]
        i = min(bisect.bisect_left(rows, n), len(rows) - 1)
        low, high = rows[i - 1], rows[i]
        return effective[i - 1] + (effective[i] - effective[i - 1]) * (n - low) / (high - low)


class LinearCostModel:
    """t(u) = fixed + per_unit * u seconds for a step of u row units (see the module's doc).

    Online it fits t = fixed + per_unit * x_rows + per_cache_key * x_keys, where x_keys is the
    keys of the step's requests' caches and x_rows its rows plus what its verify rows attend
    beyond the cache read (row_key_units per key). Two variables, because a steady batch's
    contexts grow step by step: fitted on units alone, that growth pinned the row price to
    whatever made the key price right, and a key price a little off moved the draft's price by
    half. The cache-key price then sets request_key_units (= per_cache_key / per_unit -
    row_key_units), so `units` and `__call__` price every row alike."""

    def __init__(self, fixed: float, per_unit: float, row_key_units: float = 0.0,
                 request_key_units: float = 0.0, row_shape: RowShape | None = None):
        self.fixed, self.per_unit = fixed, per_unit
        self.row_shape = row_shape or RowShape()
        self.row_key_units, self.request_key_units = row_key_units, request_key_units
        # The line the online fit falls back on where the data does not pin the slopes: the
        # start-up's, or the last one the data pinned.
        self._held = (fixed, per_unit)
        # weight, then sums of x_rows, x_keys, t and of their products (decayed)
        self._sums = dict.fromkeys(("w", "r", "k", "t", "rr", "rk", "kk", "rt", "kt", "tt"), 0.0)
        self._outliers_in_a_row = 0

    def units(self, rows: int, row_keys: int = 0, request_keys: int = 0) -> float:
        return (self.row_shape(rows) + self.row_key_units * row_keys
                + self.request_key_units * request_keys)

    def request_units(self, first_position: int, num_rows: int) -> float:
        """Units of a step of one request feeding `num_rows` rows from `first_position`, cache
        read included."""
        return self.units(num_rows, attended_keys(first_position, num_rows),
                          first_position + num_rows)

    def draft_units(self, first_position: int, draft_index: int, rows_before: int) -> float:
        """Units of the draft_index-th (from 1) verified row of a request whose fed token sits at
        `first_position`, in a step of `rows_before` rows so far: its row and its attention;
        the cache read is paid by the fed token."""
        return (self.row_shape(rows_before + 1) - self.row_shape(rows_before)
                + self.row_key_units * (first_position + draft_index + 1))

    @property
    def per_cache_key(self) -> float:
        return self.per_unit * (self.row_key_units + self.request_key_units)

    def observe(self, rows: float, seconds: float, row_keys: int = 0,
                request_keys: int = 0) -> None:
        x_rows = self.row_shape(rows) + self.row_key_units * (row_keys - request_keys)
        predicted = self.fixed + self.per_unit * x_rows + self.per_cache_key * request_keys
        if seconds > OUTLIER_FACTOR * predicted > 0 \
                and self._outliers_in_a_row < MAX_OUTLIERS_IN_A_ROW:
            self._outliers_in_a_row += 1
            return
        self._outliers_in_a_row = 0
        sums = {name: v * COST_DECAY for name, v in self._sums.items()}
        for name, v in (("w", 1.0), ("r", x_rows), ("k", request_keys), ("t", seconds),
                        ("rr", x_rows * x_rows), ("rk", x_rows * request_keys),
                        ("kk", request_keys * request_keys), ("rt", x_rows * seconds),
                        ("kt", request_keys * seconds), ("tt", seconds * seconds)):
            sums[name] += v
        self._sums = sums
        slopes = self._precise_slopes()
        if slopes is not None:
            per_unit, per_cache_key = slopes
            fixed = (sums["t"] - per_unit * sums["r"] - per_cache_key * sums["k"]) / sums["w"]
            if fixed >= 0:
                self.fixed, self.per_unit = fixed, per_unit
                self.request_key_units = max(per_cache_key / per_unit - self.row_key_units, 0.0)
                self._held = (fixed, per_unit)
                return
        self._follow_held_line(sums)

    def _follow_held_line(self, sums: dict[str, float]) -> None:
        """Where the data does not pin the slopes: steps slower than the held line says (host
        work the start-up forward did not time) move its intercept only; steps faster than it
        says scale the whole line down. The start-up takes the fastest of its timings, so
        faster steps mean they were all slowed (servers started together on a shared CPU
        timed 1.9-2.4 ms a row where alone it was 0.57): moving the intercept alone to data
        below such a line left fixed = 0 and rows 3x dear, and drafting stayed off, since a
        batch that does not draft feeds too few row counts to pin a slope again."""
        held_fixed, held_per_unit = self._held
        key_units = self.row_key_units + self.request_key_units
        line = held_fixed * sums["w"] + held_per_unit * (sums["r"] + key_units * sums["k"])
        scale = sums["t"] / line if line > 0 else 1.0
        if scale < 1:
            self.fixed, self.per_unit = scale * held_fixed, scale * held_per_unit
        else:
            self.per_unit = held_per_unit
            self.fixed = (sums["t"] - line) / sums["w"] + held_fixed

    def _precise_slopes(self) -> tuple[float, float] | None:
        """(per_unit, per_cache_key) by least squares, each within MAX_SLOPE_ERROR of its
        standard error; where the keys barely vary (a short run), the row price alone, the
        key price held."""
        s = self._sums
        w = s["w"]
        if w < 3:
            return None
        srr, srk, skk = (s["rr"] - s["r"] ** 2 / w, s["rk"] - s["r"] * s["k"] / w,
                         s["kk"] - s["k"] ** 2 / w)
        srt, skt, stt = (s["rt"] - s["r"] * s["t"] / w, s["kt"] - s["k"] * s["t"] / w,
                         s["tt"] - s["t"] ** 2 / w)
        if srr <= 1e-9 * max(s["rr"], 1.0):
            return None
        det = srr * skk - srk * srk
        if det > 1e-6 * srr * max(skk, 1e-12) and w >= 4:
            per_unit = (skk * srt - srk * skt) / det
            per_cache_key = (srr * skt - srk * srt) / det
            residual = max(stt - per_unit * srt - per_cache_key * skt, 0.0) / max(w - 3, 1e-9)
            if (per_unit > 0 and per_cache_key >= 0
                    and (residual * skk / det) ** 0.5 <= MAX_SLOPE_ERROR * per_unit
                    and (residual * srr / det) ** 0.5 <= MAX_SLOPE_ERROR * max(per_cache_key,
                                                                                1e-12)):
                return per_unit, per_cache_key
        # the row price alone, on the times less the held price of the cache reads
        held = self.per_cache_key
        srt_held = srt - held * srk
        per_unit = srt_held / srr
        residual = max(stt - 2 * held * skt + held * held * skk - per_unit * srt_held, 0.0) \
            / max(w - 2, 1e-9)
        if per_unit <= 0 or (residual / srr) ** 0.5 > MAX_SLOPE_ERROR * per_unit:
            return None
        return per_unit, held

    def __call__(self, n: float) -> float:
        return self.fixed + self.per_unit * n


class DraftCost:
    """Seconds of drafting. A model-based proposer pays per sequential draft step (one forward
    of the draft per position, whatever the batch); n-gram lookup pays per token."""

    def __init__(self, per_step: bool, seconds_per_unit: float = 0.0):
        self.per_step = per_step
        self.seconds_per_unit = seconds_per_unit
        self._observed = False

    def __call__(self, num_tokens: int, num_steps: int) -> float:
        return self.seconds_per_unit * (num_steps if self.per_step else num_tokens)

    def observe(self, num_tokens: int, num_steps: int, seconds: float) -> None:
        units = num_steps if self.per_step else num_tokens
        if units:
            rate = seconds / units
            self.seconds_per_unit = rate if not self._observed else (
                0.9 * self.seconds_per_unit + 0.1 * rate)
            self._observed = True


class ModelDraftCost:
    """Seconds of drafting with a model (a draft model, the target's own layers, an EAGLE head):
    a `fraction` of what the target's fitted step cost charges for the same rows. A draft step
    over b sequences costs like a small target step of b tokens, so drafting for a batch costs
    fraction * (fixed * steps + per_token * draft tokens), where a flat per-step price would
    undercharge every draft after a step's first. The fraction is re-estimated from every
    measured proposal."""

    per_step = True

    def __init__(self, fraction: float, step_cost: LinearCostModel):
        self.fraction = fraction
        self.step_cost = step_cost

    def _target_seconds(self, num_tokens: int, num_steps: int) -> float:
        return self.step_cost.fixed * num_steps + self.step_cost.per_unit * num_tokens

    def __call__(self, num_tokens: int, num_steps: int) -> float:
        return self.fraction * self._target_seconds(num_tokens, num_steps)

    def observe(self, num_tokens: int, num_steps: int, seconds: float) -> None:
        reference = self._target_seconds(num_tokens, num_steps)
        if num_steps and reference > 0:
            self.fraction = 0.9 * self.fraction + 0.1 * seconds / reference
