"""The accuracy gate: run a reference and a candidate on the same feeds, compare every output.

    result = verify(ref_runner, cand_runner, feeds, Tolerance())   # truthy when it passes
    print(result.table())

Per output it reports the max absolute and relative error, the cosine similarity and, for
float outputs of rank >= 2 (logits), the top-1 agreement over the last axis. Positions where
the feed's attention mask is 0 are padding, whose values no one reads: they are left out of
the comparison (for outputs whose leading axes are (batch, seq)). An element passes when
|cand - ref| <= atol + rtol * |ref| (numpy's allclose, Polygraphy's --atol/--rtol).

The gate fails closed: an output of which fewer than `min_compared` elements were compared
(nothing at all, by default: a missing output, another shape, a mask of zeros) FAILS with the
reason "nothing compared", and the table states that floor. A half-precision model is gated
at its own precision's tolerances (`Tolerance.at_precision`), and the table says so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from tuner.errors import one_line
from tuner.graph.roles import InputSpec, mask_in
from tuner.runtime.base import Runner

# what an error says when the reference itself could not run a feed (no comparison made)
REFERENCE_FAILED = "the reference failed to run"

# (output name, reference array, candidate array) -> passes
TolerancePolicy = Callable[[str, np.ndarray, np.ndarray], bool]


@dataclass(frozen=True)
class Tolerance:
    """Elementwise |cand - ref| <= atol + rtol * |ref|; `per_output` overrides by name."""

    atol: float = 1e-4
    rtol: float = 1e-3
    per_output: tuple[tuple[str, float, float], ...] = ()  # (name, atol, rtol)
    precision: str = "fp32"  # the model's own precision these tolerances are for

    def __post_init__(self) -> None:
        for name, a, r in ((None, self.atol, self.rtol), *self.per_output):
            if not (a >= 0 and r >= 0) or not np.isfinite(a) or not np.isfinite(r):
                raise ValueError(f"tolerances must be finite and >= 0, not atol={a} rtol={r}"
                                 + (f" for output {name!r}" if name else ""))

    @classmethod
    def fp16(cls) -> "Tolerance":
        """Half precision: about three significant digits."""
        return cls(atol=1e-2, rtol=1e-2, precision="fp16")

    @classmethod
    def bf16(cls) -> "Tolerance":
        """bfloat16: about two and a half significant digits (one ulp is 2^-8 relative)."""
        return cls(atol=2e-2, rtol=2e-2, precision="bf16")

    def at_precision(self, precision: str) -> "Tolerance":
        """These tolerances, widened to a half-precision model's own (`precision` from
        tuner.graph.io.model_precision); unchanged for fp32 models."""
        own = {"fp16": Tolerance.fp16, "bf16": Tolerance.bf16}.get(precision)
        if own is None:
            return self
        o = own()
        return Tolerance(max(self.atol, o.atol), max(self.rtol, o.rtol), self.per_output,
                         precision)

    def label(self) -> str:
        text = f"atol={self.atol:g} rtol={self.rtol:g}"
        return text + (f" ({self.precision} model: {self.precision} tolerances)"
                       if self.precision != "fp32" else "")

    def limits(self, name: str) -> tuple[float, float]:
        for n, a, r in self.per_output:
            if n == name:
                return a, r
        return self.atol, self.rtol

    def __call__(self, name: str, ref: np.ndarray, cand: np.ndarray) -> bool:
        atol, rtol = self.limits(name)
        ref, cand = np.asarray(ref, np.float64), np.asarray(cand, np.float64)
        return bool(np.all(np.abs(cand - ref) <= atol + rtol * np.abs(ref)))


@dataclass(frozen=True)
class OutputReport:
    """The comparison of one output over all feeds."""

    name: str
    passed: bool
    max_abs: float
    max_rel: float
    cosine: float  # the lowest over the feeds
    top1: float | None  # agreement of the argmax over the last axis, None when not meaningful
    compared: int  # elements compared (padding excluded)
    reason: str = ""  # why it failed, when not by tolerance alone


@dataclass(frozen=True)
class VerifyResult:
    """Truthy when every output passed. `table()` renders it; `to_json()` is for manifests."""

    outputs: tuple[OutputReport, ...]
    feeds: int
    tolerance: str
    errors: tuple[str, ...] = field(default=())
    min_compared: int = 1  # the floor of compared elements per output, stated in the table

    @property
    def reference_failed(self) -> bool:
        """Every feed failed on the reference itself: nothing could be compared, and the
        fault is the original's on this runtime, not the variant's."""
        return bool(self.errors) and len(self.errors) >= self.feeds and all(
            REFERENCE_FAILED in e for e in self.errors)

    @property
    def passed(self) -> bool:
        return not self.errors and bool(self.outputs) and all(o.passed for o in self.outputs)

    def __bool__(self) -> bool:
        return self.passed

    def table(self) -> str:
        head = f"{'output':24s} {'max abs':>10s} {'max rel':>10s} {'cosine':>10s} {'top-1':>7s} " \
               f"{'compared':>9s}  result"
        lines = [f"accuracy over {self.feeds} feed(s), tolerance {self.tolerance}, at least "
                 f"{self.min_compared} compared element(s) per output", head]
        for o in self.outputs:
            top1 = f"{o.top1:7.2%}" if o.top1 is not None else f"{'-':>7s}"
            verdict = "pass" if o.passed else "FAIL" + (f" ({o.reason})" if o.reason else "")
            # nothing compared (missing output, other shape): errors of 0 and a cosine of 1
            # would read as a perfect match, so print dashes
            stats = (f"{o.max_abs:10.3g} {o.max_rel:10.3g} {o.cosine:10.6f}" if o.compared
                     else f"{'-':>10s} {'-':>10s} {'-':>10s}")
            lines.append(f"{o.name[:24]:24s} {stats} {top1} {o.compared:9d}  {verdict}")
        lines.extend(f"error: {e}" for e in self.errors)
        lines.append("PASS" if self.passed else "FAIL")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"passed": self.passed, "feeds": self.feeds, "tolerance": self.tolerance,
                "min_compared": self.min_compared, "errors": list(self.errors), "outputs": [asdict(o) for o in self.outputs]}


def kept_positions(arr: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """`arr` at the (batch, seq) positions the attention mask keeps, (kept, ...): padding is
    never read, so never compared. Unchanged when its leading axes are not the mask's (an
    output without a sequence axis) or there is no mask. The one home of this rule (the
    gate, the server's shadow check)."""
    if mask is None or arr.ndim < 2 or arr.shape[:2] != mask.shape:
        return arr
    return arr[mask.astype(bool)]


class Stats:
    """Running statistics of one output over many comparisons: the one comparator of the
    gate (plain feeds here, greedy rollouts in tuner.gate.kv_gate)."""

    def __init__(self) -> None:
        self.max_abs = self.max_rel = 0.0
        self.cosine = 1.0
        self.agree = self.rows = self.compared = 0
        self.passed, self.reason, self.top1 = True, "", False

    def fail(self, reason: str) -> None:
        self.passed, self.reason = False, reason

    def add(self, name: str, ref: np.ndarray, cand: np.ndarray, policy,
            mask: np.ndarray | None = None, top1: bool = True) -> None:
        """Compare `cand` with `ref` where the (batch, seq) `mask` keeps positions (all of
        them without one); `top1`: count argmax agreement over the last axis of float
        outputs of rank >= 2 (logits)."""
        if ref.shape != cand.shape or ref.dtype != cand.dtype:
            self.fail(f"shape/dtype {cand.shape} {cand.dtype} != {ref.shape} {ref.dtype}")
            return
        ref, cand = kept_positions(ref, mask), kept_positions(cand, mask)
        r = ref.reshape(-1).astype(np.float64)
        c = cand.reshape(-1).astype(np.float64)
        self.compared += r.size
        if r.size == 0:
            return
        if (np.isnan(r) != np.isnan(c)).any():
            self.fail("NaN where the reference has none (or the reverse)")
        fin = np.isfinite(r) & np.isfinite(c)
        diff = np.abs(r[fin] - c[fin])
        if diff.size:
            self.max_abs = max(self.max_abs, float(diff.max()))
            self.max_rel = max(self.max_rel, float((diff / np.maximum(np.abs(r[fin]), 1e-12)).max()))
            denom = np.linalg.norm(r[fin]) * np.linalg.norm(c[fin])
            cos = float(r[fin] @ c[fin] / denom) if denom > 0 else float(np.array_equal(r[fin], c[fin]))
            self.cosine = min(self.cosine, cos)
        if not policy(name, ref, cand):
            self.passed = False
        if top1 and ref.dtype.kind == "f" and ref.ndim >= 2 and ref.shape[-1] > 1:
            self.top1 = True
            self.agree += int((ref.argmax(-1) == cand.argmax(-1)).sum())
            self.rows += int(np.prod(ref.shape[:-1]))

    def report(self, name: str, min_compared: int = 1) -> OutputReport:
        """The output's row; fewer than `min_compared` compared elements fail it ("nothing
        compared"), whatever the errors were."""
        passed, reason = self.passed, self.reason
        if self.compared < min_compared:
            passed = False
            reason = (f"nothing compared: {self.compared} element(s), the floor is {min_compared}"
                      + (f"; {reason}" if reason else ""))
        top1 = (self.agree / self.rows if self.rows else 1.0) if self.top1 else None
        return OutputReport(name, passed, self.max_abs, self.max_rel, self.cosine, top1,
                            self.compared, reason)


def tolerance_label(tolerance: Tolerance | TolerancePolicy) -> str:
    return (tolerance.label() if isinstance(tolerance, Tolerance)
            else getattr(tolerance, "__name__", "custom"))


def verify(reference: Runner, candidate: Runner, feeds: Sequence[Mapping[str, np.ndarray]],
           tolerance: Tolerance | TolerancePolicy = Tolerance(),
           specs: Sequence[InputSpec] | None = None, min_compared: int = 1) -> VerifyResult:
    """Run both runners on every feed and compare every output of the reference. `specs`
    (tuner.graph.roles.input_specs) say which input is the attention mask; an output with fewer
    than `min_compared` compared elements fails ("nothing compared")."""
    if min_compared < 1:
        raise ValueError(f"min_compared must be >= 1, not {min_compared}")
    accs: dict[str, Stats] = {}
    errors: list[str] = []
    for i, feed in enumerate(feeds):
        shapes = {k: tuple(v.shape) for k, v in feed.items()}
        try:
            ref_out = reference.infer(feed)
        except Exception as e:  # noqa: BLE001 - nothing to compare against: the gate fails
            errors.append(f"feed {i} {shapes}: {REFERENCE_FAILED}: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}")
            continue
        try:
            cand_out = candidate.infer(feed)
        except Exception as e:  # noqa: BLE001 - a candidate that cannot run fails the gate
            errors.append(f"feed {i} {shapes}: candidate failed to run: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}")
            continue
        mask = mask_in(feed, specs)
        for name, ref in ref_out.items():
            acc = accs.setdefault(name, Stats())
            if name not in cand_out:
                acc.fail("missing in the candidate")
                continue
            acc.add(name, np.asarray(ref), np.asarray(cand_out[name]), tolerance, mask)
    if not feeds:
        errors.append("nothing compared: no feeds")
    reports = tuple(a.report(name, min_compared) for name, a in accs.items())
    return VerifyResult(reports, len(feeds), tolerance_label(tolerance), tuple(errors),
                        min_compared)



# ---------------------------------------------------------------------------------------------
# One session at a time: a 3.5 GB model's ORT session holds about its size again in weights,
# so holding the reference and the candidate together doubles the peak. Record the reference's
# outputs (logits for a few small feeds: tens of MB), release it, then load the candidate.


class Replay:
    """A Runner that answers each feed with what another runner returned for it (or raises
    what it raised), so `verify` compares against a reference that is no longer loaded."""

    name = "replay"

    def __init__(self, feeds: Sequence[Mapping[str, np.ndarray]],
                 answers: Sequence[dict[str, np.ndarray] | Exception]) -> None:
        self._feeds, self._answers = list(feeds), list(answers)

    def close(self) -> None:
        self._answers = []

    @property
    def answers(self) -> tuple[dict[str, np.ndarray] | Exception, ...]:
        """What was recorded for each feed, in order."""
        return tuple(self._answers)

    @property
    def failure(self) -> str | None:
        """The first recorded failure in one line (None: every feed ran)."""
        return next((one_line(a) for a in self._answers if isinstance(a, Exception)), None)

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        # by identity: the same feed objects come back from the same list
        for f, answer in zip(self._feeds, self._answers):
            if f is feeds:
                if isinstance(answer, Exception):
                    raise answer
                return answer
        raise KeyError("this feed was not recorded")


def record(runner: Runner, feeds: Sequence[Mapping[str, np.ndarray]]) -> Replay:
    """Run every feed once; failures are kept and raised again on replay."""
    answers: list[dict[str, np.ndarray] | Exception] = []
    for feed in feeds:
        try:
            answers.append({k: np.array(v) for k, v in runner.infer(feed).items()})
        except Exception as e:  # noqa: BLE001 - verify() reports it as the reference failing
            answers.append(e.with_traceback(None))  # its frames would pin the session
    return Replay(feeds, answers)


def record_then_release(load: Callable[[], Runner],
                        feeds: Sequence[Mapping[str, np.ndarray]]) -> Replay:
    """Load a runner, record it on `feeds`, and drop it before returning: the caller holds
    only the outputs, and the session's memory is free for the next one."""
    runner = load()
    try:
        return record(runner, feeds)
    finally:
        runner.close()  # its session goes now, whatever still holds the runner
