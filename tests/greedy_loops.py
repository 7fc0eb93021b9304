"""Plain ONNX Runtime greedy loops, written here and not taken from the product, so that tests
can check the gate's verdicts (tuner/gate/kv_gate.py) against an oracle of their own.

    tokens, logits = greedy_plain(session, ids, steps)            # no cache: rerun everything
    run = greedy_cache(session, ids, steps, mask)                 # the optimum cache layout

The cache loop knows the layout models/kv.py exports (input_ids, attention_mask over past +
seq, position_ids, past_key_values.{i}.key|value -> logits, present.{i}.key|value) and
nothing else: past tensors start empty, shaped from the session's own declared inputs (so a
variant whose cache was widened is fed its own wider, empty past), and each step feeds every
present back as its past.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CacheRun:
    tokens: np.ndarray  # (B, steps) the greedy tokens
    logits: list[np.ndarray]  # per step, (B, S, V) for the prefill, (B, 1, V) after
    masks: list[np.ndarray]  # per step, (B, S): the query positions the mask keeps
    present: dict[str, np.ndarray]  # the last step's cache outputs


def positions(mask: np.ndarray) -> np.ndarray:
    """Position ids from a mask, as generate() derives them; padded slots get 1."""
    pos = mask.cumsum(-1) - 1
    return np.where(mask == 0, 1, pos)  # (B, P + S)


def greedy_plain(session, ids: np.ndarray, steps: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Greedy decoding without a cache, all rows unpadded: (tokens (B, steps), last logits)."""
    logits = []
    for _ in range(steps):
        out = session.run(["logits"], {"input_ids": ids,
                                       "attention_mask": np.ones_like(ids)})[0]  # (B, S, V)
        logits.append(out[:, -1])
        ids = np.concatenate([ids, out[:, -1].argmax(-1)[:, None]], axis=1)
    return ids[:, -steps:], logits


def _empty_past(session, batch: int) -> dict[str, np.ndarray]:
    past = {}
    for value in session.get_inputs():
        if value.name.startswith("past_key_values"):
            _, kv_heads, _, head_dim = value.shape  # (B, kv_heads, P, d): kv_heads, d static
            past[value.name] = np.zeros((batch, kv_heads, 0, head_dim), np.float32)
    return past


def greedy_cache(session, ids: np.ndarray, steps: int, mask: np.ndarray | None = None) -> CacheRun:
    """Prefill (past 0) then steps - 1 decode steps, each fed the last step's presents."""
    batch = ids.shape[0]
    mask = np.ones_like(ids) if mask is None else mask  # (B, S), left padding allowed
    past = _empty_past(session, batch)
    outputs = [o.name for o in session.get_outputs()]
    step, length, tokens, logits, masks, out = ids, 0, [], [], [], {}
    for _ in range(steps):
        s = step.shape[1]
        feeds = {"input_ids": step, "attention_mask": mask,  # (B, P + S)
                 "position_ids": positions(mask)[:, length:], **past}  # (B, S)
        out = dict(zip(outputs, session.run(outputs, feeds)))
        logits.append(out["logits"])
        masks.append(mask[:, length:])
        step = out["logits"][:, -1].argmax(-1)[:, None]  # (B, 1)
        tokens.append(step[:, 0])
        past = {n.replace("present", "past_key_values"): out[n] for n in outputs[1:]}
        length += s
        mask = np.concatenate([mask, np.ones_like(step)], axis=1)
    return CacheRun(np.stack(tokens, axis=1), logits, masks,
                    {n: out[n] for n in outputs[1:]})
