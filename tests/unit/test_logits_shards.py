"""Teacher-logits tars against Megatron-LM's layout, written and read independently here.

Megatron-LM's cached-logits tars (megatron/training/distillation/ in its source): per
data-parallel rank ``dp{D}__{start}-{end}.tar`` whose first member ``_meta.json`` holds the
dataset hash and the saver's settings, then one ``{s}-{s+G}.pt.zst`` member per iteration: zstd
of a ``torch.save`` dict ``values`` ``[seq, G/dp, K]``, ``indices_low`` uint16, ``bit_17`` the ids'
17th bits packed MSB-first, ``format_version`` 2; row ``r`` of rank ``D`` is global sample
``s + ((r // M) * dp + D) * M + r % M``. Its first layout (format 1): ``cp0_dp{D}__{I}.tar``,
members ``{i}.pt.zst``, lists of per-micro-batch tensors, ``bit_17`` as bool. The writers and
readers below follow that description with tarfile, zstandard, torch.save and a bit loop; they
never call the project's own."""

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from types import SimpleNamespace

import pytest
import torch

from megatron.training.distillation import logits_files as lf
from megatron.training.distillation import shards
from megatron.training.distillation.logits_files import LogitsFileError

zstandard = pytest.importorskip("zstandard")


# ---- an independent writer and reader ------------------------------------------------------

def _pack_bits_msb_first(bits):
    out = bytearray((len(bits) + 7) // 8)
    for n, bit in enumerate(bits):
        if bit:
            out[n // 8] |= 0x80 >> (n % 8)
    return torch.tensor(list(out), dtype=torch.uint8)


def _unpack_bits_msb_first(packed, count):
    data = bytes(packed.tolist())
    return [(data[n // 8] >> (7 - n % 8)) & 1 for n in range(count)]


def _tar(path, members):
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _zst(payload):
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return zstandard.ZstdCompressor(level=1).compress(buffer.getvalue())


def _meta(saver, hash_="h"):
    return json.dumps({"hash": hash_, "identifiers": {}, "saver": saver}).encode()


def _teacher_rows(seq, rows, k, vocab, seed):
    """Megatron-style saved top-K: sorted log-probabilities, ids up to 17 bits, and a top-p
    tail of sentinel entries (-1e3, id -1) in some rows."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.log_softmax(torch.randn(seq, rows, vocab, generator=gen), -1)
    values, ids = torch.topk(values, k, dim=-1)
    values, ids = values.clone(), ids.clone()
    values[:, ::2, k - 1] = -1e3
    ids[:, ::2, k - 1] = -1
    return values.half(), ids


def _write_megatron_v2(root, *, mbs, dp, gbs, iterations, seq, k, vocab, per_tar=2):
    """Megatron-LM's format 2, ``per_tar`` iterations a tar; {global position: (values, ids)}."""
    saved = {}
    saver = {"k": k, "p": None, "min_k": 1, "save_dtype": "fp16", "format_version": 2,
             "mbs_save": mbs, "dp_size_save": dp, "gbs_save": gbs}
    rows = gbs // dp
    for d in range(dp):
        members = []
        for it in range(iterations):
            values, ids = _teacher_rows(seq, rows, k, vocab, seed=100 * d + it)
            for r in range(rows):
                pos = it * gbs + ((r // mbs) * dp + d) * mbs + r % mbs
                saved[pos] = (values[:, r], ids[:, r])
            high = [int(i) >> 16 & 1 for i in ids.reshape(-1).tolist()]
            payload = {"values": values, "indices_low": (ids & 0xFFFF).to(torch.uint16),
                       "bit_17": _pack_bits_msb_first(high), "format_version": 2}
            members.append((f"{it * gbs}-{(it + 1) * gbs}.pt.zst", _zst(payload)))
        for first in range(0, iterations, per_tar):
            chunk = members[first:first + per_tar]
            last = min(first + per_tar, iterations)
            _tar(os.path.join(root, f"dp{d}__{first * gbs}-{last * gbs}.tar"),
                 [("_meta.json", _meta(saver))] + chunk)
    return saved


def _expected(values, ids, seq):
    values, ids = values[:seq].float(), ids[:seq].clone()
    dropped = values <= -1e3
    ids[dropped] = -1
    return values, ids


@pytest.mark.parametrize("dp_load,mbs_load", [(1, 1), (2, 3), (5, 2)])
def test_tars_megatron_writes_are_read_for_any_student_layout(tmp_path, dp_load, mbs_load):
    vocab = 70000     # ids past 65535 use the 17th bit
    saved = _write_megatron_v2(str(tmp_path), mbs=2, dp=3, gbs=12, iterations=4, seq=6, k=4,
                               vocab=vocab)
    reader = shards.TeacherReader(shards.ShardSet(str(tmp_path), None), 6, vocab, 2, 1)
    assert any(int(i.max()) > 65535 for _, i in saved.values())
    # a student of another data-parallel / micro-batch size walks the same positions
    for start in range(0, 48 - dp_load * mbs_load + 1, dp_load * mbs_load):
        for d in range(dp_load):
            positions = [start + d * mbs_load + j for j in range(mbs_load)]
            values, ids = reader.get(positions)
            for row, pos in enumerate(positions):
                ref_values, ref_ids = _expected(*saved[pos], 6)
                assert torch.equal(ids[row], ref_ids)
                assert torch.equal(values[row], ref_values)


def test_longer_teacher_sequences_are_trimmed_shorter_refused(tmp_path):
    saved = _write_megatron_v2(str(tmp_path), mbs=1, dp=1, gbs=2, iterations=1, seq=8, k=3,
                               vocab=40)
    reader = shards.TeacherReader(shards.ShardSet(str(tmp_path), None), 5, 40, 1, 0)
    with pytest.warns(UserWarning, match="trimmed to this run's 5"):
        values, ids = reader.get([1])
    assert torch.equal(ids[0], _expected(*saved[1], 5)[1]) and values.shape[1] == 5
    longer = shards.TeacherReader(shards.ShardSet(str(tmp_path), None), 9, 40, 1, 0)
    with pytest.raises(LogitsFileError, match=r"dp0__0-2\.tar member 0-2\.pt\.zst: teacher "
                                              r"sequences of 8 tokens.*--seq-length is 9"):
        longer.get([0])


def test_first_megatron_layout_is_read(tmp_path):
    """Format 1: cp0_dp{D}__{last iteration}.tar, members by iteration, per-micro-batch lists,
    bool 17th bits; its _meta.json has no layout fields (inferred from the files)."""
    mbs, dp, gbs, seq, k, vocab = 2, 2, 8, 4, 3, 70000
    saved = {}
    for d in range(dp):
        members = []
        for it in range(3):
            values, ids = _teacher_rows(seq, gbs // dp, k, vocab, seed=7 * d + it)
            for r in range(gbs // dp):
                saved[it * gbs + ((r // mbs) * dp + d) * mbs + r % mbs] = (values[:, r],
                                                                           ids[:, r])
            chunks = list(range(0, gbs // dp, mbs))
            payload = {"values": [values[:, c:c + mbs] for c in chunks],
                       "indices_low": [(ids[:, c:c + mbs] & 0xFFFF).to(torch.uint16)
                                       for c in chunks],
                       "bit_17": [(ids[:, c:c + mbs] >> 16).bool() for c in chunks]}
            members.append((f"{it}.pt.zst", _zst(payload)))
        meta = ("_meta.json", _meta({"k": k, "p": None, "min_k": 1, "save_dtype": "fp16"}))
        _tar(str(tmp_path / f"cp0_dp{d}__1.tar"), [meta] + members[:2])
        _tar(str(tmp_path / f"cp0_dp{d}__2.tar"), [meta] + members[2:])
    reader = shards.TeacherReader(shards.ShardSet(str(tmp_path), None), seq, vocab, 1, 2)
    for pos in range(24):
        values, ids = reader.get([pos])
        ref_values, ref_ids = _expected(*saved[pos], seq)
        assert torch.equal(ids[0], ref_ids) and torch.equal(values[0], ref_values)


# ---- what this project writes, read back independently ------------------------------------

def _args(**overrides):
    args = dict(seed=1234, train_samples=None, train_iters=3, global_batch_size=4,
                data_path=None, train_data_path=None, valid_data_path=None,
                test_data_path=None, logits_save_top_k=3, logits_save_top_p=0.5,
                logits_save_top_p_min_k=1, logits_save_dtype="bf16", micro_batch_size=1)
    args.update(overrides)
    return SimpleNamespace(**args)


def test_saved_tars_have_megatrons_bytes(tmp_path):
    mbs, dp, gbs, seq, vocab = 1, 2, 4, 3, 70000
    args = _args(global_batch_size=gbs, micro_batch_size=mbs)
    meta = lf.meta_bytes(args, dp)
    logits, expected = {}, {}
    for d in range(dp):
        writer = shards.TeacherWriter(str(tmp_path), meta, d, dp, mbs, gbs)
        for m in range(gbs // (mbs * dp)):
            pos = m * dp + d
            logits[pos] = torch.randn(1, seq, vocab, generator=torch.Generator().manual_seed(pos))
            values, ids = lf.top_logprobs(logits[pos], 3, 0.5, 1)
            expected[pos] = (values[0].to(torch.bfloat16), ids[0])
            writer.add(values.to(torch.bfloat16), ids, [pos])
    assert sorted(os.listdir(tmp_path)) == ["dp0__0-4.tar", "dp1__0-4.tar"]
    for d in range(dp):
        with tarfile.open(tmp_path / f"dp{d}__0-4.tar") as tar:
            assert tar.getnames() == ["_meta.json", "0-4.pt.zst"]
            meta_read = tar.extractfile("_meta.json").read()
            blob = tar.extractfile("0-4.pt.zst").read()
        assert meta_read == meta and b" " not in meta_read       # compact JSON
        decoded = json.loads(meta_read)
        ident = '{"seed":1234,"train_samples":12,"blend":{"kind":"mock","mock":true}}'
        assert decoded["hash"] == hashlib.md5(ident.encode()).hexdigest()
        assert decoded["saver"] == {"k": 3, "p": 0.5, "min_k": 1, "save_dtype": "bf16",
                                    "format_version": 2, "mbs_save": 1, "dp_size_save": 2,
                                    "gbs_save": 4}
        assert blob[:4] == b"\x28\xb5\x2f\xfd"                     # a zstd frame
        payload = torch.load(io.BytesIO(zstandard.ZstdDecompressor().decompress(blob)),
                             weights_only=True)
        assert sorted(payload) == ["bit_17", "format_version", "indices_low", "values"]
        assert payload["format_version"] == 2
        values, low, high = payload["values"], payload["indices_low"], payload["bit_17"]
        assert values.dtype == torch.bfloat16 and low.dtype == torch.uint16
        assert high.dtype == torch.uint8 and high.dim() == 1
        assert values.shape[:2] == (seq, 2) and low.shape == values.shape
        assert high.numel() == (low.numel() + 7) // 8
        bits = torch.tensor(_unpack_bits_msb_first(high, low.numel())).view(low.shape)
        ids = (bits << 16) | low.long()
        for r in range(2):                                  # row r: position (r * dp + d)
            ref_values, ref_ids = expected[r * dp + d]
            width = ref_ids.shape[-1]
            assert torch.equal(values[:, r, :width], ref_values)
            assert torch.equal(torch.where(ref_ids < 0, 131071, ref_ids), ids[:, r, :width])
            assert torch.all(values[:, r, width:] == -1e3)     # right padding: dropped
            assert torch.all(ids[:, r, width:] == 131071)


def test_dataset_hash_is_megatrons_md5_of_seed_samples_and_blend():
    args = _args(data_path=["0.3", "/data/a_text_document", "0.7", "/x/b.c"], train_samples=96)
    text = ('{"seed":1234,"train_samples":96,"blend":{"kind":"blend","blend":'
            '[[0.3,"a_text_document"],[0.7,"b"]]}}')
    ident = lf.dataset_identifiers(args)
    assert json.dumps(ident, separators=(",", ":")) == text
    assert lf.dataset_hash(ident) == hashlib.md5(text.encode()).hexdigest()
    split = lf.dataset_identifiers(_args(train_data_path=["/d/t"], valid_data_path=["/d/v"]))
    assert split["blend"] == {"kind": "blend_per_split", "train": [[1.0, "t"]]}


def test_hash_mismatch_and_bad_folders_are_refused_by_name(tmp_path):
    with pytest.raises(LogitsFileError, match="no teacher logits tars"):
        shards.ShardSet(str(tmp_path), None)
    _write_megatron_v2(str(tmp_path), mbs=1, dp=1, gbs=2, iterations=2, seq=3, k=2, vocab=9,
                       per_tar=1)
    with pytest.raises(LogitsFileError, match=r"dp0__0-2\.tar was saved with dataset hash h "
                                              r".*this run has abc"):
        shards.ShardSet(str(tmp_path), ("abc", {"seed": 1}))
    reader = shards.TeacherReader(shards.ShardSet(str(tmp_path), None), 3, 9, 1, 0)
    with pytest.raises(LogitsFileError, match=r"samples \[4, 6\) of saved data-parallel rank 0 "
                                              r"are missing.*4-6\.pt\.zst"):
        reader.get([4])
    with open(tmp_path / "dp0__2-4.tar", "r+b") as f:
        f.seek(1536)
        f.write(b"garbage!" * 8)
    with pytest.raises(LogitsFileError, match=r"dp0__2-4\.tar member 2-4\.pt\.zst is corrupt"):
        reader.get([2])
    _tar(str(tmp_path / "dp0__0-4.tar"), [("_meta.json", _meta({}))])
    with pytest.raises(LogitsFileError, match=r"dp0__0-4\.tar overlaps .*dp0__0-2\.tar"):
        shards.ShardSet(str(tmp_path), None)


def test_a_resumed_teacher_retires_the_tar_it_covers_again(tmp_path):
    lf.write_shard(str(tmp_path), 0, [(0, 4, b"old")], b"{}")
    lf.write_shard(str(tmp_path), 0, [(0, 4, b"a"), (4, 8, b"b")], b"{}")
    assert sorted(os.listdir(tmp_path)) == ["dp0__0-4.tar.stale", "dp0__0-8.tar"]


def test_zstandard_is_imported_only_by_logits_runs(monkeypatch):
    code = ("import sys; sys.modules['zstandard'] = None; "   # as if it were not installed
            "import megatron.training.distillation.run, pretrain_gpt")
    subprocess.run([sys.executable, "-c", code], check=True,
                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(LogitsFileError, match=r"need the 'zstandard' package.*pip install "
                                              r"zstandard"):
        lf.encode_payload(torch.zeros(1, 1, 1), torch.zeros(1, 1, 1, dtype=torch.long))
