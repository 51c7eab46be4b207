"""Jane Austen's six novels, read offline from Debian's ``r-cran-janeaustenr`` package.

The package stores each novel as an R character vector (one element per line of the Project Gutenberg text) in
R's lazy-load database: ``Rdata.rdx`` is a gzip-compressed serialised index that maps each object name to an
``(offset, length)`` slice of ``Rdata.rdb``; each slice is a 4-byte big-endian uncompressed length followed by
zlib data (or, for ``compressed`` 2/3, a one-byte codec tag and bzip2/xz data) holding one serialised object.
The reader below understands just enough of R's XDR serialisation format (R Internals, "Serialization
Formats") to decode those vectors, so no R installation is needed at run time - only the data files.

The novels are public domain; the package itself is MIT-licensed.

    python recipes/corpus.py                      # list the books with their sizes
    python recipes/corpus.py --book persuasion    # print one book to stdout
"""

from __future__ import annotations

import argparse
import bz2
import gzip
import lzma
import struct
import sys
import zlib
from pathlib import Path

DATA_DIR = Path("/usr/lib/R/site-library/janeaustenr/data")
INSTALL_HINT = "apt-get install r-cran-janeaustenr  (Debian/Ubuntu; provides the six novels offline)"

# R object names -> titles, in publication order.
TITLES = {
    "sensesensibility": "Sense and Sensibility",
    "prideprejudice": "Pride and Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}
# The shortest novel, kept out of training so that perplexity is measured on unseen prose.
HELDOUT_TITLE = "Persuasion"

# SEXP type codes (R Internals, "Rinternals.h" / serialize.c).
NILSXP, SYMSXP, LISTSXP, CHARSXP, LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP = 0, 1, 2, 9, 10, 13, 14, 16, 19
REFSXP, NILVALUE_SXP = 255, 254
_NA_INT = -(2**31)


class _XDRReader:
    """Decoder for R's binary XDR serialisation (format versions 2 and 3), restricted to data objects:
    NULL, symbols, pairlists, and atomic / generic vectors with their attributes."""

    def __init__(self, data: bytes):
        self.buf, self.pos = data, 0
        self.refs: list = []  # symbols are written once, later occurrences are back-references
        if self._take(2) != b"X\n":
            raise ValueError("not an R XDR serialisation stream (expected the 'X\\n' header)")
        version = self._int()
        self._int(), self._int()  # writer's R version, minimal reader version
        if version == 3:
            self._take(self._int())  # native encoding name, e.g. "UTF-8"

    def _take(self, n: int) -> bytes:
        chunk = self.buf[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def _int(self) -> int:
        return struct.unpack(">i", self._take(4))[0]

    def _length(self) -> int:
        n = self._int()
        if n == -1:  # long vector: the length follows as two 32-bit halves
            hi, lo = self._int(), self._int()
            n = (hi << 32) + lo
        return n

    def read(self):
        flags = self._int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind == NILVALUE_SXP:
            return None
        if kind == REFSXP:
            index = flags >> 8 or self._int()  # packed into the flags unless too large
            return self.refs[index - 1]
        if kind == SYMSXP:
            symbol = self.read()
            self.refs.append(symbol)
            return symbol
        if kind == LISTSXP:
            # Pairlist node: [attributes] [tag] value, then the rest of the list (read iteratively, not recursively).
            items = {}
            while kind == LISTSXP:
                if has_attr:
                    self.read()
                tag = self.read() if has_tag else len(items)
                items[tag] = self.read()
                flags = self._int()
                kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
            if kind != NILVALUE_SXP:
                raise ValueError(f"pairlist ends in SEXP type {kind}, expected NULL")
            return items
        if kind == CHARSXP:
            n = self._int()
            return None if n == -1 else self._take(n).decode("utf-8", errors="replace")
        if kind in (LGLSXP, INTSXP):
            n = self._length()
            value = [None if v == _NA_INT else v for v in struct.unpack(f">{n}i", self._take(4 * n))]
        elif kind == REALSXP:
            n = self._length()
            value = list(struct.unpack(f">{n}d", self._take(8 * n)))
        elif kind in (STRSXP, VECSXP):
            value = [self.read() for _ in range(self._length())]
        else:
            raise ValueError(f"SEXP type {kind} is not supported by this data-only reader")
        attributes = self.read() if has_attr else {}
        names = attributes.get("names")
        return dict(zip(names, value, strict=False)) if names is not None and kind == VECSXP else value


def _decompress_chunk(chunk: bytes, codec: int) -> bytes:
    size = struct.unpack(">I", chunk[:4])[0]
    if codec == 1:
        data = zlib.decompress(chunk[4:])
    else:  # compress = 2 or 3: a tag byte names the codec actually used for this object
        tag, body = chunk[4:5], chunk[5:]
        data = {b"Z": zlib.decompress, b"2": bz2.decompress, b"X": lzma.decompress, b"0": bytes}[tag](body)
    if len(data) != size:
        raise ValueError(f"corrupt lazy-load chunk: {len(data)} bytes, header says {size}")
    return data


def load_lazy_db(stem: Path) -> dict:
    """All objects of the R lazy-load database ``stem.rdx`` / ``stem.rdb`` as Python values."""
    index = _XDRReader(gzip.decompress(stem.with_suffix(".rdx").read_bytes())).read()
    codec = index["compressed"][0]
    db = stem.with_suffix(".rdb").read_bytes()
    objects = {}
    for name, (offset, length) in index["variables"].items():
        objects[name] = _XDRReader(_decompress_chunk(db[offset : offset + length], int(codec))).read()
    return objects


def load_austen(data_dir: Path = DATA_DIR) -> dict[str, str]:
    """Book title -> full text (lines joined with newlines), in publication order."""
    stem = data_dir / "Rdata"
    if not stem.with_suffix(".rdx").exists():
        raise FileNotFoundError(f"Jane Austen corpus not found at {data_dir}. Install it with: {INSTALL_HINT}")
    objects = load_lazy_db(stem)
    return {title: "\n".join(line or "" for line in objects[name]) for name, title in TITLES.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--book", help="print this book (title or R name, case-insensitive) instead of the list")
    args = parser.parse_args()
    try:
        books = load_austen()
    except FileNotFoundError as error:
        sys.exit(str(error))
    if args.book is None:
        for title, text in books.items():
            role = "held out" if title == HELDOUT_TITLE else "train"
            print(f"{title:24s} {len(text):>9,d} chars  {role}")
        return
    wanted = args.book.lower()
    for name, title in TITLES.items():
        if wanted in (name, title.lower()):
            sys.stdout.write(books[title] + "\n")
            return
    sys.exit(f"unknown book {args.book!r}; expected one of: {', '.join(TITLES.values())}")


if __name__ == "__main__":
    main()
