"""`python -m specserve [serve|bench|train-draft] ...` is the same as `specserve ...`; a bare
`python -m specserve --port 8000` serves."""

import sys

from specserve.cli import main

arguments = sys.argv[1:]
if not arguments or arguments[0] not in ("serve", "bench", "train-draft", "-h", "--help"):
    arguments = ["serve", *arguments]
main(arguments)
