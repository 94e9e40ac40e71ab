"""Make the copy of the course that students get: everything but the reference solutions.

    python scripts/make_student_copy.py DEST

Takes the committed tree (``git archive HEAD``), leaves out ``solutions/`` and what needs it (the course's
own ``tests/``, ``.ci/``, the authors' ``CONTRIBUTING.md``), and writes it to ``DEST`` (a new folder).
In the copy the graders grade the student's code, the notebooks run it, and the engine asks students to
finish a lesson instead of falling back to a reference that is not there.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEFT_OUT = ("solutions/", "tests/", ".ci/", "CONTRIBUTING.md", "scripts/make_student_copy.py")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path, help="a folder that does not exist yet")
    args = parser.parse_args(argv)
    if args.dest.exists():
        print(f"make_student_copy: {args.dest} already exists; choose a new folder", file=sys.stderr)
        return 2
    archive = subprocess.run(["git", "archive", "--format=tar", "HEAD"], cwd=ROOT, capture_output=True, check=True)
    kept = 0
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        members = [m for m in tar.getmembers()
                   if not (m.name + "/").startswith(LEFT_OUT) and not m.name.startswith(LEFT_OUT)]
        tar.extractall(args.dest, members=members, filter="data")
        kept = sum(m.isfile() for m in members)
    print(f"wrote {kept} files to {args.dest} (left out: {', '.join(LEFT_OUT)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
