"""`python -m gpullm_lessons <command>`: doctor | start | submit | grade | exercises | leaks | train."""
from __future__ import annotations

import sys

USAGE = """usage: python -m gpullm_lessons <command> [args]

commands:
  doctor                 check this machine: Python, numpy pin, numba, simulator, GPU, CuPy, compilers
  start DIR [--update]   copy the exercise notebooks into DIR, your own folder (never over a notebook there;
                         --update adds only the exercises DIR does not have yet)
  submit [DIR] [--to DROPBOX]
                         hand in: copy your notebooks into the class's drop box, with the time (--name NAME;
                         the drop box defaults to $GPULLM_DROPBOX)
  grade [DIR]            run each exercise notebook in DIR (default: exercises) and print a score table
  grade --class ROOT     instructors: grade every learner's folder under ROOT into a gradebook (CSV, JSON) and
                         print where the class is stuck (--out DIR, --workers N, --timeout S, --strict,
                         --notebooks PATTERN; --dropbox --deadline TIME: the latest hand-in of each learner;
                         see grade --class ROOT --help)
  exercises [--check]    regenerate exercises/ from solutions/ (or check that it is up to date)
  leaks                  instructors: how much of each solution region its lesson or exercise text shows
  train [args]           train the GPT on the default corpus (same as python -m gpullm_lessons.train)
"""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "doctor":
        from .runtime import doctor
        return doctor.main(rest)
    if cmd == "start":
        from .classroom import gradebook as classroom
        return classroom.start_main(rest)
    if cmd == "submit":
        from .classroom import handin
        return handin.main(rest)
    if cmd == "grade" and any(a == "--class" or a.startswith("--class=") for a in rest):
        from .classroom import gradebook as classroom
        return classroom.grade_main(rest)
    if cmd == "grade":
        from .classroom import grading
        return grading.main(rest)
    if cmd == "exercises":
        from .classroom import exercises
        return exercises.main(rest)
    if cmd == "leaks":
        from .classroom import leaks
        return leaks.main(rest)
    if cmd == "train":
        from . import train
        train.cli(rest)
        return 0
    print(f"unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
