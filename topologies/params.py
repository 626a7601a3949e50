"""Parameters from text, in one place: `--set key=value` for an experiment, a
topology or the queues (`fabriclab run`, lab/runner.py; `verify` and `up`, lab/cli.py)
and keyword values given to the topology registry all turn into typed values here."""
from __future__ import annotations

TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")


class ParamError(ValueError):
    """A parameter is out of range or not of its type; the message names it."""


def key_value(item: str) -> tuple[str, str]:
    """One `--set` item, "key=value", as (key, value); a key's dashes are underscores
    (`hosts-per-leaf=4` is `hosts_per_leaf`)."""
    if "=" not in item:
        raise ParamError(f"--set takes key=value, got {item!r}")
    key, value = item.split("=", 1)
    return key.strip().replace("-", "_"), value


def parse_value(key: str, value, ftype):
    """`value` (text, or already a value) as a dataclass field of type `ftype` (a type
    or its name, as `from __future__ import annotations` leaves it) wants it."""
    kind = ftype if isinstance(ftype, type) else {"int": int, "float": float, "str": str,
                                                  "bool": bool}.get(str(ftype), str)
    try:
        if not isinstance(value, str):
            return kind(value) if kind in (int, float) else value
        if kind is bool:
            if value.lower() not in TRUE + FALSE:
                raise ValueError
            return value.lower() in TRUE
        return kind(value)
    except ValueError:
        raise ParamError(f"{key}: expected {kind.__name__}, got {value!r}") from None
