"""`python -m server [serve] ...` is the same as `specserve serve ...`."""

import sys

from server.cli import main

arguments = sys.argv[1:]
if not arguments or arguments[0] not in ("serve", "-h", "--help"):
    arguments = ["serve", *arguments]
main(arguments)
