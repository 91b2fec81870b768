"""`python -m server [serve|bench|train-draft] ...` is the same as `specserve ...`."""

import sys

from server.cli import main

arguments = sys.argv[1:]
if not arguments or arguments[0] not in ("serve", "bench", "train-draft", "-h", "--help"):
    arguments = ["serve", *arguments]
main(arguments)
