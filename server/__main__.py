"""`python -m server [serve] ...` serves, as `specserve serve ...` does (the other commands:
`python -m specserve`)."""

import sys

from server.cli import main

arguments = sys.argv[1:]
if not arguments or arguments[0] not in ("serve", "-h", "--help"):
    arguments = ["serve", *arguments]
main(arguments)
