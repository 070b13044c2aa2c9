"""Write the out-of-domain evaluation text of the frontier runs: Python source code, one file outside the repository.

The text is the top-level ``*.py`` files of the running interpreter's standard library (``sysconfig``'s ``stdlib``
path, no sub-packages), in sorted name order, each followed by one newline: for CPython 3.11.7 that is 168 files and
4.7 MB. The command prints the file's size and SHA-256, which ``oakenkv eval ppl --text-file`` records in its result.

    python benchmarks/make_python_text.py /tmp/oakenkv-python-stdlib.txt
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import sysconfig
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the text file to write (outside the repository)")
    args = ap.parse_args()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    text = "".join(p.read_text(encoding="utf-8") + "\n" for p in files)
    args.out.write_text(text, encoding="utf-8")
    raw = text.encode("utf-8")
    print(
        f"{args.out}: {len(files)} files of {stdlib} (Python {sys.version.split()[0]}), {len(raw)} bytes, "
        f"sha256 {hashlib.sha256(raw).hexdigest()}"
    )


if __name__ == "__main__":
    main()
