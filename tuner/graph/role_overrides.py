"""`--roles NAME=ROLE`: the user's word on an input's role, for the inputs the structure
cannot decide, and the refusal when two inputs claim a role only one can hold.

`overriding` sets the overrides for one command; every `tuner.graph.roles.input_specs` inside
it applies them (the server keeps the artifact's for its lifetime).
"""

from __future__ import annotations

import contextlib
from typing import Mapping, Sequence

from tuner.errors import BadInput
from tuner.graph.role_names import ROLES, SINGULAR

OVERRIDE_HINT = "--roles NAME=ROLE overrides"
_OVERRIDES: dict[str, str] = {}  # NAME -> role, while `overriding` is in force


def parse_roles(items: Sequence[str]) -> dict[str, str]:
    """`--roles NAME=ROLE` values as {name: role}; BadInput on a malformed one."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, role = item.partition("=")
        name, role = name.strip(), role.strip()
        if not sep or not name or not role:
            raise BadInput(f"--roles {item!r}: expected NAME=ROLE (e.g. position_ids=position_ids)")
        if role not in ROLES:
            raise BadInput(f"--roles {item!r}: unknown role {role!r}; roles: {', '.join(ROLES)}")
        out[name] = role
    return out


@contextlib.contextmanager
def overriding(roles: Mapping[str, str] | None):
    """Within the block, every `input_specs` gives the inputs named in `roles` those roles."""
    saved = dict(_OVERRIDES)
    _OVERRIDES.clear()
    _OVERRIDES.update(roles or {})
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(saved)


def role_overrides() -> dict[str, str]:
    """The overrides in force (recorded in the artifact's manifest, so serve uses them)."""
    return dict(_OVERRIDES)


def with_overrides(roles: dict[str, str], names: list[str]) -> dict[str, str]:
    unknown = sorted(set(_OVERRIDES) - set(names))
    if unknown:
        raise BadInput(f"--roles names {', '.join(map(repr, unknown))}, which the model does not "
                       f"take; its inputs: {', '.join(names)}")
    return {**roles, **_OVERRIDES}


def checked(roles: dict[str, str]) -> dict[str, str]:
    """Refuse a graph in which two inputs claim a role only one can hold: feeding either
    alone would leave the other out, or fill it with the wrong values."""
    for role in SINGULAR:
        holders = [n for n, r in roles.items() if r == role]
        if len(holders) > 1:
            raise BadInput(f"inputs {' and '.join(map(repr, holders))} both look like the "
                           f"{role} to the graph's structure, and only one can be; "
                           f"{OVERRIDE_HINT} (e.g. --roles {holders[-1]}=other)")
    return roles
