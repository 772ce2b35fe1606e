"""Server-side apply of a ResourceClaim's `status.devices`, with per-manager ownership of its entries.

`status.devices` is a `listType=map` list keyed by driver, device, pool and shareID, so the API
server records in `metadata.managedFields` which field manager owns each entry. The emulator
keeps ownership per entry (the real server goes down to each field; drivers own their entries
whole, so the difference does not show):

- an apply by manager M (`application/apply-patch+yaml`, `fieldManager=M`) sets the entries it
  names and makes M an owner of them. An entry another manager owns with a different value
  is a conflict (409) unless `force=true`, which takes it over. Entries M owned before and
  no longer names lose M as owner, and are removed when nobody owns them any more. Entries
  of other managers are left as they are;
- any other write of the status (merge patch, PUT) makes its manager (`fieldManager`, else
  the client's name) the owner of the entries it added or changed, and drops the ownership of
  the entries it removed.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

from kubeapi_rules import ApiAnswer

APPLY = "application/apply-patch+yaml"
MAP_KEYS = ("device", "driver", "pool", "shareID")
Owners = dict[tuple[str, str], set[str]]  # (manager, operation) -> entry keys


def entry_key(entry: Mapping[str, Any]) -> str:
    """`k:{...}`, how managedFields names an entry of a map list."""
    return "k:" + json.dumps({k: entry[k] for k in MAP_KEYS if entry.get(k)}, sort_keys=True, separators=(",", ":"))


def owners(meta: Mapping[str, Any]) -> Owners:
    out: Owners = {}
    for mf in meta.get("managedFields") or []:
        if mf.get("subresource") != "status":
            continue
        keys = ((mf.get("fieldsV1") or {}).get("f:status") or {}).get("f:devices") or {}
        out[(mf["manager"], mf["operation"])] = set(keys)
    return out


def with_owners(meta: Mapping[str, Any], table: Owners, api_version: str, now: str) -> list[dict[str, Any]]:
    """managedFields with the status entries replaced by `table` (other entries kept)."""
    kept = [mf for mf in meta.get("managedFields") or [] if mf.get("subresource") != "status"]
    previous = {(mf["manager"], mf["operation"]): mf for mf in meta.get("managedFields") or []
                if mf.get("subresource") == "status"}
    for (manager, operation), keys in sorted(table.items()):
        if not keys:
            continue
        old = previous.get((manager, operation))
        fields = {"f:status": {"f:devices": {k: {".": {}} for k in sorted(keys)}}}
        same = old is not None and old.get("fieldsV1") == fields
        kept.append({"manager": manager, "operation": operation, "apiVersion": api_version,
                     "time": old["time"] if same and old else now, "fieldsType": "FieldsV1",
                     "fieldsV1": fields, "subresource": "status"})
    return kept


def _devices(obj: Mapping[str, Any]) -> list[dict[str, Any]]:
    status = obj.get("status")
    devices = status.get("devices") if isinstance(status, Mapping) else None
    return [dict(d) for d in devices or [] if isinstance(d, Mapping)]


def apply_devices(current: Mapping[str, Any], applied: Mapping[str, Any], manager: str,
                  force: bool) -> tuple[list[dict[str, Any]], Owners]:
    """status.devices and the owners after manager's apply of `applied` (the apply body)."""
    table = owners(current.get("metadata") or {})
    live = {entry_key(e): e for e in _devices(current)}
    mine = (manager, "Apply")
    new_entries = {entry_key(e): e for e in _devices(applied)}
    if len(new_entries) != len(_devices(applied)):
        raise ApiAnswer(422, "Invalid", "status.devices: Duplicate value: an entry is applied twice")
    conflicts = []
    for key, entry in new_entries.items():
        if key in live and live[key] != entry:
            for who, keys in table.items():
                if who != mine and key in keys:
                    if not force:
                        conflicts.append(f'conflict with "{who[0]}": .status.devices[{key}]')
                    keys.discard(key)  # forced (or about to fail): taken over
    if conflicts:
        raise ApiAnswer(409, "Conflict", f"Apply failed with {len(conflicts)} conflict(s): " + "; ".join(conflicts))
    for key in table.get(mine, set()) - new_entries.keys():
        if not any(key in keys for who, keys in table.items() if who != mine):
            live.pop(key, None)
    live.update(copy.deepcopy(new_entries))
    table[mine] = set(new_entries)
    return list(live.values()), table


def update_owners(current: Mapping[str, Any], new: Mapping[str, Any], manager: str) -> Owners:
    """The owners after a plain write (merge patch or PUT) of the status by `manager`."""
    table = owners(current.get("metadata") or {})
    before = {entry_key(e): e for e in _devices(current)}
    after = {entry_key(e): e for e in _devices(new)}
    changed = {k for k, e in after.items() if before.get(k) != e}
    for keys in table.values():
        keys.intersection_update(after.keys())
        keys.difference_update(changed)
    if changed:
        table.setdefault((manager, "Update"), set()).update(changed)
    return table


def check_apply_body(body: Any, api_version: str, kind: str, name: str, namespace: str | None) -> dict[str, Any]:
    if not isinstance(body, Mapping):
        raise ApiAnswer(400, "BadRequest", "error decoding YAML: the apply configuration is not an object")
    if body.get("apiVersion") != api_version or body.get("kind") != kind:
        raise ApiAnswer(400, "BadRequest", f"the apply configuration must name apiVersion {api_version} and kind "
                        f"{kind}, not {body.get('apiVersion')!r} and {body.get('kind')!r}")
    meta = body.get("metadata") or {}
    if meta.get("name") not in (None, name):
        raise ApiAnswer(400, "BadRequest", "the name of the object does not match the name on the URL")
    if meta.get("namespace") not in (None, namespace):
        raise ApiAnswer(400, "BadRequest", "the namespace of the provided object does not match the namespace "
                        "sent on the request")
    return dict(body)


def field_manager(params: Mapping[str, str], headers: Mapping[str, str], *, apply: bool) -> str:
    manager = params.get("fieldManager", "")
    if apply and not manager:
        raise ApiAnswer(422, "Invalid", 'PatchOptions.meta.k8s.io "" is invalid: fieldManager: Required value: '
                        "is required for apply patch", kind="PatchOptions", group="meta.k8s.io",
                        causes=[{"reason": "FieldValueRequired", "field": "fieldManager",
                                 "message": "Required value: is required for apply patch"}])
    if not apply and params.get("force"):
        raise ApiAnswer(422, "Invalid", 'PatchOptions.meta.k8s.io "" is invalid: force: Forbidden: may not be '
                        "specified for non-apply patch")
    return manager or headers.get("User-Agent", "unknown").split("/")[0]
