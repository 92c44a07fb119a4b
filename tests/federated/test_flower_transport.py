"""memaudit's Flower transport behind one fence (`memaudit.federated.flower.transport`): one
`install` that refuses any Flower but the pinned one, patches exactly the names `PATCHES` lists,
and a bundle schema whose generated module is what its .proto file says."""

from __future__ import annotations

import builtins
import json
import re
import subprocess
import sys
from pathlib import Path

import flwr
import pytest

from memaudit.errors import ConfigError
from memaudit.federated.flower import transport
from memaudit.federated.flower.transport import PATCHES, PINNED_FLWR, FlowerVersionError, bundle_pb2
from tests.conftest import REPO_ROOT


def test_the_pin_is_the_flower_extras():
    """`PINNED_FLWR` is the version pyproject's flower extra installs."""
    text = (REPO_ROOT / "pyproject.toml").read_text()
    assert re.search(r'^flower = \["flwr==([^"]+)"', text, re.MULTILINE).group(1) == PINNED_FLWR == flwr.__version__


def test_another_flower_is_refused_in_one_line_before_anything_is_patched(monkeypatch, capsys):
    from flwr.superlink.servicer.fleet import fleet_handlers

    monkeypatch.setattr(flwr, "__version__", "1.43.0")
    monkeypatch.setattr(fleet_handlers, "pull_messages", fleet_handlers.pull_messages)  # restored after
    before = fleet_handlers.pull_messages
    with pytest.raises(FlowerVersionError) as e:
        transport.install("superlink")
    line = str(e.value)
    assert len(line.splitlines()) == 1 and "1.43.0" in line and "install flwr==1.42.0" in line
    assert fleet_handlers.pull_messages is before  # nothing patched
    from memaudit.federated.flower import superlink, supernode

    for main in (superlink.main, supernode.main):
        assert main(["--insecure"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"memaudit: error: {line}" and "Traceback" not in err


def test_a_layer_that_cannot_be_left_out_is_named(monkeypatch):
    monkeypatch.setattr(transport, "_off", set())  # this process's record, restored after
    with pytest.raises(ValueError, match=r"cannot leave out \['fab_guard'\]; the layers that may be off: short_waits"):
        transport.install("superlink", off=["fab_guard"])
    with pytest.raises(ValueError, match="no transport for 'worker'"):
        transport.install("worker")


_PROBE = """
import importlib, json, sys
from memaudit.federated.flower import transport
from memaudit.federated.flower.transport import PATCHES, resolve

def names(module):  # every name of the module, and of the classes it patches
    out = dict(vars(importlib.import_module(module)))
    for p in PATCHES:
        if p.module == module and "." in p.attribute:
            owner = resolve(p._replace(attribute=p.attribute.rsplit(".", 1)[0]))
            out.update({f"{p.attribute.rsplit('.', 1)[0]}.{k}": v for k, v in vars(owner).items()})
    return out

def extent(obj):  # what an extended name holds: its keys, or its routes' paths
    return sorted(map(str, obj)) if isinstance(obj, dict) else sorted(r.path for r in obj.routes)

before = {m: names(m) for m in {p.module for p in PATCHES}}
extents = {p: extent(resolve(p)) for p in PATCHES if p.kind == "extended"}
for component in transport.COMPONENTS:
    transport.install(component, fab_check=(lambda content: None) if component == "serverapp" else None)
    transport.install(component, fab_check=(lambda content: None) if component == "serverapp" else None)
after = {m: names(m) for m in before}
changed = sorted([m, k] for m in before for k in set(before[m]) | set(after[m])
                 if before[m].get(k) is not after[m].get(k))
print(json.dumps({"changed": changed,
                  "extended": {f"{p.module}:{p.attribute}": sorted(set(extent(resolve(p))) - set(old))
                               for p, old in extents.items()}}))
"""


def test_install_patches_exactly_the_listed_names():
    """In a fresh interpreter: every name `PATCHES` lists exists in the installed Flower; after
    `install` for every component (twice: idempotent), each "replaced" name holds a new object
    and no other name of those modules (or of the patched class) changed; each "extended" one is
    the same object with memaudit's entries added (the two bundle routes)."""
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300,
                         cwd=REPO_ROOT, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    replaced = sorted([p.module, p.attribute] for p in PATCHES if p.kind == "replaced")
    assert got["changed"] == replaced
    from memaudit.federated.flower.transport import bundle  # the routes' paths

    paths = sorted([bundle.PULL_PATH, bundle.PUSH_PATH])
    assert got["extended"] == {
        "flwr.supercore.protobuf.translation:PROTOBUF_REQUEST_TYPES": sorted(str(("POST", p)) for p in paths),
        "flwr.superlink.routers.fleet.router:router": paths}
    assert len({(p.module, p.attribute) for p in PATCHES}) == len(PATCHES)
    assert {p.layer for p in PATCHES} == set(transport.LAYERS)


def test_without_flower_the_transport_names_the_extra(monkeypatch):
    real = builtins.__import__

    def no_flwr(name, *a, **kw):
        if name == "flwr" or name.startswith("flwr."):
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **kw)

    for name in [m for m in sys.modules if m.startswith("memaudit.federated.flower.transport")]:
        monkeypatch.delitem(sys.modules, name)  # put back after the test
    monkeypatch.setattr(builtins, "__import__", no_flwr)
    with pytest.raises(ConfigError, match=r"install the extra: pip install 'memaudit\[flower\]'"):
        import memaudit.federated.flower.transport  # noqa: F401


_SCALARS = {"string": 9, "bytes": 12, "bool": 8, "int64": 3, "uint64": 4, "int32": 5, "double": 1, "float": 2}


def _proto_fields(text: str) -> tuple[str, list[str], dict[str, list[tuple]]]:
    """The package, imports and messages of a .proto file of plain messages: message name ->
    (field name, number, repeated, scalar type number or message type name)."""
    text = re.sub(r"//[^\n]*", "", text)
    package = re.search(r"^\s*package\s+([\w.]+)\s*;", text, re.MULTILINE).group(1)
    imports = re.findall(r'^\s*import\s+"([^"]+)"\s*;', text, re.MULTILINE)
    messages = {}
    for name, body in re.findall(r"message\s+(\w+)\s*\{([^}]*)\}", text):
        fields = []
        for rep, ftype, fname, number in re.findall(r"(repeated\s+)?([\w.]+)\s+(\w+)\s*=\s*(\d+)\s*;", body):
            kind = _SCALARS.get(ftype, ftype if "." in ftype else f"{package}.{ftype}")
            fields.append((fname, int(number), bool(rep), kind))
        messages[name] = fields
    return package, imports, messages


def test_the_generated_bundle_module_is_what_bundle_proto_says():
    """`bundle_pb2` (generated by scripts/gen_bundle_proto.py) against bundle.proto, read here
    with a parser of its own: the same package, imports, messages and fields (names, numbers,
    labels, types); and its gencode loads with the installed protobuf runtime (imported above)."""
    proto = Path(bundle_pb2.__file__).with_suffix("").with_name("bundle.proto")
    package, imports, messages = _proto_fields(proto.read_text())
    d = bundle_pb2.DESCRIPTOR
    assert d.name == "memaudit/federated/flower/transport/bundle.proto" and d.package == package == "memaudit.flower"
    assert [dep.name for dep in d.dependencies] == imports
    got = {}
    for name, m in d.message_types_by_name.items():
        got[name] = [(f.name, f.number, f.label == f.LABEL_REPEATED,
                      f.message_type.full_name if f.message_type is not None else f.type) for f in m.fields]
    assert got == messages
    assert set(messages) == {"BundledObject", "PullBundleResponse", "PushBundleRequest"}
