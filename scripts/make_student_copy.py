"""Make the copy of the course that students get: everything but the reference solutions.

    python scripts/make_student_copy.py DEST              # from the last commit
    python scripts/make_student_copy.py DEST --worktree   # from the working tree (uncommitted changes too)

Takes the committed tree (``git archive HEAD``), leaves out ``solutions/`` and what needs it (the course's
own ``tests/``, ``.ci/``, the authors' ``CONTRIBUTING.md``, the scripts that run the reference), and writes it
to ``DEST`` (a new folder). The copy's README is ``docs/student_copy_README.md`` with the main README's lesson
table, and its ``pytest`` runs the graders. In the copy the graders grade the student's code, the notebooks
run it, and the engine asks students to finish a lesson instead of falling back to a reference that is not
there.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEFT_OUT = ("solutions/", "tests/", ".ci/", "CONTRIBUTING.md", "scripts/make_student_copy.py",
            "docs/student_copy_README.md")
STUDENT_README = ROOT / "docs" / "student_copy_README.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path, help="a folder that does not exist yet")
    parser.add_argument("--worktree", action="store_true",
                        help="copy the working tree's files (tracked and new, not ignored) instead of the last commit")
    args = parser.parse_args(argv)
    if args.dest.exists():
        print(f"make_student_copy: {args.dest} already exists; choose a new folder", file=sys.stderr)
        return 2
    if args.worktree:
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                                check=True).stdout.decode().split("\0")
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for name in filter(None, listed):
                if (ROOT / name).is_file():
                    tar.add(ROOT / name, arcname=name)
        data = buffer.getvalue()
    else:
        data = subprocess.run(["git", "archive", "--format=tar", "HEAD"], cwd=ROOT, capture_output=True,
                              check=True).stdout
    kept = 0
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = [m for m in tar.getmembers()
                   if not (m.name + "/").startswith(LEFT_OUT) and not m.name.startswith(LEFT_OUT)]
        tar.extractall(args.dest, members=members, filter="data")
        kept = sum(m.isfile() for m in members)
    _adapt(args.dest)
    print(f"wrote {kept} files to {args.dest} (left out: {', '.join(LEFT_OUT)})")
    return 0


def _adapt(dest: Path) -> None:
    """The copy's README (the students' own, with the main README's lesson table), its pytest running the
    graders, and no script that imports the reference solutions."""
    readme = (ROOT / "README.md").read_text()
    lessons = readme[readme.index("## Lessons"):readme.index("## How a lesson works")].rstrip()
    lessons = lessons.replace(" and `solutions/kernels/<module>.py` (the reference)", "")
    (dest / "README.md").write_text(STUDENT_README.read_text().replace("LESSONS", lessons))
    pyproject = dest / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('testpaths = ["tests"]', 'testpaths = ["grader"]'))
    for script in (dest / "scripts").glob("*"):
        text = script.read_text(errors="replace")
        if "solutions" in text and ("import solutions" in text or "from solutions" in text
                                    or "YAIE_SOLUTIONS=all" in text or "--solutions" in text):
            script.unlink()


if __name__ == "__main__":
    sys.exit(main())
