"""The names of the files a claim leaves: its CDI specs (`<vendor>-claim_<uid>.json`, the metadata
specs `<vendor>_metadata_<uid>_<request>.json`) and its metadata files
(`<metadata dir>/<uid>/<request>/metadata.json`). One place for the rules that make a name and read
one back, so the files, recovery and the record's roles agree; every name is keyed by the claim's UID,
so which claim owns a file is never a guess."""

from __future__ import annotations

import functools
import re

from cdi.atomic import TEMP_MARK, is_temp_name
from cdi.store import check_filename, transient_spec_name

METADATA_FILE_NAME = "metadata.json"  # of every host file: `<metadata dir>/<uid>/<base request>/metadata.json`
CLAIM_CLASS = "claim"
METADATA_CLASS = "metadata"
_UID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


def claim_spec_name(vendor: str, uid: str) -> str:
    return transient_spec_name(vendor, CLAIM_CLASS, uid)


def metadata_spec_name(vendor: str, uid: str, base_request: str) -> str:
    # `<vendor>_metadata_<uid>_<request>.json`: the name the device metadata contract gives.
    name = f"{vendor}_{METADATA_CLASS}_{uid}_{base_request}.json"
    check_filename(name)
    return name


@functools.lru_cache(maxsize=8)
def _owned_spec_pattern(vendor: str) -> re.Pattern[str]:
    v = re.escape(vendor)
    return re.compile(rf"(?:{v}-{CLAIM_CLASS}_(?P<a>{_UID})\.json"
                      rf"|{v}_{METADATA_CLASS}_(?P<b>{_UID})_[a-z0-9-]+\.json)")


_METADATA_SPEC = re.compile(rf".+_{METADATA_CLASS}_{_UID}_(?P<request>[a-z0-9-]+)\.json")


def metadata_spec_request(name: str) -> str | None:
    """The base request in the name of a metadata spec (`metadata_spec_name`, whatever its vendor); None
    for any other name."""
    m = _METADATA_SPEC.fullmatch(name)
    return m.group("request") if m else None


def claim_uid_of_spec(name: str, vendor: str) -> str | None:
    """The claim UID in the file name of one of the agent's per-claim specs, or of a temp file of
    one (an interrupted write); None for any other file. Ownership is never a guess."""
    if is_temp_name(name):
        name = name[1: name.index(TEMP_MARK)]
    m = _owned_spec_pattern(vendor).fullmatch(name)
    return (m.group("a") or m.group("b")) if m else None
