"""A claim's measured value as text a person reads (metrics.json keeps the raw value).

    readable.measured({"drops": 0, "pause_frames_sent": 4518})  # 'drops 0, pause frames sent 4,518'
    readable.measured({"g0": 0.75, "g1": 0.75, "g2": 0.75})     # 'all 0.75 (g0, g1, g2)'
    readable.measured(12800, "bytes")                           # '12,800 bytes (12.5 KB)'

Claims measure numbers, named numbers (a dict: per variant, per host, per counter),
lists of them, and sentences the experiment already wrote; the unit, when the claim
has one, follows every number.
"""
from __future__ import annotations

import re

# the lab's protocol and transport names, spelled as the docs spell them when a dict
# key (a variant, a counter) carries one in lower case
ACRONYMS = {"rc": "RC", "mrc": "MRC", "ecn": "ECN", "pfc": "PFC", "ce": "CE",
            "cnps": "CNPs", "cnp": "CNP", "psns": "PSNs", "ev": "EV", "evs": "EVs"}
_WORD = re.compile(r"[a-z]+")
KB = 1024


def name(key: str) -> str:
    """A dict key as words: 'pause_frames_sent' -> 'pause frames sent', 'ecn+pfc' ->
    'ECN+PFC'."""
    return _WORD.sub(lambda m: ACRONYMS.get(m.group(), m.group()), str(key).replace("_", " "))


def number(value: int | float, unit: str = "") -> str:
    """Thousands separated, 4 significant digits, the unit after (bytes also in KB)."""
    if isinstance(value, float) and abs(value) < 10_000:
        text = f"{value:.4g}"
    else:
        text = f"{value:,.0f}"
    if not unit:
        return text
    if unit == "bytes" and abs(value) >= KB:
        return f"{text} bytes ({value / KB:.1f} KB)"
    return f"{text} {unit}"


def measured(value, unit: str = "") -> str:
    if value is None:
        return "not measured"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, (int, float)):
        return number(value, unit)
    if isinstance(value, (list, tuple)):
        return ", ".join(measured(v, unit) for v in value) or "none"
    if isinstance(value, dict):
        if not value:
            return "none"
        texts = [measured(v, unit) for v in value.values()]
        if len(value) > 2 and len(set(texts)) == 1:    # one value everywhere: say it once
            return f"all {texts[0]} ({', '.join(name(k) for k in value)})"
        # a list per key has commas of its own: keys apart by semicolons
        sep = "; " if any(isinstance(v, (list, tuple, dict)) for v in value.values()) else ", "
        return sep.join(f"{name(k)} {t}" for k, t in zip(value, texts))
    return str(value)


def verdict(claim: dict) -> str:
    """PASS, FAIL, or FAIL with the machine's load named (a starved claim)."""
    if claim["passed"]:
        return "PASS"
    return "FAIL (machine load)" if claim.get("starved") else "FAIL"


def claim_measured(claim: dict) -> str:
    """What a claim (as metrics.json holds it) measured, in its unit."""
    return measured(claim["measured"], claim.get("unit", ""))
