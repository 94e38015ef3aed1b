"""Refresh the CRC-32 checksums of a stored (uncompressed) zip after its member bytes were
rewritten in place.

:func:`megatron.convert.megatron_io.save_megatron` writes every target file with placeholder
tensor bytes (``torch.serialization.skip_data``) and fills them through a shared memory map
afterwards, so the checksums ``torch.save`` recorded describe the placeholders; loading verifies
them (:func:`megatron.checkpoint.load.load_state_file`).
"""

import os
import struct
import zipfile
import zlib
from typing import Dict

from megatron.convert.schema import ConversionError


def refresh_zip_checksums(path: str) -> None:
    """Rewrite the CRC-32 of every member of the (stored, uncompressed) zip at ``path``.

    The files were written with placeholder tensor bytes and filled in place afterwards, so the
    checksums torch recorded describe the placeholders; loading verifies them
    (:func:`megatron.checkpoint.load.load_state_file`). Each member's CRC sits in its local header
    (offset 14), in its central-directory entry (offset 16) and, when flag bit 3 is set, in the
    data descriptor after its bytes.
    """
    with zipfile.ZipFile(path) as archive:
        infos = archive.infolist()
    with open(path, "r+b") as f:
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED:
                raise ConversionError(f"{path}: member {info.filename} is compressed; "
                                      "cannot refresh its checksum in place")
            f.seek(info.header_offset)
            header = f.read(30)
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            f.seek(info.header_offset + 30 + name_len + extra_len)
            crc, left = 0, info.file_size
            while left:
                block = f.read(min(left, 1 << 24))
                crc = zlib.crc32(block, crc)
                left -= len(block)
            if info.flag_bits & 0x08:
                descriptor = f.read(4)
                at = f.tell() if descriptor == b"PK\x07\x08" else f.tell() - 4
                f.seek(at)
                f.write(struct.pack("<I", crc))
            f.seek(info.header_offset + 14)
            f.write(struct.pack("<I", crc))
            info.CRC = crc
        _patch_central_directory(f, path, {i.header_offset: i.CRC for i in infos})


def _patch_central_directory(f, path: str, crc_by_offset: Dict[int, int]) -> None:
    """Write each member's CRC into its central-directory entry (found by its local offset)."""
    f.seek(0, os.SEEK_END)
    size = f.tell()
    tail_len = min(size, 65536 + 22)
    f.seek(size - tail_len)
    tail = f.read(tail_len)
    eocd = tail.rfind(b"PK\x05\x06")
    if eocd < 0:
        raise ConversionError(f"{path}: no zip end-of-central-directory record")
    count, cd_size, cd_offset = struct.unpack("<HII", tail[eocd + 10:eocd + 20])
    locator = tail.rfind(b"PK\x06\x07", 0, eocd)
    if locator >= 0:  # zip64: the real offsets are in the zip64 end record
        (zip64_end,) = struct.unpack("<Q", tail[locator + 8:locator + 16])
        f.seek(zip64_end)
        record = f.read(56)
        count, cd_size, cd_offset = struct.unpack("<QQQ", record[32:56])
    f.seek(cd_offset)
    directory = bytearray(f.read(cd_size))
    at = 0
    while at + 46 <= len(directory) and directory[at:at + 4] == b"PK\x01\x02":
        name_len, extra_len, comment_len = struct.unpack("<HHH", directory[at + 28:at + 34])
        (offset,) = struct.unpack("<I", directory[at + 42:at + 46])
        if offset == 0xFFFFFFFF:  # the real offset is in the zip64 extra field
            offset = _zip64_offset(directory[at + 46 + name_len:at + 46 + name_len + extra_len],
                                   directory[at + 20:at + 28])
        if offset in crc_by_offset:
            directory[at + 16:at + 20] = struct.pack("<I", crc_by_offset[offset])
        at += 46 + name_len + extra_len + comment_len
    f.seek(cd_offset)
    f.write(directory)


def _zip64_offset(extra: bytes, sizes: bytes) -> int:
    """The local-header offset from a central entry's zip64 extra field."""
    compressed, uncompressed = struct.unpack("<II", sizes)
    at = 0
    while at + 4 <= len(extra):
        tag, length = struct.unpack("<HH", extra[at:at + 4])
        if tag == 0x0001:
            fields = extra[at + 4:at + 4 + length]
            skip = 8 * ((uncompressed == 0xFFFFFFFF) + (compressed == 0xFFFFFFFF))
            return struct.unpack("<Q", fields[skip:skip + 8])[0]
        at += 4 + length
    raise ConversionError("zip64 central entry without its offset field")
