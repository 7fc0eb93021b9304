"""Left-padded cache feeds for a graph that reads its mask only as lengths.

onnxruntime-genai's graphs turn the attention mask into GroupQueryAttention's `seqlens_k`
(ReduceSum(mask) - 1) and `total_sequence_length` (the mask's width): a row's entries are
taken to be the first seqlens_k + 1 of its timeline (past, then the new tokens), i.e. right
padding, and the new keys are written right after the row's own past. The gate's prefills and
the server's batched decode steps are left-padded (tuner.gate.decode_step, serving.generation): a
row whose mask is 0 on its first `lead` entries is here rolled left by `lead` before the run
and its outputs rolled back after, so both see the layout they were written for:

    timeline (P past + S new)  [0 0 a b | c]  --roll -lead-->  [a b c | 0 0]  --run-->
    present (B, h, P + S, d)   [a b c 0 0]    --roll +lead-->  [0 0 a b c]

With a past (P > 0) the padding must lie inside it (a decode step of generate(), a decode
rollout): the past is rolled and the new tokens stay. With P = 0 (a prefill) the ids, the
positions and the logits are rolled instead. Rows without leading zeros pass unchanged.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from tuner.errors import BadInput
from tuner.graph.cache_record import CacheRecord


def _leads(mask: np.ndarray) -> np.ndarray:
    """Leading zeros per row of a (B, T) mask, 0 for rows that are not left-padded (a row
    whose ones are not one run to the end is left as it is)."""
    keep = mask.astype(bool)
    first = keep.argmax(axis=1)  # (B,)
    contiguous = np.array([keep[i, first[i]:].all() for i in range(len(keep))])
    return np.where(contiguous & keep.any(axis=1), first, 0)


def _roll_rows(arr: np.ndarray, shifts: np.ndarray, axis: int) -> np.ndarray:
    """Each row i of `arr` rolled by shifts[i] along `axis` (axis counted within a row)."""
    out = arr.copy()
    for i, k in enumerate(shifts):
        if k:
            out[i] = np.roll(arr[i], int(k), axis=axis)
    return out


class RightPadded:
    """A runner wrapper: `infer(left-padded feeds)` -> outputs as a left-padded run would
    give them, through a graph whose mask means lengths (KvCache.mask == "lengths")."""

    def __init__(self, runner, roles: CacheRecord) -> None:
        if roles.attention_mask is None:
            raise BadInput("a graph that reads its mask as lengths must take a mask")
        self.runner, self.roles = runner, roles
        self.name = getattr(runner, "name", "right-padded")
        self._seq_axis = roles.cache.layout.index("s") - 1  # within a row (batch axis gone)

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        r = self.roles
        mask = np.asarray(feeds[r.attention_mask])  # (B, P + S)
        lead = _leads(mask)
        if not lead.any():
            return dict(self.runner.infer(feeds))
        seq = int(np.asarray(feeds[r.input_ids]).shape[1])
        past = mask.shape[1] - seq
        if past > 0 and (lead > past).any():
            raise BadInput("a row padded into its new tokens needs past 0 for a graph that "
                           "reads its mask as lengths (GroupQueryAttention)")
        arrays = dict(feeds)
        arrays[r.attention_mask] = _roll_rows(mask, -lead, 0)
        cache_inputs = set(r.past_to_present)
        if past > 0:
            for name in cache_inputs:
                arrays[name] = _roll_rows(np.asarray(feeds[name]), -lead, self._seq_axis)
        else:
            for name in (r.input_ids, r.position_ids):
                if name is not None:
                    arrays[name] = _roll_rows(np.asarray(feeds[name]), -lead, 0)
        out = dict(self.runner.infer(arrays))
        for name in r.past_to_present.values():
            out[name] = _roll_rows(np.asarray(out[name]), lead, self._seq_axis)
        if past == 0:
            out[r.logits] = _roll_rows(np.asarray(out[r.logits]), lead, 0)
        return out

    def close(self) -> None:
        self.runner.close()


def adapted(runner, roles: CacheRecord):
    """`runner` as it is, or wrapped in RightPadded when the graph reads its mask as lengths."""
    return RightPadded(runner, roles) if roles.cache.mask == "lengths" else runner
