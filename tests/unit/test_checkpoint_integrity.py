"""megatron.checkpoint.integrity: the manifest lists every file with hashlib's SHA-256, and a
changed, missing or unlisted-manifest folder is refused in one line naming the file."""

import hashlib
import json
import os

import pytest

from megatron.checkpoint import integrity
from megatron.checkpoint.layout import CheckpointError


def _folder(tmp_path):
    root = tmp_path / "iter_0000005"
    (root / "mp_rank_00").mkdir(parents=True)
    (root / "mp_rank_00" / "model_optim_rng.pt").write_bytes(bytes(range(256)) * 50)
    (root / "common.pt").write_bytes(b"common")
    return str(root)


def test_manifest_matches_hashlib(tmp_path):
    folder = _folder(tmp_path)
    integrity.write_manifest(folder)
    manifest = json.load(open(os.path.join(folder, "integrity.json")))
    want = {rel: hashlib.sha256(open(os.path.join(folder, rel), "rb").read()).hexdigest()
            for rel in ("common.pt", "mp_rank_00/model_optim_rng.pt")}
    assert manifest == {"algorithm": "sha256", "files": want}
    integrity.verify(folder)  # intact: no error


def test_one_changed_byte_is_named(tmp_path):
    folder = _folder(tmp_path)
    integrity.write_manifest(folder)
    path = os.path.join(folder, "mp_rank_00", "model_optim_rng.pt")
    data = bytearray(open(path, "rb").read())
    data[1234] ^= 0x80
    open(path, "wb").write(bytes(data))
    with pytest.raises(CheckpointError) as err:
        integrity.verify(folder)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{os.path.abspath(folder)}: checkpoint integrity check failed")
    assert "1 file(s): mp_rank_00/model_optim_rng.pt: sha256 mismatch" in message
    assert "common.pt" not in message


def test_missing_file_and_manifest(tmp_path):
    folder = _folder(tmp_path)
    with pytest.raises(CheckpointError, match=r"integrity.json: missing"):
        integrity.verify(folder)
    integrity.write_manifest(folder)
    os.remove(os.path.join(folder, "common.pt"))
    with pytest.raises(CheckpointError, match=r"common.pt: missing or unreadable"):
        integrity.verify(folder)


def test_foreign_algorithm_refused(tmp_path):
    folder = _folder(tmp_path)
    with open(os.path.join(folder, "integrity.json"), "w") as f:
        json.dump({"algorithm": "md5", "files": {}}, f)
    with pytest.raises(CheckpointError, match=r"hash algorithm 'md5', expected 'sha256'"):
        integrity.verify(folder)
