"""Select: keep the original unless a variant's whole speedup interval lies above 1 + margin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from tuner.measure.stats import RatioCI


@dataclass(frozen=True)
class Selection:
    name: str
    reason: str


MIN_PAIRS = 5  # fewer paired rounds than this cannot support a claim of a win


def select(speedups: Mapping[str, RatioCI], margin: float = 0.03,
           eligible: Callable[[str], bool] = lambda name: True,
           min_pairs: int = MIN_PAIRS) -> Selection:
    """The original unless some eligible variant's interval, from at least `min_pairs`
    paired rounds, lies wholly above 1 + margin; among those, the one with the highest lower
    bound (the surest win)."""
    if margin < 0:
        raise ValueError("margin must be >= 0")
    few = [n for n, ci in speedups.items() if n != "original" and ci.n < min_pairs]
    if few:
        return Selection("original", (
            f"too few paired rounds to tell ({min(speedups[n].n for n in few)} < {min_pairs}; "
            "use more --rounds): the original is kept"))
    winners = {n: ci for n, ci in speedups.items()
               if n != "original" and eligible(n) and ci.above(1 + margin)}
    if not winners:
        best = max(((n, ci) for n, ci in speedups.items() if n != "original" and eligible(n)),
                   key=lambda kv: kv[1].ratio, default=None)
        if best is None:
            return Selection("original", "no exact variant to compare: the original is kept")
        n, ci = best
        return Selection("original", (
            f"nothing was faster beyond noise: the best variant, {n}, measured "
            f"{ci.ratio:.3f}x [{ci.low:.3f}, {ci.high:.3f}] at {ci.confidence:.0%}, and a win needs "
            f"the whole interval above {1 + margin:.2f}x; the original is kept"))
    n, ci = max(winners.items(), key=lambda kv: (kv[1].low, kv[1].ratio))
    return Selection(n, (f"{n} is faster beyond noise: {ci.ratio:.3f}x "
                         f"[{ci.low:.3f}, {ci.high:.3f}] at {ci.confidence:.0%}, interval above "
                         f"{1 + margin:.2f}x"))
