"""`python -m server [serve|bench] ...` is the same as `specserve serve|bench ...`."""

import sys

from server.cli import main

arguments = sys.argv[1:]
if not arguments or arguments[0] not in ("serve", "bench", "-h", "--help"):
    arguments = ["serve", *arguments]
main(arguments)
