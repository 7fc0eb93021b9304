"""The manifest as JSON, both directions: `manifest_to_json` writes the docs/design.md contract;
`manifest_from_json` reads it back from untrusted JSON, every field type-checked, every error
naming the field's JSON path (`variants[1].latency.1x64.n`)."""

from __future__ import annotations

from typing import Any

from tuner.artifact.records import (FORMAT, Accuracy, Advice, Buckets, ExpectedLatency, Latency,
                                    Manifest, Speedup, Variant)
from tuner.errors import BadInput
from tuner.graph.paddable import Transform

# ---------------------------------------------------------------------------------------------
# Writing


def _latency_json(x: Latency) -> dict[str, Any]:
    return {"median_ms": x.median_ms, "p10_ms": x.p10_ms, "q1_ms": x.q1_ms, "q3_ms": x.q3_ms,
            "p90_ms": x.p90_ms, "spread_ms": x.spread_ms, "n": x.n}


def _speedup_json(x: Speedup | None) -> dict[str, Any] | None:
    return None if x is None else {"ratio": x.ratio, "low": x.low, "high": x.high,
                                   "confidence": x.confidence}


def _variant_json(v: Variant) -> dict[str, Any]:
    return {
        "name": v.name, "path": v.path, "exact": v.exact,
        "transforms": [{"kind": t.kind, "from": t.old, "to": t.new} for t in v.transforms],
        "shape": dict(v.shape),
        "accuracy": {"passed": v.accuracy.passed, "max_abs_error": v.accuracy.max_abs_error,
                     "max_rel_error": v.accuracy.max_rel_error, "detail": v.accuracy.detail},
        "latency": {k: _latency_json(x) for k, x in v.latency.items()},
        "speedup": _speedup_json(v.speedup),
        "speedup_by_shape": {k: _speedup_json(x) for k, x in v.speedup_by_shape.items()},
        "note": v.note,
        **({"latency_decode": {k: _latency_json(x) for k, x in v.latency_decode.items()}}
           if v.latency_decode else {}),
    }


def manifest_to_json(m: Manifest) -> dict[str, Any]:
    e = m.buckets.expected
    return {
        "format": FORMAT, "version": m.version,
        "source": {"path": m.source_path, "sha256": m.source_sha256},
        "device": dict(m.device), "backend": m.backend, "settings": dict(m.settings),
        "selected": m.selected, "selection": m.selection, "margin": m.margin,
        "buckets": {
            "batch": list(m.buckets.batch), "seq": list(m.buckets.seq),
            "source": m.buckets.source, "requests": m.buckets.requests,
            **({"past": list(m.buckets.past)} if m.buckets.past else {}),
            "expected_latency": None if e is None else {
                "chosen_ms": e.chosen_ms, "pad_to_max_ms": e.pad_to_max_ms,
                "no_buckets_ms": e.no_buckets_ms},
        },
        "variants": [_variant_json(v) for v in m.variants],
        "advice": [{"name": a.name, "exact": False, "note": a.note,
                    "transforms": [{"kind": t.kind, "from": t.old, "to": t.new} for t in a.transforms],
                    "speedup": _speedup_json(a.speedup)} for a in m.advice],
        "notes": list(m.notes),
        **({"cache": dict(m.cache)} if m.cache is not None else {}),
        **({"phases": dict(m.phases)} if m.phases is not None else {}),
        **({"roles": dict(m.roles)} if m.roles else {}),
    }


# ---------------------------------------------------------------------------------------------
# Reading


class _Reader:
    """Typed field access on untrusted JSON; every error names the field's JSON path."""

    def __init__(self, obj: Any, where: str) -> None:
        if not isinstance(obj, dict):
            raise BadInput(f"manifest: {where or 'top level'} must be an object")
        self.obj, self.where = obj, where

    def _path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(self, key: str, types: type | tuple[type, ...], default: Any = ...,
            nullable: bool = False) -> Any:
        if key not in self.obj:
            if default is ...:
                raise BadInput(f"manifest: missing field {self._path(key)!r}")
            return default
        v = self.obj[key]
        if v is None and nullable:
            return None
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in _tuple(types)):
            raise BadInput(f"manifest: field {self._path(key)!r} has the wrong type "
                           f"({type(v).__name__})")
        return v

    def sub(self, key: str, default: Any = ...) -> "_Reader":
        return _Reader(self.get(key, dict, default), self._path(key))


def _tuple(t: type | tuple[type, ...]) -> tuple[type, ...]:
    return t if isinstance(t, tuple) else (t,)


_NUM = (int, float)


def _latency_from(r: _Reader) -> Latency:
    return Latency(r.get("median_ms", _NUM), r.get("p10_ms", _NUM), r.get("p90_ms", _NUM),
                   r.get("q1_ms", _NUM), r.get("q3_ms", _NUM), r.get("n", int))


def _speedup_from(r: _Reader | None) -> Speedup | None:
    if r is None:
        return None
    return Speedup(r.get("ratio", _NUM), r.get("low", _NUM), r.get("high", _NUM),
                   r.get("confidence", _NUM, 0.95))


def _transforms_from(r: _Reader) -> tuple[Transform, ...]:
    transforms = []
    for i, t in enumerate(r.get("transforms", list)):
        tr = _Reader(t, f"{r.where}.transforms[{i}]")
        transforms.append(Transform(tr.get("kind", str), tr.get("from", int, None, nullable=True),
                                    tr.get("to", int, None, nullable=True)))
    return tuple(transforms)


def _advice_from(r: _Reader) -> Advice:
    return Advice(r.get("name", str), _transforms_from(r), _speedup_from(r.sub("speedup")),
                  r.get("note", str, ""), r.get("exact", bool, False))


def _variant_from(r: _Reader) -> Variant:
    transforms = _transforms_from(r)
    a = r.sub("accuracy")
    lat = r.sub("latency", {})
    sbs = r.sub("speedup_by_shape", {})
    sp = r.get("speedup", dict, None, nullable=True)
    dec = r.sub("latency_decode", {})
    return Variant(
        name=r.get("name", str), path=r.get("path", str), exact=r.get("exact", bool),
        transforms=transforms, shape=r.get("shape", dict),
        accuracy=Accuracy(a.get("passed", bool), a.get("max_abs_error", _NUM, None, True),
                          a.get("max_rel_error", _NUM, None, True), a.get("detail", str, "")),
        latency={k: _latency_from(lat.sub(k)) for k in lat.obj},
        speedup=_speedup_from(None if sp is None else _Reader(sp, f"{r.where}.speedup")),
        speedup_by_shape={k: _speedup_from(sbs.sub(k)) for k in sbs.obj},
        note=r.get("note", str, ""),
        latency_decode={k: _latency_from(dec.sub(k)) for k in dec.obj},
    )


def _roles_from(roles: dict | None) -> dict[str, str] | None:
    """The manifest's role overrides, checked as `--roles` values are."""
    if roles is None:
        return None
    from tuner.graph.role_overrides import parse_roles

    if not all(isinstance(k, str) and isinstance(v, str) for k, v in roles.items()):
        raise BadInput("manifest: roles must map input names to role names")
    return parse_roles([f"{k}={v}" for k, v in roles.items()])


def manifest_from_json(obj: Any) -> Manifest:
    """Build and validate a Manifest from parsed JSON; BadInput naming the bad field."""
    r = _Reader(obj, "")
    if r.get("format", str) != FORMAT:
        raise BadInput(f"manifest: format must be {FORMAT!r}")
    src, b = r.sub("source"), r.sub("buckets")
    variants = []
    for i, v in enumerate(r.get("variants", list)):
        try:
            variants.append(_variant_from(_Reader(v, f"variants[{i}]")))
        except ValueError as e:
            raise BadInput(f"manifest: variants[{i}]: {e}") from None
    advice = []
    for i, a in enumerate(r.get("advice", list, [])):
        try:
            advice.append(_advice_from(_Reader(a, f"advice[{i}]")))
        except ValueError as e:
            raise BadInput(f"manifest: advice[{i}]: {e}") from None
    try:
        e = b.get("expected_latency", dict, None, nullable=True)
        er = None if e is None else _Reader(e, "buckets.expected_latency")
        buckets = Buckets(
            tuple(b.get("batch", list)), tuple(b.get("seq", list)),
            None if er is None else ExpectedLatency(er.get("chosen_ms", _NUM),
                                                    er.get("pad_to_max_ms", _NUM),
                                                    er.get("no_buckets_ms", _NUM)),
            b.get("source", str, "default"), b.get("requests", int, 0),
            tuple(b.get("past", list, [])))
        return Manifest(
            source_path=src.get("path", str), source_sha256=src.get("sha256", str),
            device=r.get("device", dict), backend=r.get("backend", str),
            settings=r.get("settings", dict), selected=r.get("selected", str),
            buckets=buckets, variants=tuple(variants), selection=r.get("selection", str, ""),
            margin=r.get("margin", _NUM, 0.03), notes=tuple(r.get("notes", list, [])),
            advice=tuple(advice),
            version=r.get("version", int),
            cache=r.get("cache", dict, None, nullable=True),
            phases=r.get("phases", dict, None, nullable=True),
            roles=_roles_from(r.get("roles", dict, None, nullable=True)))
    except ValueError as e:
        raise BadInput(f"manifest: {e}") from None
