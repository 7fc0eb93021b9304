"""The artifact's manifest (docs/design.md contract): dataclasses, atomic write, validated read.

    OUT/manifest.json      this file's format
    OUT/variants/<name>/   one folder per variant graph (external data beside it)
    OUT/report.md, report.html, plots/

`tuner optimize` writes it; `tuner serve` reads it back through `read_manifest`, which treats
the file as untrusted input: every field is type-checked, every variant path must stay inside
OUT, and `selected` must name an exact variant whose accuracy gate passed. Problems raise
BadInput with the field's JSON path in the message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from tuner.errors import BadInput
from tuner.graph.paddable import Transform
from tuner.runtime.base import SessionSettings

FORMAT = "shapetuner-artifact"
VERSION = 1
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,79}$")
_SHAPE_KEY = re.compile(r"^([1-9][0-9]*)x([1-9][0-9]*)$")
_DECODE_KEY = re.compile(r"^([1-9][0-9]*)x1@([1-9][0-9]*)$")  # batch x 1 at past length


def shape_key(batch: int, seq: int) -> str:
    """The key of a measured shape in `latency` maps: "batch x seq", e.g. "1x128"."""
    return f"{int(batch)}x{int(seq)}"


def parse_shape_key(key: str) -> tuple[int, int]:
    m = _SHAPE_KEY.match(key)
    if not m:
        raise ValueError(f"shape key must look like '1x128' (batch x seq), not {key!r}")
    return int(m.group(1)), int(m.group(2))


def _finite_nonneg(name: str, x: float | None) -> None:
    if x is None:
        return
    if not isinstance(x, (int, float)) or isinstance(x, bool) or x != x or x < 0 or x == float("inf"):
        raise ValueError(f"{name} must be a finite number >= 0, not {x!r}")


@dataclass(frozen=True)
class Latency:
    """Timings of one (variant, shape) in milliseconds: median and spread over `n` runs."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    q1_ms: float
    q3_ms: float
    n: int

    def __post_init__(self) -> None:
        for k in ("median_ms", "p10_ms", "p90_ms", "q1_ms", "q3_ms"):
            _finite_nonneg(k, getattr(self, k))
        if not (self.p10_ms <= self.q1_ms <= self.median_ms <= self.q3_ms <= self.p90_ms):
            raise ValueError("latency percentiles must satisfy p10 <= q1 <= median <= q3 <= p90")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be a positive integer, not {self.n!r}")

    @property
    def spread_ms(self) -> float:
        """Interquartile range."""
        return self.q3_ms - self.q1_ms


@dataclass(frozen=True)
class Speedup:
    """Time(original) / time(variant): > 1 is faster. [low, high] is a bootstrap interval."""

    ratio: float
    low: float
    high: float
    confidence: float = 0.95

    def __post_init__(self) -> None:
        for k in ("ratio", "low", "high"):
            _finite_nonneg(k, getattr(self, k))
        if not (self.low <= self.ratio <= self.high):
            raise ValueError(f"speedup interval must contain the ratio: {self.low} <= "
                             f"{self.ratio} <= {self.high}")
        if not 0 < self.confidence < 1:
            raise ValueError("confidence must be in (0, 1)")


@dataclass(frozen=True)
class Accuracy:
    """The accuracy gate's verdict against the original on the same feeds."""

    passed: bool
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    detail: str = ""  # one line: tolerance used, worst output, or why it was not checked

    def __post_init__(self) -> None:
        if not isinstance(self.passed, bool):
            raise ValueError("accuracy.passed must be true or false")
        _finite_nonneg("max_abs_error", self.max_abs_error)
        _finite_nonneg("max_rel_error", self.max_rel_error)


@dataclass(frozen=True)
class Variant:
    name: str
    path: str  # relative to OUT, forward slashes
    exact: bool
    transforms: tuple[Transform, ...]
    shape: Mapping[str, Any]  # `tuner inspect --json` of this variant
    accuracy: Accuracy
    latency: Mapping[str, Latency] = field(default_factory=dict)  # shape key -> on `backend`
    speedup: Speedup | None = None  # over original, across the measured shapes
    speedup_by_shape: Mapping[str, Speedup] = field(default_factory=dict)
    note: str = ""
    # a decoder with a KV cache: decode steps (b x 1 against a cache of P), "1x1@128" keys;
    # `latency` then holds the prefill (b x s, past 0)
    latency_decode: Mapping[str, Latency] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"variant name must match {_NAME.pattern}, not {self.name!r}")
        _check_relative(self.path)
        if not isinstance(self.exact, bool):
            raise ValueError("exact must be true or false")
        for k in list(self.latency) + list(self.speedup_by_shape):
            parse_shape_key(k)
        for k in self.latency_decode:
            if not _DECODE_KEY.match(k):
                raise ValueError(f"decode shape key must look like '1x1@128' (batch x 1 at "
                                 f"past), not {k!r}")


def _check_relative(path: str) -> None:
    """A variant path must be relative and stay inside OUT (no '..', no absolute, no drive)."""
    if not isinstance(path, str) or not path:
        raise ValueError("path must be a non-empty string")
    p = Path(path)
    if p.is_absolute() or path.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", path):
        raise ValueError(f"path {path!r} must be relative to the artifact folder")
    if ".." in p.parts or "\\" in path:
        raise ValueError(f"path {path!r} must stay inside the artifact folder")


@dataclass(frozen=True)
class Advice:
    """A non-exact reshape (`--advise`): what a retrain would buy. Never selected or served."""

    name: str
    transforms: tuple[Transform, ...]
    speedup: Speedup
    note: str = ""
    exact: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"advice name must match {_NAME.pattern}, not {self.name!r}")
        if self.exact is not False:
            raise ValueError("advice is never exact")


@dataclass(frozen=True)
class ExpectedLatency:
    """Expected latency per request (ms) over the request distribution."""

    chosen_ms: float
    pad_to_max_ms: float
    no_buckets_ms: float

    def __post_init__(self) -> None:
        for k in ("chosen_ms", "pad_to_max_ms", "no_buckets_ms"):
            _finite_nonneg(k, getattr(self, k))


@dataclass(frozen=True)
class Buckets:
    batch: tuple[int, ...]
    seq: tuple[int, ...]
    expected: ExpectedLatency | None = None
    source: str = "default"  # the requests file, or "default"
    requests: int = 0  # how many requests the choice was made over
    past: tuple[int, ...] = ()  # cache-length buckets (decoders with a KV cache)

    def __post_init__(self) -> None:
        for k in ("batch", "seq", "past"):
            v = getattr(self, k)
            if k == "past" and not v:
                continue
            if not v or any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in v):
                raise ValueError(f"buckets.{k} must be a non-empty list of positive integers")
            if list(v) != sorted(set(v)):
                raise ValueError(f"buckets.{k} must be strictly increasing, not {list(v)}")


@dataclass(frozen=True)
class Manifest:
    source_path: str
    source_sha256: str
    device: Mapping[str, Any]  # what was measured on: tuner.hardware.detect.DeviceInfo.to_json()
    backend: str  # the backend `latency` was measured on and serve should use
    settings: Mapping[str, Any]  # SessionSettings, recorded as measured
    selected: str
    buckets: Buckets
    variants: tuple[Variant, ...]
    selection: str = ""  # why `selected` won (or why nothing beat the original)
    margin: float = 0.03
    notes: tuple[str, ...] = ()  # skipped backends, skipped probe, ...
    advice: tuple[Advice, ...] = ()  # --advise: non-exact reshapes, for a retrain
    version: int = VERSION
    # decoders with a KV cache (tuner.jobs.decoder): layers, kv heads, head dim, layout,
    # policy, original and served cache shapes; and the phases (prefill, decode) measured,
    # with the selection rule that weighs them
    cache: Mapping[str, Any] | None = None
    phases: Mapping[str, Any] | None = None
    # `--roles NAME=ROLE` overrides optimize ran with (tuner.graph.roles); serve applies them
    roles: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.device.get("name"), str) or not self.device.get("name"):
            raise ValueError("device must be an object with a non-empty 'name'")
        if not re.match(r"^[0-9a-f]{64}$", str(self.source_sha256)):
            raise ValueError("source.sha256 must be 64 lowercase hex digits")
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names):
            raise ValueError(f"variant names must be unique: {names}")
        if "original" not in names:
            raise ValueError("the variant 'original' must be present")
        if self.selected not in names:
            raise ValueError(f"selected {self.selected!r} is not one of the variants {names}")
        chosen = self.variant(self.selected)
        if not chosen.exact or not chosen.accuracy.passed:
            raise ValueError(f"selected variant {self.selected!r} must be exact and have passed "
                             "the accuracy gate")
        if self.version != VERSION:
            raise ValueError(f"manifest version {self.version} is not supported (expected {VERSION})")

    def variant(self, name: str) -> Variant:
        for v in self.variants:
            if v.name == name:
                return v
        raise KeyError(f"no variant named {name!r}; have {[v.name for v in self.variants]}")

    def selected_variant(self) -> Variant:
        return self.variant(self.selected)

    def session_settings(self, ignore_unknown: bool = False) -> SessionSettings:
        """The tuner.runtime.base.SessionSettings the latencies were measured with (serve
        runs with the same); BadInput if the recorded values are unusable. `ignore_unknown`
        skips keys this version does not know (a manifest from a newer tuner)."""
        known = {f.name for f in fields(SessionSettings)}
        given = {k: v for k, v in self.settings.items() if k in known or not ignore_unknown}
        try:
            return SessionSettings(**given)
        except (TypeError, ValueError) as e:
            raise BadInput(f"manifest: settings: {e} (not usable session settings)") from None

    @property
    def device_label(self) -> str:
        """A short name for the device: "AMD EPYC (2 cores)", "NVIDIA H100 (132 SMs)"."""
        d = self.device
        if d.get("kind") == "gpu" and d.get("sm_count"):
            return f"{d['name']} ({d['sm_count']} SMs)"
        if d.get("cpu_cores"):
            return f"{d['name']} ({d['cpu_cores']} cores)"
        return str(d["name"])
