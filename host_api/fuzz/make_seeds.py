#!/usr/bin/env python3
"""Writes the seed corpus of elf_image_fuzzer: minimal x86-64 ELF shared-object headers (an ELF
header, program headers, optional section headers) that the pre-check accepts, and near-valid
ones it must refuse (truncated segment, other machine, executable type, header table past the end).
Run from the repository root: python3 host_api/fuzz/make_seeds.py"""
import pathlib
import struct

out = pathlib.Path(__file__).resolve().parent / "corpus/elf_image"
out.mkdir(parents=True, exist_ok=True)

EHDR, PHDR, SHDR = 64, 56, 64
PT_LOAD, PT_DYNAMIC, PT_GNU_STACK = 1, 2, 0x6474E551


def elf(segments, e_type=3, machine=62, shnum=0, size=None, phoff=EHDR):
    """segments: (type, offset, filesz); the file is padded to `size` (default: what they need)."""
    phnum = len(segments)
    shoff = phoff + phnum * PHDR if shnum else 0
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)
    header = ident + struct.pack("<HHIQQQIHHHHHH", e_type, machine, 1, 0, phoff, shoff, 0, EHDR, PHDR, phnum,
                                 SHDR, shnum, 0)
    body = bytearray(header)
    body += bytes(max(0, phoff - len(body)))
    for kind, offset, filesz in segments:
        body += struct.pack("<IIQQQQQQ", kind, 5, offset, offset, offset, filesz, filesz, 0x1000)
    body += bytes(shnum * SHDR)
    need = max([len(body)] + [o + f for _, o, f in segments if f])
    body += bytes((size if size is not None else need) - len(body))
    return bytes(body)


seeds = {
    "valid-two-segments.so": elf([(PT_LOAD, 0, 400), (PT_DYNAMIC, 300, 64)]),
    "valid-stack-segment.so": elf([(PT_LOAD, 0, 300), (PT_GNU_STACK, 0xFFFFFFFF, 0)]),
    "valid-section-table.so": elf([(PT_LOAD, 0, 200)], shnum=2),
    "truncated-segment.so": elf([(PT_LOAD, 0, 4096)], size=600),
    "other-machine.so": elf([(PT_LOAD, 0, 200)], machine=183),
    "executable.so": elf([(PT_LOAD, 0, 200)], e_type=2),
    "phdr-table-past-end.so": elf([(PT_LOAD, 0, 200)])[:100],
    "not-elf.so": b"#!/bin/sh\necho not a plugin\n",
}
for name, data in seeds.items():
    (out / name).write_bytes(data)
