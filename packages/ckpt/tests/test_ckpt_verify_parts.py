"""The pieces that make verification cheap give the same answers as the plain computations: span CRCs cut into
pieces and combined equal ``zlib.crc32``, bucketed tensor checksums equal ``tensor_checksum`` and name every
non-finite tensor, a save fsyncs every file of the role before its manifest is written, and the load's check
in DCP's read order finds what the check in file order finds."""

from __future__ import annotations

import json
import random
import zlib
from pathlib import Path

import pytest
import torch
from ckpt_crash_worker import CONTENTS, step, tiny_model

from posttrain.ckpt import RoleInfo, RoleState, crc, layout, save_role
from posttrain.ckpt.batched import checksums_and_finite
from posttrain.ckpt.verify import check_files, dcp_read_order, listed_files
from posttrain.core.checksum import tensor_checksum


def test_crc32_combine_equals_zlib() -> None:
    rng = random.Random(0)
    for n in [0, 1, 255, 256, 4097] + [rng.randrange(1 << 16) for _ in range(20)]:
        a, b = rng.randbytes(rng.randrange(3000)), rng.randbytes(n)
        assert crc.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@pytest.mark.parametrize("read_ahead", [True, False])
def test_span_crcs_in_pieces_equal_zlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, read_ahead: bool
) -> None:
    monkeypatch.setattr(crc, "PIECE", 1000)  # spans of several pieces, pieces of several spans' sizes
    data = random.Random(1).randbytes(123_457)
    (tmp_path / "a").write_bytes(data)
    (tmp_path / "empty").write_bytes(b"")
    spans = [(0, 0), (0, 5000), (5000, 100_000), (105_000, 18_456), (123_456, 1)]
    got = crc.span_crcs(
        [(tmp_path / "a", spans), (tmp_path / "empty", [(0, 0)]), (tmp_path / "a", [(0, len(data))])],
        read_ahead,
    )
    assert got == [[zlib.crc32(data[o : o + n]) for o, n in spans], [0], [zlib.crc32(data)]]


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(33, 7, generator=g),  # 924 bytes: padded in its bucket
        torch.tensor(3.0),  # 0-d, like Adam's step
        torch.randn(5, generator=g).to(torch.bfloat16),  # its own dtype's bucket
        torch.arange(10, dtype=torch.int64),  # not floating: finite by definition
        torch.randn(64, 64, generator=g),  # 16 KiB: the large path below
        torch.randn(3, 300, generator=g)[:, ::2],  # not contiguous
    ]


@pytest.mark.parametrize("small", [16 << 20, 4096])
def test_bucketed_checksums_equal_tensor_checksum(small: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("posttrain.ckpt.batched.SMALL", {"cpu": small})
    monkeypatch.setattr("posttrain.ckpt.batched.BUCKET", 2048)  # several buckets per dtype
    tensors = _tensors()
    sums, finite = checksums_and_finite(tensors)
    assert sums == [tensor_checksum(t) for t in tensors]
    assert finite == [True] * len(tensors)


@pytest.mark.parametrize("small", [16 << 20, 4096])
def test_bucketed_finiteness_names_each_tensor(small: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("posttrain.ckpt.batched.SMALL", {"cpu": small})
    tensors = _tensors()
    tensors[0][4, 2] = float("nan")
    tensors[2][1] = float("-inf")
    tensors[4][7, 7] = float("inf")
    assert checksums_and_finite(tensors)[1] == [False, True, False, True, False, True]


def test_save_fsyncs_every_role_file_before_its_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCP writes without its own fsync; the save fsyncs each file of the role (while the CRCs are
    computed)."""
    synced: list[Path] = []
    real = layout.fsync_path

    def record(path: Path) -> None:
        if path.is_file():  # (the manifest's atomic write fsyncs its directory after it)
            role = next(d for d in path.parents if d.name.startswith("verify_"))
            assert not (role / "manifest.json").exists()
            synced.append(path)
        real(path)

    monkeypatch.setattr(layout, "fsync_path", record)
    model, opt = tiny_model()
    step(model, opt, 1)
    for verify in (True, False):
        role = tmp_path / f"verify_{verify}"
        save_role(role, RoleState(model=model, optimizer=opt), RoleInfo(), CONTENTS, 1, verify=verify)
        assert (role / "manifest.json").is_file()
        assert sorted(str(p.relative_to(role)) for p in synced if role in p.parents) == listed_files(role)


def test_check_in_dcp_read_order_finds_the_same(tmp_path: Path) -> None:
    """The load's check reads the segments in DCP's order (every stored item has a place in it) and reports
    what the check in file order reports."""
    model, opt = tiny_model()
    step(model, opt, 1)
    save_role(tmp_path, RoleState(model=model, optimizer=opt), RoleInfo(), CONTENTS, 1)
    records = json.loads((tmp_path / "manifest.json").read_text())["checksums"]["files"]
    order = dcp_read_order(tmp_path / "dist_ckpt")
    keyed = {k for name, (_, segs) in records.items() for *_, k in segs if name.endswith(".distcp")}
    assert keyed and set(order) == keyed and check_files(tmp_path, records, order) == []
    shard, (_, segments) = next((n, r) for n, r in records.items() if n.endswith(".distcp"))
    offset, length, _, key = segments[len(segments) // 2]
    data = bytearray((tmp_path / shard).read_bytes())
    data[offset + length // 2] ^= 0xFF
    (tmp_path / shard).write_bytes(bytes(data))
    found = check_files(tmp_path, records, order)
    assert found == check_files(tmp_path, records) and len(found) == 1 and key.split("@")[0] in found[0]
    assert dcp_read_order(tmp_path / "missing") == {}
