"""The committed stubs are exactly what `make protos` generates from protos/."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_committed_stubs_match_fresh_generation(tmp_path):
    _load_generator().generate(tmp_path / "proto")
    fresh = _tree(tmp_path / "proto")
    committed = _tree(ROOT / "kvfence" / "proto")
    assert sorted(fresh) == sorted(committed), "stub file set differs: run `make protos`"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale stubs {stale}: run `make protos` and commit kvfence/proto/"


def test_freshness_check_detects_a_changed_proto(tmp_path):
    """Control: the comparison above does see a proto change (so it cannot pass vacuously)."""
    gen = _load_generator()
    protos = tmp_path / "protos"
    import shutil

    shutil.copytree(ROOT / "protos", protos)
    common = protos / "kvfence" / "v1" / "common.proto"
    common.write_text(
        common.read_text().replace(
            "uint32 page_size = 1;", "uint32 page_size = 1;\n  uint32 extra = 99;"
        )
    )
    gen.PROTO_ROOT = protos
    gen.generate(tmp_path / "changed")
    changed = _tree(tmp_path / "changed")
    committed = _tree(ROOT / "kvfence" / "proto")
    assert changed["kvfence/v1/common_pb2.py"] != committed["kvfence/v1/common_pb2.py"]
    imports = changed["kvfence/v1/client_pb2.py"].decode()
    assert "from kvfence.proto.kvfence.v1 import common_pb2" in imports


def test_stubs_import_inside_the_package():
    from kvfence.proto.kvfence.v1 import client_pb2_grpc, decode_pb2_grpc

    assert hasattr(client_pb2_grpc, "GenerationStub")
    assert hasattr(decode_pb2_grpc, "DecodeServicer")
