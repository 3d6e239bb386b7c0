"""Which study a silo's call is for: one aggregator hosts several studies.

Every call a silo makes for a named study carries the study's id in the gRPC metadata entry `STUDY_HEADER`;
a call without one is for the aggregator's default study (the one its consortium.toml defines), as every
call was before studies existed. The id only routes a call: the aggregator can relabel it like any label it
sends, so nothing a silo guarantees is keyed on it (`fedlt.aggregation.gate`).
"""

from __future__ import annotations

import re

STUDY_HEADER = "fedlt-study"  # gRPC metadata keys are lower case
DEFAULT_STUDY = "main"
ID_FORM = "1 to 40 lower-case letters, digits and dashes, starting with a letter or digit"
_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,39}")


def id_problems(study: str, where: str) -> list[str]:
    """Why `study` cannot name a study (it names a folder and a metadata value), or nothing."""
    if _ID.fullmatch(study):
        return []
    return [f"{where}: a study id is {ID_FORM}, such as 'readmission-2026'; got {study!r}"]


def study_of(metadata: object) -> str:
    """The study a call's metadata names ("" when it names none: the default study)."""
    for key, value in metadata or ():
        if key == STUDY_HEADER:
            return value if isinstance(value, str) else ""
    return ""
