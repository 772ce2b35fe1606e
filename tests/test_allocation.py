"""Claims of the wrong shape are a precise `ClaimError` naming the field, never a crash
(issue 6, item 8): one test per shape for the exact message, a property test that splices
arbitrary JSON/YAML values into every position of a valid claim, and the message as the
kubelet sees it through the prepare engine."""

from __future__ import annotations

import copy
import datetime
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from agentkit import DRIVER, NODE, make_node
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.claims.allocation import Allocation, decode_config, parse_claim
from agent.claims.metadata import POD_CLAIM_NAME
from agent.errors import ClaimError
from agent.kinds import Kind
from agent.model import Device
from agent.names import ClaimRef

UID = "5b0e3f0a-0000-4000-8000-000000000001"
REF = ClaimRef("team-a", "train-0-gpu", UID)
DEVICES = {name: Device(name=name, kind=Kind.GPU) for name in ("gpu-0", "gpu-1")}
RESULTS = "status.allocation.devices.results"
CONFIG = "status.allocation.devices.config"
PARAMS = f"{CONFIG}[0].opaque.parameters"
AT_RESULTS = ("status", "allocation", "devices", "results")
AT_CONFIG = ("status", "allocation", "devices", "config")

Path_ = tuple[str | int, ...]


def valid_claim() -> dict[str, Any]:
    """A claim that uses every field parse_claim reads, so every one of them can be broken."""
    def params(env: dict[str, Any]) -> dict[str, Any]:
        return {"apiVersion": f"{DRIVER}/v1alpha1", "kind": "DeviceConfig", "env": env}

    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": REF.name, "namespace": REF.namespace, "uid": UID,
                     "annotations": {POD_CLAIM_NAME: "gpu", "other": "x"}},
        "spec": {"devices": {"requests": [{"name": "gpu"}]}},
        "status": {"allocation": {"devices": {
            "results": [
                {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0", "shareID": "s-1"},
                {"request": "gpu/h100", "driver": DRIVER, "pool": NODE, "device": "gpu-1"},
                {"request": "nic", "driver": "other.example.com", "pool": "p", "device": "eth0"}],
            "config": [
                {"source": "FromClaim", "requests": ["gpu"],
                 "opaque": {"driver": DRIVER, "parameters": params({"MODE": "claim"})}},
                {"source": "FromClass", "opaque": {"driver": DRIVER, "parameters": params({"MODE": "class"})}},
                {"source": "FromClaim", "opaque": {"driver": "other.example.com", "parameters": [1]}}]}}},
    }


def parse(obj: Any) -> Allocation:
    return parse_claim(obj, REF, driver=DRIVER, pool=NODE, lookup=DEVICES.get)


def paths(value: Any, prefix: Path_ = ()) -> list[Path_]:
    """Every position in a document, the root included."""
    out = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            out += paths(child, (*prefix, key))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            out += paths(child, (*prefix, i))
    return out


def spliced(doc: Any, path: Path_, value: Any) -> Any:
    """`doc` with `value` at `path`; only the containers on the path are copied, the rest is shared
    (parse_claim never writes to the claim). The root path replaces the whole document."""
    if not path:
        return value
    top = copy.copy(doc)
    parent = top
    for step in path[:-1]:
        parent[step] = copy.copy(parent[step])
        parent = parent[step]
    parent[path[-1]] = value
    return top


def test_the_valid_claim_parses() -> None:
    alloc = parse(valid_claim())
    assert alloc.pod_claim_name == "gpu"
    assert [(a.request, a.device.name, a.share_id) for a in alloc.devices] == [
        ("gpu", "gpu-0", "s-1"), ("gpu/h100", "gpu-1", "")]
    # Class configuration first, the claim's own after it and winning.
    assert alloc.config_env == {"gpu-0": {"MODE": "claim"}, "gpu-1": {"MODE": "claim"}}


# -- each shape, its exact message --------------------------------------------------------------

BAD_SHAPES: list[tuple[Path_, Any, str]] = [
    ((), ["a", "list"], "the claim must be an object, not list"),
    ((), None, "the claim must be an object, not null"),
    (("metadata",), ["name"], "metadata must be an object, not list"),
    (("metadata",), "team-a/train-0-gpu", "metadata must be an object, not str"),
    (("metadata", "name"), 5, "metadata.name must be a string, not int"),
    (("metadata", "namespace"), ["team-a"], "metadata.namespace must be a string, not list"),
    (("metadata", "uid"), 1234, "metadata.uid must be a string, not int"),
    (("metadata", "annotations"), ["x"], "metadata.annotations must be an object, not list"),
    (("metadata", "annotations", POD_CLAIM_NAME), 7,
     f"metadata.annotations['{POD_CLAIM_NAME}'] must be a string, not int"),
    (("status",), "allocated", "status must be an object, not str"),
    (("status", "allocation"), [{"devices": {}}], "status.allocation must be an object, not list"),
    (("status", "allocation", "devices"), [], "status.allocation.devices must be an object, not list"),
    (AT_RESULTS, "gpu-0", f"{RESULTS} must be a list, not str"),
    (AT_RESULTS, {"gpu": "gpu-0"}, f"{RESULTS} must be a list, not object"),
    ((*AT_RESULTS, 0), None, f"{RESULTS}[0] must be an object, not null"),
    ((*AT_RESULTS, 1), ["gpu-1"], f"{RESULTS}[1] must be an object, not list"),
    ((*AT_RESULTS, 0, "driver"), None,
     f"{RESULTS}[0].driver must be a string, not null"),
    ((*AT_RESULTS, 0, "request"), 0, f"{RESULTS}[0].request must be a string, not int"),
    ((*AT_RESULTS, 0, "device"), 0.5,
     f"{RESULTS}[0].device must be a string, not float"),
    ((*AT_RESULTS, 0, "device"), None,
     f"{RESULTS}[0].device must be a string, not null"),
    ((*AT_RESULTS, 0, "pool"), True, f"{RESULTS}[0].pool must be a string, not bool"),
    ((*AT_RESULTS, 0, "shareID"), 12, f"{RESULTS}[0].shareID must be a string, not int"),
    (AT_CONFIG, {"opaque": {}}, f"{CONFIG} must be a list, not object"),
    ((*AT_CONFIG, 2), "FromClass", f"{CONFIG}[2] must be an object, not str"),
    ((*AT_CONFIG, 1), None, f"{CONFIG}[1] must be an object, not null"),
    ((*AT_CONFIG, 0, "source"), ["FromClass"],
     f"{CONFIG}[0].source must be a string, not list"),
    ((*AT_CONFIG, 0, "requests"), "gpu",
     f"{CONFIG}[0].requests must be a list, not str"),
    ((*AT_CONFIG, 0, "requests"), ["gpu", 3],
     f"{CONFIG}[0].requests[1] must be a string, not int"),
    ((*AT_CONFIG, 0, "opaque"), [DRIVER], f"{CONFIG}[0].opaque must be an object, not list"),
    ((*AT_CONFIG, 2, "opaque", "driver"), 1,
     f"{CONFIG}[2].opaque.driver must be a string, not int"),
    ((*AT_CONFIG, 0, "opaque", "parameters"), ["env"],
     f"{PARAMS} must be an object, not list"),
    ((*AT_CONFIG, 0, "opaque", "parameters"), None,
     f"{PARAMS} must be an object, not null"),
    ((*AT_CONFIG, 0, "opaque", "parameters", "env"), "MODE=x",
     f"{PARAMS}.env must be an object of strings, not str"),
    ((*AT_CONFIG, 0, "opaque", "parameters", "env"), {"MODE": None},
     f"{PARAMS}.env['MODE'] must be a string, not null"),
    ((*AT_CONFIG, 0, "opaque", "parameters", "env"), {1: "x"},
     f"{PARAMS}.env: name '1' is not a valid variable name"),
    ((*AT_CONFIG, 0, "opaque", "parameters", "kind"), ["DeviceConfig"],
     f"{PARAMS}.kind must be 'DeviceConfig', 'NetworkConfig' or 'VfioConfig', not ['DeviceConfig']"),
    ((*AT_CONFIG, 0, "opaque", "parameters", 7), "x",
     f"{PARAMS}: unknown field(s) '7'"),
]


@pytest.mark.parametrize(("path", "value", "message"), BAD_SHAPES,
                         ids=[f"{'.'.join(map(str, p)) or 'claim'}={type(v).__name__}" for p, v, _ in BAD_SHAPES])
def test_each_wrong_shape_has_its_exact_message(path: Path_, value: Any, message: str) -> None:
    with pytest.raises(ClaimError) as caught:
        parse(spliced(valid_claim(), path, value))
    assert str(caught.value) == message


@pytest.mark.parametrize("path", [
    ("metadata", "annotations"), AT_RESULTS,
    AT_CONFIG, (*AT_CONFIG, 0, "requests"),
    (*AT_CONFIG, 0, "source"),
    (*AT_RESULTS, 0, "shareID"),
    (*AT_CONFIG, 0, "opaque", "parameters", "env"),
])
def test_null_is_absent_where_a_field_is_optional(path: Path_) -> None:
    # The API server drops nulls; an offline claim written with them means the same thing.
    assert isinstance(parse(spliced(valid_claim(), path, None)), Allocation)


@pytest.mark.parametrize(("path", "message"), [
    (("status",), "the claim is not allocated"),
    (("status", "allocation"), "the claim is not allocated"),
    (("metadata",), "the claim source returned team-a/None, not team-a/train-0-gpu"),
    (("metadata", "uid"), "UID mismatch: the claim has UID None"),
])
def test_null_where_a_field_is_required_is_the_error_of_its_absence(path: Path_, message: str) -> None:
    with pytest.raises(ClaimError, match=f"^{message}"):
        parse(spliced(valid_claim(), path, None))


def test_decode_config_names_its_position() -> None:
    with pytest.raises(ClaimError, match=r"^parameters\.env\['A'\] must be a string, not list$"):
        decode_config({"apiVersion": f"{DRIVER}/v1alpha1", "kind": "DeviceConfig", "env": {"A": []}}, DRIVER)
    with pytest.raises(ClaimError, match=r"^parameters: unknown field\(s\) '1', 'x'$"):
        decode_config({1: 0, "x": 0, "kind": "DeviceConfig"}, DRIVER)


# -- any value anywhere ---------------------------------------------------------------------------

# Mostly constants, which are cheap to draw (the property must stay fast): values that get a broken
# claim past the early checks into the later ones, every JSON type, and what a YAML file can hold
# besides JSON (timestamps, binary, non-string keys).
SCALARS = st.one_of(
    st.sampled_from([None, True, False, 0, -1, 7, 10**30, 1.5, -0.0, float("nan"), float("inf"),
                     "", "gpu", "gpu-0", "gpu/h100", "a/b/c", "GPU", DRIVER, NODE, UID, REF.name, REF.namespace,
                     "FromClass", "DeviceConfig", f"{DRIVER}/v1alpha1", "DRA_X", "MODE", "x" * 300, "\x00",
                     datetime.datetime(2024, 1, 1, 12), datetime.date(2024, 1, 1), b"\xff"]),
    st.text(max_size=3), st.integers(),
)
KEYS = st.one_of(st.sampled_from(["env", "apiVersion", "kind", "driver", "name", "MODE", "", 1, None, True]),
                 st.text(max_size=3))
SHALLOW = st.one_of(SCALARS, st.lists(SCALARS, max_size=2), st.dictionaries(KEYS, SCALARS, max_size=2))
# Up to three levels: enough for a whole results list or config entry of the wrong shape inside.
VALUES = st.one_of(SHALLOW, st.lists(SHALLOW, max_size=2), st.dictionaries(KEYS, SHALLOW, max_size=2))
# Any value at one position, and maybe a scalar at a second (a foreign result made ours, then broken).
SPLICES = st.tuples(st.tuples(st.sampled_from(paths(valid_claim())), VALUES),
                    st.none() | st.tuples(st.sampled_from(paths(valid_claim())), SCALARS))
BASE = valid_claim()
EXAMPLES = 2500
examples_run: list[None] = []


@settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(SPLICES)
def any_value_at_any_position(splices: tuple[tuple[Path_, Any], tuple[Path_, Any] | None]) -> None:
    examples_run.append(None)
    doc: Any = BASE
    for path, value in filter(None, splices):
        try:
            doc = spliced(doc, path, value)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier splice replaced the container this position was in
    try:
        got = parse(doc)
    except ClaimError as exc:
        assert str(exc) and "Error" not in str(exc)  # a sentence, not an exception's repr
    else:
        assert isinstance(got, Allocation)
        assert all(a.device is DEVICES[a.device.name] for a in got.devices)
        assert all(isinstance(k, str) and isinstance(v, str) for env in got.config_env.values()
                   for k, v in env.items())
    assert valid_claim() == BASE  # splicing copies: every example starts from the valid claim


def test_any_value_at_any_position_parses_or_is_a_claim_error() -> None:
    # Run here rather than collected directly, so the same run proves its size and its speed.
    examples_run.clear()
    started = time.monotonic()
    any_value_at_any_position()
    assert len(examples_run) >= 2000
    assert time.monotonic() - started < 20


def test_yaml_types_do_not_confuse_messages() -> None:
    with pytest.raises(ClaimError, match=r"results\[0\]\.device must be a string, not datetime$"):
        parse(spliced(valid_claim(), (*AT_RESULTS, 0, "device"),
                      datetime.datetime(2024, 1, 1)))


# -- through the engine: what the kubelet is told ---------------------------------------------------

def offline(path: Path_, value: Any) -> dict[str, Any]:
    """A claim for the engine's node (claim default/c) with `value` spliced in at `path`."""
    doc = spliced(valid_claim(), ("metadata",), {"name": "c", "namespace": "default", "uid": UID})
    return spliced(doc, path, value)


@pytest.mark.parametrize(("path", "value", "message"), [
    (("metadata",), ["a", "b"], "metadata must be an object, not list"),
    (("metadata", "annotations"), ["x"], "metadata.annotations must be an object, not list"),
    (AT_RESULTS, "gpu-0", f"{RESULTS} must be a list, not str"),
    ((*AT_RESULTS, 0, "device"), 0, f"{RESULTS}[0].device must be a string, not int"),
    ((*AT_CONFIG, 1, "opaque"), [DRIVER], f"{CONFIG}[1].opaque must be an object, not list"),
])
async def test_an_offline_claim_of_the_wrong_shape_is_a_precise_error(tmp_path: Path, path: Path_, value: Any,
                                                                      message: str) -> None:
    node = await make_node(tmp_path)
    (node.claims_dir / "default").mkdir(parents=True)
    (node.claims_dir / "default" / "c.yaml").write_text(yaml.safe_dump(offline(path, value)))
    (res,) = (await node.engine.prepare([ClaimRef("default", "c", UID)])).values()
    assert res.error == f"claim default/c ({UID}): {message}"
    assert node.engine.records == {}


def test_a_loaded_yaml_claim_is_what_the_splices_model() -> None:
    # The property feeds parse_claim values a YAML file can hold; check the loader agrees.
    doc = yaml.safe_load("a: 2024-01-01\nb: !!binary aGk=\n1: x\n")
    assert doc == {"a": datetime.date(2024, 1, 1), "b": b"hi", 1: "x"}
